#!/usr/bin/env python3
"""Issue 26's acceptance figures in one command: modelyard against llama-server side by side, on
a real-size bench model and on SmolLM2, quiet and with two busy processes.

    .venv/bin/python scripts/bench_issue26.py [--rounds 3] [--quick] [--skip 1b,smollm2,busy]
        [--llama-server PATH]

Runs ``scripts/bench_side_by_side.py`` three times (each run starts its servers once, then
alternates the measurements between them round after round, so a change of load shows in both
sides alike) and prints, after their own JSON lines, one table of the ratios the issue asks for,
each with its threshold and the load average of its run:

1. ``llama-1b-Q4_K_M`` (``make_bench_models.py``, written first when missing): decode and prefill
   of ``ours`` (the default config) / ``llama-t2`` (llama-server ``-t 2``), with both sides' weight
   bytes per second and the machine's streaming read bandwidth (``--bandwidth``);
2. SmolLM2 quiet: decode / prefill of ``ours`` / ``llama-t2``;
3. SmolLM2 with two busy processes (``--busy 2``): ``ours`` against ``ours-t1`` (``n_threads = 1``)
   and against ``llama-t2``.

A ratio is the median over rounds of that round's ratio (both sides measured back to back).
``--quick``: 2 rounds and 32 decode tokens (a smoke run; the figures are noisier). Takes about
10-15 minutes on 2 cores with the default 3 rounds (models cached; the first run also writes the
1B model, ~5 s, and its weight cache on the first load). The machine should be otherwise quiet:
the load average printed beside each figure says whether it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SBS = ROOT / "scripts" / "bench_side_by_side.py"

#: (name, threshold, what) of every acceptance ratio (issue 26)
THRESHOLDS = {
    "1b_decode_vs_llama_t2": 1.0,
    "1b_prefill_vs_llama_t2": 1.3,
    "smollm2_busy_decode_vs_own_t1": 0.8,
    "smollm2_busy_decode_vs_llama_t2": 2.0,
    "smollm2_quiet_decode_vs_llama_t2": 0.95,
    "smollm2_quiet_prefill_vs_llama_t2": 1.5,
}


WARM_1B = """
import sys
sys.path.insert(0, "scripts")
from make_bench_models import ensure
from worker.engine.arch.registry import load_model
from worker.engine.loading.gguf_loader import read_gguf
load_model(read_gguf(str(ensure("llama-1b", "Q4_K_M"))), n_ctx=64, weights="quantized", cache_write="sync")
"""


def run(args: list[str]) -> tuple[list[dict], float]:
    """Run bench_side_by_side with ``args``; its JSON lines (echoed) and the wall seconds."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, str(SBS), *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    rows = []
    assert p.stdout is not None
    for line in p.stdout:
        print(line, end="", flush=True)
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    if p.wait() != 0:
        raise SystemExit(f"bench_side_by_side.py {' '.join(args)} failed ({p.returncode})")
    return rows, time.monotonic() - t0


def paired(rows: list[dict], a: str, b: str, key: str) -> float | None:
    """Median over rounds of ``a``'s ``key`` / ``b``'s in the same round."""
    by = {(r["round"], r["server"]): r for r in rows if "round" in r and key in r}
    ratios = [by[(n, a)][key] / by[(n, b)][key] for (n, s) in by if s == a and (n, b) in by and by[(n, b)][key]]
    return round(statistics.median(ratios), 3) if ratios else None


def median(rows: list[dict], server: str, key: str) -> float | None:
    v = [r[key] for r in rows if r.get("server") == server and key in r]
    return round(statistics.median(v), 2) if v else None


