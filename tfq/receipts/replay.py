"""Replaying receipts: each reply computed again on this machine, step by step against what its receipt says.

Receipts of one model and arithmetic run together through one engine (a reply's bits do not depend on its batch,
so a thousand receipts are one batched run). A receipt whose model is not the one at hand (its weights' sha256),
whose recipe this build does not compute, or that lacks the issuer's signature when a key is given, is refused
in one line and counts as not equal.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

from tfq.errors import TfqError
from tfq.kernels.contract import RECIPE
from tfq.receipts.receipt import chain, replayed_finish, request_of, signed_by


@dataclass(frozen=True)
class Verdict:
    """One receipt's replay: equal, or where it parted (`step`, 0 the first reply token) and how."""

    where: str  # the file, and the receipt's place in it
    equal: bool
    what: str  # "equal", the first difference with both values, or why it was refused
    step: int | None = None
    tokens: int = 0  # reply tokens the receipt holds


@dataclass(frozen=True)
class Group:
    """Receipts replayed by one engine: one model and one arithmetic."""

    name: str
    sha256: str
    arithmetic: tuple[tuple[str, object], ...]
    items: tuple[tuple[int, str, dict], ...]  # (place in the list given, where, receipt)

    @property
    def settings(self) -> dict:
        return dict(self.arithmetic)


def groups(receipts: Sequence[tuple[str, dict]], model: str | None) -> list[Group]:
    by: dict[tuple, list] = {}
    for i, (where, doc) in enumerate(receipts):
        key = (model or doc["model"]["name"], doc["model"]["sha256"], tuple(sorted(doc["arithmetic"].items())))
        by.setdefault(key, []).append((i, where, doc))
    return [Group(*k, tuple(v)) for k, v in by.items()]


def compare(where: str, doc: dict, ids: list[int], digests: list[str], finish: str) -> Verdict:
    """The receipt against its replay: the first step whose token or logits digest differs, then how it ended,
    then whether the receipt's chain follows from its digests."""
    want_ids, want_digests, n = doc["reply"], doc["digests"], len(doc["reply"])
    for step in range(n):
        if step >= len(ids):
            return Verdict(where, False, f"step {step}: the replay ended ({finish}) where the receipt has token "
                                         f"{want_ids[step]}", step, n)
        if digests[step] != want_digests[step]:
            return Verdict(where, False, f"step {step}: logits digest {want_digests[step]} in the receipt, "
                                         f"{digests[step]} replayed", step, n)
        if ids[step] != want_ids[step]:
            return Verdict(where, False, f"step {step}: token {want_ids[step]} in the receipt, {ids[step]} replayed",
                           step, n)
    if finish != replayed_finish(doc):
        return Verdict(where, False, f"the reply ended by {doc['finish']} in the receipt, by {finish} replayed", n, n)
    if chain(want_digests) != doc["chain"]:
        return Verdict(where, False, "its chain does not follow from its digests (the receipt was altered)", None, n)
    return Verdict(where, True, "equal", None, n)


def refusal(group: Group, model_sha: Callable[[str], str]) -> str | None:
    """Why a group cannot be replayed here, in one line; None when it can."""
    recipe = group.settings.get("recipe")
    if recipe != RECIPE:
        return f"made by tfq's recipe {recipe}; this build computes recipe {RECIPE} (other bits by design)"
    try:
        here = model_sha(group.name)
    except TfqError as e:
        return f"{e}; give the model it was made with (--model)"
    if here != group.sha256:
        return (f"the weights differ: {group.name} is sha256 {here[:16]}..., the receipt's model is "
                f"{group.sha256[:16]}...; give the model it was made with (--model)")
    return None


def replay(receipts: Sequence[tuple[str, dict]], model: str | None = None, key: bytes | None = None,
           sets: Sequence[str] = (), on_group: Callable[[Group], None] | None = None) -> list[Verdict]:
    """Every receipt's verdict, in the order given. model: the model to replay with (default: the name each
    receipt holds); key: the issuer's, when its signatures must hold; sets: plan overrides that change no bits
    (window, lanes, threads are chosen here)."""
    from tfq.model.identity import weights_sha256

    verdicts: dict[int, Verdict] = {}
    for group in groups(receipts, model):
        items = list(group.items)
        if key is not None:
            for i, where, doc in items:
                if not signed_by(doc, key):
                    verdicts[i] = Verdict(where, False, "refused: not signed with the key given", None,
                                          len(doc["reply"]))
            items = [item for item in items if item[0] not in verdicts]
        if not items:
            continue
        try:
            why = refusal(group, weights_sha256)
            if why is None:
                if on_group is not None:
                    on_group(group)
                results = _run(group, [d for _, _, d in items], sets)
        except TfqError as e:  # the arithmetic cannot run here (a GPU's receipt on a machine without one)
            why = str(e)
        if why is not None:
            verdicts.update({i: Verdict(w, False, f"refused: {why}", None, len(d["reply"])) for i, w, d in items})
            continue
        for (i, where, doc), r in zip(items, results):
            verdicts[i] = compare(where, doc, r.ids, r.digests, str(r.finish)) if r.error is None else \
                Verdict(where, False, f"the replay failed: {r.error}", 0, len(doc["reply"]))
    return [verdicts[i] for i in range(len(receipts))]


def _run(group: Group, docs: list[dict], sets: Sequence[str]) -> list:
    """The receipts' requests through one engine of their model and arithmetic, together."""
    from tfq.engine.core import Engine
    from tfq.model.load import load_model
    from tfq.plan import Streams
    from tfq.plan.resolve import resolve_plan

    a = group.settings
    window = max(len(d["prompt"]) + len(d["reply"]) for d in docs)  # the last token is drawn, never fed
    plan, _, layout = resolve_plan(None, group.name, [
        *sets, f"weights={a['weights']}", f"kv.dtype={a['kv_dtype']}", f"attention={a['attention']}",
        f"device={a['device']}", f"window={window}"], True, None, Streams.of(len(docs), "receipt"))
    loaded = load_model(plan.model, progress=False, device=layout.device, weights=plan.weights)
    return Engine.from_plan(plan, layout, loaded).generate([request_of(d) for d in docs])

def as_json(verdicts: list[Verdict]) -> str:
    return json.dumps({"equal": all(v.equal for v in verdicts), "receipts": [v.__dict__ for v in verdicts]},
                      indent=1)
