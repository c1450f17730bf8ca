#!/usr/bin/env python3
"""Time tokenizing a ~100 KB source text with each model's tokenizer.

Usage: .venv/bin/python scripts/bench_tokenizer.py [--models PATH ...] [--text FILE] [--repeat N]

The default text is the first 100,000 characters of the Jinja2 package's
Python sources (deterministic, installed with the project). Besides it, two
harder texts are timed: 33,000 random CJK characters (no spaces: one long
SentencePiece word per line) and 100 KB of base64. "cold" clears the
SentencePiece word memo first; "warm" runs again with it filled. Target:
< 1 s for 100 KB on both models.
"""

from __future__ import annotations

import argparse
import base64
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine.text.tokenizer import Tokenizer  # noqa: E402

DEFAULT_MODELS = [ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf", ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"]


def metadata(path: Path) -> dict[str, Any]:
    try:
        from worker.engine.loading.gguf_loader import read_gguf
    except ImportError:  # fall back to the gguf package's (slow) reader
        import gguf

        reader = gguf.GGUFReader(str(path))
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return read_gguf(str(path)).metadata


def default_text() -> str:
    import jinja2

    src = "".join(p.read_text(encoding="utf-8") for p in sorted(Path(jinja2.__file__).parent.glob("*.py")))
    return src[:100_000]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", type=Path, default=DEFAULT_MODELS)
    ap.add_argument("--text", type=Path, help="a text file to tokenize instead of the default source text")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    args = ap.parse_args()

    rng = random.Random(0)
    texts = {
        "source": args.text.read_text(encoding="utf-8") if args.text else default_text(),
        "cjk": "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(33_000)),
        "base64": base64.b64encode(rng.randbytes(75_000)).decode(),
    }
    print(f"{'model':<34} {'text':<8} {'bytes':>7} {'tokens':>7} {'cold s':>7} {'warm s':>7} {'tok/s (cold)':>12}")
    worst = 0.0
    for path in args.models:
        if not path.is_file():
            print(f"{path.name}: not found, skipped")
            continue
        t0 = time.perf_counter()
        tok = Tokenizer.from_metadata(metadata(path))
        build = time.perf_counter() - t0
        for name, text in texts.items():
            cold = warm = float("inf")
            n = 0
            for _ in range(max(1, args.repeat)):
                if tok._spm is not None:  # the SentencePiece word memo: cold again
                    tok._spm.memo.clear()
                t = time.perf_counter()
                n = len(tok.tokenize(text, add_special=True, parse_special=True))
                cold = min(cold, time.perf_counter() - t)
                t = time.perf_counter()
                tok.tokenize(text, add_special=True, parse_special=True)
                warm = min(warm, time.perf_counter() - t)
            worst = max(worst, cold)
            print(f"{path.name:<34} {name:<8} {len(text.encode()):>7} {n:>7} {cold:>7.3f} {warm:>7.3f} {n / cold:>12.0f}")
        print(f"{path.name:<34} (tokenizer built from metadata in {build:.3f} s)")
    print(f"worst cold time: {worst:.3f} s (target < 1 s per 100 KB)")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