def load_of(rows: list[dict]) -> list[float]:
    """The load averages seen during a run: the highest 1-minute figure of its measurements."""
    v = [r["loadavg"][0] for r in rows if "round" in r and "loadavg" in r]
    return [round(min(v), 2), round(max(v), 2)] if v else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated: 1b, smollm2, busy")
    ap.add_argument("--llama-server", default=None)
    a = ap.parse_args()
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    rounds = 2 if a.quick else a.rounds
    common = ["--rounds", str(rounds), "--decode-tokens", "32" if a.quick else "64"]
    if a.llama_server:
        common += ["--llama-server", a.llama_server]
    out: dict[str, dict] = {}
    t0 = time.monotonic()
    # set-up, not measured: numba's kernel cache and the 1B model's file and weight cache, so that
    # no server's first load compiles or prepares weights
    subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py")], cwd=ROOT, check=True)
    if "1b" not in skip:
        subprocess.run([sys.executable, "-c", WARM_1B], cwd=ROOT, check=True)
    if "1b" not in skip:
        rows, secs = run(["--model", "llama-1b-Q4_K_M", "--servers", "llama-t2,ours", "--bandwidth", "--port", "8311",
                          *common])
        head = rows[0]
        out["1b"] = {"load_min_max": load_of(rows), "seconds": round(secs), "model": head.get("model"),
                     "tensor_mib": head.get("tensor_mib"), "machine_read_gb_s": head.get("machine_read_gb_s"),
                     "ours_decode_tok_s": median(rows, "ours", "decode_tok_s"),
                     "llama_t2_decode_tok_s": median(rows, "llama-t2", "decode_tok_s"),
                     "ours_weights_gb_s": median(rows, "ours", "weights_gb_s"),
                     "llama_t2_weights_gb_s": median(rows, "llama-t2", "weights_gb_s"),
                     "ours_prefill_tok_s": median(rows, "ours", "prefill_tok_s"),
                     "llama_t2_prefill_tok_s": median(rows, "llama-t2", "prefill_tok_s"),
                     "1b_decode_vs_llama_t2": paired(rows, "ours", "llama-t2", "decode_tok_s"),
                     "1b_prefill_vs_llama_t2": paired(rows, "ours", "llama-t2", "prefill_tok_s")}
    if "smollm2" not in skip:
        rows, secs = run(["--model", "smollm2", "--servers", "llama-t2,ours", "--port", "8321", *common])
        out["smollm2_quiet"] = {"load_min_max": load_of(rows), "seconds": round(secs),
                                "ours_decode_tok_s": median(rows, "ours", "decode_tok_s"),
                                "llama_t2_decode_tok_s": median(rows, "llama-t2", "decode_tok_s"),
                                "ours_prefill_tok_s": median(rows, "ours", "prefill_tok_s"),
                                "llama_t2_prefill_tok_s": median(rows, "llama-t2", "prefill_tok_s"),
                                "smollm2_quiet_decode_vs_llama_t2": paired(rows, "ours", "llama-t2", "decode_tok_s"),
                                "smollm2_quiet_prefill_vs_llama_t2": paired(rows, "ours", "llama-t2", "prefill_tok_s")}
    if "busy" not in skip:
        rows, secs = run(["--model", "smollm2", "--servers", "ours-t1,ours,llama-t2", "--busy", "2", "--port", "8331",
                          *common])
        out["smollm2_busy2"] = {"load_min_max": load_of(rows), "seconds": round(secs),
                                "ours_decode_tok_s": median(rows, "ours", "decode_tok_s"),
                                "ours_t1_decode_tok_s": median(rows, "ours-t1", "decode_tok_s"),
                                "llama_t2_decode_tok_s": median(rows, "llama-t2", "decode_tok_s"),
                                "smollm2_busy_decode_vs_own_t1": paired(rows, "ours", "ours-t1", "decode_tok_s"),
                                "smollm2_busy_decode_vs_llama_t2": paired(rows, "ours", "llama-t2", "decode_tok_s")}
    print("\n# issue 26 acceptance (ratio = median over rounds of ours / other in the same round)")
    for part, d in out.items():
        print(f"## {part}: load average during the run {d['load_min_max']}, {d['seconds']} s")
        for k, v in d.items():
            if k in THRESHOLDS:
                verdict = "n/a" if v is None else ("PASS" if v >= THRESHOLDS[k] else "FAIL")
                print(f"  {k:<36} {v!s:>7}  (>= {THRESHOLDS[k]})  {verdict}")
            elif k not in ("load_min_max", "seconds"):
                print(f"  {k:<36} {v}")
    print(json.dumps({"issue26": out, "total_s": round(time.monotonic() - t0),
                      "loadavg_end": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
