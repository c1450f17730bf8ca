"""KV state as a verified object: save -> restore into a fresh engine -> the same greedy
continuation; identity mismatches named; truncated / corrupt / foreign states refused
without touching the KV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.worker.tiny_gguf import write_tiny_gemma3, write_tiny_llama
from worker.engine import Engine, SamplingParams
from worker.engine.kv.state import (
    KVStateError,
    StateDecoder,
    encode_state,
    read_state_file,
    read_state_tokens,
    write_state_file,
)

WORDS = ("the river carried small boats past the old mill while children counted clouds and a dog "
         "barked at nothing in particular under the bridge near the market square").split()


def text_of(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def save(engine: Engine, path: Path, id_slot: int = 0, chunk: int = 1 << 20) -> int:
    st = engine.save_slot(id_slot)
    return write_state_file(path, encode_state(st.identity, st.tokens, st.k, st.v, chunk))


def restore(engine: Engine, path: Path, id_slot: int = 0) -> int:
    state, _ = read_state_file(path, engine.kv_identity)
    return engine.restore_slot(state, id_slot)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_save_restore_into_fresh_engine_continues_identically(which: str, smollm2_path: Path, gemma3_path: Path,
                                                              tmp_path: Path) -> None:
    path = str(smollm2_path if which == "smollm2" else gemma3_path)
    a = Engine.load(path, n_ctx=1024)
    prompt = a.tokenize(text_of(700, seed=3))[:600]  # beyond Gemma's 512-token sliding window
    assert len(prompt) == 600
    assert a.generate(prompt, greedy(8)).cache_n == 0
    # the reference is the same engine reusing its own KV: a prompt beyond Gemma's window re-evaluates
    # its last token alone there too (as llama-server does), which need not give a fresh run's bits
    ref = a.generate(prompt, greedy(8))
    assert ref.cache_n == len(prompt) - 1
    f = tmp_path / "state.bin"
    n_written = save(a, f, chunk=1 << 16)  # many small chunks
    assert n_written == f.stat().st_size
    ident, toks, size = read_state_tokens(f)
    assert ident == a.kv_identity and toks[:600] == prompt and size == n_written
    del a
    b = Engine.load(path, n_ctx=1024)
    n = restore(b, f)
    assert n == len(prompt) + 7  # prompt + every generated token fed back (the last is not yet in the KV)
    got = b.generate(prompt, greedy(8))
    assert got.cache_n == len(prompt) - 1 and got.prompt_n == 1
    assert got.tokens == ref.tokens
    assert b.slots()[0].n_past == len(prompt) + 7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {"f32": write_tiny_llama(d / "llama-f32.gguf", qtype="F32", n_ctx_train=256),
            "q8": write_tiny_llama(d / "llama-q8.gguf", qtype="Q8_0", n_ctx_train=256),
            "gemma": write_tiny_gemma3(d / "gemma.gguf", qtype="F32", n_ctx_train=256)}


@pytest.fixture(scope="module")
def saved(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A state of tiny llama F32 (n_ctx 128) holding a 40-token prompt + 5 generated tokens."""
    e = Engine.load(str(tiny["f32"]), n_ctx=128)
    prompt = e.tokenize(text_of(60, seed=1))[:40]
    e.generate(prompt, greedy(6))
    f = tmp_path_factory.mktemp("st") / "s.bin"
    save(e, f)
    return f, prompt


@pytest.mark.parametrize("other, n_ctx, field", [
    ("q8", 128, "model_fingerprint"),   # another quantization of the same model
    ("gemma", 128, "architecture"),     # another model
    ("f32", 64, "n_ctx"),               # same file, another context size
])
def test_restore_into_another_identity_is_refused_naming_the_field(tiny: dict[str, Path], saved, other: str,
                                                                   n_ctx: int, field: str) -> None:
    f, prompt = saved
    e = Engine.load(str(tiny[other]), n_ctx=n_ctx)
    before = e.generate(prompt[:30], greedy(4))
    held = e.slots()[0].n_past
    with pytest.raises(KVStateError) as ei:
        restore(e, f)
    assert ei.value.code == "kv_state_mismatch" and ei.value.field == field
    assert field in ei.value.message
    assert e.slots()[0].n_past == held  # the slot is untouched
    e.reset_cache()
    assert e.generate(prompt[:30], greedy(4)).tokens == before.tokens


