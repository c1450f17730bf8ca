"""NumPy inference engine on GGUF files; the worker uses only what is exported here.

Contract: docs/ENGINE-API.md.
"""

from .engine import Engine, EngineInfo, compile_kernels, preload_kernels
from .errors import EngineError
from .generate import GenerationResult, TokenEvent
from .scheduler import Finished, SlotInfo
from .sampling import SamplingParams

__all__ = ["Engine", "EngineError", "EngineInfo", "Finished", "GenerationResult", "SamplingParams",
           "SlotInfo", "TokenEvent", "compile_kernels", "preload_kernels"]
