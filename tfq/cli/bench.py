"""`tfq bench`: prefill and decode speed, time to first token and memory, per lane count and arm, beside a peer;
`tfq bench serve`: the OpenAI-compatible server under the `openai` client at several concurrencies.

`bench` is a group whose callback is the engine bench itself (run when no subcommand is named), so
`tfq bench --lanes 1 ...` keeps working as it did when bench was a single command."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tfq.cli.app import app, output_file
from tfq.errors import TfqError

bench_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
def bench_command(
    ctx: typer.Context,
    plan: Optional[str] = typer.Option(None, "--plan",
                                       help="Plan YAML the arms are derived from (default plan if left out)."),
    model: Optional[str] = typer.Option(None, "--model", help="default, an HF folder or a .gguf file."),
    lanes: str = typer.Option("1,2,4,8", "--lanes", help="Lane counts (streams run together), comma-separated."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens",
                                      help="Prompt length: random token ids, exactly this many."),
    tokens: int = typer.Option(32, "--tokens", help="Reply tokens a stream (EOS ignored: every reply is this long)."),
    repeats: int = typer.Option(3, "--repeats", help="Timed rounds after the warm-up; figures are their medians."),
    peer: str = typer.Option("hf", "--peer",
                             help="hf: HF transformers generate on the same weights (pip install -e \".[peer]\"); "
                                  "llama.cpp: llama.cpp on the weights tfq computes with (the GGUF as shipped for "
                                  "weights: gguf, an F32 GGUF of its values for fp32), llama.cpp-gguf: on the GGUF as "
                                  "shipped (pip install -e \".[peer-llama]\"); ik_llama.cpp: the fork, on the same "
                                  "file as llama.cpp (built by benchmarks/build_ik_llama.sh); none."),
    arms: str = typer.Option("whole,paged,partial,drafted", "--arms",
                             help="tfq arms: whole, paged (256-row pages beyond stream 0), partial, drafted (ngram)."),
    json_file: Optional[str] = typer.Option(None, "--json", metavar="FILE",
                                            help="Also write the report as JSON ('-': stdout)."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (after TFQ_* variables)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads for both engines (default: torch's)."),
    quiet: bool = typer.Option(False, "--quiet", help="No plan lines and no progress: the table only."),
) -> None:
    """Measure tfq's speed and memory per lane count and arm, side by side with a peer on the same weights
    (runs interleaved, medians of the rounds; the peer runs in its own process, and llama.cpp apart, all its
    rounds first, when the two do not fit in memory together), with each decode step as a fraction of the
    memory-bandwidth roofline measured in the same run. Kernel correctness is a separate check: `tfq kernels`.
    `tfq bench serve`: the server under the `openai` client (see `tfq bench serve --help`)."""
    if ctx.invoked_subcommand is not None:
        _no_options_before(ctx)
        return
    from tfq.bench import (
        Bench,
        BenchSettings,
        bench_window,
        build_report,
        check_against_plan,
        check_settings,
        measure_bandwidth,
        parse_arms,
        parse_lanes,
    )
    from tfq.bench.peers.choice import start_peer
    from tfq.bench.rounds import apart_run_count, run_apart
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan

    err = Console(stderr=True)
    settings = BenchSettings(lanes=parse_lanes(lanes), prompt_tokens=prompt_tokens, tokens=tokens, repeats=repeats,
                             peer=peer.strip().lower(), arms=parse_arms(arms), seed=seed, threads=threads)
    check_settings(settings)
    output_file(json_file)
    the_plan, config, layout = resolve_plan(plan, model, sets, quiet, err)
    check_against_plan(settings, the_plan)
    if layout.device != "cpu":
        raise TfqError(f"tfq bench measures the engine on the CPU (its roofline and memory probe are the CPU's), "
                       f"and the plan runs on {layout.device}; use --set device=cpu, or "
                       f"benchmarks/gpu_kernels.py for the attention kernels on a GPU")
    if not quiet:
        window = bench_window(the_plan, settings)
        err.print(f"bench: {settings.prompt_tokens}-token prompts and {settings.tokens}-token replies, so each arm's "
                  f"cache holds {window} rows a stream (not the plan's window of {the_plan.window}); arms "
                  f"{', '.join(settings.arms)}; peer {settings.peer}",
                  highlight=False, soft_wrap=True)

    import torch

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    load_before = os.getloadavg()

    def say(line: str) -> None:
        err.print(line, highlight=False, soft_wrap=True, style="yellow")

    the_peer = start_peer(settings, the_plan, layout, say, progress=not quiet)
    if the_peer is not None and the_peer.apart:
        if not quiet:
            err.print(f"the peer runs apart, first, before tfq loads: {the_peer.order.words()}", highlight=False,
                      soft_wrap=True)
        with _progress(err, quiet, apart_run_count(settings)) as progress:
            run_apart(the_peer, settings, the_plan, config, torch.get_num_threads(), progress)
    with err.status("loading the model"):
        loaded = load_model(the_plan.model, progress=not quiet, device=layout.device,
                            weights=the_plan.weights, tp=the_plan.tp)
    if the_peer is not None:
        the_peer.load_beside(torch.get_num_threads(), not quiet, err.status)
    bench = Bench(the_plan, config, loaded, settings, peer=the_peer)
    with err.status("measuring memory bandwidth"):
        bandwidth_start = measure_bandwidth()
    t0 = time.perf_counter()
    with _progress(err, quiet, bench.run_count()) as progress:
        bench.run(progress)
    wall = time.perf_counter() - t0
    report = build_report(bench, (bandwidth_start, measure_bandwidth()), (load_before, os.getloadavg()), wall)
    out = err if json_file == "-" else Console()
    _print_table(report, Console(file=out.file, width=max(out.width, 150)))  # a narrow pipe would cut the numbers
    if json_file == "-":
        print(json.dumps(report, indent=2))
    elif json_file:
        with open(json_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


@contextmanager
def _progress(err: Console, quiet: bool, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (none when quiet), advanced each time it is told what runs next."""
    if quiet:
        yield lambda what: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("bench", total=total)
        started = [False]

        def progress(what: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=what)

        yield progress


