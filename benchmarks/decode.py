"""Superseded by `tfq bench` (tfq/bench/, tfq/cli/bench.py): the same whole-vs-paged decode figures, plus
prefill, time to first token, memory, the partial and drafted arms, a peer engine and a bandwidth roofline.

    python benchmarks/decode.py [tfq bench options]   runs   tfq bench --peer none --arms whole,paged [options]
"""
import sys

from tfq.cli import main

if __name__ == "__main__":
    sys.argv = ["tfq", "bench", "--peer", "none", "--arms", "whole,paged", *sys.argv[1:]]
    main()
