"""The schedule language: actions, schedules, generators, lowering passes, validation,
the cost-model simulator and rendering.  Pure Python: imports neither torch nor ray."""

from .actions import Action, Kind
from .blocking import BlockingResult, DeadlockError, simulate_blocking
from .generators import ScheduleInfo, get_schedule, register_schedule, schedule_info, schedule_names
from .passes import add_allreduce, add_fill_slots, add_frees, add_send_recv, lower
from .render import render, render_order
from .schedule import Schedule, ScheduleError, looped_stage_to_rank, v_stage_to_rank
from .simulate import Costs, SimResult, dependencies, simulate
from .validate import validate
from . import terapipe
from . import token_sliced  # registers terapipe (token-sliced GPipe order)
from . import zero_bubble  # registers zb-h1, zb-h2, zbv, dualpipev

__all__ = [
    "Action", "Kind", "Schedule", "ScheduleError", "DeadlockError", "ScheduleInfo",
    "get_schedule", "register_schedule", "schedule_info", "schedule_names",
    "add_send_recv", "add_allreduce", "add_frees", "add_fill_slots", "lower", "validate",
    "Costs", "SimResult", "simulate", "simulate_blocking", "BlockingResult", "dependencies",
    "render", "render_order", "looped_stage_to_rank", "v_stage_to_rank", "terapipe", "zero_bubble",
]
