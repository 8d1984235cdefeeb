"""`tfq bench`: tfq's speed and memory under several arms, side by side with a peer engine on the same weights.

For each lane count every arm (whole, paged, partial, drafted) and the peer (HF transformers `generate`,
greedy, fp32, its own cache) run the same random-token prompts of exactly `prompt_tokens` ids for exactly
`tokens` reply tokens (tfq ignores EOS, the peer has min_new_tokens = max_new_tokens). A warm-up round comes
first; then `repeats` rounds, each running every arm and the peer once (peer last on even rounds, first on
odd ones), so each tfq/peer ratio is taken from runs side by side and a noisy machine hits both alike.
Figures are medians over the rounds.

The roofline: a decode step reads every linear weight and the output head once (the embedding is a lookup)
plus each stream's cached keys and values; divided by the memory bandwidth measured in this run, that is the
least time a step can take. fraction = that time / the measured step time.

By job: settings (options, bad input, the arms' plans), measure (roofline, bandwidth, resident memory),
runs (one timed run of tfq), peer (one of HF transformers), rounds (the interleaved rounds), report (medians,
ratios, targets, the JSON report).
"""
from tfq.bench.measure import (
    BANDWIDTH_MIB, BANDWIDTH_TRIES, MemoryProbe, kv_read_bytes, mean_context, measure_bandwidth, weights_read_bytes,
)
from tfq.bench.peer import HfPeer
from tfq.bench.report import bench_rows, build_report, targets
from tfq.bench.rounds import WARMUP_TOKENS, Bench, Progress
from tfq.bench.runs import NO_EOS, Run, TfqArm, ordinary_vocab, random_prompts
from tfq.bench.settings import (
    ARM_ABOUT, ARMS, DRAFT, PAGE_ROWS, PEER_INSTALL, PEERS, BenchSettings, arm_plan, bench_window,
    check_against_plan, check_settings, parse_arms, parse_lanes, require_peer, skipped_arm,
)

__all__ = [
    "ARMS", "ARM_ABOUT", "BANDWIDTH_MIB", "BANDWIDTH_TRIES", "Bench", "BenchSettings", "DRAFT", "HfPeer",
    "MemoryProbe", "NO_EOS", "PAGE_ROWS", "PEERS", "PEER_INSTALL", "Progress", "Run", "TfqArm", "WARMUP_TOKENS",
    "arm_plan", "bench_rows", "bench_window", "build_report", "check_against_plan", "check_settings",
    "kv_read_bytes", "mean_context", "measure_bandwidth", "ordinary_vocab", "parse_arms", "parse_lanes",
    "random_prompts", "require_peer", "skipped_arm", "targets", "weights_read_bytes",
]
