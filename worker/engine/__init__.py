"""NumPy inference engine on GGUF files; the worker uses only what is exported here.

Contract: docs/ENGINE-API.md.
"""

from .engine import Engine, EngineInfo
from .errors import EngineError
from .generate import GenerationResult, TokenEvent
from .seqs import Finished, SlotInfo
from .sampling import SamplingParams
from .warmup import compile_kernels, preload_kernels

__all__ = ["Engine", "EngineError", "EngineInfo", "Finished", "GenerationResult", "SamplingParams",
           "SlotInfo", "TokenEvent", "compile_kernels", "preload_kernels"]
