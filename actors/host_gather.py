"""DTensor's all-gathers of CUDA tensors over gloo, through host memory.

Note [gloo all-gathers of CUDA tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Actors that share a GPU talk over gloo (NCCL refuses two ranks on one device: Note [staged
transport] in actors/comm.py), and so does a tensor-parallel stage's group there.  The runtime's
own collectives stage their CUDA tensors through host memory, but DTensor's go to gloo as they
are, and gloo's all-gather into one tensor (``allgather_into_tensor_coalesced``, which the
functional ``all_gather_into_tensor`` reaches) copies device memory as if it were the host's:
the process dies of a segmentation fault (torch issue 152645; seen on the first GPU check,
torch 2.11 on an H200, where an actor of a tp=2 GPT stage died at its first replicated
output).  Every other collective tried there on CUDA tensors over gloo gave right results:
c10d's all_reduce, all_gather (list), all_gather_into_tensor, reduce_scatter_tensor,
broadcast and all_to_all_single, and the functional all_reduce and reduce_scatter_tensor
(docs/gpu-check.md).

``gather_through_host`` replaces that one functional op's CUDA kernel in this process with one
that copies the input to the host, all-gathers there on the same gloo group, and copies the
result back: the same values, the same group, in the same order on every member (the op is
called where DTensor called it).  It is installed only in an actor whose groups are gloo and
whose device is a GPU, and it refuses a group of another backend.  GPUs are never reused by the
next pipeline (Note [reused actors] in mpmd/runtime/pool.py), so the replacement never meets
an NCCL group.  The CPU suite checks the kernel by installing it for the CPU
(tests/actors/test_host_gather.py); the GPU check runs the tp test it exists for."""
from __future__ import annotations

import torch
import torch.distributed as dist

_libraries: dict[str, torch.library.Library] = {}  # dispatch key -> the library holding our kernel
_gathered = [0]  # all-gathers this process ran through host memory


def host_gathers() -> int:
    """How many all-gathers this process has run through host memory."""
    return _gathered[0]


def gather_through_host(dispatch_key: str = "CUDA") -> None:
    """Make ``_c10d_functional.all_gather_into_tensor`` on ``dispatch_key`` tensors gather
    through host memory (Note [gloo all-gathers of CUDA tensors]); once per process."""
    if dispatch_key in _libraries:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    library.impl("all_gather_into_tensor", _all_gather_into_tensor, dispatch_key)
    _libraries[dispatch_key] = library


def _all_gather_into_tensor(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    backend = dist.get_backend(group)
    if backend != "gloo":
        raise RuntimeError(f"mpmd gathers through host memory only on gloo groups; group {group_name!r} is {backend}")
    host = input.detach().to("cpu").contiguous()
    out = torch.empty((group_size * host.shape[0], *host.shape[1:]), dtype=host.dtype)
    dist.all_gather_into_tensor(out, host, group=group)
    _gathered[0] += 1
    return out.to(input.device)
