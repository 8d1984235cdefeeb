"""`tfq chat`: one prompt streamed, several prompts run together, or an interactive multi-turn chat."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from tfq.cli.app import app, output_file
from tfq.decode import tools as calls
from tfq.decode.grammar import constraint_of
from tfq.decode.penalties import Penalties
from tfq.decode.thinking import ThinkStream, opened, split, thinks
from tfq.engine.stream import Request
from tfq.engine.threads import fix_threads
from tfq.errors import TfqError
from tfq.plan.streams import Streams
from tfq.receipts.receipt import Issuer
from tfq.suite import Chat, chat_from_prompt, load_prompts, requests_for


def read_json(path: str):
    """A JSON file's value; one line naming what is wrong if it is not JSON."""
    import json
    from pathlib import Path

    from tfq.suite import read_text

    try:
        return json.loads(read_text(Path(path)))
    except json.JSONDecodeError as e:
        raise TfqError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def read_schema(path: str) -> dict | bool:
    schema = read_json(path)
    if not isinstance(schema, (dict, bool)):
        raise TfqError(f"{path}: a JSON schema is an object; this file holds a {type(schema).__name__}")
    return schema


def read_tools(path: str) -> list[dict]:
    """A JSON file of tools in OpenAI's shape ([{"type": "function", "function": {"name": ...}}, ...])."""
    from pydantic import ValidationError

    from tfq.serve.intake import validation_message
    from tfq.serve.protocol import Tool

    tools = read_json(path)
    if not isinstance(tools, list) or not tools:
        raise TfqError(f"{path}: give a JSON list of tools, each {{\"type\": \"function\", \"function\": {{...}}}}")
    try:
        return [Tool.model_validate(t).model_dump(exclude_none=True) for t in tools]
    except ValidationError as e:
        raise TfqError(f"{path}: {validation_message(e.errors())[0]}") from None


@app.command()
def chat(
    prompt: Optional[str] = typer.Argument(None, help="Prompt; leave out for an interactive chat."),
    prompts: List[str] = typer.Option([], "-p", "--prompt", help="A prompt; repeat to run several together."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts", help="One prompt per line, or a YAML suite."),
    plan: Optional[str] = typer.Option(None, "--plan", help="Plan YAML (default: plans/default.yaml values)."),
    model: Optional[str] = typer.Option(None, "--model", help="default, an HF folder or a .gguf file."),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Most tokens in a reply."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int = typer.Option(0, "--seed", help="Seed of the per-position draws (temperature > 0)."),
    draft: Optional[str] = typer.Option(None, "--draft",
                                        help="none | ngram[:K] | a draft checkpoint (plan key draft)."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (after TFQ_* variables)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Exactly N torch threads, even past the cores "
                                          "(default: follow the free cores)."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="A JSON schema file every reply follows."),
    regex: Optional[str] = typer.Option(None, "--regex", help="A regex every reply matches."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="-2 to 2, as OpenAI's."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="-2 to 2, as OpenAI's."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="0.1 to 10, as vLLM's (1: none)."),
    tools_file: Optional[str] = typer.Option(None, "--tools", help="A JSON file of tools (OpenAI's shape) the model "
                                             "may call; the calls it writes are listed after the reply."),
    tool_choice: str = typer.Option("auto", "--tool-choice", help="auto | required | none | a tool's name."),
    thinking: str = typer.Option("show", "--thinking", help="A thinking model's thinking (Qwen3, Qwen3.5): show "
                                 "(dimmed, before the answer), hide, or off (the template's enable_thinking: false)."),
    receipt: Optional[str] = typer.Option(None, "--receipt", help="Write each reply's receipt to FILE (JSON lines; "
                                          "`tfq replay FILE` checks them)."),
    quiet: bool = typer.Option(False, "--quiet", help="Hide the plan lines."),
) -> None:
    """Chat with the model; replies stream as they are generated."""
    from tfq.engine.core import Engine
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan

    err = Console(stderr=True)
    chats = [chat_from_prompt(p, f"p{i + 1}", system) for i, p in enumerate(([prompt] if prompt else []) + prompts)]
    if prompts_file:
        chats += load_prompts(prompts_file)
    settings = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                    penalties=Penalties(presence_penalty, frequency_penalty, repetition_penalty),
                    constraint=constraint_of(read_schema(json_schema) if json_schema else None, regex=regex))
    Request((0,), **{k: v for k, v in settings.items() if k != "seed"}).validate()
    if thinking not in ("show", "hide", "off"):
        raise TfqError(f"--thinking {thinking!r}: give show, hide or off")
    if thinking == "off":
        settings["options"] = {"enable_thinking": False}
    tools = read_tools(tools_file) if tools_file else None
    if tools and tool_choice not in ("auto", "none") and settings["constraint"] is not None:
        raise TfqError("--tool-choice required or a name is a grammar of its own; leave out --json-schema and --regex")
    if draft is not None:
        sets = [*sets, f"draft={draft}"]
    output_file(receipt, "--receipt")
    fix_threads(threads)
    the_plan, _, layout = resolve_plan(plan, model, sets, quiet, err, chat_streams(len(chats)))
    with err.status("loading the model"):
        loaded = load_model(the_plan.model, device=layout.device, weights=the_plan.weights, tp=the_plan.tp)
    engine = Engine.from_plan(the_plan, layout, loaded)
    tok = loaded.tokenizer
    keep = Receipts(Path(receipt), Issuer.of(the_plan, layout, loaded)) if receipt else None
    show = Thoughts(tok, settings.get("options"), thinking == "show")
    if tools:
        choice = tool_choice if tool_choice in ("auto", "none", "required") else {"function": {"name": tool_choice}}
        settings.update(tools=tools, constraint=calls.constraint(tools, choice, True, tok) or settings["constraint"])
    if not chats:
        _interactive(engine, tok, system, settings, err, keep, show)
    elif len(chats) == 1:
        _stream_one(engine, requests_for(chats, tok, **settings)[0], err, bool(tools), keep, show.of(chats[0]))
    else:
        _together(engine, requests_for(chats, tok, **settings), err, bool(tools), keep, [show.of(c) for c in chats])


