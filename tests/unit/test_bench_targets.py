"""The bench's targets from its rows: a decode step of one lane no slower than one of more lanes, and peak memory
at most a llama.cpp peer's plus 10% (each met at or below its goal), beside the speed targets (at or above)."""
from __future__ import annotations

from tfq.bench.report import targets

MIB = 2**20


def row(lanes: int, arm: str, step_s: float, rss_mib: int, decode: float = 2.0) -> dict:
    r = {"lanes": lanes, "arm": arm, "step_s": step_s, "peak_rss_bytes": rss_mib * MIB, "roofline_fraction": 0.8,
         "decode_tokens_per_s": lanes / step_s}
    if arm == "whole":
        r["vs_peer"] = {"decode": decode, "prefill": 2.0}
    return r


def by_name(rows: list[dict], peer: str = "llama.cpp") -> dict:
    return {t["target"]: t for t in targets(rows, peer, "gguf-q8")}


def test_a_step_of_one_lane_is_held_to_the_steps_of_more_lanes():
    rows = [row(1, "whole", 0.020, 700), row(4, "whole", 0.025, 760), row(8, "whole", 0.019, 800)]
    got = by_name(rows, "none")
    four, eight = got["decode step at 1 lane over one at 4 lanes"], got["decode step at 1 lane over one at 8 lanes"]
    assert four["value"] == 0.020 / 0.025 and four["most"] and four["met"]
    assert eight["value"] == 0.020 / 0.019 and not eight["met"]  # the control: one lane slower than eight
    assert not any("peak memory" in name for name in got)  # no peer, no memory to compare with


def test_peak_memory_is_held_to_the_peers_plus_a_tenth_at_each_lane_count():
    rows = [row(1, "whole", 0.02, 653), row(1, "peer", 0.04, 594), row(4, "whole", 0.03, 700),
            row(4, "peer", 0.06, 600)]
    got = by_name(rows)
    one, four = got["peak memory at 1 lane over llama.cpp's"], got["peak memory at 4 lanes over llama.cpp's"]
    assert one["goal"] == 1.1 and one["most"] and one["met"]  # 653 / 594 = 1.099
    assert four["value"] == 700 / 600 and not four["met"]  # the control: 17% above the peer
    assert got["decode at 1 lane vs llama.cpp on its GGUF file"]["met"] and not got[
        "decode at 1 lane vs llama.cpp on its GGUF file"]["most"]
    assert "peak memory at 1 lane over ik_llama.cpp's" in by_name(rows, "ik_llama.cpp")
    assert not any("peak memory" in name for name in by_name(rows, "hf"))  # HF's memory is no target