def _num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def _print_table(report: dict, console: Console) -> None:
    s, m = report["settings"], report["machine"]
    table = Table(title=f"tfq bench: {s['prompt_tokens']}-token prompts, {s['tokens']}-token replies, "
                        f"medians of {s['repeats']} round{'s' * (s['repeats'] > 1)}")
    cols = ("lanes", "engine", "prefill\ntok/s", "TTFT\ns", "decode\ntok/s", "per\nstream", "ms/\nstep", "roof-\nline",
            "vs\npeer", "peak RSS\nMiB", "run\n+MiB", "cache\nMiB", "note")
    for c in cols:
        table.add_column(c, justify="left" if c in ("engine", "note") else "right", no_wrap=c != "note")
    for r in report["rows"]:
        name = f"{m['peer']} (peer)" if r["arm"] == "peer" else f"tfq {r['arm']}"
        vs = (r.get("vs_peer") or {}).get("decode")
        note = ""
        if r.get("drafted"):
            d = r["drafted"]
            note = f"{d['accepted']}/{d['proposed']} drafts kept"
        if r.get("same_reply_as_peer") is not None and r["arm"] == "whole":
            same = r["same_reply_as_peer"]
            note = f"= peer: {same['whole_replies']:.0%} replies, {same['tokens_before_parting']:.0%} tokens"
        table.add_row(str(r["lanes"]), name, _num(r["prefill_tokens_per_s"]), _num(r["ttft_s"], ".2f"),
                      _num(r["decode_tokens_per_s"]), _num(r["decode_tokens_per_s_per_stream"]),
                      _num(r["step_s"] and r["step_s"] * 1000), _num(r["roofline_fraction"], ".0%"),
                      "-" if vs is None else f"{vs:.2f}x", _mib(r["peak_rss_bytes"]), _mib(r["run_rss_bytes"]),
                      _mib(r["cache_bytes"]), note)
    console.print(table)
    la, lb = m["load_average_before"], m["load_average_after"]
    probes = {**m["bandwidth_start"], **m["bandwidth_end"]}
    best = max(probes, key=probes.get)
    console.print(f"memory bandwidth {m['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (the best of {len(probes)} probes, "
                  f"at the start and the end: {best}); a step at one lane reads "
                  f"{report['model']['weights_read_per_step_bytes'] / 1e9:.2f} GB of weights plus the cache; "
                  f"load average {la[0]:.2f} before, {lb[0]:.2f} after, on {m['cpus']} CPUs", highlight=False)
    console.print("roofline: the least time a decode step can take (bytes it reads / bandwidth) over the time it took; "
                  f"vs peer: tfq/peer decode tokens/s, {_pairs(report['peer'])}; run +MiB: resident memory a "
                  "run added (the peer's includes its cache); = peer: replies equal to the peer's up to their first "
                  "EOS (which the peer may not draw), and tokens before they part"
                  + ("" if m["rss_peak_is_per_run"] else "; peak RSS is the process's lifetime peak here"),
                  highlight=False, style="dim")
    if report["peer"] and report["peer"]["failure"]:
        console.print(f"peer: {report['peer']['failure']}", highlight=False, style="yellow")
    if la[0] > m["cpus"] - m["torch_threads"] + 0.5:
        console.print(f"the machine was busy (load average {la[0]:.2f} on {m['cpus']} CPUs, {m['torch_threads']} torch "
                      f"thread{'s' * (m['torch_threads'] > 1)} each engine): a thread that waits for a busy core "
                      "stalls every parallel step, so these figures are noisy; compare with --threads 1",
                      highlight=False, style="yellow")
    for r in report["rows"]:
        b = r.get("breakdown_ms")
        if b:
            experts = f" + experts {b['experts_ms']:.1f}" if b.get("experts_ms") else ""
            split = (f" ({b['rest_in_object_ms']:.1f} inside the one object's call, "
                     f"{b['rest_ms'] - b['rest_in_object_ms']:.1f} around it)") if "rest_in_object_ms" in b else ""
            console.print(f"a whole decode step at {r['lanes']} lane{'s' * (r['lanes'] > 1)}: {b['step_ms']:.1f} ms = "
                          f"linear layers {b['linear_ms']:.1f} + attention {b['attention_ms']:.1f}{experts} + the rest "
                          f"{b['rest_ms']:.1f}{split}", highlight=False)
    for sk in report["skipped"]:
        console.print(f"skipped: lanes {sk['lanes']} {sk['arm']}: {sk['why']}", highlight=False, style="dim")
    for g in report["targets"]:
        mark = "[green]met[/green]" if g["met"] else "[yellow]missed[/yellow]"
        goal = f"at most {g['goal']}" if g.get("most") else g["goal"]
        console.print(f"target: {g['target']}: {g['value']:.2f} (goal {goal}) {mark}", highlight=False)


