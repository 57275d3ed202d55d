"""The body of the two-process exactness check (test_tp_exact.py): each gloo process builds
the same stage under the same seed, shards a copy by its resolved plan with the actors' own
functions (actors/tensor_parallel.py) and trains it two SGD steps beside the unsharded
stage; rank 0 writes, per case, what differed."""

from __future__ import annotations

import contextlib
import copy
import datetime
import pickle
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

from mpmd.models import GPTConfig, gpt_stages, lm_loss
from mpmd.planning import partition
from mpmd.planning.hf import causal_lm_loss, split_causal_lm
from actors.tensor_parallel import align_grads, apply_plan, counted_here, full_state, local, local_state
from actors.tensor_parallel import step as optimizer_step
from mpmd.tensor_parallel import resolve_plans, tp_collectives, vocab_parallel_cross_entropy

# atol is this much of the tensor's largest magnitude: row-parallel sums reorder additions,
# so an element near zero differs by rounding of its neighbours' size, not its own.
OUT_TOL = (1e-5, 1e-6)
GRAD_TOL = (1e-4, 1e-6)
VOCAB, SEQ, BATCH, STEPS = 64, 8, 2, 2


def hf_stages(family: str, tied: bool, balance, pad_token_id=None):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=sum(balance),
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
                  pad_token_id=pad_token_id)
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "qwen2": lambda: transformers.Qwen2Config(**common),
              "qwen3": lambda: transformers.Qwen3Config(head_dim=8, **common)}[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return split_causal_lm(model, len(balance), list(balance), balancer=partition)[0]


def gpt():
    return gpt_stages(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=32, n_heads=4, n_layers=2), 2, seed=0)


def _inputs(stage, first: bool, last: bool, hf: bool):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, :3] = 0  # the padding (below) holds token 0, a padding_idx in one case
    ids[1, 1] = VOCAB // 2  # the first row of rank 1's vocabulary shard
    x = ids if first else torch.randn(BATCH, SEQ, 32, generator=g)
    side = {}
    if hf:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, :3] = 0  # left padding
        side["attention_mask"] = mask
    if last:
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        lm = causal_lm_loss if hf else lm_loss
        loss = lambda out, rows=slice(None): lm(out, labels[rows])  # noqa: E731
    else:
        weights = torch.randn(BATCH, SEQ, 32, generator=g)
        loss = lambda out, rows=slice(None): (out * weights[rows]).sum()  # noqa: E731
    return x, side, loss


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(errors: list, what: str, got, want, tol) -> None:
    rtol, scale = tol
    try:
        if got is None or want is None:
            assert got is None and want is None, f"one gradient is None: {got is None}, {want is None}"
            return
        torch.testing.assert_close(_full(got), want, rtol=rtol, atol=scale * float(want.abs().max()))
    except AssertionError as e:
        errors.append(f"{what}: {str(e).splitlines()[0]} {' '.join(str(e).split()[-12:])}")


def shard_copy(stage, plan, s: int, mesh):
    shard = copy.deepcopy(stage)
    apply_plan(shard, plan, mesh, s)
    return shard


def misplaced(module) -> int:
    """How many DTensor gradients are not laid out as their parameters."""
    return sum(isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements)
               for p in module.parameters())


