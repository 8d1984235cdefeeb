"""A replica's self-check: before it takes traffic, a few chats of the shipped suite (greedy, and the first again
sampled), compared bit for bit with the reference: the record in the repository for the default model
(tfq/reference/default.json), else the bits the first replica of the same weights gave on this cluster (kept by a
named, detached Ray actor: the book). A replica that parts is refused with one line naming the chat, the reply
step and the node.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import ray

from tfq.errors import TfqError
from tfq.proofs import verify as v
from tfq.suite import default_suite, load_suite

CHATS = 2  # of the shipped suite; the first is run again sampled (tfq.proofs.verify.requests)


@dataclass(frozen=True)
class Verdict:
    reference: str  # what the bits were compared with
    parted: str | None  # the refusal's line; None: equal


@ray.remote(num_cpus=0)
class Book:
    """The first bits offered for a deployment: the reference of every replica after it."""

    def __init__(self):
        self.first: tuple[list, str] | None = None

    def offer(self, bits: list, where: str) -> tuple[list, str]:
        if self.first is None:
            self.first = (bits, where)
        return self.first


def where_am_i() -> str:
    return f"node {ray.get_runtime_context().get_node_id()[:12]} ({socket.gethostname()})"


def own_bits(plan, layout, loaded) -> list[v.ChatBits]:
    chats = load_suite(default_suite())[:CHATS]
    return v.run(plan, layout, loaded, v.requests(chats, loaded.tokenizer))


def book_name(plan, layout, loaded) -> str:
    """One book for every replica that must give the same bits: the same weights (by their content, so a model
    changed in place gets a new book) in the same arithmetic (tfq/receipts/receipt.py: weights, cache dtype,
    attention, device kind)."""
    import hashlib
    import json

    from tfq.model.identity import weights_sha256
    from tfq.receipts.receipt import arithmetic

    what = [weights_sha256(plan.model), arithmetic(loaded.weights, plan.kv.dtype, plan.attention, layout.device)]
    return "tfq-bits-" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def the_record(plan, layout, loaded) -> dict | None:
    """The repository's record where it holds this replica's case: the default model, the shipped suite, an
    arithmetic it recorded, with the default plan's cache and attention, on a CPU."""
    if plan.model != "default" or plan.kv.dtype != "fp32" or plan.attention != "rows" or layout.device != "cpu":
        return None
    doc = v.read(v.REFERENCE)
    return doc if loaded.weights in doc["weights"] and doc["suite_sha256"] == v.suite_sha(default_suite()) else None


def check(plan, layout, loaded) -> Verdict:
    """This replica's bits against the record (the default model, in a recorded arithmetic) or the book's."""
    where = where_am_i()
    bits = own_bits(plan, layout, loaded)
    doc = the_record(plan, layout, loaded)
    if doc is not None:
        want = v.recorded(doc, loaded.weights)
        reference = f"the record of the default model ({loaded.weights})"
    else:
        # detached: the book outlives the replica that opened it (a named actor without handles is collected)
        book = Book.options(name=book_name(plan, layout, loaded), get_if_exists=True, lifetime="detached").remote()
        first, first_where = ray.get(book.offer.remote(bits, where))
        want = {c.chat: c for c in first}
        reference = f"the first replica's bits ({first_where})"
    for got in bits:
        p = v.compare(want.get(got.chat), got, got.chat)
        if not p.equal:
            what = next(f"{k} at reply step {getattr(p, k)}" for k in ("ids", "logits", "logprobs", "prompt_scores")
                        if getattr(p, k) is not None) if not p.missing else "missing there"
            return Verdict(reference, f"the replica on {where} parted from {reference}: chat {p.chat!r}, {what}")
    return Verdict(reference, None)


def refuse(verdict: Verdict) -> None:
    if verdict.parted:
        raise TfqError(f"{verdict.parted}; it takes no traffic (its kernels or weights give other bits: run "
                       f"`tfq verify` there)")
