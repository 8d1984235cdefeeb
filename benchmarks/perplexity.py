"""Quality of `weights: gguf`: perplexity on the project's own text, against `weights: fp32` and llama.cpp on the
same GGUF file, and how far greedy replies to the shipped suite agree.

    python benchmarks/perplexity.py [--tokens 4096] [--chunk 1024] [--json FILE]

The text is docs/contract.md and docs/architecture.md, tokenized once; it is cut into chunks of --chunk tokens
and every token after a chunk's first is scored given the tokens before it in its chunk (tfq: the prompt's
log-probabilities, float64 log-softmax of the exact logits; llama.cpp: the same log-softmax of its logits,
every row of a chunk in one llama_decode). Perplexity is exp of the mean negative log-probability.

tfq's two modes must agree bit for bit (the quantized kernel is exact against the dequantized weights): the
script says so, and shows the greedy replies of the shipped suite equal in ids and logits digests. llama.cpp
quantizes each activation row to 8 bits per block of 32 (its own arithmetic), so its numbers differ a little;
its greedy replies are compared with tfq's up to the first token where they part.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("docs/contract.md", "docs/architecture.md")


def tfq_scores(loaded, chunks: list[list[int]]) -> list[float]:
    """Each scored token's log-probability, chunk after chunk, by tfq's engine."""
    from tfq.engine.core import Engine, EngineSettings
    from tfq.engine.stream import Request

    width = max(len(c) for c in chunks) + 1
    engine = Engine(loaded.model, EngineSettings(window=width, lanes=1, prefill_chunk=width), eos_ids=())
    out: list[float] = []
    for chunk in chunks:
        result = engine.generate([Request(prompt=tuple(chunk), max_tokens=1, prompt_logprobs=0)])[0]
        out += [p.logprob for p in result.prompt_logprobs[1:]]
    return out


def llama_scores(path: Path, chunks: list[list[int]], threads: int) -> list[float]:
    """The same with llama.cpp on the GGUF file: every row's logits of a chunk from one decode."""
    from tfq.bench.peers.llama import LlamaPeer

    peer = LlamaPeer(path, threads, "llama.cpp")
    peer.prepare(1, max(len(c) for c in chunks))
    out: list[float] = []
    try:
        for chunk in chunks:
            peer.L.llama_memory_clear(peer.L.llama_get_memory(peer.ctx), True)
            peer._decode([(tok, pos, 0, True) for pos, tok in enumerate(chunk)])
            for i in range(len(chunk) - 1):
                row = np.ctypeslib.as_array(peer.L.llama_get_logits_ith(peer.ctx, i), shape=(peer.vocab,))
                row = row.astype(np.float64)
                m = row.max()
                out.append(float(row[chunk[i + 1]] - m - math.log(np.exp(row - m).sum())))
    finally:
        peer.close()
    return out


def greedy(loaded, prompts, tokens: int):
    from tfq.engine.core import Engine, EngineSettings
    from tfq.engine.stream import Request

    engine = Engine(loaded.model, EngineSettings(window=2048, lanes=4), eos_ids=())
    return [(r.ids, r.digests) for r in engine.generate([Request(prompt=tuple(p), max_tokens=tokens) for p in prompts])]


def llama_greedy(path: Path, prompts, tokens: int, threads: int) -> list[list[int]]:
    from tfq.bench.peers.llama import LlamaPeer

    peer = LlamaPeer(path, threads, "llama.cpp")
    out = []
    try:
        for p in prompts:
            peer.prepare(1, len(p) + tokens)
            peer.L.llama_memory_clear(peer.L.llama_get_memory(peer.ctx), True)
            peer._decode([(tok, pos, 0, pos == len(p) - 1) for pos, tok in enumerate(p)])
            reply = peer._greedy([len(p) - 1])
            for j in range(1, tokens):
                peer._decode([(reply[-1], len(p) + j - 1, 0, True)])
                reply += peer._greedy([0])
            out.append(reply)
    finally:
        peer.close()
    return out


