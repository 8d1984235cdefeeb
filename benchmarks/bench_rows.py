"""The docs' table rows from `tfq bench --json` reports: one markdown row per report, named by its file, with the
figures docs/measurements.md quotes for a shape beside a peer (the arm `whole` at one lane and at the most lanes run).

    python benchmarks/bench_rows.py runs/*.json            # a header, then a row per report
    python benchmarks/bench_rows.py --no-header a.json b.json

Columns: tfq / peer prefill and decode tokens/s at one lane; the ratios tfq/peer (each the median of rounds run side by
side); the decode ratio at the most lanes; tfq's step at one lane as linear + attention (+ experts) + rest, with the
part of the rest inside the one object in brackets; the same step and its rest at the most lanes; the fraction of the
bandwidth roofline, tfq / peer; peak resident memory at one lane, tfq / peer; the probe's bandwidth; how far tfq's
replies follow the peer's. A figure the report lacks is `-`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HEADER = ("| run | 1 lane: tfq / peer prefill, decode tok/s | prefill ratio | decode ratio | "
          "most lanes: decode ratio | tfq's step at 1 lane: linear + attention (+ experts) + rest "
          "(ms; inside the object) | at the most lanes (rest) | roofline tfq / peer | peak RSS MiB tfq / peer | "
          "probe GB/s | tokens before parting |\n|---|---|---|---|---|---|---|---|---|---|---|")


def num(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:,.{digits}f}{suffix}"


def breakdown(b: dict | None) -> str:
    if not b:
        return "-"
    parts = [num(b.get("linear_ms")), num(b.get("attention_ms"))]
    if b.get("experts_ms"):
        parts.append(num(b["experts_ms"]))
    parts.append(num(b.get("rest_ms"), 2))
    return f"{num(b.get('step_ms'))} = {' + '.join(parts)} ({num(b.get('rest_in_object_ms'), 2)})"


def mib(r: dict) -> str:
    return num(r["peak_rss_bytes"] / 2 ** 20, 0) if r.get("peak_rss_bytes") else "-"


def pct(r: dict) -> str:
    return num(100 * r["roofline_fraction"], 0, "%") if r.get("roofline_fraction") else "-"


def row(name: str, report: dict) -> str:
    """One report's row (the arm `whole`; the peer's figures where it ran)."""
    rows = {(r["lanes"], r["arm"]): r for r in report["rows"]}
    whole = sorted(n for n, arm in rows if arm == "whole")
    one, most = rows.get((1, "whole"), {}), rows.get((whole[-1], "whole"), {}) if whole else {}
    peer = rows.get((1, "peer"), {})
    ratio = one.get("vs_peer") or {}
    most_ratio = (most.get("vs_peer") or {}).get("decode") if most is not one else None
    split = most.get("breakdown_ms") or {}  # the profiled steps', as at one lane
    step_most = f"{num(split.get('step_ms'))} ({num(split.get('rest_ms'), 2)})" if most is not one and split else "-"
    agree = (one.get("same_reply_as_peer") or {}).get("tokens_before_parting")
    cells = [
        name,
        f"{num(one.get('prefill_tokens_per_s'))} / {num(peer.get('prefill_tokens_per_s'))}, "
        f"{num(one.get('decode_tokens_per_s'))} / {num(peer.get('decode_tokens_per_s'))}",
        num(ratio.get("prefill"), 2, "x"),
        f"**{num(ratio.get('decode'), 2, 'x')}**",
        num(most_ratio, 2, "x"),
        breakdown(one.get("breakdown_ms")),
        step_most,
        f"{pct(one)} / {pct(peer)}",
        f"{mib(one)} / {mib(peer)}",
        num(report["machine"]["bandwidth_bytes_per_s"] / 1e9),
        num(None if agree is None else 100 * agree, 0, "%"),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="JSON files written by `tfq bench --json`")
    ap.add_argument("--no-header", action="store_true", help="the rows only")
    args = ap.parse_args()
    if not args.no_header:
        print(HEADER)
    for path in args.reports:
        print(row(path.stem, json.loads(path.read_text())))


if __name__ == "__main__":
    main()