def compare(stage, plan, s: int, mesh, first: bool, last: bool, hf: bool, loss_parallel: bool = False) -> dict:
    """Train the stage and its sharded copy side by side; what differed, and facts about the copy.
    ``loss_parallel``: the sharded copy's loss and backward run under torch's ``loss_parallel()``
    (its logits a DTensor sharded over the vocabulary), as the actors run them."""
    ref, shard = copy.deepcopy(stage), shard_copy(stage, plan, s, mesh)
    x, side, loss_fn = _inputs(stage, first, last, hf)
    # The sharded copy steps with the foreach kernels CUDA defaults to, through the actors' ``step``
    # (its plain parameters beside DTensor ones: Note [tensor parallelism]); the reference loops.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=m is shard) for m in (ref, shard)]
    errors, facts = [], {"sharded": sorted(n for n, p in shard.named_parameters() if isinstance(p, DTensor))}
    facts["local_shapes"] = {n: tuple(p.to_local().shape) for n, p in shard.named_parameters()
                             if isinstance(p, DTensor)}
    facts["full_shapes"] = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    for step in range(STEPS):
        outs, grads_in = [], []
        for m, opt in zip((ref, shard), opts):
            opt.zero_grad()
            xi = x if first else x.clone().requires_grad_(True)
            parts = []
            for rows in (slice(0, 1), slice(1, 2)):  # two microbatches: gradients accumulate
                with parallel_loss() if loss_parallel and m is shard else contextlib.nullcontext():
                    out = m(xi[rows], **{k: v[rows] for k, v in side.items()})
                    loss = loss_fn(out, rows) / 2
                    loss.backward()
                parts.append((_full(out.detach()), _full(loss.detach())))
            outs.append((torch.cat([o for o, _ in parts]), sum(lo for _, lo in parts)))
            grads_in.append(None if first else xi.grad)
            facts["output_type"] = type(out).__name__
            if isinstance(out, DTensor):
                facts["logits_shape"], facts["logits_local_shape"] = tuple(out.shape), tuple(out.to_local().shape)
        _close(errors, f"step {step} output", outs[1][0], outs[0][0], OUT_TOL)
        _close(errors, f"step {step} loss", outs[1][1], outs[0][1], OUT_TOL)
        if not first:
            _close(errors, f"step {step} input grad", grads_in[1], grads_in[0], GRAD_TOL)
        want = dict(ref.named_parameters())
        facts["misaligned"] = misplaced(shard)
        align_grads(shard.parameters())  # as the actors do before their reductions
        for name, p in shard.named_parameters():
            _close(errors, f"step {step} grad {name}", p.grad, want[name].grad, GRAD_TOL)
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                errors.append(f"step {step} grad {name} placed {p.grad.placements}, its parameter {p.placements}")
        # The group's local terms give the whole stage's gradient norm, replicated gradients counted once.
        squares = torch.stack([local(q.grad).double().pow(2).sum() for q in shard.parameters()
                               if counted_here(q, dist.get_rank())]).sum()
        dist.all_reduce(squares)
        want_squares = torch.stack([q.grad.double().pow(2).sum() for q in ref.parameters()]).sum()
        _close(errors, f"step {step} grad norm", squares.sqrt(), want_squares.sqrt(), OUT_TOL)
        for opt in opts:
            optimizer_step(opt)
    want = dict(ref.named_parameters())
    for name, p in shard.named_parameters():
        _close(errors, f"after {STEPS} steps {name}", p.detach(), want[name].detach(), GRAD_TOL)
    facts["retied"] = _retied(shard)
    return {"errors": errors, **facts}


def _retied(module) -> bool:
    base = getattr(module, "model", None)
    if base is None or not hasattr(base, "embed_tokens") or not hasattr(module, "lm_head"):
        return False
    return module.lm_head.weight is base.embed_tokens.weight


def run_pair(stages, s_list, mesh, hf: bool, loss_parallel: bool = False) -> dict:
    plans = resolve_plans(stages, "auto", mesh.size(), loss_parallel=loss_parallel)
    n = len(stages)
    return {s: compare(stages[s], plans[s], s, mesh, s == 0, s == n - 1, hf, loss_parallel) for s in s_list}


def source_rank_facts(mesh) -> dict:
    """Rank 1 builds different weights: what do the shards and the replicated parameters hold
    after the actors' ``apply_plan``?"""
    stage = gpt_stages(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=32, n_heads=4, n_layers=2), 2,
                       seed=dist.get_rank())[0]
    own, rank0 = copy.deepcopy(stage), copy.deepcopy(stage)
    for p in rank0.parameters():
        dist.broadcast(p.data, src=0)
    apply_plan(stage, resolve_plans([stage], "auto", mesh.size())[0], mesh, 0)
    want, mine = dict(rank0.named_parameters()), dict(own.named_parameters())
    sharded = [(n, p) for n, p in stage.named_parameters() if isinstance(p, DTensor)]
    from_0 = all(torch.equal(_full(p.detach()), want[n]) for n, p in sharded)
    own_slice = all(torch.equal(p.to_local().detach(), _slice_of(mine[n], p)) for n, p in sharded)
    replicated = all(torch.equal(p.detach(), want[n]) for n, p in stage.named_parameters()
                     if not isinstance(p, DTensor))
    facts = [None, None]
    dist.all_gather_object(facts, (from_0, own_slice, replicated))  # rank 0 reports for both
    return {"sharded_from_rank0": all(f[0] for f in facts), "sharded_own_slice": all(f[1] for f in facts),
            "replicated_equal_rank0": all(f[2] for f in facts)}


