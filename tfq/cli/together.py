"""`tfq together`: run a suite alone and together under every arm; show, chat by chat, that nothing changed."""
from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tfq.cli.app import app, output_file
from tfq.engine.threads import fix_threads
from tfq.errors import TfqError
from tfq.proofs.together import (
    EXACT,
    RED,
    ArmRun,
    Check,
    CheckSuite,
    Listener,
    arm_names,
    arms_for,
    check_options,
    select_arms,
)

# About eleven minutes for the whole default check (14 chats) on 2 CPU cores; `--tokens 300`, the field report's
# length, took 1134 s (every arm EXACT 12/12 on the 12 chats of then, controls RED) on a quiet machine.
DEFAULT_TOKENS = 128
DEFAULT_GROUP = 4
SHOWN_PARTINGS = 3


@app.command()
def together(
    suite: Optional[str] = typer.Option(None, "--suite",
                                        help="Suite YAML, a list of chats (default examples/chats.yaml)."),
    plan: Optional[str] = typer.Option(None, "--plan",
                                       help="Plan YAML the arms derive from (default plan if left out)."),
    model: Optional[str] = typer.Option(None, "--model", help="default, an HF folder or a .gguf file."),
    group: int = typer.Option(DEFAULT_GROUP, "--group", help="K: streams together in the together arms."),
    tokens: int = typer.Option(DEFAULT_TOKENS, "--tokens",
                               help="Reply tokens a chat (its own smaller max_tokens wins); 300 for the full check."),
    arms: Optional[str] = typer.Option(None, "--arms",
                                       help=f"Comma-separated arms (default all): {','.join(arm_names())}"),
    evidence: Optional[str] = typer.Option(None, "--evidence",
                                           help="Evidence folder (default evidence/together-TIME)."),
    json_file: Optional[str] = typer.Option(None, "--json", help="Also write the summary JSON here ('-': stdout)."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (after TFQ_* variables)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Exactly N torch threads, even past the cores "
                                          "(default: follow the free cores); prove the rule at your count."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress and no plan lines: the table only."),
) -> None:
    """The exactness check: every arm must equal the chats alone, token ids and logits bits; controls must differ."""
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.suite import default_suite, load_suite, requests_for

    err = Console(stderr=True)
    if tokens < 1:
        raise TfqError(f"--tokens must be at least 1, got {tokens}")
    chosen = select_arms(arms)
    output_file(json_file)
    fix_threads(threads)
    suite_path = Path(suite) if suite else default_suite()
    chats = load_suite(suite_path)
    the_plan, config, layout = resolve_plan(plan, model, sets, True, None)
    check_options(the_plan, group, tokens)
    chosen, left_out = arms_for(chosen, config, named=bool(arms and arms.strip()), tp=the_plan.tp)
    if left_out and not quiet:
        err.print(left_out, highlight=False)
    folder = Path(evidence) if evidence else Path("evidence") / f"together-{time.strftime('%Y%m%d-%H%M%S')}"
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise TfqError(f"evidence folder {folder} is not empty; give a new one with --evidence DIR")
    t0 = time.perf_counter()
    try:
        with err.status("loading the model"):
            # the reference's model, in one process; arms with tp > 1 load theirs split (tfq.proofs.together)
            loaded = load_model(the_plan.model, progress=not quiet, device=layout.device, weights=the_plan.weights)
    except KeyboardInterrupt:
        err.print("[yellow](stopped before the check began)[/]")
        raise typer.Exit(130)
    requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, tokens))
                for r in requests_for(chats, loaded.tokenizer, tokens, 0.0, 1.0, 0)]
    check = Check(the_plan, config, loaded, CheckSuite(chats, requests, suite_path, tokens), chosen, group, folder,
                  named=bool(arms and arms.strip()))
    previous = signal.signal(signal.SIGTERM, _terminate)  # a kill leaves evidence too, marked incomplete
    try:
        if quiet:
            check.run()
        elif err.is_terminal:
            with _Progress(err, requests, loaded.tokenizer.eos_ids, len(check.runs)) as listener:
                check.listener = listener
                check.run()
        else:
            check.listener = _Lines(err, requests, loaded.tokenizer.eos_ids)
            check.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    total = time.perf_counter() - t0
    out = Console()
    if not out.is_terminal:
        out = Console(width=max(out.width, 140))  # logs: a table wide enough not to fold every cell
    out.print(_table(check))
    for run in check.arms:
        if run.note:
            out.print(f"[bold]{run.arm.name}[/]: {run.note}", highlight=False)
    for line in check.left_out:  # arms on their own page rows that could not be planned
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    if not quiet:
        _print_plans(out, check)
    out.print(_build_line(check.versions["build"]), highlight=False, soft_wrap=True)
    state = "complete" if check.complete else f"[yellow]interrupted in {check.interrupted_in}[/]"
    out.print(f"{state}; {total:.0f} s in all ({check.seconds:.0f} s running the suite); evidence in {folder}",
              highlight=False)
    if json_file:
        text = json.dumps(check.summary(), indent=1, ensure_ascii=False)
        if json_file == "-":
            print(text)
        else:
            Path(json_file).write_text(text + "\n", encoding="utf-8")
    raise typer.Exit(check.exit_code)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def _table(check: Check) -> Table:
    n = len(check.requests)
    table = Table(title=f"tfq together: {n} chats, {check.tokens} tokens, K = {check.group}")
    for name in ("arm", "mode", "equal ids", "equal logits", "prompt scores equal", "where replies part", "verdict",
                 "time"):
        table.add_column(name, justify="right" if name == "time" else "left")
    ref = check.reference
    ref_state = "reference" if ref.complete else "[yellow]incomplete[/]"
    table.add_row("reference", "alone", "", "", "", "", ref_state, f"{ref.seconds:.0f} s")
    for run in check.arms:
        if not run.complete:
            table.add_row(run.arm.name, run.arm.mode(check.group), "", "", "", "", "[yellow]not run[/]", "")
            continue
        color = {EXACT: "green", RED: "red"}.get(run.verdict, "bold magenta")
        equal, compared = run.scores
        parts = run.partings
        where = "; ".join(parts[:SHOWN_PARTINGS])
        if len(parts) > SHOWN_PARTINGS:
            where += f"; +{len(parts) - SHOWN_PARTINGS} more"
        mode = run.arm.mode(check.group) + (f", {run.preemptions} preempted" if run.preemptions else "")
        mode += f", {run.reused} rows reused" if run.arm.warm else ""  # the prefix cache's hits
        table.add_row(run.arm.name + (" (control)" if run.arm.control else ""), mode, f"{run.equal_ids}/{n}",
                      f"{run.equal_logits}/{n}", f"{equal}/{compared}" if compared else "", where or "-",
                      f"[{color}]{run.verdict}[/]", f"{run.seconds:.0f} s")
    return table


