"""Tensor parallelism inside a pipeline stage: which modules of each stage are sharded how.

    plans.py    resolve_plans: the user's tp_plan ("auto", a dict, a function) as one checked plan per
                stage (Note [tensor-parallel plans])
    builtin.py  the built-in plans of tp_plan="auto": Llama-family stages and mpmd.models.GPTStage
    apply.py    apply_plan (on the actors: parallelize_module, re-tying in-stage ties) and the
                placements of tied parameters, checked on the controller
    grads.py    settle_grads, norm_terms: a sharded stage's gradients after the backward, on the actors
                (Note [DTensor gradients])
    collectives.py  tp_collectives: the TP all-reduces/all-gathers a stage's plan costs per microbatch
    state.py    full_state_dict, load_full_state_dict: full tensors out of and into a sharded stage
"""

from .apply import apply_plan, check_tied_placements, param_placements
from .collectives import Collective, TPCollectives, tp_collectives
from .grads import norm_terms, settle_grads
from .builtin import auto_plan, gpt_plan, llama_plan
from .state import full_state_dict, load_full_state_dict
from .plans import StagePlan, TPPlan, check_plan, expand_plan, resolve_plans

__all__ = ["resolve_plans", "apply_plan", "expand_plan", "check_plan", "auto_plan", "llama_plan", "gpt_plan",
           "param_placements", "check_tied_placements", "settle_grads", "norm_terms", "full_state_dict", "load_full_state_dict",
           "tp_collectives", "TPCollectives", "Collective", "StagePlan", "TPPlan"]
