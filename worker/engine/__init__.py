"""NumPy inference engine on GGUF files; the worker uses only what is exported here.

Contract: docs/ENGINE-API.md.
"""

from .engine import DEFAULT_KV_BUDGET_MIB, Engine, EngineInfo
from .errors import EngineError
from .generate import GenerationResult, TokenEvent
from .scheduler import Finished, SlotInfo
from .sampling import SamplingParams

__all__ = ["DEFAULT_KV_BUDGET_MIB", "Engine", "EngineError", "EngineInfo", "Finished", "GenerationResult", "SamplingParams",
           "SlotInfo", "TokenEvent"]
