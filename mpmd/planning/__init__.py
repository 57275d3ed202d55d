"""Planning a pipeline before it runs: cutting a model into stages, and choosing the
schedule and the microbatch count from measured stage costs.

    split.py    mpmd.split: PipelineYield markers or a min-max balance of layers
    hf.py       Hugging Face causal LMs cut into stages under the model's own keys; causal_lm_loss
    auto.py     schedule="auto" / num_microbatches="auto": simulate every option, pick one
    measure.py  timing stage modules on the controller with the actors' stage code
    memory.py   each actor's peak memory under a schedule; a MoE layer's per actor (moe_layer_bytes)
"""

from .auto import (MAX_AUTO_MICROBATCHES, Decision, Option, StageCost, choose_schedule, default_memory_limit,
                   plan_pipeline, rank_memory)
from .hf import HF_CAUSAL_LMS, CausalLMStage, GPT2Stage, LlamaStage, causal_lm_loss, split_causal_lm
from .memory import MoELayerBytes, MoESpec, moe_layer_bytes
from .measure import (DEFAULT_BYTES_PER_S, DEFAULT_LATENCY_S, Measurement, measure_chain, measure_module,
                      measure_stages)
from .split import BALANCE_MODES, PipelineYield, SplitStages, partition, split

__all__ = ["split", "partition", "PipelineYield", "SplitStages", "BALANCE_MODES", "StageCost", "Option", "Decision",
           "choose_schedule", "plan_pipeline", "rank_memory", "default_memory_limit", "MAX_AUTO_MICROBATCHES", "Measurement",
           "measure_module", "measure_chain", "measure_stages", "DEFAULT_BYTES_PER_S", "DEFAULT_LATENCY_S",
           "causal_lm_loss", "split_causal_lm", "HF_CAUSAL_LMS", "CausalLMStage", "GPT2Stage", "LlamaStage",
           "MoESpec", "MoELayerBytes", "moe_layer_bytes"]
