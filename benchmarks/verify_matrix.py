"""`tfq verify` under combinations of instruction sets and thread counts: tfq's kernels' -march, torch's ATen
capability, numpy's dispatched features (on, or off: NPY_DISABLE_CPU_FEATURES) and torch's thread count, each
in a process of its own, against the recorded bits of the default model.

    python benchmarks/verify_matrix.py                      # the combinations of docs/contract.md's table
    python benchmarks/verify_matrix.py --only 0,4 --json out.json

Each row is one run of `tfq verify --json`: equal chats (ids, logits digests, log-probabilities and prompt scores
all equal the record) out of the chats run, per weights kind, and the run's seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

# (tfq's -march, ATen capability, numpy features on, threads, weights)
COMBOS = [
    ("native", "avx512", True, 2, "gguf,fp32"),
    ("native", "avx512", False, 1, "gguf,fp32"),
    ("native", "avx2", True, 3, "gguf,fp32"),
    ("native", "default", False, 8, "gguf,fp32"),
    ("haswell", "avx2", False, 2, "gguf,fp32"),
    ("haswell", "avx512", True, 3, "gguf,fp32"),
    ("x86-64", "default", False, 2, "gguf"),
]


def numpy_off() -> str:
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))


def run(combo: tuple, extra: list[str]) -> dict:
    march, isa, numpy_on, threads, weights = combo
    env = {**os.environ, "TFQ_CPU_MARCH": march, "ATEN_CPU_CAPABILITY": isa}
    env.pop("NPY_DISABLE_CPU_FEATURES", None)
    if not numpy_on:
        env["NPY_DISABLE_CPU_FEATURES"] = numpy_off()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "v.json"
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tfq", "verify", "--quiet", "--threads", str(threads), "--weights",
                               weights, "--json", str(out), *extra], env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        report = json.loads(out.read_text()) if out.is_file() else None
    row = {"march": march, "aten": isa, "numpy": "on" if numpy_on else "off", "threads": threads,
           "exit": done.returncode, "seconds": round(seconds, 1)}
    if report is None:
        row["error"] = (done.stderr.strip().splitlines() or ["no report"])[-1]
        return row
    row["machine"] = report["machine"]
    for kind, chats in report["chats"].items():
        equal = sum(1 for c in chats if not c["missing"] and c["ids"] is c["logits"] is c["logprobs"] is
                    c["prompt_scores"] is None)
        row[kind] = f"{equal}/{len(chats)}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="Comma-separated indexes into COMBOS (default: all).")
    ap.add_argument("--json", help="Write the rows as JSON here.")
    ap.add_argument("extra", nargs="*", help="More arguments for tfq verify (after --).")
    a = ap.parse_args()
    chosen = [COMBOS[int(i)] for i in a.only.split(",")] if a.only else COMBOS
    err = Console(stderr=True)
    rows = []
    for i, combo in enumerate(chosen):
        err.print(f"[{i + 1}/{len(chosen)}] -march={combo[0]}, ATen {combo[1]}, numpy features "
                  f"{'on' if combo[2] else 'off'}, {combo[3]} threads, {combo[4]}", highlight=False)
        rows.append(run(combo, a.extra))
    table = Table(title="tfq verify against tfq/reference/default.json")
    for col in ("-march", "lanes", "ATen", "numpy features", "threads", "gguf", "fp32", "exit", "s"):
        table.add_column(col)
    for r in rows:
        lanes = r.get("machine", {}).get("lanes", "?")
        table.add_row(r["march"], lanes, r["aten"], r["numpy"], str(r["threads"]), r.get("gguf", "-"),
                      r.get("fp32", "-"), str(r["exit"]), f"{r['seconds']:.0f}")
    Console().print(table)
    for r in rows:
        if "error" in r:
            Console().print(f"-march={r['march']}, ATen {r['aten']}: {r['error']}", highlight=False)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
