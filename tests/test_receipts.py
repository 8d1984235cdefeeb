"""Receipts on a tiny model: replies served under load (greedy, sampled, constrained, penalized, n = 2, streamed
or not), `tfq chat --receipt` and `tfq.LLM`'s, replayed with `tfq replay` in one run: all equal, here and on
kernels built for AVX2. The controls, in the same run: a receipt with one reply token changed, one with a step's
logits digest changed, one whose chain was altered, one signed with another key, and the receipts replayed on
another model's weights: each named, and the exit is 1."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import platform
import subprocess
import sys

import pytest

from cli import tfq
from serve_load import EXTRA, Call, calls, fire
from served import NAME, TINY_PLAN, idle, server, tiny_served
from tfq.receipts.receipt import sign, signed_by
from tfq.serve.background import serving

KEY = b"tfq receipts test key, 32 bytes!"


def receipt_load() -> list[Call]:
    """The server tests' mixed load, every call asking for receipts, with a constrained call and a penalized one
    for each kind of endpoint."""
    load = calls(seed=11, count=20, max_tokens=24)
    extra = {"structured_outputs": {"regex": "[a-z ]{3,12}"}}
    load += [Call("regex", False, False, 0.5, {"prompt": "name a colour:", "max_tokens": 12, "temperature": 0,
                                                 "extra_body": extra}),
             Call("schema", True, True, 0.5, {"messages": [{"role": "user", "content": "yes?"}], "max_tokens": 20,
                                              "response_format": {"type": "json_schema", "json_schema": {
                                                  "name": "a", "schema": {"type": "object", "properties": {
                                                      "a": {"enum": ["yes", "no"]}}, "required": ["a"]}}}}),
             Call("penalized", True, False, 0.3, {"messages": [{"role": "user", "content": "again and again"}],
                                                  "max_tokens": 16, "temperature": 0.9, "seed": 4, "n": 2,
                                                  "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                                  "logit_bias": {"17": 4}, "extra_body": {"repetition_penalty": 1.3}})]
    return [dataclasses.replace(c, body={**c.body, "extra_body": {**EXTRA, **c.body.get("extra_body", {}),
                                                                   "receipt": True}}) for c in load]


@pytest.fixture(scope="module")
def served_receipts(tiny_dirs, tiny_models) -> list[dict]:
    """Every choice's receipt from a server with a key, under load."""
    with serving(server(tiny_served(tiny_dirs, tiny_models), served={"receipt_key": KEY})) as base:
        replies = asyncio.run(fire(base, NAME, receipt_load()))
        idle(base)
    return [choice["receipt"] for call in replies for choice in call]


def write(path, docs: list[dict]):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def test_every_served_choice_carries_a_signed_receipt_of_its_reply(served_receipts):
    docs = served_receipts
    assert len(docs) == sum(c.body.get("n", 1) for c in receipt_load()) and all(d is not None for d in docs)
    assert all(signed_by(d, KEY) for d in docs)
    kinds = {(d["sampling"]["temperature"] > 0, d["sampling"]["constraint"] is not None,
              d["sampling"]["presence_penalty"] != 0) for d in docs}
    assert {(False, False, False), (True, False, False), (False, True, False), (True, True, False),
            (True, False, True)} <= kinds


def test_replay_finds_every_receipt_equal_and_names_each_control(served_receipts, tiny_dirs, tmp_path, monkeypatch,
                                                                   capsys):
    docs = copy.deepcopy(served_receipts)
    key = tmp_path / "key"
    key.write_bytes(KEY)
    token, digest, altered, forged = (copy.deepcopy(docs[i]) for i in (0, 1, 2, 3))
    step = len(token["reply"]) // 2
    token["reply"][step] = (token["reply"][step] + 1) % 100
    digest["digests"][-1] = "0" * 16
    altered["chain"] = "0" * 64
    for d in (token, digest, altered):  # re-signed with the key: only the replay can tell
        d.update(sign(d, KEY))
    forged.update(sign(forged, b"another key, 32 bytes long......"))
    controls = write(tmp_path / "controls.jsonl", [token, digest, altered, forged])
    code, out, _ = tfq(["replay", write(tmp_path / "served.jsonl", docs), controls, "--key", str(key),
                        "--json", str(tmp_path / "v.json")], monkeypatch, capsys)
    verdicts = json.loads((tmp_path / "v.json").read_text())["receipts"]
    assert code == 1 and f"PARTS: {len(docs)}/{len(docs) + 4} receipts equal" in out
    assert all(v["equal"] for v in verdicts[:len(docs)])
    token_v, digest_v, altered_v, forged_v = verdicts[len(docs):]
    assert token_v["step"] == step and f"step {step}: token" in token_v["what"]
    assert digest_v["step"] == len(digest["reply"]) - 1 and "logits digest 0000000000000000" in digest_v["what"]
    assert "altered" in altered_v["what"] and "not signed with the key" in forged_v["what"]

    code, out, _ = tfq(["replay", write(tmp_path / "some.jsonl", docs[:3]), "--model", str(tiny_dirs["qwen3"])],
                       monkeypatch, capsys)
    assert code == 1 and out.count("refused: the weights differ") == 3


def test_chat_and_llm_receipts_replay_equal_on_kernels_built_for_avx2(tiny_dirs, tmp_path, monkeypatch, capsys):
    from tfq import LLM, SamplingParams

    model = str(tiny_dirs["qwen2"])
    chat_file = tmp_path / "chat.jsonl"
    code, _, err = tfq(["chat", "-p", "alpha beta", "-p", "gamma", "--model", model, "--plan", TINY_PLAN,
                        "--max-tokens", "12", "--temperature", "0.5", "--receipt", str(chat_file), "--quiet"],
                       monkeypatch, capsys)
    assert code == 0, err
    llm = LLM(model=model, plan=TINY_PLAN)
    outs = llm.generate(["one two three"], SamplingParams(max_tokens=10, n=2, temperature=0.9, seed=5, receipt=True))
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].outputs[0].receipt is None
    files = [str(chat_file), write(tmp_path / "llm.jsonl", [c.receipt for c in outs[0].outputs])]
    assert len(chat_file.read_text().splitlines()) == 2
    code, out, _ = tfq(["replay", *files], monkeypatch, capsys)
    assert code == 0 and "EQUAL: 4/4" in out
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() != "x86_64" or " avx2 " not in flags or " fma " not in flags:
        pytest.skip("the AVX2 build runs on x86-64 with AVX2 and FMA")
    env = {**os.environ, "TFQ_CPU_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-m", "tfq", "replay", *files], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0 and "EQUAL: 4/4" in done.stdout, done.stdout + done.stderr
