"""Cold against warm: time to first token and prompt rows computed for prompts that share a 2,000-token prefix,
on the default model, with the prefix cache on and off.

    python benchmarks/prefix_cache.py [--questions 4] [--tokens 8]

The shared prefix is the review guide of examples/shared-prefix.yaml, twice (about 2,040 tokens), followed by
each question of that suite. One engine per mode (plans/paged.yaml, every stream on 256-row pages); the
questions run one after another, so the first is cold and the others find its pages. The replies of the two
modes must be equal, token for token and logits bit for bit (the last column). Speed is measured here, never
asserted in tests.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    from tfq.engine.core import Engine
    from tfq.engine.stream import Request
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.suite import load_prompts

    chats = load_prompts(str(ROOT / "examples" / "shared-prefix.yaml"))
    guide = chats[0].messages[0]["content"]
    questions = [c.messages[-1]["content"] for c in chats if len(c.messages) == 2][:a.questions]
    loaded = load_model("default", progress=False)
    tok = loaded.tokenizer
    prompts = [tok.chat_ids([{"role": "system", "content": guide + "\n\n" + guide},
                             {"role": "user", "content": q}]) for q in questions]
    table = Table(title=f"prefix cache, default model: {len(prompts)} questions after a shared "
                        f"{len(tok.encode(guide + chr(10) * 2 + guide))}-token prefix, one after another")
    for col in ("cache", "question", "prompt tokens", "rows reused", "rows computed", "TTFT s", "equal to off"):
        table.add_column(col, justify="right" if col != "cache" else "left")
    runs = {}
    for mode in ("off", "on"):
        plan, _, layout = resolve_plan(str(ROOT / "plans" / "paged.yaml"), None,
                                       ["kv.paged=all", f"kv.prefix_cache={mode}"], True, None)
        engine = Engine.from_plan(plan, layout, loaded)
        runs[mode] = [engine.generate([Request(tuple(p), max_tokens=a.tokens)])[0] for p in prompts]
    for mode in ("off", "on"):
        for i, (p, r) in enumerate(zip(prompts, runs[mode])):
            same = (r.ids, r.digests) == (runs["off"][i].ids, runs["off"][i].digests)
            table.add_row(mode, str(i + 1), str(len(p)), str(r.reused), str(len(p) - r.reused),
                          f"{r.first_token_s:.2f}", "yes" if same else "NO")
    Console().print(table)


if __name__ == "__main__":
    main()
