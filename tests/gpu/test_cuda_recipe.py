"""The training recipe on CUDA, each against single-process training on the same GPU: fp16
with an injected overflow, tied parameters, AdamW save/resume, multi-tensor stage values,
Ray Data fed steps, and a step's data pinned and uploaded once (Note [step inputs]).

Every pipeline puts its actors on the one GPU (fractional ``num_gpus``, the staged
transport); the reference runs the same microbatches in this process on the same GPU, so
the kernels are the same ones and fp32 results agree to rtol 1e-5.  ``DEVICE`` is a module
constant so the tests' logic can be checked on the CPU by a copy that sets it to "cpu"."""

from __future__ import annotations

import copy
import math

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import Reference, adamw, make_data, make_stages, reference_train, sgd
from tests.mpmd.runtime.test_recipe import OverflowsOnce
from tests.mpmd.test_pipeline import multi_tensor_stages
from tests.mpmd.runtime.test_ties import lm_loss, tied_copies, tied_lm, token_data

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="needs CUDA: run `make gpu-check` on a machine with an NVIDIA GPU")]

MICROBATCHES = 2
RTOL, ATOL = 1e-5, 1e-6


def gpu_pipeline(stages, schedule: str, num_actors: int, *, loss_fn=F.mse_loss, optimizer=sgd,
                 **options) -> mpmd.Pipeline:
    """Every actor (``num_actors`` x ``dp``) on the one GPU."""
    share = {"num_gpus": 1.0 / (num_actors * options.get("dp", 1))} if DEVICE == "cuda" else {}
    return mpmd.Pipeline(stages, schedule=schedule, num_actors=num_actors, num_microbatches=MICROBATCHES,
                         loss_fn=loss_fn, optimizer=optimizer, device=DEVICE, num_cpus=1.0, fusion="step",
                         **share, **options)


def reference(stages, data, microbatches: int, *, loss_fn=F.mse_loss, optimizer=sgd, precision="fp32"):
    """``Reference`` on ``DEVICE``; fp16 as plain PyTorch does it (autocast, the stage outputs
    cast to fp16 (Note [precision boundary]), ``GradScaler`` at the pipeline's initial scale).
    ``(model, losses, skipped)``."""
    reference = Reference(stages, microbatches, loss_fn, optimizer, device=DEVICE, precision=precision,
                          grad_scaler=2.0 ** 16 if precision == "fp16" else None)
    losses = [r.loss for r in reference.fit(data)]
    return reference.model, losses, reference.skipped


