"""Slot actions and the KV cache directory on a real ``python -m worker`` process (tiny GGUF),
driven over its socket: a busy slot's action waits for the slot; a refused restore leaves the
slot alone; Shutdown saves the idle KV and the next worker restores it on a prefix match."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import Done, Error, Generate, Ping, Pong, Shutdown, SlotAction, SlotActionResult, Token
from tests.worker.router_stub import RouterStub, spawn_worker
from tests.worker.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("g") / "tiny.gguf", n_ctx_train=512)


def start(gguf: Path, tmp: Path, n_ctx: int = 512) -> tuple[RouterStub, subprocess.Popen[bytes]]:
    stub = RouterStub("tcp://127.0.0.1:*")
    proc = spawn_worker(str(gguf), stub.endpoint, "--n-ctx", str(n_ctx), "--parallel", "1",
                        "--slot-save-path", str(tmp / "slots"), "--kv-cache-dir", str(tmp / "cache"))
    stub.handshake(60)
    return stub, proc


@pytest.fixture()
def worker(gguf: Path, tmp_path: Path) -> Iterator[tuple[RouterStub, subprocess.Popen[bytes]]]:
    stub, proc = start(gguf, tmp_path)
    yield stub, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    stub.close()


PROMPT = list(range(10, 110))  # 100 token ids of the tiny vocabulary


def run(stub: RouterStub, rid: str, prompt: list[int], n: int) -> tuple[list[Token], Done]:
    stub.send(Generate(id=rid, prompt=prompt, max_tokens=n, temperature=0.0, ignore_eos=True))
    toks, done = stub.stream(rid, 60)
    assert isinstance(done, Done), done
    return toks, done


def test_busy_slot_action_waits_and_refused_restore_changes_nothing(worker, gguf: Path, tmp_path: Path) -> None:
    stub, _ = worker
    stub.send(Generate(id="g1", prompt=PROMPT, max_tokens=300, temperature=0.0, ignore_eos=True))
    assert isinstance(stub.next(lambda m: isinstance(m, Token) and m.id == "g1", 60), Token)
    stub.send(SlotAction(id="s1", action="save", id_slot=0, filename="a.bin"))  # slot 0 is busy now
    first = stub.next(lambda m: m.id in ("g1", "s1") and isinstance(m, (Done, Error, SlotActionResult)), 60)
    assert isinstance(first, Done) and first.id == "g1"  # the save waited for the generation
    res = stub.next_for("s1", 60)
    assert isinstance(res, SlotActionResult), res
    assert res.n_tokens == len(PROMPT) + 299 and res.n_bytes == (tmp_path / "slots" / "a.bin").stat().st_size

    # a state of another n_ctx: refused, named, and slot 0 still holds what it held
    other_stub, other = start(gguf, tmp_path / "other", n_ctx=256)
    try:
        run(other_stub, "o1", PROMPT, 3)
        other_stub.send(SlotAction(id="os", action="save", id_slot=0, filename="b.bin"))
        assert isinstance(other_stub.next_for("os", 60), SlotActionResult)
    finally:
        other.kill()
        other.wait(10)
        other_stub.close()
    (tmp_path / "slots" / "b.bin").write_bytes((tmp_path / "other" / "slots" / "b.bin").read_bytes())
    stub.send(SlotAction(id="s2", action="restore", id_slot=0, filename="b.bin"))
    err = stub.next_for("s2", 60)
    assert isinstance(err, Error) and err.code == "kv_state_mismatch" and "n_ctx" in err.message
    stub.send(SlotAction(id="s3", action="restore", id_slot=0, filename="../a.bin"))
    err = stub.next_for("s3", 60)
    assert isinstance(err, Error) and err.code == "invalid_request"
    stub.send(Ping(id="p"))
    pong = stub.next_for("p", 30)
    assert isinstance(pong, Pong) and pong.slots[0]["n_past"] == len(PROMPT) + 299


def test_shutdown_saves_idle_kv_and_the_next_worker_restores_it(gguf: Path, tmp_path: Path) -> None:
    stub, proc = start(gguf, tmp_path)
    try:
        toks, d1 = run(stub, "t1", PROMPT, 5)
        stub.send(Shutdown(id="bye"))
        assert proc.wait(30) == 0
    finally:
        stub.close()
    files = list((tmp_path / "cache").glob("*.kvstate"))
    assert len(files) == 1
    turn2 = PROMPT + [t.token_id for t in toks] + list(range(200, 220))
    stub, proc = start(gguf, tmp_path)
    try:
        _, d2 = run(stub, "t2", turn2, 5)
        assert d2.cache_n == len(PROMPT) + 4  # the saved entry: prompt + the 4 generated tokens fed back
        assert d2.prompt_n == len(turn2) - d2.cache_n
    finally:
        proc.kill()
        proc.wait(10)
        stub.close()


def test_generate_save_slot_to_writes_the_entry_before_its_done(worker, tmp_path: Path) -> None:
    stub, _ = worker
    stub.send(Generate(id="h1", prompt=PROMPT, max_tokens=1, temperature=0.0, save_slot_to="h.kvstate"))
    toks, done = stub.stream("h1", 60)
    assert isinstance(done, Done)
    f = tmp_path / "slots" / "h.kvstate"
    assert f.is_file()  # written before the Done was sent
    from worker.engine.kv.state import read_state_tokens

    _, tokens, _ = read_state_tokens(f)
    assert tokens == PROMPT
    stub.send(Generate(id="h2", prompt=PROMPT, max_tokens=1, save_slot_to="../x"))
    _, err = stub.stream("h2", 60)
    assert isinstance(err, Error) and err.code == "invalid_request" and "save_slot_to" in err.message
