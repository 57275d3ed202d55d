"""What runs inside one Ray actor: stage compute, the program executor, communication."""

from .errors import StageError
from .program import Instr, decode_program, encode_program
from .protocol import OPTIMIZER_STEP, ChunkResult, FillChunk, FillSlot, StepCall, StepReply
from .worker import StageWorker

__all__ = ["StageWorker", "StageError", "Instr", "encode_program", "decode_program", "StepCall", "StepReply",
           "FillChunk", "FillSlot", "ChunkResult", "OPTIMIZER_STEP"]