@dataclass
class Thoughts:
    """How a thinking model's thinking is shown: dimmed before the answer, or not at all (tfq/decode/thinking.py)."""

    tokenizer: object
    options: dict | None
    show: bool

    def of(self, chat: Chat) -> "Thinking | None":
        """The reply's splitter for `chat`; None where the template does not think."""
        if not thinks(self.tokenizer.chat_template):
            return None
        return Thinking(opened(self.tokenizer.render_chat(list(chat.messages), options=self.options)), self.show)


@dataclass
class Thinking:
    inside: bool  # the prompt leaves the reply inside the thinking block
    show: bool
    console: Console = field(default_factory=lambda: Console(highlight=False, markup=False, soft_wrap=True))

    def printer(self):
        """A callback that prints a streamed reply's pieces: thinking dimmed, then a blank line, then the answer."""
        split, seen = ThinkStream(self.inside), [False]

        def write(thought: str, answer: str) -> None:
            if thought and self.show:
                self.console.print(thought, style="dim", end="")
                seen[0] = True
            if answer:
                if seen[0]:
                    self.console.print("\n")
                    seen[0] = False
                self.console.print(answer, end="")

        return lambda piece: write(*split.feed(piece)), lambda: write(*split.finish())

    def whole(self, text: str) -> None:
        thought, answer = split(text, self.inside)
        if thought and self.show:
            self.console.print(thought.strip("\n"), style="dim")
            self.console.print()
        self.console.print(answer)


