"""Expert parallelism on the actors (Note [expert parallelism] in actors/grid.py): a GPT-MoE at
pp=2 x dp=2 x ep=2 (4 CPU actors) trains equal to one process with gradient accumulation on
every schedule, with the same top-k assignments, with zero=1, the auxiliary loss and the bias
update; ep=1 with the MoE options too; and the bad input refused before any actor starts."""

from __future__ import annotations

import pytest
import torch

import mpmd
import schedules
from actors.experts import expert_ranges, hooks_of
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss
from mpmd.moe import attach, finish_step, loss_scale
from tests.models import Reference, sgd

STEPS, MICROBATCHES, ROWS = 2, 2, 2  # rows per microbatch
# TeraPipe cuts sequences into token slices: the auxiliary loss is per microbatch, not per slice
SCHEDULES = [n for n in schedules.schedule_names() if n != "terapipe"]


def _config(**router) -> GPTConfig:
    return GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=4, n_experts=4, top_k=2,
                     expert_hidden=6, router=router)


def _data(batch: int, seed: int = 3) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 16, (batch, 6), generator=g), torch.randint(0, 16, (batch, 6), generator=g))
            for _ in range(STEPS)]


def _record_routing(worker) -> None:
    for m in worker.stages.modules.values():
        if hooks_of(m) is not None:
            hooks_of(m).record_routing = True


def _actor_state(worker) -> tuple:
    """Where the actor sits, its stages' state dicts, expert ranges and recorded routing."""
    mods = worker.stages.modules
    return (worker.place.replica, {s: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
                                   for s, m in mods.items()},
            {s: expert_ranges(m) for s, m in mods.items()},
            {s: hooks_of(m).routing() for s, m in mods.items() if hooks_of(m) is not None})


def _whole_state(got: list, dp: int, ep: int) -> dict:
    """The pipeline's state with the whole experts: replica group 0's EP ranks' slices joined; every
    other replica holds the same dense state and the same slices as its EDP group's first."""
    state = {}
    for replica, states, ranges, _ in sorted(got, key=lambda g: g[0]):
        if replica >= ep:
            for s, sd in states.items():
                for k, v in sd.items():
                    first = ranges[s][k][0] if k in ranges[s] else 0
                    assert torch.equal(v, state[f"{s}.{k}"][first:first + v.shape[0]] if k in ranges[s] else
                                       state[f"{s}.{k}"]), f"replica {replica} differs from its group's at {s}.{k}"
            continue
        for s, sd in states.items():
            for k, v in sd.items():
                if k in ranges[s]:
                    first, total = ranges[s][k]
                    whole = state.setdefault(f"{s}.{k}", torch.full((total,) + v.shape[1:], float("nan")))
                    whole[first:first + v.shape[0]] = v
                elif replica == 0:
                    state[f"{s}.{k}"] = v
    return state


def _train(stages, schedule: str, m: int, dp: int, ep: int, data: list, **options) -> tuple:
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=m, loss_fn=lm_loss, optimizer=sgd,
                       dp=dp, ep=ep, **options) as pipe:
        pipe.engine.client.run_in_each(_record_routing, "recording the routing")
        losses = [pipe.step(x, y) for x, y in data]
        got = pipe.engine.client.run_in_each(_actor_state, "reading the stages")
        metrics = pipe.moe_metrics
        evaluated = pipe.evaluate(*data[0])  # the forward-only program's all-to-alls
    return losses + [evaluated], _whole_state(got, dp, ep), got, metrics


