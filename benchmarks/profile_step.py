"""Where a decode step's time goes, by lane count: linear layers, attention and the rest, with the ops that
take the most time (tfq.bench.breakdown; `tfq bench` puts the same split in its JSON).

    python benchmarks/profile_step.py --lanes 1,8 --steps 8
    python benchmarks/profile_step.py --model shape.gguf --lanes 1 --steps 20   # a shape (write_shape.py)
    python benchmarks/profile_step.py --model shape.gguf --lanes 1 --steps 8 --alternate 2 --prompt-tokens 32

Each lane count gets its own engine on the default model or `--model` (whole plan, 128-token prompts of random
ids). The prompts are prefilled, then `--steps` decode steps are timed without the profiler and as many under it.
`--json FILE` writes the same as JSON. `--alternate R` instead times R rounds in one engine, each round the model's
layers as one object then each layer in one call (the object set aside): the same stream, side by side. Speed is
measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json

import torch


def started(loaded, lanes: int, prompt_tokens: int, tokens: int):
    """An engine with `lanes` streams of random prompts, every prompt prefilled, `tokens` left to each."""
    from tfq.engine.core import Engine, EngineSettings
    from tfq.engine.stream import Request

    g = torch.Generator().manual_seed(lanes)
    vocab = loaded.config.vocab_size
    engine = Engine(loaded.model, EngineSettings(window=prompt_tokens + tokens + 8, lanes=lanes), eos_ids=())
    for _ in range(lanes):
        engine.add(Request(tuple(torch.randint(100, vocab - 1000, (prompt_tokens,), generator=g).tolist()),
                           max_tokens=tokens))
    engine.step()  # every prompt prefilled, first tokens drawn
    return engine


def profile_lanes(loaded, lanes: int, steps: int, prompt_tokens: int) -> dict:
    from tfq.bench.breakdown import step_breakdown

    engine = started(loaded, lanes, prompt_tokens, 3 * steps + 4)
    return {"lanes": lanes, **step_breakdown(engine, steps, top=15)}


def alternate(loaded, lanes: int, steps: int, prompt_tokens: int, rounds: int) -> list[dict]:
    """Rounds of `steps` decode steps in one engine, the model's one object and each layer in one call in turn."""
    from tfq.bench.breakdown import step_breakdown

    model = loaded.model
    engine, built, out = started(loaded, lanes, prompt_tokens, rounds * 2 * (2 * steps + 2) + 4), model.stack, []
    try:
        for r in range(rounds):
            for arm, stack in (("one object", built), ("each layer", None)):
                model.stack = stack
                out.append({"lanes": lanes, "round": r, "arm": arm, **step_breakdown(engine, steps)})
                print(f"lanes {lanes}, round {r}, {arm}: " + line(out[-1]), flush=True)
    finally:
        model.stack = built
    return out


def line(r: dict) -> str:
    inside = f", {r['rest_in_object_ms']:.2f} of it inside the one object's call" if "rest_in_object_ms" in r else ""
    return (f"{r['step_ms']:.1f} ms a step = linear {r['linear_ms']:.1f} + attention {r['attention_ms']:.1f} + "
            f"experts {r['experts_ms']:.1f} + rest {r['rest_ms']:.2f}{inside} (threads {torch.get_num_threads()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--model", default="default", help="the default model, a folder or a GGUF file")
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="rounds of the one object against each layer in one call, in one engine")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tfq.model.load import load_model

    loaded = load_model(a.model, progress=False)
    if a.alternate:
        results = [r for n in a.lanes.split(",") for r in alternate(loaded, int(n), a.steps, a.prompt_tokens,
                                                                     a.alternate)]
    else:
        results = [profile_lanes(loaded, int(n), a.steps, a.prompt_tokens) for n in a.lanes.split(",")]
    if not a.alternate:
        for r in results:
            print(f"lanes {r['lanes']}: " + line(r))
            for op in r["top_ops"][:10]:
                print(f"    {op['op']:<36} {op['calls_per_step']:>5} calls {op['self_ms_per_step']:>8.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