def parted(a: list[int], b: list[int]) -> int:
    """Tokens equal before the two replies part."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text scored (about)")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--reply", type=int, default=48, help="greedy tokens per suite prompt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from tfq.model.load import load_model
    from tfq.model.source import gguf_path
    from tfq.suite import default_suite, load_prompts

    console = Console(stderr=True)
    models = {w: load_model("default", progress=False, weights=w) for w in ("gguf", "fp32")}
    tok = models["gguf"].tokenizer
    ids = tok.encode("\n\n".join((ROOT / p).read_text() for p in TEXT))[:a.tokens]
    chunks = [ids[i:i + a.chunk] for i in range(0, len(ids), a.chunk) if len(ids[i:i + a.chunk]) > 1]
    path = gguf_path("default")
    scores, seconds = {}, {}
    for name, run in (("tfq weights: gguf", lambda: tfq_scores(models["gguf"], chunks)),
                      ("tfq weights: fp32", lambda: tfq_scores(models["fp32"], chunks)),
                      ("llama.cpp (same GGUF)", lambda: llama_scores(path, chunks, torch.get_num_threads()))):
        with console.status(f"scoring {len(ids)} tokens: {name}"):
            t0 = time.perf_counter()
            scores[name] = np.array(run())
            seconds[name] = time.perf_counter() - t0
    ref = scores["tfq weights: fp32"]
    table = Table(title=f"perplexity on {' + '.join(TEXT)}: {len(ref)} tokens scored in {a.chunk}-token chunks")
    for col in ("engine", "perplexity", "mean NLL", "max |logprob - fp32|", "equal to fp32 (bits)", "s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    rows = []
    for name, s in scores.items():
        row = {"engine": name, "perplexity": math.exp(-s.mean()), "mean_nll": -s.mean(),
               "max_abs_diff_vs_fp32": float(np.abs(s - ref).max()),
               "equal_bits_to_fp32": bool(np.array_equal(s.view(np.int64), ref.view(np.int64))), "s": seconds[name]}
        rows.append(row)
        table.add_row(name, f"{row['perplexity']:.4f}", f"{row['mean_nll']:.5f}", f"{row['max_abs_diff_vs_fp32']:.2e}",
                      "yes" if row["equal_bits_to_fp32"] else "no", f"{row['s']:.1f}")
    Console().print(table)

    prompts = [tok.chat_ids(c.messages) for c in load_prompts(default_suite())]
    with console.status(f"greedy replies to the shipped suite ({len(prompts)} chats, {a.reply} tokens)"):
        g, f = greedy(models["gguf"], prompts, a.reply), greedy(models["fp32"], prompts, a.reply)
        peer = llama_greedy(path, prompts, a.reply, torch.get_num_threads())
    same = sum(x == y for x, y in zip(g, f))
    before = [parted(x[0], y) for x, y in zip(f, peer)]
    agree = Table(title=f"greedy replies to the shipped suite: {len(prompts)} chats, {a.reply} tokens each")
    for col in ("against tfq weights: fp32", "replies equal", "tokens before they part (each chat)", "mean"):
        agree.add_column(col)
    agree.add_row("tfq weights: gguf (ids and logits digests)", f"{same}/{len(prompts)}",
                  " ".join(str(parted(x[0], y[0])) for x, y in zip(g, f)), f"{a.reply:.1f}" if same == len(g) else "-")
    agree.add_row("llama.cpp (same GGUF, ids)", f"{sum(b == a.reply for b in before)}/{len(prompts)}",
                  " ".join(map(str, before)), f"{sum(before) / len(before):.1f}")
    Console().print(agree)
    if a.json:
        Path(a.json).write_text(json.dumps({"perplexity": rows, "text": TEXT, "tokens": len(ids), "chunk": a.chunk,
                                            "greedy": {"gguf_equal_fp32": same, "chats": len(prompts),
                                                       "llama_tokens_before_parting": before, "reply": a.reply}},
                                           indent=2))


if __name__ == "__main__":
    main()
