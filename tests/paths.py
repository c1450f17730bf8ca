"""Where the tests find their real inputs.

* ``MODELS_DIR``: the GGUF files ``scripts/fetch_models.py`` puts in ``models/``
  (``MODELYARD_MODELS_DIR`` overrides). ``scripts/test`` always fetches them, so a
  missing model is a test *failure*, never a silent skip.
* ``FIXTURES_DIR``: the llama.cpp reference outputs (``tests/fixtures/``, a copy of
  the team's ``shared/fixtures``; ``MODELYARD_FIXTURES`` overrides).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models")
FIXTURES_DIR = Path(os.environ.get("MODELYARD_FIXTURES") or ROOT / "tests" / "fixtures")
SMOLLM2_PATH = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PATH = MODELS_DIR / "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_FIXTURES = FIXTURES_DIR / "smollm2-135m-instruct-q4_1.shared.json"
GEMMA3_FIXTURES = FIXTURES_DIR / "gemma-3-270m-q4_k_m.shared.json"
