"""A receipt: what decides a reply's bits and what they were, as a small JSON document anyone can replay.

It holds the model's identity (the sha256 of its weights), the arithmetic (weights kind, cache dtype, attention,
device, tfq's recipe), the prompt's token ids, every sampling setting, the reply's token ids, how it ended, each
step's logits digest and a hash chained over them. Since a reply is a function of these alone (the exactness rule),
`tfq replay` on any machine computes the same ids and digests (tfq/receipts/replay.py). An issuer with a key signs
the document with an HMAC, so a receipt it handed out can be told from one written by someone else.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tfq.decode.grammar import Constraint
from tfq.decode.penalties import Penalties
from tfq.engine.stream import Finish, Request, Result
from tfq.errors import TfqError
from tfq.kernels.contract import RECIPE

FORMAT = "tfq-receipt/2"  # /1 (2026-12-05): the same fields, each digest a sha256
SIGNATURE = "hmac-sha256"
_CHAIN_ROOT = hashlib.sha256(b"tfq receipt chain").hexdigest()


def chain(digests: list[str]) -> str:
    """A hash chained over the steps' digests in order: one value that changes when any step's does."""
    h = _CHAIN_ROOT
    for d in digests:
        h = hashlib.sha256(f"{h}:{d}".encode()).hexdigest()
    return h


def canonical(doc: dict) -> bytes:
    """The bytes a signature covers: the document without its signature, keys sorted, no spaces (JSON writes a
    float by its shortest round-trip form, so a receipt read back and written again gives the same bytes)."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sign(doc: dict, key: bytes) -> dict:
    return {**doc, "signature": f"{SIGNATURE}:{hmac.new(key, canonical(doc), hashlib.sha256).hexdigest()}"}


def signed_by(doc: dict, key: bytes) -> bool:
    """Whether the document carries a signature made with `key` over exactly its content."""
    given = doc.get("signature")
    return isinstance(given, str) and hmac.compare_digest(given, sign(doc, key)["signature"])


@dataclass(frozen=True)
class Issuer:
    """What every receipt of one engine shares: the model, the arithmetic, and the key that signs (if any).

    name: how the model was named (`default`, a path); arithmetic: {"weights", "kv_dtype", "attention", "device",
    "recipe"}. The model's identity, the sha256 of its weights (tfq/model/identity.py), is computed on the first
    receipt, not at start: a server whose clients never ask for one never hashes a large folder."""

    name: str
    arithmetic: dict
    key: bytes | None = None

    @classmethod
    def of(cls, plan, layout, loaded, key: bytes | None = None) -> "Issuer":
        """The issuer of an engine built from this plan, layout and loaded model (tfq.model.load.LoadedModel)."""
        from tfq.model.hub import hub_name

        name = hub_name(plan.model) or plan.model  # a hub model by its hub name, which finds it on another machine
        return cls(name, arithmetic(loaded.weights, plan.kv.dtype, plan.attention, layout.device), key)

    @cached_property
    def model(self) -> dict:
        from tfq.model.identity import weights_sha256

        return {"name": self.name, "sha256": weights_sha256(self.name)}

    def receipt(self, request: Request, result: Result) -> dict:
        """The receipt of one finished reply (its request as the engine ran it: a choice's own seed)."""
        doc = {"format": FORMAT, "model": self.model, "arithmetic": self.arithmetic,
               "prompt": list(request.prompt), "sampling": sampling(request),
               "reply": list(result.ids), "finish": str(result.finish), "digests": list(result.digests),
               "chain": chain(result.digests)}
        return sign(doc, self.key) if self.key else doc


def arithmetic(weights: str, kv_dtype: str, attention: str, device: str) -> dict:
    """What besides the weights decides the bits (the device by its kind: every CUDA GPU runs the same kernels)."""
    return {"weights": weights, "kv_dtype": kv_dtype, "attention": attention,
            "device": str(device).split(":")[0], "recipe": RECIPE}


def sampling(r: Request) -> dict:
    p = r.penalties
    return {"max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed,
            "stop": list(r.stop), "presence_penalty": p.presence, "frequency_penalty": p.frequency,
            "repetition_penalty": p.repetition, "logit_bias": [[t, b] for t, b in p.bias],
            "constraint": None if r.constraint is None else {"kind": r.constraint.kind, "source": r.constraint.source}}


