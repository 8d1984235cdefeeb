"""Where a decode step's time goes, by lane count: linear layers, attention and the rest, with the ops that
take the most time (tfq.bench.breakdown; `tfq bench` puts the same split in its JSON).

    python benchmarks/profile_step.py --lanes 1,8 --steps 8
    python benchmarks/profile_step.py --model shape.gguf --lanes 1 --steps 20   # a shape (write_shape.py)

Each lane count gets its own engine on the default model or `--model` (whole plan, 128-token prompts of random
ids). The prompts are prefilled, then `--steps` decode steps are timed without the profiler and as many under it.
`--json FILE` writes the same as JSON. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json

import torch


def profile_lanes(loaded, lanes: int, steps: int, prompt_tokens: int) -> dict:
    from tfq.bench.breakdown import step_breakdown
    from tfq.engine.core import Engine, EngineSettings
    from tfq.engine.stream import Request

    g = torch.Generator().manual_seed(lanes)
    vocab = loaded.config.vocab_size
    engine = Engine(loaded.model, EngineSettings(window=prompt_tokens + 3 * steps + 8, lanes=lanes), eos_ids=())
    for _ in range(lanes):
        engine.add(Request(tuple(torch.randint(100, vocab - 1000, (prompt_tokens,), generator=g).tolist()),
                           max_tokens=3 * steps + 4))
    engine.step()  # every prompt prefilled, first tokens drawn
    return {"lanes": lanes, **step_breakdown(engine, steps, top=15)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--model", default="default", help="the default model, a folder or a GGUF file")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tfq.model.load import load_model

    loaded = load_model(a.model, progress=False)
    results = [profile_lanes(loaded, int(n), a.steps, a.prompt_tokens) for n in a.lanes.split(",")]
    for r in results:
        print(f"lanes {r['lanes']}: {r['step_ms']:.1f} ms a step = linear {r['linear_ms']:.1f} + attention "
              f"{r['attention_ms']:.1f} + experts {r['experts_ms']:.1f} + rest {r['rest_ms']:.2f} "
              f"(threads {torch.get_num_threads()})")
        for op in r["top_ops"][:10]:
            print(f"    {op['op']:<36} {op['calls_per_step']:>5} calls {op['self_ms_per_step']:>8.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
