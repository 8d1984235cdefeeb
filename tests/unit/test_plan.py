"""The memory plan: loading and overrides, the layout's bytes, the plan lines, and one-line errors. The default
model's plan and the budget of a process holding 4 GiB are in tests/test_plan.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.model.footprint import activation_row_bytes
from tfq.plan import (
    ENV_FLAGS,
    ENV_VALUES,
    SCHEMA,
    KVPlan,
    Plan,
    load_plan,
    parse_bytes,
    parse_plan_text,
    plan_json,
    plan_lines,
)

ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "plans"
TINY = {
    "model_type": "qwen2", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "max_position_embeddings": 32768, "torch_dtype": "float32", "tie_word_embeddings": True,
}
TINY_ROW = 2 * 2 * 1 * 64 * 4  # layers x K,V x kv heads x head dim x fp32 bytes
GiB = 2**30


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_dict(TINY)


def tfq(args: list[str], env: dict[str, str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run the real `tfq` entry point in-process: (exit code, stdout, stderr)."""
    from tfq.cli import main

    for var in list(ENV_VALUES) + list(ENV_FLAGS):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "argv", ["tfq", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    code = exit_.value.code
    return (0 if code is None else code), out, err


# ------------------------------------------------------------------------------------------ loading

def test_default_file_is_the_embedded_default():
    assert load_plan(PLANS / "default.yaml", env={}) == load_plan(None, env={}) == Plan()


@pytest.mark.parametrize("name", ["default", "paged", "paged-all", "long", "tiny"])
def test_shipped_plans_load_and_fit(name, tiny):
    plan = load_plan(PLANS / f"{name}.yaml", env={}, sets=["budget=1GiB"])
    lay = plan.layout(tiny)
    assert lay.fits and lay.cache_bytes > 0


def test_env_then_set_then_source_names_the_last(tiny):
    plan = load_plan(PLANS / "default.yaml", env={"TFQ_KV_PAGES": "128", "TFQ_LANES": "3"}, sets=["kv.pages=256"])
    assert plan.kv.pages == 256 and plan.lanes == 3
    assert plan.source("kv.pages") == "--set" and plan.source("lanes") == "TFQ_LANES"
    assert plan.source("window") is None


def test_switches_and_their_off_values():
    on = load_plan(None, env={"TFQ_KV_PAGES_ALL": "1", "TFQ_FORCE_PARTIAL": "yes"})
    assert (on.kv.paged, on.attention) == ("all", "partial")
    off = load_plan(None, env={"TFQ_KV_PAGES_ALL": "0", "TFQ_FORCE_PARTIAL": ""})
    assert (off.kv.paged, off.attention, off.sources) == ("more", "rows", ())


def test_the_paged_partial_control_is_no_plan_setting():
    """The field report's split lives only in the together check (an attention policy it hands the engine)."""
    plan = load_plan(None, env={"TFQ_PAGED_PARTIAL": "1"})
    assert not hasattr(plan, "paged_partial") and plan.sources == ()
    with pytest.raises(TfqError, match="unknown key"):
        load_plan(None, sets=["paged_partial=true"])


@pytest.mark.parametrize("text,size", [("12GiB", 12 * GiB), ("500MB", 500 * 10**6), ("1.5G", 3 * GiB // 2),
                                       ("1024", 1024), (" 64 KiB ", 64 * 1024), (2048, 2048)])
def test_budget_sizes(text, size):
    assert parse_bytes(text) == size


def test_draft_values():
    assert load_plan(None, env={"TFQ_DRAFT": "ngram:4"}).draft == "ngram:4"
    assert load_plan(None, env={}, sets=["draft=NGRAM"]).draft == "ngram"
    assert load_plan(None, env={}, sets=["draft=/ckpt/draft-0.1b"]).draft == "/ckpt/draft-0.1b"
    for bad in ("ngram:0", "ngram:17", "ngram:x"):
        with pytest.raises(TfqError, match="ngram:K"):
            load_plan(None, env={}, sets=[f"draft={bad}"])


def test_empty_sections_and_values_keep_defaults():
    assert parse_plan_text("kv:\nwindow:\n", "t.yaml") == Plan()
    assert parse_plan_text("", "t.yaml") == Plan()


# ------------------------------------------------------------------------------------------- layout

@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1)])
def test_row_bytes_follow_the_cache_layout(dtype, size, tiny):
    lay = Plan(kv=KVPlan(dtype=dtype), budget="1GiB").layout(tiny)
    assert lay.row_bytes == 2 * 2 * 1 * 64 * size