@dataclass
class Receipts:
    """Where `--receipt` writes: each finished reply's receipt, one JSON line each, the file started afresh."""

    path: Path
    issuer: Issuer
    written: int = 0

    def write(self, requests: list[Request], results: list) -> None:
        docs = [self.issuer.receipt(q, r) for q, r in zip(requests, results) if r.error is None]
        with open(self.path, "a" if self.written else "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(d) + "\n" for d in docs))
        self.written += len(docs)


def chat_streams(prompts: int) -> Streams:
    """The streams a chat runs at once: its prompts, all together; an interactive chat one reply at a time (each
    turn waits for the one before), whatever the window its history grows to."""
    return Streams.of(prompts, "prompt") if prompts else Streams(1, "an interactive chat, one reply at a time")


def _stream_one(engine, request: Request, err: Console, tools: bool = False, keep: Receipts | None = None,
                thinking: Thinking | None = None) -> str:
    """Print the reply as it comes (a thinking model's thinking dimmed first); Ctrl-C ends it cleanly. Returns the
    text printed."""
    printed: list[str] = []
    feed, flush = thinking.printer() if thinking else (None, None)

    def on_token(_: int, __: int, piece: str) -> None:
        printed.append(piece)
        if feed:
            feed(piece)
        else:
            sys.stdout.write(piece)
        sys.stdout.flush()

    t0 = time.perf_counter()
    try:
        result = engine.generate([request], on_token)[0]
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        err.print("[yellow](stopped)[/]")
        return "".join(printed)
    if flush:
        flush()
    sys.stdout.write("\n")
    if result.error:
        raise TfqError(result.error)
    if keep is not None:
        keep.write([request], [result])
    _speed(err, len(result.ids), result.first_token_s, time.perf_counter() - t0, 1, engine.threads)
    _acceptance(err, [result])
    _reuse(err, [result])
    if tools:
        _calls(err, [result])
    return result.text


def _together(engine, requests: list[Request], err: Console, tools: bool = False,
              keep: Receipts | None = None, thinking: list[Thinking | None] | None = None) -> None:
    t0 = time.perf_counter()
    with err.status(f"running {len(requests)} chats together"):
        results = engine.generate(requests)
    if keep is not None:
        keep.write(requests, results)
    failed = 0
    for i, r in enumerate(results):
        print(f"=== {r.label}", flush=True)
        if r.error:
            failed += 1
            print(f"(failed: {r.error})")
        elif thinking and thinking[i]:
            thinking[i].whole(r.text)
        else:
            print(r.text)
    wall = time.perf_counter() - t0
    _speed(err, sum(len(r.ids) for r in results), min(r.first_token_s for r in results), wall, len(results),
           engine.threads)
    _acceptance(err, results)
    _reuse(err, results)
    if tools:
        _calls(err, results)
    if failed:
        raise typer.Exit(1)


def _speed(err: Console, tokens: int, first: float, wall: float, streams: int, threads=None) -> None:
    decode = max(wall - first, 1e-9)
    busy = ""
    if threads is not None and threads.fewest < threads.most:  # tfq.engine.threads.Threads
        busy = (f" (other processes kept cores busy: down to {threads.fewest} of {threads.most} threads; "
                f"the bits are the same)")
    err.print(f"[dim]{tokens} tokens in {wall:.1f} s; first token after {first:.2f} s; "
              f"{max(tokens - streams, 0) / decode:.1f} tokens/s decoding{busy}[/]")


def _calls(err: Console, results) -> None:
    """The tool calls each reply wrote (tfq/decode/tools.py parses them as the server does), one line each."""
    for r in results:
        for call in calls.parse(r.text)[1]:
            err.print(f"tool call{f' ({r.label})' if len(results) > 1 else ''}: {call.name} {call.arguments}",
                      markup=False, highlight=False)


def _reuse(err: Console, results) -> None:
    reused = sum(r.reused for r in results)
    if reused:
        err.print(f"[dim]prefix cache: {reused} rows reused, not computed[/]")


def _acceptance(err: Console, results) -> None:
    proposed = sum(r.proposed for r in results)
    if not proposed:
        return
    accepted = sum(r.accepted for r in results)
    verifies = sum(r.verifies for r in results)
    err.print(f"[dim]drafted: {proposed} proposed, {accepted} accepted ({accepted / proposed:.0%}), "
              f"{(accepted + verifies) / verifies:.2f} tokens per verify forward[/]")


def _interactive(engine, tok, system: str | None, settings: dict, err: Console, keep: Receipts | None,
                 show: Thoughts) -> None:
    err.print("[dim]Interactive chat: type a message; /exit or Ctrl-D ends it.[/]")
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        chat = Chat("you", tuple(history))
        reply = _stream_one(engine, requests_for([chat], tok, **settings)[0], err, keep=keep, thinking=show.of(chat))
        history.append({"role": "assistant", "content": reply})
