"""Tensor parallelism inside a pipeline stage: which modules of each stage are sharded how.

On the controller (may import mpmd):
    plans.py        resolve_plans: the user's tp_plan ("auto", a dict, a function) as one checked plan
                    per stage (Note [tensor-parallel plans])
    builtin.py      the built-in plans of tp_plan="auto": Llama-family stages and mpmd.models.GPTStage
    ties.py         the placements a plan gives parameters; a tie's places must agree
    collectives.py  tp_collectives: the TP all-reduces/all-gathers a stage's plan costs per microbatch
On the actors (import only torch, so they can move under actors/ as they are):
    apply.py        apply_plan: parallelize_module, re-tying a tie held twice in one stage
    grads.py        settle_grads, norm_terms: the gradients after the backward (Note [DTensor gradients])
    state.py        full_state_dict, load_full_state_dict: full tensors out of and into a sharded stage
"""

from .apply import apply_plan
from .builtin import auto_plan, gpt_plan, llama_plan
from .collectives import Collective, TPCollectives, tp_collectives
from .grads import norm_terms, settle_grads
from .plans import StagePlan, TPPlan, check_plan, expand_plan, resolve_plans
from .state import full_state_dict, load_full_state_dict
from .ties import check_tied_placements, param_placements

__all__ = ["resolve_plans", "expand_plan", "check_plan", "auto_plan", "llama_plan", "gpt_plan", "param_placements",
           "check_tied_placements", "tp_collectives", "TPCollectives", "Collective", "apply_plan", "settle_grads",
           "norm_terms", "full_state_dict", "load_full_state_dict", "StagePlan", "TPPlan"]
