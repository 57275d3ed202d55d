"""Note [step inputs]: the step's batch is pinned once per stacked tensor, side inputs are
uploaded once per step, and every microbatch is a view of what was pinned or uploaded.
The CUDA functions are replaced by counting fakes that copy (as ``pin_memory`` and an
upload do), so a per-microbatch pin or upload shows as extra calls and as microbatches
that are not views of the prepared tensors."""

import torch

from actors.feed import chunk
from actors.step_inputs import StepInputs, step_inputs
from actors.values import pack_batch


class Counting:
    def __init__(self):
        self.made = []

    def __call__(self, t):
        out = t.clone()  # a new buffer, like pin_memory() or an upload
        self.made.append(out)
        return out

    def owns(self, t):
        return any(t.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() for m in self.made)


def _batch(m=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=g), {"ids": torch.arange(2) + i}) for i in range(m)]


def test_batch_pinned_once_per_stacked_tensor_and_microbatches_are_views():
    mbs = _batch()
    pin = Counting()
    out = StepInputs(pin=pin).batch(pack_batch(mbs))
    assert len(pin.made) == 2  # one per tensor of the structure, not per microbatch (4 × 2)
    for got, want in zip(out, mbs, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1]["ids"], want[1]["ids"])
        assert pin.owns(got[0]) and pin.owns(got[1]["ids"])


def test_side_uploaded_once_per_step():
    mask = [torch.ones(2, 5) * i for i in range(4)]
    upload = Counting()
    per_mb, whole = StepInputs(upload=upload).side(({"mask": pack_batch(mask)}, {"scale": torch.tensor(2.0), "k": 3}))
    assert len(upload.made) == 2  # the stacked mask once, the whole tensor once; the int untouched
    assert all(upload.owns(v) and torch.equal(v, w) for v, w in zip(per_mb["mask"], mask, strict=True))
    assert upload.owns(whole["scale"]) and whole["k"] == 3


def test_fed_batch_pinned_before_it_is_cut():
    pin = Counting()
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    inputs, targets, _, _ = step_inputs(StepInputs(pin=pin), None, None, None,
                                        pull=lambda keep: (chunk(keep(x), 4), chunk(keep(y), 4)))
    assert len(pin.made) == 2 and all(pin.owns(t) for t in inputs + targets)
    assert torch.equal(torch.cat(inputs), x) and torch.equal(torch.cat(targets), y)


def test_cpu_changes_nothing():
    mbs, mask = _batch(), torch.randn(8, 5)
    prep = StepInputs.for_device(torch.device("cpu"))
    assert prep.pin is None and prep.upload is None
    inputs, targets, per_mb, whole = step_inputs(prep, pack_batch(mbs), mbs, ({"m": pack_batch(list(mask.chunk(4)))},
                                                                             {"w": mask}), None)
    assert targets is mbs and whole["w"] is mask  # ragged/whole values pass as they are
    assert all(torch.equal(a[0], b[0]) for a, b in zip(inputs, mbs, strict=True))
    assert torch.equal(torch.cat(per_mb["m"]), mask)
