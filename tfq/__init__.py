"""tfq: an exact LLM inference engine for Qwen-family models."""

__version__ = "0.1.0"