def _slice_of(full, dtensor):
    (placement,) = dtensor.placements
    if not placement.is_shard():
        return full.detach()
    return full.detach().chunk(dtensor.device_mesh.size(), dim=placement.dim)[dist.get_rank()]


def tie_reduce_facts(mesh) -> dict:
    """A tied embedding (first stage) and head (last stage), each sharded on its own group:
    each TP rank's two aligned local gradients sum to its rows of the tied gradient."""
    stages = hf_stages("llama", True, [1, 1])
    plans = resolve_plans(stages, "auto", mesh.size())
    refs, shards = [copy.deepcopy(s) for s in stages], [copy.deepcopy(s) for s in stages]  # copies: as shipped
    for s, (shard, plan) in enumerate(zip(shards, plans)):
        apply_plan(shard, plan, mesh, s)
    for s in (0, 1):
        x, side, loss_fn = _inputs(stages[s], s == 0, s == 1, True)
        for m in (refs[s], shards[s]):
            loss_fn(m(x, **side)).backward()
        align_grads(shards[s].parameters())
    got = shards[0].model.embed_tokens.weight.grad.to_local() + shards[1].lm_head.weight.grad.to_local()
    want = (refs[0].model.embed_tokens.weight.grad + refs[1].lm_head.weight.grad).chunk(mesh.size())[dist.get_rank()]
    errors: list = []
    _close(errors, "tied gradient rows", got, want, GRAD_TOL)
    return _gather_errors(errors)


def state_facts(mesh) -> dict:
    """full_state gathers the model's keys and values; local_state + load_state_dict puts other
    full values back into the shards (a tied embedding and head in one stage, and the GPT stage)."""
    errors: list = []
    for build in (lambda seed: hf_stages("llama", True, [1]), lambda seed: gpt()):
        stage = build(0)[0]
        shard = shard_copy(stage, resolve_plans([stage], "auto", mesh.size())[0], 0, mesh)
        full = full_state(shard.state_dict())
        if list(full) != list(stage.state_dict()):
            errors.append(f"keys {list(full)} != {list(stage.state_dict())}")
        for k, v in stage.state_dict().items():
            _close(errors, f"gathered {k}", full[k], v, (0, 0))
        torch.manual_seed(5)
        other = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in stage.state_dict().items()}
        if "lm_head.weight" in other:  # one tied parameter: one value under both keys
            other["lm_head.weight"] = other["model.embed_tokens.weight"]
        shard.load_state_dict(local_state(shard, other))
        for k, v in full_state(shard.state_dict()).items():
            _close(errors, f"loaded {k}", v, other[k], (0, 0))
    return _gather_errors(errors)


def collective_facts(mesh) -> dict:
    """Per stage: the collectives torch ran (CommDebugMode) in the forward, the backward and
    align_grads, and the ones tp_collectives predicts from the plan."""
    from torch.distributed.tensor.debug import CommDebugMode

    names = {"c10d_functional.all_reduce": "all_reduce", "c10d_functional.all_gather_into_tensor": "all_gather",
             "c10d_functional.reduce_scatter_tensor": "reduce_scatter", "c10d.allreduce_": "all_reduce"}
    out = {}
    for case, stages, s, hf in [("llama", hf_stages("llama", False, [1, 1]), 0, True),
                                ("llama", hf_stages("llama", False, [1, 1]), 1, True),
                                ("qwen3", hf_stages("qwen3", False, [1]), 0, True), ("gpt", gpt(), 0, False),
                                ("gpt", gpt(), 1, False),
                                ("llama_loss_parallel", hf_stages("llama", False, [1, 1]), 1, True)]:
        parallel = case.endswith("loss_parallel")
        plan = resolve_plans(stages, "auto", mesh.size(), loss_parallel=parallel)[s]
        shard = shard_copy(stages[s], plan, s, mesh)
        first, last = s == 0, s == len(stages) - 1
        x, side, loss_fn = _inputs(stages[s], first, last, hf)
        x = x if first else x.clone().requires_grad_(True)
        with parallel_loss() if parallel else contextlib.nullcontext():
            with CommDebugMode() as forward:
                loss = loss_fn(shard(x, **side))
            with CommDebugMode() as backward:
                loss.backward()
        with CommDebugMode() as per_step:
            align_grads(shard.parameters())
        ran = {(phase, names.get(str(op), str(op))): n
               for phase, mode in (("forward", forward), ("backward", backward), ("per_step", per_step))
               for op, n in mode.get_comm_counts().items()}
        out[(case, s)] = {"ran": ran, "predicted": tp_collectives(stages[s], plan).counts()}
    return out


