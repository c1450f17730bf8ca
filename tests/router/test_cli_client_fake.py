"""``modelyard ps | models | load | unload | events`` against a live router on fake workers
(issue 27): the command run as a user runs it (``python -m router ...`` in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


import pytest
from gguf import GGUFReader

from tests.router.conftest import ROOT, LiveRouter
from tests.worker.tiny_gguf import write_tiny_llama

CONFIG = """
[server]
models_dir = "."
{keys}
[models.tiny]
path = "tiny.gguf"
aliases = ["t"]
idle_ttl_s = 300
[models.other]
path = "bad.gguf"
"""


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "router", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def rows(out: str) -> dict[str, list[str]]:
    """A printed table by its first column (header included, as "NAME")."""
    return {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    write_tiny_llama(module_tmp / "tiny.gguf", qtype="Q8_0", n_ctx_train=512, extra_metadata={"general.file_type": 7})
    (module_tmp / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # cut short after the version
    r = LiveRouter(module_tmp, CONFIG.format(keys=""))
    yield r
    r.stop()


def test_models_reads_the_gguf_headers_without_loading(router: LiveRouter, module_tmp: Path) -> None:
    out = cli("models", "--url", router.url)
    assert out.returncode == 0, out.stderr
    t = rows(out.stdout)
    assert t["NAME"] == ["NAME", "STATE", "ARCH", "PARAMS", "QUANT", "CTX", "SIZE", "FILE", "SOURCE"]
    assert t["tiny"][:6] == ["tiny", "unloaded", "llama", t["tiny"][3], "Q8_0", "512"]
    assert "other" in t and "(invalid: the GGUF header is cut short or malformed)" in out.stdout
    js = cli("models", "--url", router.url, "--json")
    data = {m["id"]: m for m in json.loads(js.stdout)["data"]}
    g = data["tiny"]["gguf"]
    reader = GGUFReader(module_tmp / "tiny.gguf")  # the gguf package's reader agrees
    assert g["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert g["file_size"] == (module_tmp / "tiny.gguf").stat().st_size
    assert (g["architecture"], g["quantization"], g["context_length"], g["valid"]) == ("llama", "Q8_0", 512, True)
    assert data["other"]["gguf"]["valid"] is False
    assert data["tiny"]["state"] == "unloaded" and not router.workers()  # nothing was loaded to read them


def test_load_ps_unload(router: LiveRouter) -> None:
    out = cli("ps", "--url", router.url)
    assert out.returncode == 0 and list(rows(out.stdout)) == ["NAME"]  # nothing loaded
    out = cli("load", "t", "--url", router.url)  # an alias names the model
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("tiny: ready (pid ")
    pid = router.admin("tiny")["pid"]
    out = cli("ps", "--url", router.url)
    t = rows(out.stdout)
    assert t["NAME"] == ["NAME", "STATE", "PID", "MEMORY", "SLOTS", "QUEUE", "LOAD", "LOADED", "UNTIL"]
    row = t["tiny"]
    assert row[1:3] == ["ready", str(pid)] and row[3].replace(".", "").isdigit() and row[4] == "MiB"
    assert row[5] == "0/1" and row[6] == "0/8" and row[-2] == "in" and row[-1].startswith(("4m", "5m0"))
    assert "other" not in t
    js = json.loads(cli("ps", "--url", router.url, "--json").stdout)
    [m] = js["data"]
    assert m["id"] == "tiny" and time.time() < m["expires_at"] <= time.time() + 300
    out = cli("unload", "tiny", "--url", router.url)
    assert out.returncode == 0 and out.stdout.startswith("tiny: unloaded"), out.stdout + out.stderr
    assert list(rows(cli("ps", "--url", router.url).stdout)) == ["NAME"]
    assert router.admin("tiny")["state"] == "unloaded"
    assert router.admin("tiny")["unload_reason"] == "unloaded by request"
    # loaded again, the last unload's reason no longer describes it
    assert cli("load", "tiny", "--url", router.url).returncode == 0
    assert router.admin("tiny")["unload_reason"] is None
    assert cli("unload", "tiny", "--url", router.url).returncode == 0


def test_events_and_follow(router: LiveRouter) -> None:
    out = cli("events", "--url", router.url, "--json", "-n", "200")
    assert out.returncode == 0, out.stderr
    evs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["model"] for e in evs[:2]] == ["tiny", "other"] and {e["event"] for e in evs[:2]} == {"snapshot"}
    text = cli("events", "--url", router.url).stdout
    assert " tiny " in text and " snapshot " in text
    e = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    e["PYTHONPATH"] = str(ROOT)
    follow = subprocess.Popen([sys.executable, "-m", "router", "events", "--follow", "-n", "0", "--url", router.url],
                              cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        seen = [follow.stdout.readline() for _ in range(2)]  # the snapshot: one line per model
        assert all(" snapshot " in line for line in seen), seen
        assert cli("load", "tiny", "--url", router.url).returncode == 0
        line = follow.stdout.readline()
        assert " tiny " in line and " state " in line and "to=loading" in line, line
    finally:
        follow.terminate()
        follow.wait(10)
    assert cli("unload", "tiny", "--url", router.url).returncode == 0
    # a reader that leaves is how a followed stream ends: logged as a 200, not a 499
    lines = [x for x in router.log_path.read_text().splitlines() if "route=/admin/events" in x]
    assert lines and all(" status=200 " in x for x in lines), lines


def test_errors_are_one_line(router: LiveRouter, tmp_path: Path) -> None:
    out = cli("load", "nope", "--url", router.url)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("modelyard load: POST /admin/models/load: 404 ") and "nope" in out.stderr
    out = cli("ps", "--url", "http://127.0.0.1:9", "--timeout", "5")
    assert out.returncode == 1 and "cannot reach the service at http://127.0.0.1:9" in out.stderr
    out = cli("events", "-n", "500", "--url", router.url)
    assert out.returncode == 1 and "-n/--recent must be 0..200" in out.stderr


def test_address_and_keys_from_the_config_or_the_environment(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"x")
    r = LiveRouter(tmp_path, CONFIG.format(keys='api_key = "k-api"\nadmin_key = "k-admin"'))
    try:
        # the config names the port and the keys: no --url, no environment
        client_cfg = tmp_path / "client.toml"
        client_cfg.write_text(f'[server]\nport = {r.port}\napi_key = "k-api"\nadmin_key = "k-admin"\n')
        out = cli("models", "--config", str(client_cfg))
        assert out.returncode == 0 and "tiny" in out.stdout, out.stderr
        # the environment: the url and the admin key
        env = {"MODELYARD_URL": r.url, "MODELYARD_ADMIN_KEY": "k-admin"}
        assert cli("load", "tiny", "--config", str(tmp_path / "none.toml"), env=env).returncode == 0
        # the api key alone does not pass /admin when an admin key is set
        env = {"MODELYARD_URL": r.url, "MODELYARD_API_KEY": "k-api"}
        out = cli("ps", "--config", str(tmp_path / "none.toml"), env=env)
        assert out.returncode == 1 and ": 401 " in out.stderr
    finally:
        r.stop()


def test_bare_modelyard_says_what_it_does_instead_of_serving() -> None:
    out = cli()
    assert out.returncode == 2 and "no command given; 'modelyard serve' starts the service" in out.stderr
    assert "{serve,ps,models,load,unload,events}" in out.stderr and out.stdout == ""


def test_help_lists_the_commands() -> None:
    out = cli("--help")
    for cmd in ("serve", "ps", "models", "load", "unload", "events"):
        assert f"    {cmd}" in out.stdout, out.stdout
    out = cli("ps", "--help")
    assert "--url" in out.stdout and "MODELYARD_API_KEY" in out.stdout


