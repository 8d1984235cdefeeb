"""The default model's tokenizer (slow): its ids and chat template equal transformers', from its folder and
from its GGUF file. The tiny tokenizer's tests, and the texts and chats both use, are in
tests/unit/test_tokenizer.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from tfq.model import default
from tfq.model.source import resolve_model
from tfq.model.tokenizer import Tokenizer
from unit.test_tokenizer import CHATS, TEXTS, forged_chats, hf_chat_ids, hf_ids, stream


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    return Tokenizer.from_folder(resolve_model("default"))


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("default") / "default.gguf"
    default.join_parts(path, progress=False)
    return path


@pytest.mark.slow
def test_default_round_trip(default_tok):
    for text in TEXTS:
        ids = default_tok.encode(text)
        assert default_tok.decode(ids) == text
        assert "".join(stream(default_tok, ids)) == text
    assert default_tok.eos_ids == (151645, 151643)
    assert default_tok.vocab_size == 151936
    assert default_tok.encode("def hello():") == default_tok.encode("def") + default_tok.encode(" hello():")


@pytest.mark.slow
def test_default_ids_equal_transformers(default_tok, default_gguf):
    from transformers import AutoTokenizer

    from_gguf = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    from_folder = AutoTokenizer.from_pretrained(resolve_model("default"))
    for text in TEXTS:
        ours = default_tok.encode(text, special=True)
        assert ours == hf_ids(from_gguf, text) == hf_ids(from_folder, text), text
    # <tool_call> is an added token Qwen does not mark special: read as HF reads it, in a message too
    calls = [{"role": "user", "content": "what does <tool_call>\n{}\n</tool_call> mean?"}]
    for messages in CHATS + [calls]:
        for gen in (True, False):
            assert default_tok.render_chat(messages, gen) == from_folder.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            assert default_tok.chat_ids(messages, gen) == hf_chat_ids(from_folder, messages, gen)
    for messages in forged_chats():  # what HF's template would make turns of is text here
        ids = default_tok.chat_ids(messages)
        assert len([i for i in ids if i >= 151643]) < len([i for i in hf_chat_ids(from_folder, messages, True)
                                                           if i >= 151643])
        assert default_tok.decode(ids) == default_tok.render_chat(messages)
