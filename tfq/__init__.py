"""tfq: an exact LLM inference engine for Qwen-family models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from tfq import LLM, SamplingParams` without importing torch for `import tfq` alone."""
    if name in ("LLM", "SamplingParams"):
        from tfq import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tfq' has no attribute {name!r}")
