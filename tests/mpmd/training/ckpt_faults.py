"""Checkpoint faults that happen inside the actors (they import this module by name): a stage
whose state cannot be written, or whose write waits at a named pipe until the test lets it
go, while a flag file exists (the actors run on this machine and see the test's files)."""

from __future__ import annotations

import functools
import os
import threading

import torch
from torch import nn

UNWRITABLE, HELD = "unwritable", "held"


class UnwritableTensor(torch.Tensor):
    """A tensor ``torch.save`` stops on, as on a full disk."""

    def __reduce_ex__(self, protocol):
        raise OSError(28, "No space left on device (simulated)")


class HeldTensor(torch.Tensor):
    """A tensor whose write waits for one byte from the named pipe ``fifo`` (``release``);
    then it is written as a plain tensor."""

    fifo = ""

    def __reduce_ex__(self, protocol):
        with open(type(self).fifo, "rb", buffering=0) as f:
            f.read(1)
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def fifo_of(flag) -> str:
    return f"{flag}.fifo"


def hold(flag) -> None:
    """From now on, a ``HELD`` stage's state taken for a checkpoint waits at its pipe when written."""
    if not os.path.exists(fifo_of(flag)):
        os.mkfifo(fifo_of(flag))
    open(flag, "w").close()


def release(flag) -> threading.Thread:
    """Let one held write go on (opening the pipe waits for the actor's end); the thread doing it."""
    def send() -> None:
        with open(fifo_of(flag), "wb", buffering=0) as f:
            f.write(b"x")

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@functools.lru_cache(maxsize=None)
def held_at(fifo: str) -> type:
    return type("HeldTensor", (HeldTensor,), {"fifo": fifo})


class FaultyStage(nn.Sequential):
    """``layers`` as one stage (the keys of ``nn.Sequential(*layers)``).  While the file
    ``flag`` exists, its state dict holds tensors that cannot be written (``UNWRITABLE``), or
    its first tensor's write waits at the named pipe ``fifo_of(flag)`` (``HELD``)."""

    def __init__(self, flag, fault: str, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.flag, self.fault = str(flag), fault
        self.register_state_dict_post_hook(mark_state)


def mark_state(module: FaultyStage, state_dict: dict, prefix: str, local_metadata) -> None:
    if not os.path.exists(module.flag):
        return
    keys = list(state_dict)
    if module.fault == HELD:
        state_dict[keys[0]] = state_dict[keys[0]].as_subclass(held_at(fifo_of(module.flag)))
    else:
        for k in keys:
            state_dict[k] = state_dict[k].as_subclass(UnwritableTensor)
