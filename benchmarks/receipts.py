"""Receipts of replies served under load, written for `tfq replay`: the default model behind `tfq serve`'s app in
this process, the official `openai` client sending the shipped suite's chats at once (greedy, sampled,
constrained by a JSON schema or a regex, penalized, n = 2; every third streamed), each asking for its receipt.

    python benchmarks/receipts.py --replies 200 --out receipts.jsonl
    tfq replay receipts.jsonl                                                    # here
    TFQ_CPU_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 tfq replay receipts.jsonl     # kernels built for AVX2

`--key FILE` signs them (then `tfq replay --key FILE`). It prints the replies of each kind and the time taken.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}
KINDS = ("greedy", "sampled", "schema", "regex", "penalized", "n=2")


def body(kind: str, i: int, messages: list[dict], max_tokens: int) -> dict:
    """One request of `kind`, the i-th sent."""
    out = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": i,
           "extra_body": {"receipt": True}}
    if kind in ("sampled", "schema", "n=2"):
        out.update(temperature=0.8, top_p=0.95)
    if kind == "schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    if kind == "regex":
        out["extra_body"]["structured_outputs"] = {"regex": "[A-Za-z ,.]{8,60}"}
    if kind == "penalized":
        out.update(temperature=0.7, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"13": -2.0})
        out["extra_body"]["repetition_penalty"] = 1.15
    if kind == "n=2":
        out["n"] = 2
    return out


async def send_all(base: str, model: str, bodies: list[dict], concurrency: int) -> list[dict]:
    """Every request, `concurrency` in flight; each choice's receipt (a streamed one's from its last chunk)."""
    from openai import AsyncOpenAI

    gate = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        async def one(i: int, b: dict) -> list[dict]:
            async with gate:
                if i % 3 != 2:
                    r = (await client.chat.completions.create(model=model, **b)).model_dump()
                    return [c["receipt"] for c in r["choices"]]
                found: dict[int, dict] = {}
                async for chunk in await client.chat.completions.create(model=model, stream=True, **b):
                    for c in chunk.model_dump()["choices"]:
                        if c.get("receipt"):
                            found[c["index"]] = c["receipt"]
                return [found[k] for k in sorted(found)]

        return [d for got in await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))) for d in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--key", default=None, help="a file holding the key that signs the receipts")
    ap.add_argument("--out", default="receipts.jsonl")
    a = ap.parse_args()
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.receipts.receipt import read_key
    from tfq.serve.background import ServeOptions, build_served, serving
    from tfq.suite import load_suite

    chats = load_suite(ROOT / "examples" / "chats.yaml")
    bodies, replies, kinds = [], 0, {k: 0 for k in KINDS}
    while replies < a.replies:
        kind = KINDS[len(bodies) % len(KINDS)]
        chat = chats[len(bodies) % len(chats)]
        bodies.append(body(kind, len(bodies), [dict(m) for m in chat.messages], a.max_tokens))
        replies += 2 if kind == "n=2" else 1
        kinds[kind] += 2 if kind == "n=2" else 1
    plan, _, layout = resolve_plan(None, "default", [], True, None)
    loaded = load_model(plan.model, progress=True, device=layout.device, weights=plan.weights)
    served = build_served(plan, layout, loaded, "default", ServeOptions(queue=len(bodies) * 2,
                                                                        receipt_key=read_key(a.key, "--key")))
    t0 = time.perf_counter()
    with serving(served) as base:
        docs = asyncio.run(send_all(base, "default", bodies, a.concurrency))
    Path(a.out).write_text("".join(json.dumps(d) + "\n" for d in docs))
    print(f"{len(docs)} receipts of {len(bodies)} requests ({', '.join(f'{k}: {v}' for k, v in kinds.items())}) "
          f"in {time.perf_counter() - t0:.0f} s, {a.concurrency} in flight; written to {a.out}")


if __name__ == "__main__":
    main()
