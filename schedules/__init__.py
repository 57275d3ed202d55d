"""The schedule language: actions, schedules, generators, lowering passes, validation,
the cost-model simulator, rendering, and the TeraPipe token-slicing planner (``slicing``).
Pure Python: imports neither torch nor ray.

Note [import layers]: the modules form layers, lowest first; each imports only
modules above it (any other import sits under ``if TYPE_CHECKING:``, for annotations
only; the modules below ``schedule`` see one as ``view.ScheduleView``),
so there are no import cycles, lazy ones included:
``actions``; ``errors``; ``placement``; ``view``; ``text``; ``costs``, ``dependencies``, ``fit``, ``context_order``,
``expert_order``, ``posting``;
``runtime_sim``, ``nccl_order``; ``simulate``, ``blocking``;
``render``, ``validate``, ``passes``; ``schedule``; ``fuse``, ``generators``, ``zero_bubble``,
``token_sliced``.  ``slicing`` stands alone.
"""

from .actions import BACKWARD_KINDS, COMM_KINDS, COMPUTE_KINDS, WAIT_KINDS, Action, Kind, flat
from .blocking import BlockingResult, DeadlockError, simulate_blocking
from .context_order import RingExchanges, check_ring_order
from .expert_order import ExpertCollectives, check_exchange_order
from .posting import PREFETCH, prefetch_ready
from .nccl_order import linked_ranks
from .errors import ScheduleError
from .fuse import fuse_backwards
from .generators import ScheduleInfo, get_schedule, register_schedule, schedule_info, schedule_names
from .passes import add_allreduce, add_fill_slots, add_frees, add_send_recv, lower
from .placement import looped_stage_to_rank, v_stage_to_rank
from .render import render
from .schedule import Schedule
from .costs import Costs, Link
from .fit import LinkFit, OverheadFit, fit_link, fit_overhead
from .simulate import SimResult, dependencies, simulate
from .text import render_order
from .validate import validate
from . import slicing
from . import token_sliced  # registers terapipe (token-sliced GPipe order)
from . import zero_bubble  # registers zb-h1, zb-h2, zbv, dualpipev

__all__ = [
    "Action", "Kind", "flat", "COMPUTE_KINDS", "COMM_KINDS", "BACKWARD_KINDS", "WAIT_KINDS",
    "Schedule", "ScheduleError", "DeadlockError", "ScheduleInfo",
    "get_schedule", "register_schedule", "fuse_backwards", "schedule_info", "schedule_names",
    "add_send_recv", "add_allreduce", "add_frees", "add_fill_slots", "lower", "validate",
    "Costs", "Link", "LinkFit", "OverheadFit", "fit_link", "fit_overhead", "SimResult", "simulate", "simulate_blocking", "BlockingResult", "dependencies",
    "PREFETCH", "prefetch_ready", "linked_ranks", "ExpertCollectives", "check_exchange_order", "RingExchanges",
    "check_ring_order",
    "render", "render_order", "looped_stage_to_rank", "v_stage_to_rank", "slicing", "zero_bubble",
]
