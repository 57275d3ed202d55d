"""TeraPipe: token-level pipelining of a causal transformer (Li et al., ICML 2021).

A long sequence cannot be cut into enough microbatches to fill a pipeline, so each
(micro)batch of sequences is cut along the *token* axis into slices that flow through
the stages one after another: stage k runs slice i while stage k-1 runs slice i+1.
The unit of work is (microbatch b, slice i), the schedule's "microbatch" ``b*S + i``
(``schedules.token_sliced``); a stage keeps the keys/values of a sequence's earlier
slices and back-propagates their gradient (``protocol.py`` says what a stage must do;
``mpmd.models.GPTStage`` does it).

    pipe = mpmd.Pipeline(mpmd.models.gpt_stages(cfg, 4), schedule="terapipe",
                         token_slices="auto", num_microbatches=1, loss_fn=mpmd.models.lm_loss, ...)
    pipe.token_slicing.slices      # e.g. (128, 128, 128, 128): measured on the actors
    pipe.token_slicing.step_model  # predicts a step of any slicing there
    loss = pipe.step(tokens, next_tokens)     # (batch, seq_len) each

``schedule`` picks the order of units: ``"terapipe"`` (= ``"gpipe"``, the paper's) or
``"terapipe-1f1b"`` (= ``"1f1b"``).  One stage per actor; ``dp`` replicas work as usual.
How the slices are chosen: ``costs.py``; for ``"auto"`` the plan is then timed on the
actors and chosen again with the measured per-slice overhead: ``calibrate.py`` (Note
[calibrated slices]).  How a step's batch becomes units and the loss is weighted:
``batching.py``.  The loss is the token mean: ``loss_fn`` must be a mean
over the tokens it is given (like ``mpmd.models.lm_loss``).
"""

from .batching import ORDERS, SliceLoss, TokenSlicing, plan_token_slicing, wants_token_slicing
from .calibrate import SliceStepModel, calibrate_token_slicing, choose_slices, fit_step_model, probe_slicings
from .costs import default_granularity, fit_slice_cost, measure_slice_costs, resolve_token_slices
from .protocol import is_token_slice, token_slice

__all__ = ["TokenSlicing", "SliceLoss", "ORDERS", "plan_token_slicing", "wants_token_slicing", "resolve_token_slices",
           "fit_slice_cost", "measure_slice_costs", "default_granularity", "token_slice", "is_token_slice",
           "SliceStepModel", "fit_step_model", "choose_slices", "probe_slicings", "calibrate_token_slicing"]