def _pairs(peer: dict | None) -> str:
    """Whose runs each ratio pairs: side by side, or apart (and why), and whose memory the peer's row is."""
    if peer is None or peer["order"] == "interleaved":
        pairs = "each round's pair side by side"
    else:
        pairs = f"each round's pair of runs apart (the peer ran first, alone: {peer['order_why']})"
    if peer and peer["process"] == "child":
        pairs += "; the peer's peak RSS is its own process's" + (
            "" if peer["rss_peak_is_per_run"] is not False else " (its lifetime peak there)")
    return pairs


def _no_options_before(ctx: typer.Context) -> None:
    """`tfq bench --plan P serve` would hand --plan to the engine bench, which does not run: say so rather
    than drop it."""
    # by the source's name: typer may carry a click of its own, whose ParameterSource is not click's
    given = [p.opts[0] for p in ctx.command.params
             if p.name and getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
    if given:
        raise TfqError(f"{given[0]} before `{ctx.invoked_subcommand}` is an option of the engine bench (`tfq bench`); "
                       f"put it after: tfq bench {ctx.invoked_subcommand} {given[0]} ...")


@bench_app.command("serve")
def bench_serve_command(
    plan: Optional[str] = typer.Option(None, "--plan",
                                       help="Plan YAML each level's engine follows (default plan if left out)."),
    model: Optional[str] = typer.Option(None, "--model", help="default, an HF folder or a .gguf file."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (after TFQ_* variables)."),
    suite_file: Optional[str] = typer.Option(None, "--suite", help="Suite YAML whose chats are sent (default "
                                             "examples/chats.yaml)."),
    concurrency: str = typer.Option("1,4,8,16", "--concurrency", help="Requests in flight at once, a level each, "
                                    "comma-separated."),
    requests_per_level: Optional[int] = typer.Option(
        None, "--requests-per-level", metavar="N", help="Requests a level (default: 2x its concurrency, at least 4)."),
    max_tokens: int = typer.Option(32, "--max-tokens",
                                   help="max_tokens of every request (greedy; EOS may end a reply sooner)."),
    json_file: Optional[str] = typer.Option(None, "--json", metavar="FILE",
                                            help="Also write the report as JSON ('-': stdout)."),
    threads: Optional[int] = typer.Option(None, "--threads",
                                          help="Exactly N torch threads (default: follow the free cores)."),
    peer: str = typer.Option("none", "--peer",
                             help="none | llama-server: llama.cpp's own server on the same GGUF, same levels and "
                                  "client, after tfq's (built once: bash benchmarks/build_llama_server.sh)."),
    quiet: bool = typer.Option(False, "--quiet", help="No plan lines and no progress: the table only."),
) -> None:
    """The OpenAI-compatible server under the official `openai` client, at several concurrencies.

    Requests/s, output tokens/s, time to first token and time between tokens (p50, p99, as the streaming
    client reads them) at each concurrency, on the shipped suite's chats, a fresh server each level. Every
    reply must also equal its chat's reply at concurrency 1 (the `equal replies` column)."""
    import torch

    from tfq.bench.peers.llama import peer_gguf
    from tfq.bench.peers.llama_server import NAME as LLAMA_SERVER
    from tfq.bench.peers.llama_server import PeerDown, binary
    from tfq.bench.serve import (
        Listener,
        ServeSettings,
        SuiteSent,
        Target,
        build_serve_report,
        check_serve_settings,
        fitting_chats,
        level_figures,
        llama_server_level,
        parse_concurrency,
        run_levels,
        tfq_level,
        total_requests,
    )
    from tfq.engine.threads import fix_threads
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.serve.background import served_name
    from tfq.suite import default_suite, load_prompts

    err = Console(stderr=True)
    settings = ServeSettings(concurrency=parse_concurrency(concurrency), requests_per_level=requests_per_level,
                             max_tokens=max_tokens, threads=threads)
    check_serve_settings(settings)
    peer = peer.strip().lower()
    if peer not in ("none", LLAMA_SERVER):
        raise TfqError(f"--peer {peer}: bench serve's peers are none and {LLAMA_SERVER}")
    if peer != "none":
        binary()  # built, or one line on how to build it, before anything runs
    output_file(json_file)
    try:
        import openai  # noqa: F401  (the client the bench measures with; not needed to serve)
    except ImportError:
        raise TfqError("tfq bench serve drives the server with the official openai client: pip install openai "
                       "(or pip install -e \".[test]\")") from None
    suite = Path(suite_file) if suite_file else default_suite()
    fix_threads(threads)
    the_plan, config, layout = resolve_plan(plan, model, sets, quiet, err)
    load_before = os.getloadavg()
    with err.status("loading the model"):
        loaded = load_model(the_plan.model, progress=not quiet, device=layout.device,
                            weights=the_plan.weights, tp=the_plan.tp)
    chats, left_out = fitting_chats(load_prompts(suite), loaded.tokenizer, layout.window, settings.max_tokens)
    if not quiet:
        for out in left_out:
            err.print(f"bench serve: left out {out['chat']}: {out['why']}", highlight=False, style="dim",
                      soft_wrap=True)
    target = Target(the_plan, layout, loaded, served_name(the_plan.model))
    gguf = peer_gguf(the_plan.model, quantized=True, progress=not quiet) if peer != "none" else None
    torch_threads = torch.get_num_threads()  # before the engines: their thread policy may move it
    runs = [("", tfq_level(target))]
    if gguf is not None:
        runs.append((f"{LLAMA_SERVER}: ", llama_server_level(gguf, layout.window, layout.lanes, torch_threads)))
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=quiet) as bar:
        task = bar.add_task("bench serve", total=total_requests(settings, chats) * len(runs))
        listener = Listener(level=lambda what: bar.update(task, description=what), reply=lambda: bar.advance(task))
        levels, reference = run_levels(runs[0][1], chats, settings, listener)
        wall = time.perf_counter() - t0
        peer_report = None
        if gguf is not None:
            peer_report = {"name": LLAMA_SERVER, "gguf": str(gguf), "slots": layout.lanes, "failure": None,
                           "levels": []}
            try:
                peer_levels, peer_reference = run_levels(runs[1][1], chats, settings, listener, runs[1][0])
                peer_report["levels"] = [level_figures(lv, chats, peer_reference) for lv in peer_levels]
            except PeerDown as e:
                peer_report["failure"] = str(e)
    report = build_serve_report(target, config, settings, SuiteSent(str(suite), chats, left_out), levels, reference,
                                torch_threads, (load_before, os.getloadavg()), wall)
    report["peer"] = peer_report
    out = err if json_file == "-" else Console()
    _print_serve_table(report, Console(file=out.file, width=max(out.width, 120)))
    if json_file == "-":
        print(json.dumps(report, indent=2))
    elif json_file:
        with open(json_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def _print_serve_table(report: dict, console: Console) -> None:
    s, m = report["settings"], report["machine"]
    lanes = report["plan"]["layout"]["lanes"]
    table = Table(title=f"tfq bench serve: {s['served_name']}, {len(s['chats'])} chats of the suite, "
                        f"{s['max_tokens']}-token replies (greedy), {lanes} lanes")
    cols = ("concurrency", "requests", "requests/s", "output\ntok/s", "TTFT p50\nms", "TTFT p99\nms",
            "TBT p50\nms", "TBT p99\nms", "equal\nreplies")
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    peer = report.get("peer")
    if peer:
        table.add_column("engine", no_wrap=True)
    for who, levels in (("tfq", report["levels"]), *(((peer["name"], peer["levels"]),) if peer else ())):
        for lv in levels:
            ttft, tbt = lv["ttft_ms"], lv["tbt_ms"]
            equal = f"{lv['equal_replies']}/{lv['requests']}"
            table.add_row(str(lv["concurrency"]), str(lv["requests"]), _num(lv["requests_per_s"], ".2f"),
                          _num(lv["output_tokens_per_s"]), _num(ttft["p50"]), _num(ttft["p99"]), _num(tbt["p50"]),
                          _num(tbt["p99"]), equal if lv["equal_replies"] == lv["requests"] else f"[red]{equal}[/red]",
                          *((who,) if peer else ()))
    console.print(table)
    if peer and peer["failure"]:
        console.print(f"peer: {peer['failure']}; tfq's rows above are measured all the same", style="yellow",
                      highlight=False)
    la, lb = m["load_average_before"], m["load_average_after"]
    console.print(f"{m['torch_threads']} torch thread{'s' * (m['torch_threads'] > 1)} "
                  f"({'fixed' if m['threads_fixed'] else 'following the free cores'}) on {m['cpus']} CPUs; load "
                  f"average {la[0]:.2f} before, {lb[0]:.2f} after; {report['wall_s']:.1f} s in all", highlight=False)
    console.print("a fresh server each level, one untimed request first; TTFT: request sent to its first token, "
                  "TBT: between tokens, both as the streaming client read them; equal replies: replies equal to "
                  "their chat's at concurrency 1 on the same engine; requests past the lanes wait in the server's "
                  "queue" + ("; the peer: llama-server with as many slots as tfq's lanes, each the plan's window, "
                             "after tfq's levels" if peer else ""),
                  highlight=False, style="dim")