def _reference(stages, data: list, n: int, aux: float = 0.0, rate: float = 0.0, device=None) -> tuple:

    def forward(model, x, side):
        with loss_scale(1.0 / n):  # the microbatch loss's factor (actors/experts.py loss_scale)
            return model(x)

    ref = Reference(stages, n, lm_loss, sgd, forward=forward, device=device)
    attach(ref.model, aux_loss_coef=aux, bias_update_rate=rate, record_routing=True)
    losses, metrics = [], {}
    for x, y in data:
        losses.append(ref.step(x, y).loss)
        metrics = finish_step(ref.model)
    state = {k: v.cpu() for k, v in ref.model.state_dict().items()}
    routing = hooks_of(ref.model).routing()
    with torch.no_grad():  # the trained model's mean loss on the first batch (evaluate)
        x, y = (t.to(device) if device else t for t in data[0])
        losses.append(sum(lm_loss(ref.model(a), b).item() for a, b in zip(x.chunk(n), y.chunk(n))) / n)
    return losses, state, routing, metrics


def _check_routing(got: list, ref_routing: dict, m: int, dp: int) -> None:
    """Replica d's j-th forward of step t routed as the reference's microbatch d*m + j of step t."""
    checked = 0
    for replica, _, _, routing in got:
        for s, blocks in routing.items():
            for name, forwards in blocks.items():
                want = ref_routing[f"{s}.{name}"]
                assert len(forwards) == STEPS * m
                for t in range(STEPS):
                    for j in range(m):
                        assert torch.equal(forwards[t * m + j], want[t * m * dp + replica * m + j])
                        checked += 1
    assert checked


def _compare(stages, schedule: str, dp: int, ep: int, *, m: int = MICROBATCHES, aux: float = 0.0, rate: float = 0.0,
             device: str = "cpu", **options) -> dict:
    """Train at ``dp`` x ``ep`` and in one process (on ``device`` both), and compare."""
    data = _data(m * dp * ROWS)
    losses, state, got, metrics = _train(stages, schedule, m, dp, ep, data, moe_aux_loss_coef=aux,
                                         moe_bias_update_rate=rate, device=device, **options)
    ref_losses, ref_state, ref_routing, ref_metrics = _reference(stages, data, m * dp, aux, rate,
                                                                 None if device == "cpu" else device)
    _check_routing(got, ref_routing, m, dp)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{k}: {msg}")
    loads = {k: v for k, v in metrics.items() if k.endswith(".load")}
    assert loads and all(sum(v) == ROWS * m * dp * 6 * 2 for v in loads.values())  # tokens x top_k
    for k, v in ref_metrics.items():
        stage, name = k.split(".", 1)
        torch.testing.assert_close(torch.tensor(metrics[f"stage{stage}.{name}"]), torch.tensor(v))
    return metrics


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ep2_trains_equal_to_one_process_on_every_schedule(ray_session, schedule):
    per = schedules.schedule_info(schedule).default_stages_per_rank
    m = 4 if schedule in ("dualpipev", "zb-h2") else MICROBATCHES  # their warmups need more on 2 ranks
    _compare(gpt_stages(_config(), 2 * per), schedule, dp=2, ep=2, m=m, num_actors=2)


def test_dp4_ep2_sums_the_experts_over_their_edp_group(ray_session):
    # one rank, 4 replicas: replicas 0 and 2 hold experts 0-1, replicas 1 and 3 experts 2-3
    _compare(gpt_stages(_config(), 1), "gpipe", dp=4, ep=2, num_actors=1)


def test_ep2_with_zero1_and_the_auxiliary_loss(ray_session):
    metrics = _compare(gpt_stages(_config(), 2), "1f1b", dp=2, ep=2, zero=1, aux=0.01)
    assert any(k.endswith(".aux") for k in metrics)


def test_ep2_with_the_bias_update(ray_session):
    stages = gpt_stages(_config(score_func="sigmoid"), 2)
    metrics = _compare(stages, "1f1b", dp=2, ep=2, rate=0.01)
    biases = [v for k, v in metrics.items() if k.endswith(".bias")]
    assert biases and any(any(b != 0 for b in v) for v in biases)  # the bias moved


