"""llama.cpp alone in its own process, timed as `tfq bench` times its peer: for a model too large for both
engines to sit in one process's memory (a 27B shape on a 24 GiB machine), run this and `tfq bench --peer none`
one after the other with the same lanes, prompt and reply lengths, and compare.

    python benchmarks/llama_alone.py FILE.gguf --lanes 1,4 --prompt-tokens 32 --tokens 4

Prints one JSON object a lane count: prefill and decode tokens/s, time to first token, and the process's peak
resident memory (VmHWM, the mapped file's pages included, as /usr/bin/time counts them).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from tfq.bench.llama_peer import LlamaPeer
from tfq.bench.measure import MemoryProbe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--lanes", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    peer = LlamaPeer(args.model, args.threads, "llama.cpp")
    rng = random.Random(0)
    for lanes in (int(x) for x in args.lanes.split(",")):
        peer.prepare(lanes, args.prompt_tokens + args.tokens)
        prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_tokens)] for _ in range(lanes)]
        run = peer.run(prompts, args.tokens, 0, MemoryProbe())
        print(json.dumps({"engine": "llama.cpp", "version": peer.version, "lanes": lanes, "threads": args.threads,
                          **run.figures(args.prompt_tokens), "peak_rss_bytes": run.peak_rss}), flush=True)


if __name__ == "__main__":
    main()