def loss_function_facts(mesh) -> dict:
    """vocab_parallel_cross_entropy on logits sharded over the vocabulary against F.cross_entropy
    on the whole logits: every reduction, ignored targets, targets on either rank's shard; the
    loss and the logits' gradient (each rank's columns)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    errors: list = []
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, VOCAB, generator=g) * 4
    target = torch.randint(0, VOCAB, (3, 5), generator=g)
    target[0, :2] = -100
    target[1, 0] = VOCAB - 1
    for reduction in ("mean", "sum", "none"):
        whole = logits.clone().requires_grad_(True)
        want = torch.nn.functional.cross_entropy(whole.reshape(-1, VOCAB), target.reshape(-1), reduction=reduction)
        sharded = distribute_tensor(logits.clone(), mesh, [Shard(2)], src_data_rank=None).requires_grad_(True)
        got = vocab_parallel_cross_entropy(sharded, target, reduction=reduction)
        weights = torch.randn(want.shape, generator=g)
        (want * weights).sum().backward()
        (got * weights.view(got.shape)).sum().backward()
        _close(errors, f"{reduction} loss", got.reshape(want.shape), want, OUT_TOL)
        _close(errors, f"{reduction} logits grad", sharded.grad, whole.grad, GRAD_TOL)
        if isinstance(got, DTensor):
            errors.append(f"{reduction}: the loss is a DTensor, not a plain tensor")
    return _gather_errors(errors)


def _gather_errors(errors: list) -> dict:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, errors)
    return {"errors": [f"rank {r}: {e}" for r, errs in enumerate(every) for e in errs]}


CASES = {
    "llama_tied": lambda mesh: run_pair(hf_stages("llama", True, [1, 1]), [0, 1], mesh, True),
    "llama_untied": lambda mesh: run_pair(hf_stages("llama", False, [1, 1], pad_token_id=0), [0, 1], mesh, True),
    "llama_tied_one_stage": lambda mesh: run_pair(hf_stages("llama", True, [1]), [0], mesh, True),
    "qwen2_one_stage": lambda mesh: run_pair(hf_stages("qwen2", False, [1]), [0], mesh, True),
    "qwen3_one_stage": lambda mesh: run_pair(hf_stages("qwen3", False, [1]), [0], mesh, True),
    "gpt": lambda mesh: run_pair(gpt(), [0, 1], mesh, False),
    "llama_untied_loss_parallel": lambda mesh: run_pair(hf_stages("llama", False, [1, 1], pad_token_id=0), [1], mesh,
                                                        True, loss_parallel=True),
    "llama_tied_one_stage_loss_parallel": lambda mesh: run_pair(hf_stages("llama", True, [1]), [0], mesh, True,
                                                                loss_parallel=True),
    "gpt_loss_parallel": lambda mesh: run_pair(gpt(), [1], mesh, False, loss_parallel=True),
    "source_rank": source_rank_facts,
    "tie_reduce": tie_reduce_facts,
    "state": state_facts,
    "collectives": collective_facts,
    "loss_function": loss_function_facts,
}


@contextlib.contextmanager
def tp_group(rank: int, world: int, port: int):
    """This spawned process in a gloo group of ``world`` on ``port``: the group's 1-D mesh."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def main(rank: int, world: int, port: int, out_path: str) -> None:
    with tp_group(rank, world, port) as mesh:
        results = {}
        for name, case in CASES.items():
            try:
                results[name] = case(mesh)
            except Exception:  # noqa: BLE001 - reported per case; both ranks fail alike (same code, same data)
                results[name] = {"errors": [traceback.format_exc()]}
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(results, f)