def assert_like(losses, state, model, ref_losses, rtol=RTOL, atol=ATOL) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    ref = model.state_dict()
    assert list(state) == list(ref)
    for k, v in ref.items():
        torch.testing.assert_close(state[k].cpu(), v.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def test_an_fp16_overflow_on_cuda_skips_the_step_everywhere_and_halves_the_scale(ray_session):
    stages = make_stages(2)
    stages[1] = OverflowsOnce(stages[1].out, at_call=2 * MICROBATCHES + 1)  # step 2's first microbatch
    data = make_data(4, 4)
    with gpu_pipeline(stages, "1f1b", 2, precision="fp16") as pipe:
        first = [pipe.step_async(x, y).wait() for x, y in data[:2]]
        before = pipe.state_dict()
        bad = pipe.step_async(*data[2]).wait()
        after_bad = pipe.state_dict()
        scales = [sd["loss_scale"]["scale"] for part in ray.get([a.checkpoint_state.remote() for a in pipe.actors])
                  for sd in part.values()]
        good = pipe.step_async(*data[3]).wait()
        state = pipe.state_dict()
    assert [r.skipped for r in first + [bad, good]] == [False, False, True, False]
    assert math.isfinite(bad.loss) and pipe.skipped_steps == [2]
    assert all(torch.equal(before[k], after_bad[k]) for k in before), "an actor applied the overflowing step"
    assert scales == [2.0 ** 15] * 2, "every actor halves its loss scale"
    model, ref_losses, ref_skipped = reference(stages, data, MICROBATCHES, precision="fp16")
    assert ref_skipped == [False, False, True, False]  # GradScaler skips the same step
    # fp16 rounds at 2**-11: the same autocast kernels, but a few ulps apart over four steps
    assert_like([r.loss for r in first + [bad, good]], state, model, ref_losses, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("schedule, num_stages, dp", [("zbv", 4, 1), ("1f1b", 3, 1), ("1f1b", 2, 2)])
def test_tied_parameters_on_cuda_train_as_one(ray_session, schedule, num_stages, dp):
    stages, data = tied_lm(num_stages), token_data(3, 4 * dp)
    with gpu_pipeline(stages, schedule, 2 if schedule == "zbv" else num_stages, loss_fn=lm_loss, dp=dp) as pipe:
        losses = []
        for x, y in data:
            losses.append(pipe.step(x, y))
            copies = tied_copies(pipe, 0, num_stages - 1)
            assert len(copies) == 2 * dp and all(torch.equal(c, copies[0]) for c in copies), "the copies drifted"
        state = pipe.state_dict()
    model, ref_losses, _ = reference(stages, data, MICROBATCHES * dp, loss_fn=lm_loss)
    assert_like(losses, state, model, ref_losses)
    assert torch.equal(state["0.embedding.weight"], state[f"{num_stages - 1}.weight"])


def test_adamw_on_cuda_resumes_exactly_and_equals_one_process(ray_session, tmp_path):
    stages, data = make_stages(4), make_data(5, 4)
    with gpu_pipeline(stages, "interleaved-1f1b", 2, optimizer=adamw) as pipe:
        first = [pipe.step(x, y) for x, y in data[:2]]
        pipe.save(tmp_path / "ck")
        later = [pipe.step(x, y) for x, y in data[2:]]
        whole = pipe.state_dict()
    share = {"num_gpus": 0.5} if DEVICE == "cuda" else {}
    with mpmd.Pipeline.load(tmp_path / "ck", stages=make_stages(4, seed=3), loss_fn=F.mse_loss, optimizer=adamw,
                            **share) as resumed:
        assert [resumed.step(x, y) for x, y in data[2:]] == later  # AdamW's moments and step count came back
        assert all(torch.equal(v, whole[k]) for k, v in resumed.state_dict().items())
    model, ref_losses, _ = reference(stages, data, MICROBATCHES, optimizer=adamw)
    assert_like(first + later, whole, model, ref_losses)


def test_multi_tensor_stage_values_on_cuda_equal_one_process(ray_session):
    """A tuple ``(tensor, {"gate": float, "mask": int64})`` crosses between actors on the GPU."""
    stages, data = multi_tensor_stages(), make_data(3, 4, seed=11)
    with gpu_pipeline(stages, "interleaved-1f1b", 2) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref_losses, _ = reference(stages, data, MICROBATCHES)
    assert_like(losses, state, model, ref_losses)


@pytest.mark.parametrize("schedule, num_stages", [("1f1b", 2), ("zbv", 4)])  # targets sent on / kept (V shape)
def test_ray_data_fed_steps_on_cuda_equal_one_process(ray_session, schedule, num_stages):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    batch, data = 8, make_data(4, 8)
    rows = [{"x": x.numpy(), "y": y.numpy()} for inputs, targets in data for x, y in zip(inputs, targets)]
    stages = make_stages(num_stages)
    with gpu_pipeline(stages, schedule, 2) as pipe:
        fed = pipe.fit(ray.data.from_items(rows), batch_size=batch, columns=("x", "y"), progress=False)
        assert pipe.engine.last_dispatch.bare == 2  # no actor got data from the controller
        state = pipe.state_dict()
    model, ref_losses, _ = reference(stages, data, MICROBATCHES)
    assert_like(list(fed), state, model, ref_losses)


class MaskProbe(nn.Module):
    """``inner(x) * mask``, recording per forward whether the mask was on the device and the
    address of the storage it views (a buffer, read back through ``state_dict``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("seen", torch.zeros(MICROBATCHES, 2, dtype=torch.float64))
        self.calls, self.held = 0, []  # every mask stays alive: separate uploads cannot share a freed block

    def forward(self, x, mask):
        self.held.append(mask)
        with torch.no_grad():
            self.seen[self.calls % MICROBATCHES, 0] = float(mask.device.type == DEVICE)
            self.seen[self.calls % MICROBATCHES, 1] = float(mask.untyped_storage().data_ptr())
        self.calls += 1
        return self.inner(x) * mask


def test_side_inputs_are_uploaded_once_per_step_and_the_batch_pinned_once(ray_session):
    """Note [step inputs]: every stage and microbatch on an actor reads its side input from one
    upload (one device storage); in this process, the same preparation pins each stacked
    tensor of a batch once and makes the microbatches views of it."""
    from actors.step_inputs import StepInputs
    from actors.values import pack_batch

    stages = [MaskProbe(s) for s in make_stages(4)]
    x, y = make_data(1, 4)[0]
    mask = torch.tensor([[1.0], [0.5], [2.0], [1.5]])  # per row: cut into microbatches like the inputs
    with gpu_pipeline(stages, "zbv", 2) as pipe:  # stages 0 and 3 on actor 0, 1 and 2 on actor 1
        loss = pipe.step(x, y, mask=mask)
        state = pipe.state_dict()
    seen = {s: state[f"{s}.seen"] for s in range(4)}
    for actor in ((0, 3), (1, 2)):
        ptrs = {v for s in actor for v in seen[s][:, 1].tolist()}
        assert all(seen[s][:, 0].eq(1).all() for s in actor), "a side input was not on the device"
        assert len(ptrs) == 1, f"stages {actor} read the mask from {len(ptrs)} uploads, not one"
    model, (ref,), _ = reference_masked(stages, x, y, mask)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    if DEVICE == "cuda":
        mbs = [(torch.randn(2, 3), torch.arange(2) + i) for i in range(MICROBATCHES)]
        got = StepInputs.for_device(torch.device(DEVICE)).batch(pack_batch(mbs))
        assert all(t.is_pinned() for mb in got for t in mb), "the batch was not pinned"
        assert len({mb[0].untyped_storage().data_ptr() for mb in got}) == 1, "pinned per microbatch, not once"


def reference_masked(stages, x, y, mask):
    model = nn.Sequential(*copy.deepcopy(stages)).to(DEVICE)
    total = 0.0
    for xm, ym, mm in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), mask.chunk(MICROBATCHES), strict=True):
        h = xm.to(DEVICE)
        for stage in model:
            h = stage(h, mask=mm.to(DEVICE))
        total += F.mse_loss(h, ym.to(DEVICE)).item()
    return model, [total / MICROBATCHES], None


def test_tensor_parallel_on_one_shared_gpu_equals_single_process(ray_session):
    """tp=2 x pp=2 with every actor on the one GPU: the TP groups' DTensor collectives run on
    gloo over CUDA tensors (the actors share the GPU: no NCCL), and training equals one process."""
    from mpmd.models import GPTConfig, gpt_stages
    from mpmd.models import lm_loss as next_token_loss

    stages = gpt_stages(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2), 2)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)) for _ in range(3)]
    with mpmd.Pipeline(copy.deepcopy(stages), num_microbatches=4, loss_fn=next_token_loss, optimizer=sgd, device="cuda",
                       num_gpus=0.25, num_cpus=1.0, tp=2, tp_plan="auto") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref = reference_train(stages, data, 4, next_token_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k].cpu(), v, rtol=1e-3, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_llama_shards_are_built_on_the_gpu_and_checkpoints_and_exports_round_trip_by_pieces(ray_session, tmp_path):
    """mpmd train's Llama factories at tp=2 x pp=2 on the one GPU: each actor builds only its
    shards, on the device (Note [sharded build]), equal to the whole build; a checkpoint each TP
    rank wrote from CUDA (Note [checkpoint pieces]) loads back and the next step equals the one
    taken right after the save (optimizer state included); the actors' export (Note [export
    from the actors]) loads back (Note [weights from safetensors])."""
    from mpmd.lm.config import ModelConfig
    from mpmd.lm.models import LlamaStageFactory, layer_counts, llama_spec
    from mpmd.planning import causal_lm_loss

    spec = llama_spec(ModelConfig(size="debug", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                  intermediate_size=128), 96)
    counts = tuple(layer_counts(spec.num_layers, 2))
    factories = [LlamaStageFactory(spec, counts, s) for s in range(2)]
    whole = {k: v for stage in mpmd.build_stages(factories, seed=5) for k, v in stage.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 96, (4, 16), generator=g) for _ in range(2))
    share = {"num_gpus": 0.25} if DEVICE == "cuda" else {}
    with mpmd.Pipeline(factories, schedule="1f1b", tp=2, tp_plan="auto", num_microbatches=MICROBATCHES, seed=5,
                       loss_fn=causal_lm_loss, optimizer=adamw, device=DEVICE, num_cpus=1.0, **share) as pipe:
        built = pipe.state_dict()
        pipe.step(x, y)
        trained = pipe.state_dict()
        path = pipe.save(tmp_path / "ck")
        pipe.export_safetensors(tmp_path / "hf")
        after = pipe.step(x, y)
        pipe.load(path)
        restored = pipe.state_dict()
        again = pipe.step(x, y)
        pipe.load_safetensors(tmp_path / "hf")
        imported = pipe.state_dict()
    for key, value in whole.items():
        assert torch.equal(built[key].cpu(), value), key
    for key, value in trained.items():
        assert torch.equal(restored[key], value) and torch.equal(imported[key], value), key
    assert again == after


def test_auto_measures_on_the_gpu_away_from_the_controller(ray_session):
    """schedule='auto' on CUDA measures the stages in a Ray task placed as an actor (Note [measured
    where it runs] in mpmd/planning/away.py): this process allocates nothing on its GPU while
    the Pipeline decides and starts, and the decision is one the actors then train with."""
    stages, data = make_stages(4), make_data(2, 16)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with mpmd.Pipeline(stages, schedule="auto", num_actors=2, num_microbatches=4, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cuda", num_gpus=0.5, sample=data[0], auto_calibrate=False) as pipe:
        assert torch.cuda.max_memory_allocated() == before  # nothing measured (or left) on the controller's GPU
        losses = [pipe.step(x, y) for x, y in data]
    assert all(torch.isfinite(torch.tensor(losses)))
