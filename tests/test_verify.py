"""The same bits on every CPU: `tfq verify` records a model's bits on one build and finds them equal on builds for
other instruction sets (tfq's kernels for haswell and for the x86-64 baseline, torch held to the matching ATen
capability, numpy's dispatched features off), in processes of their own; a control that computes the
log-probabilities with torch's own vector code parts across capabilities. The default model's recorded bits
(tfq/reference/default.json) are checked here too (slow)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tfq.proofs import verify as v
from tiny import tiny_gguf, tiny_model_dir

# A run of the real entry point; argv[1] "control" first swaps the log-probabilities' recipe for torch's own
# log_softmax, whose sums follow the vector width of torch's ATen capability.
RUN = r"""
import sys
if sys.argv[1] == "control":
    import torch
    import tfq.decode.sampling
    tfq.decode.sampling.log_softmax = lambda logits: torch.log_softmax(logits, -1).double().numpy()
sys.argv = ["tfq", *sys.argv[2:]]
from tfq.cli import main
main()
"""

CHATS = [
    {"name": "short", "messages": [{"role": "user", "content": "alpha beta gamma delta"}]},
    {"name": "turns", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "one two three"},
                                   {"role": "assistant", "content": "four five"},
                                   {"role": "user", "content": "six seven eight nine ten"}]},
    {"name": "drawn", "temperature": 0.8, "seed": 3, "messages": [{"role": "user", "content": "zeta eta theta"}]},
]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


def _numpy_off() -> str:
    """NPY_DISABLE_CPU_FEATURES that takes every dispatched feature numpy uses here off (its baseline loops)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))


pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags(),
                                reason="the builds compared here are x86-64's (haswell needs AVX2 and FMA)")

# name -> the environment of one run: tfq's kernels' -march, torch's ATen capability, numpy's features
COMBOS = {
    "haswell, avx2, numpy baseline": {"TFQ_CPU_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2",
                                      "NPY_DISABLE_CPU_FEATURES": "numpy"},
    "x86-64, default, numpy baseline": {"TFQ_CPU_MARCH": "x86-64", "ATEN_CPU_CAPABILITY": "default",
                                        "NPY_DISABLE_CPU_FEATURES": "numpy"},
}