def test_ep2_with_clipping_counts_each_expert_once(ray_session):
    # a clip below the norm: a norm that counted the experts twice would clip differently
    stages = gpt_stages(_config(), 2)
    data = _data(MICROBATCHES * 2 * ROWS)
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=lm_loss, optimizer=sgd, dp=2, ep=2,
                       clip_grad_norm=1e-3, device="cpu") as pipe:
        norms = [pipe.engine.train_step(x, y).grad_norm for x, y in data]
    ref = Reference(stages, MICROBATCHES * 2, lm_loss, sgd, clip=1e-3, norm_in_float64=True,
                    forward=lambda model, x, side: _scaled(model, x, 1.0 / (MICROBATCHES * 2)))
    want = [r.grad_norm for r in ref.fit(data)]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want), rtol=1e-5, atol=0)


def _scaled(model, x, scale):
    with loss_scale(scale):
        return model(x)


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_ep1_with_the_moe_options_equals_one_process(ray_session, rate):
    _compare(gpt_stages(_config(score_func="sigmoid"), 2), "1f1b", dp=2, ep=1, aux=0.01, rate=rate)


# -- bad input, before any actor starts --------------------------------------------------------
def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match=r"ep=2 must divide dp=3"):
        mpmd.Pipeline(gpt_stages(_config(), 2), dp=3, ep=2, loss_fn=lm_loss)


def test_ep_on_a_dense_model_is_refused():
    dense = gpt_stages(GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=2), 2)
    with pytest.raises(ValueError, match=r"ep=2 .* no stage has a MoE block"):
        mpmd.Pipeline(dense, dp=2, ep=2, loss_fn=lm_loss)


def test_ep_must_divide_the_experts():
    stages = gpt_stages(GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=2, n_experts=3,
                                  top_k=1), 2)
    with pytest.raises(ValueError, match=r"ep=2 does not divide the 3 experts of stage 0's MoE block '1.mlp'"):
        mpmd.Pipeline(stages, dp=2, ep=2, loss_fn=lm_loss)


def test_top_k_above_the_experts_is_refused():
    stages = gpt_stages(_config(), 2)
    stages[1][0].mlp.gate.top_k = 5  # as a router configured with more than it has would say
    with pytest.raises(ValueError, match=r"top_k=5 experts but has only 4"):
        mpmd.Pipeline(stages, dp=2, ep=2, loss_fn=lm_loss)


def test_ep_with_tp_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"tp=2 with ep=2 is not supported: the experts' weights"):
        mpmd.Pipeline(gpt_stages(_config(), 2), dp=2, ep=2, tp=2, tp_plan="auto", loss_fn=lm_loss)


def test_recompute_with_the_bias_update_is_refused():
    with pytest.raises(ValueError, match=r"recompute with moe_bias_update_rate > 0"):
        mpmd.Pipeline(gpt_stages(_config(), 2), recompute=True, moe_bias_update_rate=0.1, loss_fn=lm_loss)


def test_a_factory_stage_is_checked_too():
    cfg = GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=2, n_experts=3, top_k=1)
    factories = [lambda: gpt_stages(cfg, 2)[0], lambda: gpt_stages(cfg, 2)[1]]
    with pytest.raises(ValueError, match=r"ep=2 does not divide the 3 experts"):
        mpmd.Pipeline(factories, dp=2, ep=2, loss_fn=lm_loss)


def test_a_skipped_step_moves_no_bias(ray_session):
    """on_nan="skip": every actor agrees not to step (Note [agreed update]); the routers' bias stays."""
    stages = gpt_stages(_config(score_func="sigmoid"), 2)
    x, _ = _data(MICROBATCHES * 2 * ROWS)[0]
    ignored = torch.full_like(x, -100)  # every target ignored: the loss is 0/0
    with pytest.warns(UserWarning, match="skipped"):
        _, state, _, metrics = _train(stages, "1f1b", MICROBATCHES, 2, 2, [(x, ignored)], device="cpu",
                                      moe_bias_update_rate=0.1, on_nan="skip")
    biases = [k for k in state if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(state[k], torch.zeros_like(state[k])) for k in biases)
    assert all(v == [0.0] * 4 for k, v in metrics.items() if k.endswith(".load"))