def _build_line(b: dict) -> str:
    """The thread count and the build the verdicts hold for."""
    return (f"threads: {b['threads']} ({b['thread_policy']}); {b['cpu']}, torch {b['torch']} ({b['torch_isa']}), "
            f"{b['onednn']}")


def _print_plans(out: Console, check: Check) -> None:
    """The reference's plan lines in full, then for each arm only the lines that differ from them."""
    ref_lines = check.plan_lines(check.reference)
    out.print("[bold]plan, reference[/]:", highlight=False)
    for line in ref_lines:
        out.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    for run in check.arms:
        own = [line for line in check.plan_lines(run) if line not in ref_lines]
        out.print(f"[bold]plan, {run.arm.name}[/] ({run.arm.about}):", highlight=False)
        for line in own or ["(same as the reference)"]:
            out.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)


class _Progress(Listener):
    """One bar for the arms, one for the tokens of the arm running now, naming the chat(s) it is on."""

    def __init__(self, console: Console, requests, eos_ids, arms: int):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.labels = [r.label for r in requests]
        self.max_tokens = [r.max_tokens for r in requests]
        self.chats, self.tokens, self.eos = len(requests), sum(self.max_tokens), frozenset(eos_ids)
        self.overall = self.progress.add_task("arms", total=arms)
        self.task = None
        self.counts: list[int] = []
        self.done = 0
        self.run: ArmRun | None = None
        self.group = 1

    def __enter__(self) -> "_Progress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def arm_started(self, run: ArmRun, group: int) -> None:
        self.run, self.group, self.counts, self.done, self.pass_name = run, group, [0] * self.chats, 0, ""
        self.task = self.progress.add_task(self._describe(), total=self.tokens)

    def chat_started(self, run: ArmRun, index: int) -> None:
        self.progress.update(self.task, description=self._describe(index))

    def pass_started(self, run: ArmRun, name: str) -> None:
        self.counts, self.done, self.pass_name = [0] * self.chats, 0, name
        self.progress.reset(self.task, description=self._describe())

    def token(self, run: ArmRun, index: int, token_id: int) -> None:
        self.counts[index] += 1
        if token_id in self.eos or self.counts[index] >= self.max_tokens[index]:
            self.done += 1
            if run.arm.together:
                self.progress.update(self.task, description=self._describe())
        self.progress.advance(self.task)

    def arm_finished(self, run: ArmRun) -> None:
        verdict = run.verdict or "done"
        self.progress.update(self.task, description=f"{run.arm.name}: {verdict} ({run.seconds:.0f} s)",
                             completed=self.tokens)
        self.progress.advance(self.overall)

    def _describe(self, index: int | None = None) -> str:
        run = self.run
        name = f"{run.arm.name} ({run.arm.mode(self.group)}{', ' + self.pass_name if self.pass_name else ''})"
        if index is not None:
            return f"{name}: chat {index + 1}/{self.chats} {self.labels[index]}"
        return f"{name}: {self.done}/{self.chats} chats done"


class _Lines(Listener):
    """Progress for logs (no terminal): a line per chat as it ends, and per arm."""

    def __init__(self, console: Console, requests, eos_ids):
        self.console, self.labels = console, [r.label for r in requests]
        self.max_tokens, self.eos = [r.max_tokens for r in requests], frozenset(eos_ids)
        self.t0, self.counts, self.done = time.perf_counter(), [0] * len(requests), 0

    def arm_started(self, run: ArmRun, group: int) -> None:
        self.console.print(f"{run.arm.name} ({run.arm.mode(group)}): running", highlight=False)
        self.t0, self.counts, self.done = time.perf_counter(), [0] * len(self.labels), 0

    def pass_started(self, run: ArmRun, name: str) -> None:
        self.console.print(f"  {run.arm.name}: {name} pass", highlight=False)
        self.counts, self.done = [0] * len(self.labels), 0

    def token(self, run: ArmRun, index: int, token_id: int) -> None:
        self.counts[index] += 1
        if token_id in self.eos or self.counts[index] >= self.max_tokens[index]:
            self.done += 1
            self.console.print(f"  {run.arm.name}: {self.labels[index]} done, {self.done}/{len(self.labels)} "
                               f"({time.perf_counter() - self.t0:.0f} s)", highlight=False)

    def arm_finished(self, run: ArmRun) -> None:
        self.console.print(f"{run.arm.name}: {run.verdict or 'done'} in {run.seconds:.0f} s", highlight=False)