@pytest.mark.parametrize(
    "kv,lanes,contiguous,paged,pool",
    [
        (KVPlan(), 8, 8, 0, 0),
        (KVPlan(pages=256), 8, 1, 7, 7 * 16),
        (KVPlan(pages=256, paged="all"), 8, 0, 8, 8 * 16),
        (KVPlan(pages=256), 1, 1, 0, 0),
        (KVPlan(pages=192, pool=50), 4, 1, 3, 50),  # 4096 / 192: 22 pages a stream; explicit pool taken as is
    ],
)
def test_cache_bytes_are_the_allocated_rows(kv, lanes, contiguous, paged, pool, tiny):
    lay = Plan(window=4096, lanes=lanes, kv=kv, budget="1GiB", weights="fp32").layout(tiny)
    assert (lay.contiguous_lanes, lay.paged_lanes, lay.pool_pages) == (contiguous, paged, pool)
    rows = contiguous * 4096 + pool * kv.pages
    assert lay.rows_total == rows
    assert lay.cache_bytes == rows * TINY_ROW
    assert lay.weights_bytes == tiny.param_count() * 4
    assert lay.total_bytes == lay.weights_bytes + lay.cache_bytes + lay.logits_bytes + lay.activation_bytes
    assert lay.logits_bytes == lay.logits_rows * tiny.vocab_size * 4
    assert lay.activation_bytes == lanes * 512 * activation_row_bytes(tiny)


def test_auto_pool_takes_what_the_budget_leaves(tiny):
    weights = tiny.param_count() * 4
    page = 256 * TINY_ROW
    logits = 512 * tiny.vocab_size * 4  # logits_rows: auto, a 512-row prompt chunk
    activations = 8 * 512 * activation_row_bytes(tiny)  # the largest forward: 8 lanes' prompt chunks
    budget = weights + logits + activations + 4096 * TINY_ROW + 40 * page + page // 2  # room for 40 pages and a half
    lay = Plan(lanes=8, kv=KVPlan(pages=256), budget=budget, weights="fp32").layout(tiny)
    assert lay.pool_pages == 40 and lay.fits and lay.pool_full == 112
    lines = plan_lines(Plan(lanes=8, kv=KVPlan(pages=256), budget=budget, weights="fp32"), tiny, lay)
    assert any(line.startswith("pool: 40 pages") and "preempted" in line for line in lines)


def test_auto_budget_reads_available_memory(tiny):
    lay = Plan().layout(tiny)
    assert lay.available_bytes and lay.budget_bytes == int(lay.available_bytes * 0.8)


# ----------------------------------------------------------------------------------------- the lines

