"""The engine: a step is schedule -> run -> draw -> update over the streams it holds (docs/architecture.md)."""
