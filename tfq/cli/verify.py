"""`tfq verify`: the shipped suite on this machine against the bits recorded in the repository, chat by chat."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from tfq.cli.app import app, output_file
from tfq.engine.threads import fix_threads
from tfq.errors import TfqError


@app.command()
def verify(
    model: str = typer.Option("default", "--model",
                              help="default (its record ships with tfq), an HF folder or a .gguf file."),
    against: Optional[str] = typer.Option(None, "--against", help="Record to compare with (default: the shipped one, "
                                          "for the default model)."),
    record: Optional[str] = typer.Option(None, "--record", help="Write this machine's bits as a record to FILE "
                                         "instead of comparing."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Weights kinds to run, comma-separated (a GGUF's: "
                                          "gguf-q8, gguf, fp32; a folder's: fp32). Default: gguf-q8,gguf,fp32."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Suite YAML (default examples/chats.yaml)."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (the bits must not change)."),
    threads: Optional[int] = typer.Option(None, "--threads",
                                          help="Exactly N torch threads (default: follow the free cores)."),
    json_file: Optional[str] = typer.Option(None, "--json", help="Also write the comparison as JSON ('-': stdout)."),
    quiet: bool = typer.Option(False, "--quiet", help="The table only."),
) -> None:
    """The same bits on every CPU: run the suite here and compare ids, logits digests and log-probabilities with
    the record, chat by chat. Exit 0 only when every chat is equal (1 when one parts)."""
    from tfq.model.load import load_model
    from tfq.plan import Streams
    from tfq.plan.resolve import resolve_plan
    from tfq.proofs import verify as v
    from tfq.proofs.facts import build_facts
    from tfq.suite import default_suite, load_suite

    kinds = list(v.WEIGHTS) if weights is None else [w.strip() for w in weights.split(",") if w.strip()]
    if not kinds:
        raise TfqError("--weights names no weights kind; give gguf-q8, gguf or fp32, or several (gguf-q8,fp32)")
    output_file(json_file)
    output_file(record, "--record")
    fix_threads(threads)
    suite_path = Path(suite) if suite else default_suite()
    doc = None
    if record is None:
        if against is None and model != "default":
            raise TfqError(f"tfq ships the record of the default model only; record {model}'s bits once with "
                           f"--record FILE, then compare with --against FILE")
        doc = v.read(Path(against) if against else v.REFERENCE)
        if doc.get("suite_sha256") != v.suite_sha(suite_path):
            raise TfqError(f"{suite_path} is not the suite the record was made with; give that one with --suite")
        unknown = [w for w in kinds if w not in doc["weights"]]
        if unknown:
            raise TfqError(f"the record has no {unknown[0]!r} run; it holds {', '.join(doc['weights'])}")
    err = Console(stderr=True, quiet=quiet)
    chats = load_suite(suite_path)
    runs: dict[str, list] = {}
    t0 = time.perf_counter()
    for kind in kinds:
        plan, _, layout = resolve_plan(None, model, [*sets, f"weights={kind}"], True, None,
                                       Streams.of(v.streams(chats), "request"))
        with err.status(f"loading the model ({kind})"):
            loaded = load_model(plan.model, progress=not quiet, device=layout.device, weights=plan.weights)
        reqs = v.requests(chats, loaded.tokenizer)
        with err.status(f"{kind}: running {len(reqs)} chats") as status:
            runs[kind] = v.run(plan, layout, loaded, reqs, _counter(status, kind, sum(r.max_tokens for r in reqs)))
    seconds = time.perf_counter() - t0
    facts = {**build_facts(), "seconds": round(seconds, 1)}
    out = Console()
    if not out.is_terminal:
        out = Console(width=max(out.width, 120))  # logs: a table wide enough not to fold every cell
    if record is not None:
        from tfq.proofs.together_evidence import write_json

        write_json(Path(record), v.document(model, suite_path, runs, facts))
        out.print(f"recorded {sum(len(c) for c in runs.values())} chats ({', '.join(kinds)}) in {record}; "
                  f"{seconds:.0f} s", highlight=False)
        return
    partings = {kind: v.compare_run(doc, kind, runs[kind]) for kind in kinds}
    out.print(_table(partings))
    out.print(_machine_line(facts, doc), highlight=False, soft_wrap=True)
    equal = all(p.equal for ps in partings.values() for p in ps)
    n = sum(len(ps) for ps in partings.values())
    n_equal = sum(p.equal for ps in partings.values() for p in ps)
    verdict = "[green]EQUAL[/]" if equal else "[red]PARTS[/]"
    out.print(f"{verdict}: {n_equal}/{n} chats equal the record; {seconds:.0f} s", highlight=False)
    if json_file:
        text = json.dumps({"equal": equal, "machine": facts, "recorded_on": doc.get("recorded_on"),
                           "chats": {k: [p.__dict__ for p in ps] for k, ps in partings.items()}}, indent=1)
        if json_file == "-":
            print(text)
        else:
            Path(json_file).write_text(text + "\n", encoding="utf-8")
    raise typer.Exit(0 if equal else 1)


def _counter(status, kind: str, total: int):
    """An on_token callback that shows the tokens drawn so far on the status line."""
    done = [0]

    def on_token(_index: int, _token: int, _text: str) -> None:
        done[0] += 1
        status.update(f"{kind}: {done[0]}/{total} tokens")
    return on_token


def _where(at: int | None) -> str:
    return "equal" if at is None else f"parts at {at}"


def _table(partings: dict) -> Table:
    table = Table(title="tfq verify: this machine against the recorded bits")
    for col in ("weights", "chat", "token ids", "logits", "log-probabilities", "prompt scores"):
        table.add_column(col)
    for kind, ps in partings.items():
        for p in ps:
            if p.missing:
                table.add_row(kind, p.chat, "[red]missing on one side[/]", "", "", "")
                continue
            cells = [_where(p.ids), _where(p.logits), _where(p.logprobs), _where(p.prompt_scores)]
            table.add_row(kind, p.chat, *(c if c == "equal" else f"[red]{c}[/]" for c in cells))
    return table


def _machine_line(facts: dict, doc: dict) -> str:
    theirs = doc.get("recorded_on", {})
    return (f"here: {facts['cpu']} ({facts['machine']}), kernels -march={facts['march']} ({facts['lanes']}), "
            f"torch {facts['torch']} at {facts['torch_isa']}, numpy {facts['numpy']}, {facts['threads']} threads; "
            f"recorded on: {theirs.get('cpu', '?')} ({theirs.get('machine', '?')}), -march={theirs.get('march', '?')}, "
            f"torch {theirs.get('torch', '?')} at {theirs.get('torch_isa', '?')}")
