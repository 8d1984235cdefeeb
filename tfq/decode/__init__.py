"""The decoding rules a stream draws under: sampling, penalties, grammars (structured outputs), tool calls."""