def test_every_stream_on_pages_names_its_variables(tiny_dir, monkeypatch, capsys):
    env = {"TFQ_KV_PAGES": "256", "TFQ_KV_PAGES_ALL": "1"}
    code, out, err = tfq(["plan", str(PLANS / "default.yaml"), "--model", str(tiny_dir)], env, monkeypatch, capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert ("stream 0: paged, on 256-row pages (set by TFQ_KV_PAGES) like every stream (set by TFQ_KV_PAGES_ALL)"
            in lines)
    assert any(line.startswith("7 more taking pages: 256-row pages (set by TFQ_KV_PAGES)") for line in lines)
    assert any(line.startswith("pool: 128 pages, 32768 rows") for line in lines)  # 8 streams x 16 pages
    assert any(line.startswith(f"model: {tiny_dir} (set by --model)") for line in lines)
    assert not any("contiguous" in line for line in lines)
    assert any(line.startswith("total:") and "fits" in line for line in lines)


def test_whole_plan_says_every_lane_is_contiguous(tiny, tiny_dir):
    plan = load_plan(PLANS / "default.yaml", env={})
    lines = plan_lines(plan, tiny, plan.layout(tiny))
    assert "stream 0: contiguous, 4096 rows, 4.0 MiB" in lines
    assert "streams 1-7: contiguous too, 4096 rows each, 28.0 MiB together" in lines
    assert "0 more taking pages: pages are off (kv.pages: 0)" in lines
    assert not any("(set by" in line for line in lines)


def test_one_lane_with_pages_says_zero_more(tiny_dir, monkeypatch, capsys):
    code, out, _ = tfq(["plan", str(PLANS / "paged.yaml"), "--model", str(tiny_dir), "--set", "lanes=1"], {},
                       monkeypatch, capsys)
    assert code == 0
    assert "0 more taking pages: lanes is 1 (set by --set), so stream 0 runs alone" in out.splitlines()


def test_attention_control_and_draft_lines(tiny):
    plan = load_plan(PLANS / "paged.yaml", env={"TFQ_FORCE_PARTIAL": "1", "TFQ_DRAFT": "ngram:3"})
    text = "\n".join(plan_lines(plan, tiny, plan.layout(tiny)))
    assert "attention: partial (set by TFQ_FORCE_PARTIAL): keys in 256-row splits of 64-row tiles" in text
    assert "drafting: n-gram lookup in the stream's own text, up to 3 tokens a step (set by TFQ_DRAFT)" in text


def test_the_prefix_store_line_says_where_and_how_much(tiny):
    plan = load_plan(PLANS / "paged.yaml", env={"TFQ_KV_PREFIX_STORE": "/srv/pages"},
                     sets=["kv.prefix_cache=on", "kv.prefix_store_size=1GiB"])
    assert plan.kv.prefix_store == "/srv/pages" and plan.kv.prefix_store_size == GiB
    text = "\n".join(plan_lines(plan, tiny, plan.layout(tiny)))
    assert "every full page is also kept on disk in /srv/pages (set by TFQ_KV_PREFIX_STORE) (at most 1.00 GiB" in text
    assert load_plan(None, env={}).kv.prefix_store == "off"


def test_json_has_the_same_facts(tiny_dir, monkeypatch, capsys):
    code, out, _ = tfq(["plan", str(PLANS / "paged.yaml"), "--json", "--model", str(tiny_dir),
                        "--set", "budget=1GiB"], {"TFQ_LANES": "4"}, monkeypatch, capsys)
    assert code == 0
    data = json.loads(out)
    assert (data["plan"]["lanes"] == 4
            and data["sources"] == {"lanes": "TFQ_LANES", "budget": "--set", "model": "--model"})
    assert data["layout"]["pool_pages"] == 48 and data["layout"]["cache_bytes"] == (4096 + 48 * 256) * TINY_ROW
    assert data["layout"]["budget_bytes"] == GiB and data["layout"]["fits"] is True
    assert "3 more taking pages" in " ".join(data["lines"])


def test_device_line_says_where_and_which_kernels(tiny):
    import torch

    auto = "\n".join(plan_lines(Plan(), tiny, Plan().layout(tiny)))
    here = "cuda:0 (auto: a CUDA GPU is here)" if torch.cuda.is_available() else "cpu (auto: no CUDA GPU here)"
    assert f"device: {here}" in auto
    plan = load_plan(None, env={"TFQ_DEVICE": "CPU"})
    lay = plan.layout(tiny)
    assert lay.device == "cpu"
    assert ("device: cpu (set by TFQ_DEVICE): tfq's C++ kernels: linear layers and attention"
            in "\n".join(plan_lines(plan, tiny, lay)))
    assert (plan_json(plan, tiny, lay)["plan"]["device"] == "cpu"
            and plan_json(plan, tiny, lay)["layout"]["device"] == "cpu")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_plan_on_a_machine_without_one_is_one_line(tiny_dir, monkeypatch, capsys):
    code, out, err = tfq(["plan", "--model", str(tiny_dir), "--set", "device=cuda"], {}, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.startswith("tfq: device cuda (set by --set): this machine sees no CUDA GPU (torch ")
    assert err.rstrip().endswith("; use device: cpu or auto") and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------ bad input

BAD_FILES = [
    ("windw: 5\n", "unknown key 'windw'; did you mean window?"),
    ("kv:\n  page: 64\n", "did you mean kv.pages?"),
    ("pages: 256\n", "did you mean kv.pages?"),
    ('window: "big"\n', "window must be a positive integer, not 'big'"),
    ("window: true\n", "window must be a positive integer"),
    ("lanes: 0\n", "lanes must be a positive integer, not 0"),
    ("prefill_chunk: -5\n", "prefill_chunk must be a positive integer, not -5"),
    ("kv:\n  pages: 100\n", "kv.pages 100 is not a multiple of the 64-row key tile; try 128"),
    ("kv:\n  pages: -64\n", "kv.pages must be 0"),
    ("window: 40000\n", "window 40000 is past the model's 32768 positions"),
    ("kv:\n  dtype: int8\n", "kv.dtype must be one of fp32 | bf16 | fp16 | fp8, not 'int8'"),
    ("attention: flash\n", "attention must be one of rows | partial"),
    ("kv:\n  paged: some\n", "kv.paged must be one of more | all"),
    ("kv: 5\n", "kv must be a mapping"),
    ("kv:\n  pages: 256\n  pool: 3\n", "set kv.pool to at least 16"),
    ("budget: 1MiB\n", "over budget by"),
    ("budget: lots\n", "budget must be auto or a size"),
    ("lanes: 2000\nbudget: 2GiB\n", "plan over budget by"),
    ("- window: 5\n", "a plan is a YAML mapping"),
    ("window: [\n", "not valid YAML"),
    ("draft: 7\n", "draft must be none, ngram"),
    ("model: 12\n", "model must be"),
    ("device: gpu\n", "device must be auto, cpu, cuda or cuda:N (a GPU's index), not 'gpu'"),
]


@pytest.mark.parametrize("text,message", BAD_FILES)
def test_bad_plan_files_get_one_line(text, message, tmp_path, tiny_dir, monkeypatch, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = tfq(["plan", str(path), "--model", str(tiny_dir)], {}, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("tfq: ") and message in err, err


BAD_OVERRIDES = [
    ({"TFQ_LANES": "abc"}, [], "TFQ_LANES=abc: lanes must be a positive integer"),
    ({"TFQ_WINDOW": "0"}, [], "TFQ_WINDOW=0: window must be a positive integer"),
    ({"TFQ_KV_PAGES": "100"}, [], "TFQ_KV_PAGES=100: kv.pages 100 is not a multiple"),
    ({"TFQ_KV_DTYPE": "int4"}, [], "TFQ_KV_DTYPE=int4: kv.dtype must be one of"),
    ({"TFQ_KV_PAGES_ALL": "maybe"}, [], "TFQ_KV_PAGES_ALL=maybe: use TFQ_KV_PAGES_ALL=1"),
    ({"TFQ_BUDGET": "-3G"}, [], "TFQ_BUDGET=-3G: budget must be"),
    ({"TFQ_KV_POOL": "none"}, [], "TFQ_KV_POOL=none: kv.pool must be auto or a positive number"),
    ({"TFQ_WINDOW": "65536"}, [], "window 65536 (set by TFQ_WINDOW) is past the model's 32768 positions"),
    ({}, ["windw=5"], "--set windw=5: unknown key 'windw'; did you mean window?"),
    ({}, ["lanes"], "--set lanes: write --set key=value"),
    ({}, ["kv=1"], "--set kv=1: kv is a section"),
    ({}, ["lanes=3.5"], "--set lanes=3.5: lanes must be a positive integer"),
    ({"TFQ_DEVICE": "tpu"}, [], "TFQ_DEVICE=tpu: device must be auto, cpu, cuda or cuda:N"),
    ({}, ["device=cuda:99"], "device cuda:99 (set by --set): this machine sees"),
    ({"TFQ_TP": "1000"}, [], "tp 1000 (set by TFQ_TP) is more ranks than the model has hidden columns (128) to "
                             "share among them; set tp to at most 128"),
    ({}, ["kv.prefix_store_size=lots"], "--set kv.prefix_store_size=lots: kv.prefix_store_size must be a size such "
                                        "as 12GiB"),
    ({"TFQ_KV_PREFIX_STORE": "/tmp/pages"}, [], "kv.prefix_store (set by TFQ_KV_PREFIX_STORE) keeps the prefix "
                                                "cache's pages on disk, and the prefix cache is off; set "
                                                "kv.prefix_cache: on"),
    ({"TFQ_KV_PREFIX_STORE": "/tmp/pages"}, ["kv.pages=64", "kv.prefix_cache=on", "tp=2"],
     "pages read back from disk reach one process's heads so far; use tp: 1"),
    ({"TFQ_LOGITS_ROWS": "none"}, [], "TFQ_LOGITS_ROWS=none: logits_rows must be auto or a positive number of rows"),
    ({}, ["logits_rows=7", "draft=ngram:3"], "logits_rows 7 (set by --set) is fewer than the rows every lane draws "
                                             "from at once (8 lanes x 4); set logits_rows to 32 or more, or auto"),
]


@pytest.mark.parametrize("env,sets,message", BAD_OVERRIDES)
def test_bad_overrides_name_their_source(env, sets, message, tiny_dir, monkeypatch, capsys):
    args = ["plan", "--model", str(tiny_dir)] + [a for s in sets for a in ("--set", s)]
    code, out, err = tfq(args, env, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and message in err, err


def test_missing_plan_file(tiny_dir, monkeypatch, capsys):
    code, _, err = tfq(["plan", "no/such/plan.yaml", "--model", str(tiny_dir)], {}, monkeypatch, capsys)
    assert code == 2 and err == ("tfq: plan file 'no/such/plan.yaml' not found; "
                                 "give a plan YAML (plans/ holds examples)\n")


def test_a_real_process_prints_no_traceback(tiny_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFQ_")}
    env["TFQ_LANES"] = "abc"
    run = subprocess.run([sys.executable, "-c", "from tfq.cli import main; main()", "plan", "--model", str(tiny_dir)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == "tfq: TFQ_LANES=abc: lanes must be a positive integer, not 'abc'\n"


# -------------------------------------------------------------------------------------- property test

_KEYS = list(SCHEMA) + ["kv"]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(),
    st.text(max_size=12), st.sampled_from(["auto", "4096", "64", "256", "all", "more", "bf16", "ngram:4", "1.5G"]),
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
_kv_docs = st.dictionaries(st.sampled_from(["dtype", "pages", "paged", "pool"]) | st.text(max_size=6), _values,
                           max_size=4)
_docs = st.one_of(
    st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), _values | _kv_docs, max_size=6),
    _values,
)
_texts = st.one_of(st.text(max_size=12), st.integers(-(2**65), 2**65).map(str),
                   st.sampled_from(["0", "1", "64", "256", "4096", "auto", "all", "fp8", "12GiB", "ngram:16", ""]))
_envs = st.dictionaries(st.sampled_from(list(ENV_VALUES) + list(ENV_FLAGS)), _texts, max_size=5)
_sets = st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(_KEYS) | st.text(max_size=6), _texts),
                           st.text(max_size=10)), max_size=3)


def _only_tfq_errors(text: str, env: dict, sets: list, tiny: ModelConfig, tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        plan = load_plan(path, env=env, sets=sets)
        lay = plan.layout(tiny)
        lines = plan_lines(plan, tiny, lay)
        json.dumps(plan_json(plan, tiny, lay))
        assert lines[-2].startswith("total:") and lines[-1].startswith("resident memory:") and lay.fits
    except TfqError as e:
        assert len(str(e).splitlines()) == 1, str(e)
    else:
        assert all(len(line.splitlines()) == 1 for line in lines)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_docs, env=_envs, sets=_sets)
def test_random_documents_and_overrides_never_trace_back(doc, env, sets, tiny, tmp_path):
    _only_tfq_errors(yaml.safe_dump(doc, allow_unicode=True), env, sets, tiny, tmp_path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("kv:window lanes pages\n-[]{}'\"&*!#0123456789.,|>%@`")),
                    max_size=60),
       env=_envs)
def test_random_yaml_text_never_traces_back(text, env, tiny, tmp_path):
    _only_tfq_errors(text, env, [], tiny, tmp_path)


@pytest.mark.parametrize("sets,rows", [([], 512), (["prefill_chunk=16"], 16),
                                       (["prefill_chunk=16", "draft=ngram:3"], 32), (["logits_rows=100"], 100)])
def test_logits_rows_are_counted_in_the_total(sets, rows, tiny):
    plan = Plan(window=4096, lanes=8, budget="1GiB")
    for s in sets:
        plan = plan.set(*s.split("="))
    lay = plan.layout(tiny)
    assert lay.logits_rows == rows and lay.logits_bytes == rows * tiny.vocab_size * 4
    line = next(ln for ln in plan_lines(plan, tiny, lay) if ln.startswith("logits:"))
    assert line.startswith(f"logits: at most {rows} rows a forward, ")
    assert ("(set by --set)" in line) is ("logits_rows=100" in sets)


