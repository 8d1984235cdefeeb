"""The peer: HF transformers `generate` on the same checkpoint folder, timed like a tfq run. It runs in the
bench's child process (tfq.bench.peers.child_end), so its memory is its own and a crash of it never takes tfq down."""
from __future__ import annotations

import time

import torch

from tfq.bench.memory import MemoryProbe
from tfq.bench.record import Run
from tfq.errors import TfqError


class HfPeer:
    """HF transformers `generate` on the same checkpoint folder: greedy, fp32, its own (dynamic) cache."""

    name = "hf"

    def __init__(self, folder, threads: int):
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()

        self.version = transformers.__version__
        dtype_key = "dtype" if int(self.version.split(".")[0]) >= 5 else "torch_dtype"
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), **{dtype_key: torch.float32})
        except Exception as e:  # transformers raises many kinds; the user needs one line
            raise TfqError(f"the peer (HF transformers {self.version}) cannot load {folder}: "
                           f"{' '.join(str(e).split())[:300]}") from None
        self.model = model.to(torch.float32).eval()

    def prepare(self, lanes: int, rows: int) -> None:
        """Nothing to size: generate grows its own cache."""

    def close(self) -> None:
        """Nothing held beyond the model, which goes with the process."""

    def run(self, prompts: list[list[int]], tokens: int, round_: int, probe: MemoryProbe) -> Run:
        from transformers import GenerationConfig

        ids = torch.tensor(prompts, dtype=torch.long)
        # The model's EOS stays; min_new_tokens keeps the peer from drawing it, so every reply has `tokens`.
        # Prompts are of equal length: nothing is padded.
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=tokens, min_new_tokens=tokens,
                                  pad_token_id=0, use_cache=True)
        clock = _Clock()
        probe.start()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=clock)
        total = time.perf_counter() - t0
        peak, grown = probe.stop()
        first = (clock.times[1] if len(clock.times) > 1 else time.perf_counter()) - t0
        replies = out[:, ids.shape[1]:].tolist()
        if any(len(r) != tokens for r in replies):
            raise TfqError(f"the peer drew {len(replies[0])} tokens, not {tokens}; its transformers "
                           f"{self.version} ignored min_new_tokens")
        return Run("hf", "peer", len(prompts), round_, first, total, tokens - 1, replies, peak, grown)


class _Clock:
    """A generate streamer that only notes when each put arrives: the prompt first, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
