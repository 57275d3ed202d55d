"""One transport class per way messages move (actors/transports.py), chosen once from the
controller's choice (mpmd/runtime/transport.py), with the staging that says where tensors
travel (Note [staged transport] in actors/staging.py).  Pure: no process group is formed."""

from __future__ import annotations

import pytest
import torch

from actors.staging import HostCopies, PinnedHostCopies, Unstaged
from actors.transports import (TRANSPORTS, GlooTransport, NcclOrderTransport, NcclTransport, StagedTransport,
                               select_transport)
from mpmd.runtime.transport import choose_transport

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("backend, staged, queued, device, transport, staging", [
    ("gloo", False, False, CPU, GlooTransport, Unstaged),
    ("gloo", True, False, CPU, StagedTransport, HostCopies),
    ("gloo", False, False, CUDA, StagedTransport, PinnedHostCopies),  # gloo moves host memory: a GPU's is staged
    ("gloo", True, False, CUDA, StagedTransport, PinnedHostCopies),
    ("gloo", False, True, CPU, NcclOrderTransport, Unstaged),
    ("gloo", True, True, CPU, NcclOrderTransport, HostCopies),
    ("gloo", True, True, CUDA, NcclOrderTransport, PinnedHostCopies),
    ("nccl", False, False, CUDA, NcclTransport, Unstaged),
])
def test_each_choice_builds_one_class_and_its_staging(backend, staged, queued, device, transport, staging):
    chosen, how = select_transport(backend, staged=staged, queued=queued, device=device)
    assert chosen is transport and type(how) is staging
    assert chosen.backend == backend and how.device == device
    assert how.wire == (device if staging is Unstaged else CPU)
    assert chosen.ordered == (backend == "nccl" or queued)
    assert chosen.world_timeout_s(10.0) == (310.0 if chosen.ordered else 10.0)  # Note [stuck operations]
    assert chosen.pair_groups([[0, 1]]) == ([[0, 1]] if chosen.ordered else ())  # Note [point-to-point groups]
    assert chosen.bound_device(device) == (device if backend == "nccl" else None)


def test_what_no_transport_does_is_refused():
    with pytest.raises(ValueError, match="NCCL moves device memory"):
        select_transport("nccl", staged=True, queued=False, device=CUDA)
    with pytest.raises(ValueError, match="'staged' and 'queued' are gloo's"):
        select_transport("nccl", staged=False, queued=True, device=CUDA)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        select_transport("mpi", staged=False, queued=False, device=CPU)


def test_the_controllers_choice_names_the_actors_class():
    own = [("node-a", ("0",)), ("node-a", ("1",))]
    shared = [("node-a", ("0",)), ("node-a", ("0",))]
    for requested, device, slots, kind in (("auto", "cpu", [], "gloo"), ("staged", "cpu", [], "staged"),
                                           ("nccl-order", "cpu", [], "nccl-order"), ("auto", "cuda", own, "nccl"),
                                           ("auto", "cuda", shared, "staged"), ("gloo", "cuda", own, "staged"),
                                           ("nccl-order", "cuda", own, "nccl-order")):
        chosen = choose_transport(requested, device, slots)
        assert chosen.kind == kind and chosen.ordered == TRANSPORTS[kind].ordered
        built, _ = select_transport(chosen.backend, staged=chosen.staged, queued=chosen.queued,
                                    device=torch.device(device, 0) if device == "cuda" else CPU)
        assert built is TRANSPORTS[kind]


def test_host_copies_travel_apart_from_the_computed_tensors():
    staging, x = HostCopies(CPU), torch.arange(6.0).view(2, 3).t()  # not contiguous
    (wire,), ready = staging.stage([x])
    assert ready is None and torch.equal(wire, x) and wire.data_ptr() != x.data_ptr() and wire.is_contiguous()
    (back,) = staging.from_wire([wire])
    assert torch.equal(back, x) and back.data_ptr() != wire.data_ptr()
    assert staging.buffer((2, 3), "float32").shape == (2, 3)
    unstaged = Unstaged(CPU)
    (same,) = unstaged.from_wire([x])
    assert same is x
