"""README's "Harnesses" section gives the settings the harness suite uses: the same
configuration files, the same pinned versions (fast: reads files only)."""

from __future__ import annotations

import json
import re

from tests.harnesses.conftest import CONFIG
from tests.harnesses.install import HARNESSES
from tests.harnesses.test_harnesses import codex_config, llm_models, opencode_config
from tests.paths import ROOT

README = (ROOT / "README.md").read_text()
SECTION = README[README.index("## Harnesses\n"):]
SECTION = SECTION[:SECTION.index("\n## ", 5)]
URL = "http://127.0.0.1:PORT"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, re.S)


def test_config_files_are_the_suites() -> None:
    assert codex_config(URL) in blocks("toml")
    assert json.loads(blocks("json")[0]) == opencode_config(URL, "<any>")
    assert llm_models(URL) in blocks("yaml")


def test_pins_are_the_suites() -> None:
    for h in HARNESSES.values():
        assert f"`{h.package}` {h.version}" in SECTION, h


def test_router_config_is_the_suites() -> None:
    (shown,) = [b for b in blocks("toml") if "[defaults]" in b]
    for line in shown.strip().splitlines():
        assert line in CONFIG, line
