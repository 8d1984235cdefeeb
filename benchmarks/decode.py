"""Aggregate decode tokens/s at several lane counts, whole and paged, on one model (default: the shipped one).

    python benchmarks/decode.py [--model default] [--lanes 1,2,4,8] [--tokens 32] [--prompt-tokens 128]

Each arm runs `lanes` streams together from the same prompts; decode rate = tokens drawn after each stream's
first token / time after the last first token. Arms interleave (whole, paged, whole, paged...) so a noisy
machine hits both alike.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from tfq.engine import Engine, EngineSettings
from tfq.model.load import load_model
from tfq.stream import Request


def measure(model, settings: EngineSettings, requests) -> dict:
    engine = Engine(model, settings, eos_ids=())
    t0 = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - t0
    first = max(r.first_token_s for r in results)
    decoded = sum(len(r.ids) - 1 for r in results)
    return {"decode_tps": decoded / (wall - first), "prefill_s": first, "wall_s": wall, "forwards": engine.forwards}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--lanes", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    console = Console()
    with console.status("loading the model"):
        loaded = load_model(args.model)
    vocab = min(loaded.config.vocab_size, 150000)
    g = torch.Generator().manual_seed(0)
    rows = []
    for lanes in [int(x) for x in args.lanes.split(",")]:
        reqs = [Request(tuple(torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()),
                        max_tokens=args.tokens) for _ in range(lanes)]
        window = args.prompt_tokens + args.tokens + 64
        pages = -(-window // 256)
        arms = {
            "whole": EngineSettings(window=window, lanes=lanes),
            "paged": EngineSettings(window=window, lanes=lanes, page_rows=256, pool_pages=pages * lanes),
        }
        measure(loaded.model, arms["whole"], reqs[:1])  # warm-up
        for name, s in arms.items():
            r = measure(loaded.model, s, reqs)
            rows.append({"lanes": lanes, "arm": name, **r})
            console.print(f"lanes {lanes} {name}: {r['decode_tps']:.1f} tokens/s")
    t = Table(title=f"decode, {args.prompt_tokens}-token prompts, {args.tokens} tokens each")
    for col in ("lanes", "arm", "decode tokens/s", "prefill s", "forwards"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["lanes"]), r["arm"], f"{r['decode_tps']:.1f}", f"{r['prefill_s']:.2f}", str(r["forwards"]))
    console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
