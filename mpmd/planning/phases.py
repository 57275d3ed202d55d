"""What one microbatch of a stage allocates, phase by phase, read from the profiler's memory
events of a marked run (``measure.py`` runs it; ``memory.py`` adds the phases up)."""

from __future__ import annotations

__all__ = ["phases_of"]


# Note [memory phases]
# --------------------
# What one microbatch holds from its forward to its backward is its saved tensors, input and
# output (``act_bytes``, read with saved-tensor hooks).  What it takes *while* a phase runs
# is more: a backward allocates the gradients of every activation on its way (the last
# stage's logits gradient is the size of the logits), a forward its temporaries.  And what a
# split backward keeps from I to W is not all of the graph: only what W's weight halves
# read, and the gradients they start from.  So a stage is run once more, after the timed
# runs' warm-up (its parameters' gradients exist), under the profiler's allocation events
# (``profile_memory``: every allocation and free of torch's allocator on the stage's
# device, what ``torch.cuda.max_memory_allocated`` counts on a GPU), each phase marked:
# the live bytes at a phase's start and end and its peak give ``f_peak`` (above what F
# leaves), ``i_peak``/``w_peak``/``b_peak`` (above what was live when the phase began) and
# ``i_held`` (live after I above live before F).  The planner's accounting
# (``rank_memory`` in memory.py) adds them where each phase runs.
#
# Note [recomputed phases]
# ------------------------
# A recomputed stage holds neither what the same stage holds without recompute nor a simple
# function of it.  Checkpointed (a fused backward), a microbatch keeps its input, its output
# and what the code after the checkpoint saved: on a last stage the loss's own buffers (the
# log-probabilities, as large as the logits).  Its B frees the loss's buffers and the
# logits' gradient before the checkpoint recomputes the layers, so B's peak is not the
# recomputed activations plus the plain B's peak (which comes from the logits' gradient):
# adding them over-predicted a 125M-shaped Llama's last actor by 80 MiB of 350.  Recomputed
# at I (a split backward), the forward runs without a graph and keeps only its input and
# output.  So the profiled run goes on with both, each marked: ``r_held`` (live after the
# checkpointed forward above before it), ``rb_peak``; ``rs_held``, ``ri_peak``, ``ri_held``
# (live after I above before that forward) and ``rw_peak``.  ``rank_memory`` uses them for
# the stages it recomputes (``StageCost.recompute``), and the structural estimate where they
# were not measured (the dry run's analytic costs).  Both recomputed forwards also keep the
# RNG state they replay (5 KiB on the CPU), which outweighs a tiny stage's activations: there
# recompute saves nothing, and the measurement says so.


def phases_of(events, device: str) -> dict:
    """The ``Measurement`` fields of Note [memory phases] and Note [recomputed phases] from the
    profiler's events of one marked run (``_Timer.memory_phases`` in measure.py): ``{}``
    when a mark is missing."""
    marks = {e.name()[len("mpmd::"):]: (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("mpmd::")}
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type().name == device)

    def live(t: int) -> int:
        return sum(n for ts, n in memory if ts < t)

    def peak(start: int, end: int) -> int:
        now = top = live(start)
        for ts, n in memory:
            if start <= ts < end:
                now += n
                top = max(top, now)
        return top

    if set(marks) != {"F", "I", "W", "F2", "B", "RF", "RB", "RS", "RI", "RW"}:
        return {}

    def above(phase: str) -> int:  # a phase's peak above what was live when it began
        start, end = marks[phase]
        return max(0, peak(start, end) - live(start))

    def held(first: str, last: str) -> int:  # live after ``last`` above live before ``first``
        return max(0, live(marks[last][1]) - live(marks[first][0]))

    f0, f1 = marks["F"]
    return dict(f_peak=max(0, peak(f0, f1) - live(f1)), i_peak=above("I"), w_peak=above("W"), b_peak=above("B"),
                i_held=held("F", "I"), r_held=held("RF", "RF"), rb_peak=above("RB"), rs_held=held("RS", "RS"),
                ri_peak=above("RI"), ri_held=held("RS", "RI"), rw_peak=above("RW"))