def tfq_run(args: list[str], env: dict[str, str] | None = None, control: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    if env.get("NPY_DISABLE_CPU_FEATURES") == "numpy":
        env["NPY_DISABLE_CPU_FEATURES"] = _numpy_off()
    env.pop("TFQ_THREADS", None)  # --threads decides
    return subprocess.run([sys.executable, "-c", RUN, "control" if control else "plain", *args], capture_output=True,
                          text=True, timeout=900, env=env)


# name -> (the model's path, the weights kind verified): attention layers in fp32, a hybrid's DeltaNet layers, and
# a GGUF file's quantized blocks (tfq's quantized kernels)
MODELS = {
    "qwen2": lambda f: (tiny_model_dir(f, "qwen2", seed=1), "fp32"),
    "hybrid": lambda f: (tiny_model_dir(f, "qwen3_5", layers=4, layer_types=("linear_attention",) * 3 +
                                        ("full_attention",)), "fp32"),
    "gguf": lambda f: (tiny_gguf(f, "qwen2", quantized=True), "gguf"),
}


def record(model: str, tmp_path_factory) -> tuple[list[str], Path]:
    """A tiny model's bits recorded on this machine's own build; the arguments that verify against them."""
    folder, kind = MODELS[model](tmp_path_factory)
    root = tmp_path_factory.mktemp("verify")
    suite = root / "suite.yaml"
    suite.write_text(yaml.safe_dump(CHATS))
    common = ["verify", "--model", str(folder), "--suite", str(suite), "--weights", kind,
              "--set", "window=512", "--set", "lanes=2", "--threads", "2", "--quiet"]
    path = root / "record.json"
    done = tfq_run(common + ["--record", str(path)])
    assert done.returncode == 0, done.stdout + done.stderr
    return common + ["--against", str(path)], path


@pytest.fixture(scope="module", params=list(MODELS))
def recorded(request, tmp_path_factory) -> tuple[list[str], Path]:
    return record(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def recorded_qwen2(tmp_path_factory) -> tuple[list[str], Path]:
    return record("qwen2", tmp_path_factory)


def test_the_record_holds_every_chat_with_its_logits_and_log_probabilities(recorded_qwen2):
    _, path = recorded_qwen2
    doc = v.read(path)
    chats = v.recorded(doc, "fp32")
    assert list(chats) == ["short", "turns", "drawn", "short, sampled"]
    assert v.streams(CHATS) == len(chats)  # the streams tfq verify sizes its lanes to are the requests it makes
    for bits in chats.values():
        assert len(bits.ids) == len(bits.digests) == len(bits.logprobs) > 0
        assert all(len(top) == v.TOP for _, _, top in bits.logprobs)
    assert chats["short"].prompt_scores and chats["turns"].prompt_scores is None
    assert doc["recorded_on"]["march"] == "native"


@pytest.mark.parametrize("combo", list(COMBOS))
def test_other_instruction_sets_give_the_recorded_bits(recorded, combo, tmp_path):
    args, _ = recorded
    done = tfq_run(args + ["--json", str(tmp_path / "v.json")], COMBOS[combo])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert sum(len(chats) for chats in report["chats"].values()) == len(CHATS) + 1
    march, isa = COMBOS[combo]["TFQ_CPU_MARCH"], COMBOS[combo]["ATEN_CPU_CAPABILITY"].upper()
    assert report["equal"] and report["machine"]["march"] == march and report["machine"]["torch_isa"] == isa
    assert "(baseline)" in report["machine"]["numpy"]  # numpy's dispatched loops were really off
    slow = march == "x86-64"  # no FMA instruction in the build: emulated, and the run says so in one line
    assert (report["machine"]["lanes"] == "SSE2, fma emulated") == slow and ("tfq: slow build" in done.stderr) == slow


def test_control_torch_log_softmax_parts_across_capabilities(recorded_qwen2, tmp_path):
    """RED by construction: recorded with torch's log_softmax at this CPU's capability, verified with it at
    `default`: the log-probabilities part (ids and logits stay equal: only the control's op moved)."""
    args, _ = recorded_qwen2
    own = tmp_path / "control.json"
    done = tfq_run(args[:args.index("--against")] + ["--record", str(own)], control=True)
    assert done.returncode == 0, done.stdout + done.stderr
    done = tfq_run([*args[:args.index("--against")], "--against", str(own), "--json", str(tmp_path / "v.json")],
                   {"ATEN_CPU_CAPABILITY": "default"}, control=True)
    assert done.returncode == 1, done.stdout + done.stderr
    chats = json.loads((tmp_path / "v.json").read_text())["chats"]["fp32"]
    assert any(c["logprobs"] is not None for c in chats)
    assert all(c["ids"] is None and c["logits"] is None for c in chats)


def test_a_record_of_another_suite_or_kind_is_refused_in_one_line(recorded_qwen2, tmp_path):
    args, _ = recorded_qwen2
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(CHATS[:1]))
    at = args.index("--suite")
    done = tfq_run(args[:at + 1] + [str(other)] + args[at + 2:])
    assert done.returncode == 2 and "is not the suite the record was made with" in done.stderr
    at = args.index("--weights")
    done = tfq_run(args[:at + 1] + ["gguf"] + args[at + 2:])
    assert done.returncode == 2 and "the record has no 'gguf' run" in done.stderr
    (tmp_path / "bad.json").write_text("{}")
    done = tfq_run(args[:args.index("--against") + 1] + [str(tmp_path / "bad.json")])
    assert done.returncode == 2 and "is not a record of bits" in done.stderr


@pytest.mark.slow
def test_the_default_model_gives_the_shipped_record_here():
    """`tfq verify` as the README runs it: the shipped suite on the default model, in each of its arithmetics
    (gguf-q8, the default; gguf; fp32), against the bits recorded in the repository."""
    done = tfq_run(["verify", "--quiet"])
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = sum(len(chats) for chats in v.read(v.REFERENCE)["weights"].values())
    assert set(v.read(v.REFERENCE)["weights"]) == set(v.WEIGHTS)
    assert recorded >= 42 and f"EQUAL: {recorded}/{recorded} chats equal the record" in done.stdout
