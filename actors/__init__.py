"""What runs inside one Ray actor: stage compute, the program executor, communication."""

from .errors import StageError
from .program import Instr, decode_program, encode_program
from .worker import StageWorker

__all__ = ["StageWorker", "StageError", "Instr", "encode_program", "decode_program"]
