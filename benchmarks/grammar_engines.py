"""xgrammar against llguidance on the shipped schema suite (examples/schemas.json) with the default model's
tokenizer: how many schemas each compiles, the time to compile, and the time to compute one token's mask
(mean, p50, p99) along the same token paths. Not a dependency of tfq: install both to run it.

    pip install xgrammar llguidance && python benchmarks/grammar_engines.py [--steps 48] [--json out.json]

Both write JSON as tfq does (a space after "," and ":", no other whitespace). The paths: from each schema's start, a
seeded walk that takes, at each step, one allowed token (the same rule for both engines: the lowest id allowed by both,
after skipping a seeded number of them), until the grammar accepts or --steps tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np


def tokenizer():
    from tfq.model.source import resolve_model
    from tfq.model.tokenizer import Tokenizer

    return Tokenizer.from_folder(resolve_model("default", progress=False, weights=False))


class Llg:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance

        self.lib = llguidance
        self.tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=list(tok.eos_ids))
        self.words = (vocab + 31) // 32

    def compile(self, schema: dict):
        from tfq.decode.grammar import Constraint

        m = self.lib.LLMatcher(self.tok, Constraint.json_schema(schema).grammar(), log_level=0)  # tfq's JSON style
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m) -> np.ndarray:
        return np.frombuffer(m.compute_bitmask(), dtype=np.uint8)

    def take(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def done(self, m) -> bool:
        return m.is_accepting()


class Xgr:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import torch
        import xgrammar

        self.lib, self.torch = xgrammar, torch
        vocab_bytes = [tok.token_bytes(i) if i < tok.vocab_size else b"" for i in range(vocab)]
        info = xgrammar.TokenizerInfo(vocab_bytes, xgrammar.VocabType.RAW, vocab_size=vocab,
                                      stop_token_ids=list(tok.eos_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.buffer = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        grammar = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "),
                                                    strict_mode=True)
        return self.lib.GrammarMatcher(grammar)

    def mask(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.buffer)
        return self.buffer.numpy().view(np.uint8).reshape(-1)

    def take(self, m, token: int) -> None:
        assert m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


def run(steps: int) -> dict:
    tok = tokenizer()
    vocab = 151936
    engines = [Llg(tok, vocab), Xgr(tok, vocab)]
    suite = json.loads((Path(__file__).parent.parent / "examples" / "schemas.json").read_text())["schemas"]
    out = {e.name: {"compiled": 0, "compile_ms": [], "mask_us": [], "failed": []} for e in engines}
    agree = 0
    for k, item in enumerate(suite):
        matchers = {}
        for e in engines:
            t = time.perf_counter()
            try:
                matchers[e.name] = e.compile(item["schema"])
            except Exception as err:  # a schema the engine cannot take: coverage
                out[e.name]["failed"].append(f"{item['name']}: {str(err).splitlines()[0][:120]}")
                continue
            out[e.name]["compile_ms"].append((time.perf_counter() - t) * 1e3)
            out[e.name]["compiled"] += 1
        if len(matchers) < len(engines):
            continue
        rng = random.Random(k)
        same = True
        for _ in range(steps):
            masks = {}
            for e in engines:
                t = time.perf_counter()
                masks[e.name] = np.unpackbits(e.mask(matchers[e.name]), bitorder="little")[:vocab].astype(bool)
                out[e.name]["mask_us"].append((time.perf_counter() - t) * 1e6)
            both = masks["llguidance"] & masks["xgrammar"]
            same &= bool(np.array_equal(masks["llguidance"], masks["xgrammar"]))
            allowed = np.flatnonzero(both)
            allowed = allowed[~np.isin(allowed, list(tok.eos_ids))] if len(allowed) > 1 else allowed
            if not len(allowed):
                break
            token = int(allowed[rng.randrange(min(len(allowed), 8))])
            for e in engines:
                e.take(matchers[e.name], token)
            if token in tok.eos_ids:
                break
        agree += same
    summary = {}
    for name, r in out.items():
        ms = sorted(r["mask_us"])
        summary[name] = {"schemas": len(suite), "compiled": r["compiled"],
                         "compile_ms_mean": round(statistics.mean(r["compile_ms"]), 1),
                         "mask_us_mean": round(statistics.mean(ms), 1), "mask_us_p50": round(ms[len(ms) // 2], 1),
                         "mask_us_p99": round(ms[int(len(ms) * 0.99)], 1), "masks": len(ms), "failed": r["failed"]}
    summary["paths_with_equal_masks"] = agree
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    summary = run(args.steps)
    table = Table(title="grammar engines on examples/schemas.json (default model's tokenizer, one thread)")
    for col in ("engine", "schemas compiled", "compile ms (mean)", "mask us mean", "p50", "p99", "masks"):
        table.add_column(col)
    for name in ("llguidance", "xgrammar"):
        s = summary[name]
        table.add_row(name, f"{s['compiled']}/{s['schemas']}", str(s["compile_ms_mean"]), str(s["mask_us_mean"]),
                      str(s["mask_us_p50"]), str(s["mask_us_p99"]), str(s["masks"]))
    Console().print(table)
    for name in ("llguidance", "xgrammar"):
        for f in summary[name]["failed"]:
            print(f"{name} refused {f}")
    print(f"paths where both engines allowed the same tokens at every step: {summary['paths_with_equal_masks']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
