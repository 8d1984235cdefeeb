"""`tfq bench`: tfq's speed and memory under several arms, side by side with a peer engine on the same weights.

For each lane count every arm (whole, paged, partial, drafted) and the peer (HF transformers `generate`,
greedy, fp32, its own cache; or llama.cpp, in a child process) run the same random-token prompts of exactly
`prompt_tokens` ids for exactly `tokens` reply tokens (tfq ignores EOS, the peer has min_new_tokens =
max_new_tokens). A warm-up round comes first; then `repeats` rounds, each running every arm and the peer once
(peer last on even rounds, first on odd ones), so each tfq/peer ratio is taken from runs side by side and a
noisy machine hits both alike. When the two engines do not fit in memory together, the peer runs apart: all
its rounds first, before tfq loads (tfq.bench.peers.choice). Figures are medians over the rounds.

The roofline: a decode step reads every linear weight and the output head once (the embedding is a lookup)
plus each stream's cached keys and values; divided by the memory bandwidth measured in this run, that is the
least time a step can take. fraction = that time / the measured step time.

By job: settings (options, bad input, the arms' plans), measure (roofline, bandwidth), memory (resident
memory), record (one run's figures), runs (one timed run of tfq), peer (HF transformers) and llama_peer
(llama.cpp), each run by peer_child (the peer's child process) and child_peer (tfq's end of it), peering
(which peer, where and when), rounds (the interleaved rounds), report (medians, ratios, targets, the JSON
report).

Names are imported when first asked for, so the peer's child process (`python -m tfq.bench.peers.child_end`)
does not import torch for llama.cpp: its resident memory is llama.cpp's own.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "tfq.bench.measure": ("BANDWIDTH_MIB", "BANDWIDTH_TRIES", "kv_read_bytes", "mean_context", "measure_bandwidth",
                          "weights_read_bytes"),
    "tfq.bench.memory": ("MemoryProbe",),
    "tfq.bench.peers.hf": ("HfPeer",),
    "tfq.bench.report": ("bench_rows", "build_report", "targets"),
    "tfq.bench.rounds": ("WARMUP_TOKENS", "Bench", "Progress"),
    "tfq.bench.record": ("Run",),
    "tfq.bench.runs": ("NO_EOS", "TfqArm", "ordinary_vocab", "random_prompts"),
    "tfq.bench.settings": ("ARM_ABOUT", "ARMS", "DRAFT", "PAGE_ROWS", "PEERS", "BenchSettings",
                           "arm_plan", "bench_window", "check_against_plan", "check_settings", "parse_arms",
                           "parse_lanes", "skipped_arm"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE)


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module 'tfq.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE[name]), name)
