"""Tensor parallelism inside a pipeline stage, on the controller: which modules of each stage
are sharded how (the actors apply it: actors/tensor_parallel.py, Note [tensor parallelism]).

    plans.py        resolve_plans: the user's tp_plan ("auto", a dict, a function) as one checked plan
                    per stage (Note [tensor-parallel plans])
    builtin.py      the built-in plans of tp_plan="auto": Llama-family stages and mpmd.models.GPTStage
    ties.py         the placements a plan gives parameters; a tie's places must agree
    collectives.py  tp_collectives: the TP all-reduces/all-gathers a stage's plan costs per microbatch

It also exports vocab_parallel_cross_entropy (actors/vocab_loss.py): the loss on logits sharded over
the vocabulary.
"""

from actors.vocab_loss import vocab_parallel_cross_entropy

from .builtin import auto_plan, gpt_plan, llama_plan
from .collectives import Collective, TPCollectives, tp_collectives
from .plans import StagePlan, TPPlan, check_plan, expand_plan, resolve_plans
from .ties import check_tied_placements, param_placements

__all__ = ["resolve_plans", "expand_plan", "check_plan", "auto_plan", "llama_plan", "gpt_plan", "param_placements",
           "check_tied_placements", "tp_collectives", "TPCollectives", "Collective", "StagePlan", "TPPlan",
           "vocab_parallel_cross_entropy"]