def request_of(doc: dict) -> Request:
    """The request that makes the receipt's reply again: its settings, for as many tokens as the reply has."""
    s = doc["sampling"]
    c = s["constraint"]
    return Request(tuple(doc["prompt"]), max_tokens=max(1, min(s["max_tokens"], len(doc["reply"]))),
                   temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"], stop=tuple(s["stop"]),
                   penalties=Penalties(s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"],
                                       tuple((int(t), b) for t, b in s["logit_bias"])),
                   constraint=None if c is None else Constraint(c["kind"], c["source"]))


def replayed_finish(doc: dict) -> str:
    """How the replay of an equal reply ends: where the receipt's ended by EOS or a stop string, the same; where it
    ran out of tokens or window, at the token budget the replay is given (the reply's length)."""
    return doc["finish"] if doc["finish"] in (Finish.EOS, Finish.STOP) else str(Finish.LENGTH)


# -- reading --------------------------------------------------------------------------------------------------
_FIELDS = {"format": str, "model": dict, "arithmetic": dict, "prompt": list, "sampling": dict, "reply": list,
           "finish": str, "digests": list, "chain": str}
_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "constraint")


def check(doc, where: str) -> dict:
    """A receipt as read from JSON, its shape checked (one line naming what is wrong)."""
    if not isinstance(doc, dict):
        raise TfqError(f"{where}: not a receipt (a JSON object with format {FORMAT!r})")
    if doc.get("format") == "tfq-receipt/1":
        raise TfqError(f"{where}: a tfq-receipt/1 receipt holds sha256 digests, which this tfq no longer computes "
                       f"({FORMAT}: XXH3 digests); replay it with the tfq that issued it")
    if doc.get("format") != FORMAT:
        raise TfqError(f"{where}: format {doc.get('format')!r} is not {FORMAT!r}; this tfq replays {FORMAT} "
                       f"receipts")
    for key, kind in _FIELDS.items():
        if not isinstance(doc.get(key), kind):
            raise TfqError(f"{where}: field {key!r} is missing or not a {kind.__name__}")
    missing = [k for k in _SAMPLING if k not in doc["sampling"]]
    if missing or not {"name", "sha256"} <= doc["model"].keys():
        raise TfqError(f"{where}: " + (f"sampling lacks {missing[0]!r}" if missing else "model lacks name or sha256"))
    lacking = [k for k in ("weights", "kv_dtype", "attention", "device", "recipe") if k not in doc["arithmetic"]]
    if lacking:
        raise TfqError(f"{where}: arithmetic lacks {lacking[0]!r}")
    ids = doc["prompt"] + doc["reply"]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) or not doc["prompt"]:
        raise TfqError(f"{where}: prompt and reply are token ids (integers from 0), the prompt at least one")
    try:
        request_of(doc).validate()
    except (TfqError, TypeError, ValueError, AttributeError) as e:
        raise TfqError(f"{where}: its sampling settings are not a request's ({e})") from None
    if len(doc["digests"]) != len(doc["reply"]) or not doc["reply"]:
        raise TfqError(f"{where}: {len(doc['reply'])} reply tokens but {len(doc['digests'])} digests; a receipt "
                       f"has one digest a token, and at least one token")
    return doc


def read_receipts(path: Path) -> list[dict]:
    """The receipts in a file: one JSON object, a JSON list of them, or one per line (JSON lines)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TfqError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        docs = json.loads(text)
        docs = docs if isinstance(docs, list) else [docs]
    except ValueError:
        try:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise TfqError(f"{path}: not JSON, nor JSON lines ({e})") from None
    if not docs:
        raise TfqError(f"{path}: holds no receipt")
    return [check(d, f"{path}" + (f" [{i}]" if len(docs) > 1 else "")) for i, d in enumerate(docs)]


def read_key(path: str | None, option: str) -> bytes | None:
    """An HMAC key from a file (its bytes, surrounding whitespace dropped); None without one."""
    if path is None:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise TfqError(f"{option} {path}: cannot read it ({e.strerror or e}); give a file holding the key") from None
    if len(key) < 16:
        raise TfqError(f"{option} {path}: the key is {len(key)} bytes; use at least 16 (e.g. from `openssl rand "
                       f"-hex 32`)")
    return key
