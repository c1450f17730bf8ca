"""Issue 27 on a real worker (SmolLM2): two presets run on its one worker, the temperature-0
preset gives the greedy text and a request's own temperature wins over a preset's; a copy of
the GGUF dropped into models_dir is served after a rescan, with its metadata, and answers as
the same weights do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import shutil

from tests.router.conftest import SMOLLM2, LiveRouter

pytestmark = [pytest.mark.slow]

CONFIG = f"""
[server]
models_dir = "models"
discover_models = true
[defaults]
n_ctx = 512
load_timeout_s = 300
[models.smollm2]
path = "{SMOLLM2.name}"
[models.smol-chatml]
path = "{SMOLLM2.name}"
chat_template = "chatml"
[presets.smol-as-chatml]
model = "smollm2"
chat_template = "chatml"
temperature = 0.0
[presets.smol-greedy]
model = "smollm2"
temperature = 0.0
[presets.smol-hot]
model = "smollm2"
temperature = 1.5
top_k = 0
top_p = 1.0
min_p = 0.0
seed = 7
"""
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    (module_tmp / "models").mkdir()
    (module_tmp / "models" / SMOLLM2.name).symlink_to(SMOLLM2)
    r = LiveRouter(module_tmp, CONFIG, real=True)
    yield r
    r.stop()


def _text(r: LiveRouter, model: str, **extra: Any) -> str:
    out = httpx.post(r.url + "/v1/chat/completions", timeout=300,
                     json={"model": model, "messages": MESSAGES, "max_tokens": 24, **extra})
    assert out.status_code == 200, out.text
    return str(out.json()["choices"][0]["message"]["content"])


def test_two_presets_one_worker_greedy_and_the_requests_own_value(router: LiveRouter) -> None:
    greedy = _text(router, "smollm2", temperature=0)
    assert greedy
    assert _text(router, "smol-greedy") == greedy              # the preset's temperature 0
    hot = _text(router, "smol-hot")
    assert hot != greedy                                       # its own sampling (seeded)
    assert _text(router, "smol-hot") == hot                    # ... and its own seed
    assert _text(router, "smol-hot", temperature=0) == greedy  # a request's own value wins
    m = router.admin("smollm2")
    assert m["spawn_count"] == 1 and len(router.workers()) == 1


def test_a_presets_chat_template_renders_its_chats(router: LiveRouter) -> None:
    """The preset's template travels with its requests: its greedy text is the one of a model
    configured with that template (another worker, same weights)."""
    spawns = router.admin("smollm2")["spawn_count"]
    assert _text(router, "smol-as-chatml") == _text(router, "smol-chatml", temperature=0)
    rendered = {m: httpx.post(router.url + "/apply-template", json={"model": m, "messages": MESSAGES},
                              timeout=60).json()["prompt"] for m in ("smol-as-chatml", "smol-chatml", "smollm2")}
    assert rendered["smol-as-chatml"] == rendered["smol-chatml"] != rendered["smollm2"]
    assert router.admin("smollm2")["spawn_count"] == spawns  # still the model's one worker


def test_a_gguf_copied_into_models_dir_is_served_after_a_rescan(router: LiveRouter, module_tmp: Path) -> None:
    greedy = _text(router, "smollm2", temperature=0)
    shutil.copy(SMOLLM2, module_tmp / "models" / "my-smol.gguf")
    r = httpx.post(router.url + "/admin/models/rescan", timeout=60)
    assert r.status_code == 200 and r.json()["added"] == ["my-smol"], r.text
    entry = httpx.get(router.url + "/v1/models/my-smol", timeout=30).json()
    assert entry["state"] == "unloaded"
    assert (entry["meta"]["architecture"], entry["meta"]["quantization"], entry["meta"]["n_ctx_train"]) == \
        ("llama", "Q4_1", 8192)
    assert _text(router, "my-smol", temperature=0) == greedy  # the same weights, its own worker
    assert router.admin("my-smol")["source"] == "models_dir"
