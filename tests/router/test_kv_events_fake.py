"""KV events' configuration (``kv_events_endpoint``, ``kv_events_block_size``) reaching the worker's
options (its command line and a spare's Assign), their errors naming the key, and a router that
receives KvEvents frames from its workers serving on unharmed (fake workers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from router.config_readers import replica_endpoint
from router.config import ConfigError, load_config
from router.workers.launchers.local import worker_command
from router.workers.options import assign_for
from tests.router.conftest import router_fixture
from tests.router.test_process_fake import MINI, write


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_kv_events_keys_reach_the_worker_command_and_the_assign(tmp_path: Path) -> None:
    text = MINI.replace('[models.two]\npath = "m.gguf"\n', '[models.two]\npath = "m.gguf"\n'
                        'kv_events_endpoint = "tcp://127.0.0.1:5557"\nkv_events_block_size = 32\n')
    cfg = load_config(write(tmp_path, text + '[defaults]\nkv_events_endpoint = "ipc://ev/{model}.sock"\n'))
    one, two = cfg.models["one"], cfg.models["two"]
    assert one.kv_events_endpoint == f"ipc://{tmp_path.resolve()}/ev/one.sock"  # {model}; relative to the config
    assert two.kv_events_endpoint == "tcp://127.0.0.1:5557" and two.kv_events_block_size == 32
    cmd = worker_command(two, "ipc:///x.sock")
    assert flag(cmd, "--kv-events-endpoint") == "tcp://127.0.0.1:5557"
    assert flag(cmd, "--kv-events-block-size") == "32" and "--kv-events-to-router" not in cmd
    a = assign_for(two, "c1")
    assert (a.kv_events_endpoint, a.kv_events_block_size, a.kv_events_to_router) == ("tcp://127.0.0.1:5557", 32, False)
    plain = load_config(write(tmp_path, MINI)).models["one"]
    assert plain.kv_events_endpoint is None and plain.kv_events_block_size == 16
    assert not any(a.startswith("--kv-events") for a in worker_command(plain, "ipc:///x.sock"))  # off by default
    asked = dataclasses.replace(plain, kv_events_to_router=True)  # the router asks for them (no config key)
    cmd = worker_command(asked, "ipc:///x.sock")
    assert "--kv-events-to-router" in cmd and flag(cmd, "--kv-events-block-size") == "16"
    assert flag(cmd, "--kv-events-endpoint") is None and assign_for(asked, "c2").kv_events_to_router


@pytest.mark.parametrize("extra,key", [
    ("[models.one]\nkv_events_endpoint = 'udp://127.0.0.1:5557'\n", "models.one.kv_events_endpoint"),
    ("[models.one]\nkv_events_endpoint = 'tcp://127.0.0.1'\n", "models.one.kv_events_endpoint"),  # no port
    ("[models.one]\nkv_events_endpoint = 5557\n", "models.one.kv_events_endpoint"),
    ("[defaults]\nkv_events_block_size = 0\n", "defaults.kv_events_block_size"),
    ("[defaults]\nkv_events_endpoint = 'tcp://127.0.0.1:5557'\n", "models.two.kv_events_endpoint"),  # bound twice
    ("[defaults]\nkv_events_to_router = true\n", "defaults.kv_events_to_router"),  # not a key
])
def test_kv_events_config_errors_name_the_key(tmp_path: Path, extra: str, key: str) -> None:
    if extra.startswith("[models.one]"):
        text = MINI.replace('[models.one]\npath = "m.gguf"\n', '[models.one]\npath = "m.gguf"\n' + extra[13:])
    else:
        text = MINI + extra
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert e.value.key == key


CONFIG = """
[server]
models_dir = "."
[models.m]
path = "m.gguf"
kv_events_endpoint = "ipc://kv-{model}.sock"
"""

router = router_fixture(CONFIG, ggufs=("m.gguf",), fake={"*": {"kv_events": True, "length": 3}})


def test_kv_events_frames_from_the_worker_harm_nothing(router) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=router.url, timeout=30) as c:
        for i in range(3):
            r = c.post("/v1/completions", json={"model": "m", "prompt": f"one two three four five {i}",
                                                "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"]
        assert c.get("/health").status_code == 200
    assert len(router.fake_events("start")) == 1  # the same worker served all three
    assert [e["seq"] for e in router.fake_events("kv_events")] == [0, 1, 2]
    argv = router.fake_events("start")[0]["argv"]
    assert argv[argv.index("--kv-events-endpoint") + 1] == f"ipc://{router.tmp.resolve()}/kv-m.sock"
    assert router.admin("m")["state"] == "ready"
    assert "Traceback" not in router.log()


def test_each_replica_binds_its_own_kv_events_endpoint(tmp_path: Path) -> None:
    """Replica 0 the model's endpoint, replica N port + N (tcp) or PATH-N (ipc), as vLLM numbers
    its data-parallel ranks' publishers."""
    from router.config import ModelConfig
    from router.workers.replicas import replica_model

    assert replica_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert replica_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert replica_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert replica_endpoint("ipc:///run/kv.sock", 1) == "ipc:///run/kv.sock-1"
    m = ModelConfig(name="m", path=Path("m.gguf"), kv_events_endpoint="tcp://127.0.0.1:5557", replicas=3)
    assert [replica_model(m, r).kv_events_endpoint for r in range(3)] == [
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5559"]
    text = MINI.replace('[models.one]\npath = "m.gguf"\n', '[models.one]\npath = "m.gguf"\nreplicas = 2\n'
                        'kv_events_endpoint = "tcp://127.0.0.1:5556"\n').replace(
        '[models.two]\npath = "m.gguf"\n', '[models.two]\npath = "m.gguf"\nkv_events_endpoint = "tcp://127.0.0.1:5557"\n')
    with pytest.raises(ConfigError) as e:  # one's second replica would bind two's port
        load_config(write(tmp_path, text))
    assert e.value.key == "models.two.kv_events_endpoint" and "5557" in str(e.value)
    assert replica_model(m, 0) is m and replica_model(ModelConfig(name="m", path=Path("m.gguf")), 1).kv_events_endpoint is None
