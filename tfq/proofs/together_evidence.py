"""What `tfq together` writes as evidence beside its verdicts: each chat's record, the suite's identity, the
versions of everything that ran, and JSON written whole or not at all."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from tfq.engine.stream import Request, Result
from tfq.proofs.together_arms import ChatComparison, score_digests

_HASH_LIMIT = 256 << 20  # hash weight files up to this size; the default model is named by its GGUF's sha


def chat_record(request: Request, result: Result, comparison: ChatComparison | None) -> dict:
    record = {
        "chat": request.label, "prompt_tokens": len(request.prompt), "max_tokens": request.max_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "seed": request.seed,
        "finish": result.finish, "error": result.error, "preempted": result.preempted, "recomputed": result.recomputed,
        "proposed": result.proposed, "accepted": result.accepted,
        "first_token_s": round(result.first_token_s, 3), "seconds": round(result.total_s, 3),
        "text": result.text, "ids": result.ids, "digests": result.digests,
    }
    if request.prompt_logprobs is not None:  # each prompt token's score, as digests of its bits
        record["prompt_logprobs"] = request.prompt_logprobs
        record["prompt_scores"] = score_digests(result)
    if comparison is not None:
        record["compared"] = {k: v for k, v in dataclasses.asdict(comparison).items() if k not in ("chat", "error")}
    return record


def suite_facts(path: Path | None, chats) -> dict:
    facts: dict[str, Any] = {"chats": [c.name for c in chats]}
    if path is not None:
        facts["path"] = str(path)
        facts["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return facts


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader (or a Ctrl-C) never sees half a file


def versions(loaded) -> dict:
    import torch

    import tfq
    from tfq.proofs.facts import build_facts

    return {"tfq": tfq.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "threads": torch.get_num_threads(), "argv": sys.argv[1:],
            "kernels": loaded.model.backend.name, "device": loaded.model.backend.where,
            "build": build_facts(), "model": model_identity(Path(loaded.folder)),
            "weights": loaded.weights}


def model_identity(folder: Path) -> dict:
    """Where the weights came from and hashes that pin them, when cheap."""
    from tfq.model import default
    from tfq.model.source import converted_dir

    ident: dict[str, Any] = {"folder": str(folder)}
    config = folder / "config.json"
    if config.is_file():
        ident["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    if folder.parent == converted_dir("x").parent:  # converted from a GGUF: the folder is named by its sha256
        sha = folder.name.rsplit("-v", 1)[0]
        ident["gguf_sha256"] = sha
        ident["default_model"] = sha == default.SHA256
        return ident
    weights = sorted(folder.glob("*.safetensors"))
    size = sum(w.stat().st_size for w in weights)
    ident["weights_bytes"] = size
    if size <= _HASH_LIMIT:
        ident["weights_sha256"] = {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in weights}
    return ident
