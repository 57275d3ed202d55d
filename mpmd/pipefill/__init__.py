"""PipeFill: run independent fill jobs inside the main job's pipeline bubbles.

1. **Place**: the training program is recompiled once with a ``FILL`` slot before
   every wait (receive or all-reduce) and shipped (``schedules.add_fill_slots``).
2. **Measure**: on profiled steps a slot's bubble is the shortest wait after it;
   slots whose bubble is shorter than ``min_bubble_s`` get nothing.
3. **Plan** (every step): a policy orders the jobs; each bubble gets a few chunks whose
   predicted time fits it and whose memory fits what is free there.  A chunk runs whole
   inside its slot, never across main-job work; the actor starts no further chunk once
   the receive the slot precedes has arrived (those go back to the controller).
4. **Account**: outputs stay on the actors until fetched; every input is processed
   exactly once, in order; a chunk that raises marks its job failed, and training goes on.

    job.py      FillJob: the work, its progress, its cost model
    planner.py  bubbles from profiled steps, the policies, the per-step plan (pure)
    manager.py  FillManager: drives one pipeline's fill work through its engine
"""

from .job import FillJob
from .manager import FillManager
from .planner import POLICIES, Bubble, find_bubbles, plan_fill, return_unprocessed, waits_of

__all__ = ["FillJob", "FillManager", "POLICIES", "Bubble", "find_bubbles", "waits_of", "plan_fill",
           "return_unprocessed"]
