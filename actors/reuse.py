"""A ``StageWorker`` process kept for the next pipeline (``mpmd.reuse_actors``): ``park``
drops everything a pipeline gave it, ``rebind`` makes it the actor a fresh start would
give.  Mixed into ``actors.worker.StageWorker``.  Note [reused actors] in
``mpmd/runtime/pool.py`` says when the controller does this and what it rules out."""

from __future__ import annotations

import gc
import os

import torch

from .state import reset_peak_rss

__all__ = ["Reusable"]


class Reusable:
    def park(self) -> int:
        """Finish what this pipeline left running here (an asynchronous checkpoint write, a Ray
        Data feed, the step channel, the process groups), drop its modules, optimizers,
        programs and buffers, and wait for ``rebind``; the process id."""
        self._join_writer()  # a write in flight finishes (or fails) first
        if self.feed is not None:
            self.feed.close()
        self.shutdown()  # the step channel, and the process groups destroyed
        torch.compiler.reset()  # graphs compiled for this pipeline's modules (mpmd train's compile=true)
        torch.set_grad_enabled(True)
        lock = self.call_lock  # held by this call until it returns
        self.__dict__.clear()
        self.call_lock = lock
        gc.collect()
        return os.getpid()

    def rebind(self, **kwargs) -> int:
        """Become the actor ``StageWorker(**kwargs)`` would be: the constructor runs again (the
        seed, the niceness, the grid place); the process id."""
        self.__dict__.clear()
        reset_peak_rss()  # memory_stats's peak is this pipeline's, as in a fresh process
        self.__init__(**kwargs)
        return os.getpid()