def corruptions(data: bytes) -> dict[str, bytes]:
    flip = lambda b, i: b[:i] + bytes([b[i] ^ 0x10]) + b[i + 1:]  # noqa: E731
    return {
        "truncated": data[:-100],
        "truncated_header": data[:30],
        "header_bit": flip(data, 40),
        "payload_bit": flip(data, len(data) // 2),
        "digest_bit": flip(data, len(data) - 1),
        "trailing": data + b"\0",
        "foreign": b"GGUF" + bytes(range(256)) * 4,
        "empty": b"",
    }


def test_truncated_corrupt_and_foreign_states_are_refused_and_change_nothing(tiny: dict[str, Path], saved,
                                                                              tmp_path: Path) -> None:
    f, prompt = saved
    e = Engine.load(str(tiny["f32"]), n_ctx=128)
    ref = e.generate(prompt, greedy(5))
    data = f.read_bytes()
    for name, bad in corruptions(data).items():
        p = tmp_path / name
        p.write_bytes(bad)
        with pytest.raises(KVStateError) as ei:
            restore(e, p)
        assert ei.value.code == "kv_state_invalid", name
        with pytest.raises(KVStateError):  # the same bytes fed in odd splits fail as well
            dec = StateDecoder(e.kv_identity)
            for i in range(0, len(bad), 777):
                dec.feed(bad[i:i + 777])
            dec.finish()
        e.reset_cache()
        assert e.generate(prompt, greedy(5)).tokens == ref.tokens, name
    with pytest.raises(KVStateError):
        restore(e, tmp_path / "missing.bin")
    # and the intact file still restores (the refusals did not consume or alter it)
    e.reset_cache()
    assert restore(e, f) == 45
    assert e.generate(prompt, greedy(5)).cache_n == 39


def test_erase_and_busy_and_bad_slot(tiny: dict[str, Path], saved) -> None:
    f, prompt = saved
    e = Engine.load(str(tiny["f32"]), n_ctx=128, parallel=2)
    assert restore(e, f, id_slot=1) == 45
    assert [s.n_past for s in e.slots()] == [0, 45]
    assert e.erase_slot(1) == 45 and e.kv_tokens == 0
    assert e.erase_slot(1) == 0
    with pytest.raises(Exception) as ei:
        e.save_slot(2)
    assert "Invalid slot ID" in str(ei.value)
    e.add("x", prompt, greedy(50))
    e.step()
    assert e.slot_busy(0)
    with pytest.raises(Exception, match="processing"):
        e.erase_slot(0)
    e.abort("x")
    e.step()
    assert not e.slot_busy(0)


def test_tokenizer_fingerprint_covers_vocabulary_and_special_ids(tiny: dict[str, Path]) -> None:
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.text.tokenizer import Tokenizer

    md = dict(read_gguf(str(tiny["f32"])).metadata)
    base = Tokenizer.from_metadata(md).fingerprint
    assert Tokenizer.from_metadata(dict(read_gguf(str(tiny["gemma"])).metadata)).fingerprint == base
    toks = list(md["tokenizer.ggml.tokens"])
    toks[-1] = toks[-1] + "x"  # an unused padding token: the tokenizer still builds
    assert Tokenizer.from_metadata({**md, "tokenizer.ggml.tokens": toks}).fingerprint != base
    assert Tokenizer.from_metadata({**md, "tokenizer.ggml.eos_token_id": 2}).fingerprint != base
    merges = list(md["tokenizer.ggml.merges"])
    assert Tokenizer.from_metadata({**md, "tokenizer.ggml.merges": merges[:-1]}).fingerprint != base


def test_disk_cache_budget_prefixes_and_corrupt_files(tiny: dict[str, Path], tmp_path: Path) -> None:
    from worker.engine.kv.disk import DiskCache

    e = Engine.load(str(tiny["f32"]), n_ctx=128, parallel=4)
    base = e.tokenize(text_of(80, seed=2))[:30]
    for extra in ([], e.tokenize(" one two three")[:3], e.tokenize(text_of(40, seed=9))[:20]):
        e.generate(base + extra, greedy(2))
    states = e.idle_states()
    assert states and all(s.n_tokens for s in states)
    one = states[0].n_tokens * states[0].identity.token_bytes
    d = DiskCache(tmp_path / "c", budget_bytes=10 * one, identity=e.kv_identity)
    written, _ = d.save(states)
    assert written == len(states) == d.files
    # a fresh index finds them; a prompt extending the newest state is served from disk
    d2 = DiskCache(tmp_path / "c", budget_bytes=10 * one, identity=e.kv_identity)
    assert d2.scan() == written
    newest = states[0].tokens
    path = d2.lookup(newest + [5, 6], have=0)
    assert path is not None and d2.lookup(newest + [5, 6], have=len(newest) + 1) is None
    st, _ = d2.load(path)
    assert st.tokens == newest
    # another identity's index ignores these files; a corrupt file is refused and deleted
    other = Engine.load(str(tiny["f32"]), n_ctx=64)
    foreign = DiskCache(tmp_path / "c", 10 * one, other.kv_identity)
    assert foreign.scan() == 0 and foreign.lookup(newest + [5, 6], have=0) is None
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(KVStateError):
        d2.load(path)
    assert not path.exists() and d2.files == written - 1
    # a tight budget keeps only the most recent states; a prefix of a kept state is not kept
    d3 = DiskCache(tmp_path / "small", budget_bytes=int(1.5 * one) + 4096, identity=e.kv_identity)
    d3.save(states)
    assert d3.files == 1
    longer = states[0]
    n = longer.n_tokens - 5
    from worker.engine.kv.state import KVState

    prefix = KVState(longer.identity, longer.tokens[:n], longer.k[:, :, :n], longer.v[:, :, :n])
    d4 = DiskCache(tmp_path / "dedupe", budget_bytes=10 * one, identity=e.kv_identity)
    assert d4.save([longer, prefix])[0] == 1 and d4.files == 1
    # files of another identity count in the budget and are pruned by age, never loaded
    f2 = DiskCache(tmp_path / "dedupe", budget_bytes=0, identity=other.kv_identity)
    f2.scan()
    f2.save([])
    assert list((tmp_path / "dedupe").glob("*.kvstate")) == []


def test_an_empty_slot_saves_and_restores_as_zero_tokens(tiny: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp saves an empty slot as n_saved 0; restoring it leaves the slot empty."""
    e = Engine.load(str(tiny["f32"]), n_ctx=128, parallel=2)
    f = tmp_path / "empty.kvstate"
    assert save(e, f, id_slot=1) > 0
    assert read_state_tokens(f)[1] == []
    assert restore(e, f, id_slot=0) == 0
    assert [s.n_past for s in e.slots()] == [0, 0]
