"""`tfq chat` as a user runs it: streamed replies, several prompts together, bad input in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_PLAN = str(ROOT / "plans" / "tiny.yaml")


def tfq(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfq", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def replies(stdout: str) -> dict[str, str]:
    out, label = {}, None
    for line in stdout.splitlines():
        if line.startswith("=== "):
            label = line[4:]
            out[label] = ""
        elif label is not None:
            out[label] += line + "\n"
    return out


def test_one_prompt_streams_a_reply(tiny_dirs):
    r = tfq("chat", "def add(a, b):", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the tiny model's words are noise, but there are words
    assert "tokens/s" in r.stderr
    assert "stream 0" in r.stderr  # plan lines first


def test_several_prompts_equal_their_runs_alone(tiny_dirs):
    prompts = ["hello there", "def fibonacci(n):", "你好，世界", "The quick brown fox"]
    common = ["--model", str(tiny_dirs["qwen3"]), "--plan", TINY_PLAN, "--max-tokens", "16", "--quiet"]
    together = tfq("chat", *[a for p in prompts for a in ("-p", p)], *common, env={"TFQ_KV_POOL": "10"})
    assert together.returncode == 0, together.stderr
    got = replies(together.stdout)
    assert list(got) == ["p1", "p2", "p3", "p4"]
    for i, p in enumerate(prompts):
        alone = tfq("chat", p, *common, "--set", "kv.pages=0")
        assert alone.returncode == 0, alone.stderr
        assert got[f"p{i + 1}"] == alone.stdout


def test_prompts_file(tiny_dirs, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    r = tfq("chat", "--prompts", str(f), "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--max-tokens", "4",
            "--quiet")
    assert r.returncode == 0, r.stderr
    assert list(replies(r.stdout)) == ["p1", "p2"]


@pytest.mark.parametrize("args, words", [
    (["--max-tokens", "-3"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--prompts", "/nonexistent/prompts.txt"], "prompts"),
    (["--json-schema", "/nonexistent/schema.json"], "schema.json"),
    (["--regex", "("], "unclosed group"),
    (["--regex", "a", "--json-schema", str(ROOT / "pyproject.toml")], "not JSON"),
    (["--presence-penalty", "3"], "presence_penalty"),
    (["--presence-penalty", "nan"], "presence_penalty"),
    (["--frequency-penalty", "inf"], "frequency_penalty"),
    (["--repetition-penalty", "1e-45"], "repetition_penalty must be in [0.1, 10]"),
    (["--repetition-penalty", "11"], "repetition_penalty"),
])
def test_bad_input_is_one_line_exit_2(tiny_dirs, args, words):
    base = {"--model": str(tiny_dirs["qwen2"])}
    extra = [] if "--model" in args else ["--model", base["--model"]]
    r = tfq("chat", "hi", "--plan", TINY_PLAN, "--quiet", *extra, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr


def test_a_reply_follows_its_json_schema_and_regex(tiny_dirs, tmp_path):
    """--json-schema and --regex hold a reply to its grammar even on a random model."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false}')
    common = ["--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--max-tokens", "24", "--quiet"]
    as_json = tfq("chat", "json?", "--json-schema", str(schema), "--repetition-penalty", "1.2", *common)
    as_time = tfq("chat", "when?", "--regex", "[0-2][0-9]:[0-5][0-9]", *common)
    assert as_json.returncode == 0 and as_time.returncode == 0, (as_json.stderr, as_time.stderr)
    assert as_json.stdout.strip() in ('{"ok": true}', '{"ok": false}')
    assert len(as_time.stdout.strip()) == 5 and as_time.stdout[2] == ":"


@pytest.mark.slow
def test_default_model_four_prompts_paged_equal_alone(shared_default, monkeypatch, capsys):
    """The field report's case on the real model: four chats on plans/paged.yaml equal their runs alone."""
    from cli import tfq as tfq_here

    prompts = ["Write a Python function that reverses a linked list.",
               "Explain what a mutex is in two sentences.",
               "Write a SQL query that counts orders per customer.",
               "用一句话解释什么是递归。"]
    common = ["--max-tokens", "24", "--quiet", "--set", "window=1024"]
    code, out, err = tfq_here(["chat", *[a for p in prompts for a in ("-p", p)], "--plan",
                               str(ROOT / "plans" / "paged.yaml"), *common], monkeypatch, capsys)
    assert code == 0, err
    got = replies(out)
    for i, p in enumerate(prompts):
        code, alone, err = tfq_here(["chat", p, *common], monkeypatch, capsys)
        assert code == 0, err
        assert alone == got[f"p{i + 1}"]


def test_interactive_chat_keeps_history(tiny_dirs):
    r = subprocess.run([sys.executable, "-m", "tfq", "chat", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN,
                        "--max-tokens", "5", "--quiet"], input="hello\nand again\n/exit\n", capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3  # two turns answered, then /exit
    assert r.stderr.count("tokens/s") == 2


def test_ctrl_c_ends_the_reply_cleanly(tiny_dirs):
    import signal

    p = subprocess.Popen([sys.executable, "-u", "-m", "tfq", "chat", "tell me a story", "--model",
                          str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--max-tokens", "3000", "--quiet",
                          "--set", "window=4096", "--set", "kv.pages=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         # a background job of a shell ignores SIGINT; give the child a terminal's default
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(1)  # the reply has started (this greedy reply draws no EOS in its first 400 tokens)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert first and p.returncode == 0, err
    assert "(stopped)" in err and "Traceback" not in err


def test_chat_with_ngram_draft_prints_acceptance_and_same_reply(tiny_dirs):
    common = ["--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--max-tokens", "40", "--quiet"]
    prompt = "def f(x): return x + 1\ndef f(x): return x + 1\ndef f(x):"
    plain = tfq("chat", prompt, *common)
    drafted = tfq("chat", prompt, *common, "--draft", "ngram:4")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    assert "proposed" in drafted.stderr and "tokens per verify forward" in drafted.stderr


@pytest.mark.parametrize("args,line", [
    (["hi"], "lanes: 1 stream in one forward at most (sized to 1 prompt; --set lanes=N to change)"),
    (["-p", "hi", "-p", "there"], "lanes: 2 streams in one forward at most (sized to 2 prompts; --set lanes=N to "
                                  "change)"),
    (["hi", "--set", "lanes=3"], "lanes: 3 streams in one forward at most (set by --set)"),
])
def test_chat_sizes_its_lanes_to_its_prompts(tiny_dirs, args, line):
    """The default plan (no --plan: its 8 lanes are a server's) sized to the prompts given, unless --set names lanes;
    the last case is the control, where the same check must see the user's 3."""
    r = tfq("chat", *args, "--model", str(tiny_dirs["qwen2"]), "--max-tokens", "2", "--set", "budget=2GiB")
    assert r.returncode == 0, r.stderr
    assert line in r.stderr.splitlines()
