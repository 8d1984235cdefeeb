"""One timed run's figures, torch-free: the peer's child process builds them too (tfq.bench.peers.child_end)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Run:
    """One timed run of `lanes` streams: every stream's prompt and reply have the bench's lengths."""

    engine: str  # tfq | hf | llama.cpp
    arm: str  # a tfq arm, or "peer"
    lanes: int
    round: int  # -1: warm-up
    first_token_s: float  # from the start to the last stream's first token (prefill + one draw)
    total_s: float
    decode_steps: int  # forwards after the first token
    replies: list[list[int]]
    peak_rss: int
    run_rss: int | None
    proposed: int = 0
    accepted: int = 0

    def figures(self, prompt_tokens: int) -> dict:
        reply = sum(len(r) for r in self.replies)
        decode_s = self.total_s - self.first_token_s
        decoded = reply - len(self.replies)  # tokens drawn after each stream's first
        rate = decoded / decode_s if decoded and decode_s > 0 else None
        return {
            "prefill_tokens_per_s": self.lanes * prompt_tokens / self.first_token_s,
            "ttft_s": self.first_token_s,
            "decode_tokens_per_s": rate,
            "decode_tokens_per_s_per_stream": rate / self.lanes if rate else None,
            "step_s": decode_s / self.decode_steps if self.decode_steps else None,
            "decode_steps": self.decode_steps,
            "total_s": self.total_s,
            "peak_rss_bytes": self.peak_rss,
            "run_rss_bytes": self.run_rss,
        }
