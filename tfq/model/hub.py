"""Models by their hub names: `ORG/REPO` (an HF checkpoint's files) and `ORG/REPO:QUANT` (the repository's .gguf file
of that quantization, e.g. `Qwen/Qwen3-8B-GGUF:Q4_K_M`), fetched by huggingface_hub into its usual cache
(`HF_HOME`), as every peer loads them. huggingface_hub honours HF_HUB_OFFLINE (the cache only), HF_ENDPOINT (a
mirror) and HF_TOKEN (gated and private repositories). What cannot be had is one line saying what to do.
"""
from __future__ import annotations

import re
from pathlib import Path

from tfq.errors import TfqError

NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
# an HF checkpoint's files: config, weights, tokenizer and template (not other formats' weights, not README's images)
FOLDER = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def is_hub_name(spec: str) -> bool:
    """Whether `spec` names a hub repository: ORG/REPO[:QUANT], and no such path here."""
    return spec != "default" and bool(NAME.match(spec)) and not Path(spec).expanduser().exists()


def hub_name(path: str) -> str | None:
    """The hub name a path of huggingface_hub's cache stands for (`ORG/REPO`, or `ORG/REPO:STEM` for a .gguf file,
    which finds that file again), or None for any other path."""
    parts = Path(path).parts
    at = next((i for i, p in enumerate(parts) if p.startswith("models--")), None)
    if at is None or len(parts) < at + 3 or parts[at + 1] != "snapshots":
        return None
    repo = parts[at][len("models--"):].replace("--", "/", 1)
    return f"{repo}:{Path(path).stem}" if path.endswith(".gguf") else repo


def local_model(spec: str) -> str:
    """The local path of hub model `spec`: its snapshot folder, or its .gguf file of the quantization named."""
    repo, _, quant = spec.partition(":")
    patterns = sorted({f"*{q}*.gguf" for q in (quant, quant.upper(), quant.lower())}) if quant else FOLDER
    folder = Path(_download(repo, patterns))
    if not quant:
        if not (folder / "config.json").is_file():
            raise TfqError(f"{repo} holds no config.json (a repository of GGUF files?); name a quantization, as in "
                           f"{repo}:Q4_K_M, or give a local folder")
        return str(folder)
    found = sorted(f for f in folder.rglob("*.gguf") if quant.lower() in f.name.lower())
    if not found:
        raise TfqError(f"{repo} has no .gguf file of quantization {quant}; name one its file names hold (Q4_K_M, "
                       f"Q8_0, ...)")
    if re.search(r"-\d+-of-\d+\.gguf$", found[0].name):
        raise TfqError(f"{repo}:{quant} is split into {len(found)} files ({found[0].name}, ...); tfq reads one .gguf "
                       f"file: join them with llama.cpp's gguf-split --merge, and give the file")
    if len(found) > 1:
        raise TfqError(f"{repo}:{quant} matches {len(found)} files ({', '.join(f.name for f in found)}); name one "
                       f"exactly (its quantization as the file name writes it)")
    return str(found[0])


def _download(repo: str, patterns: list[str]) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, logging
    from rich.console import Console

    disable_progress_bars()  # one status line instead of a bar a file; a failure is then one line alone
    logging.set_verbosity_error()
    try:
        with Console(stderr=True).status(f"fetching {repo} ({', '.join(patterns)}) from {constants.ENDPOINT}, or "
                                         f"finding it in {constants.HF_HUB_CACHE}"):
            return snapshot_download(repo, allow_patterns=patterns)
    except GatedRepoError:
        raise TfqError(f"{repo} is gated: accept its terms on the hub with your account, then set HF_TOKEN to one of "
                       f"your tokens") from None
    except RepositoryNotFoundError:
        raise TfqError(f"{repo}: no such model at {constants.ENDPOINT}, or it is private (then set HF_TOKEN); check "
                       f"the name") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        raise TfqError(f"{repo} is not in the cache ({constants.HF_HUB_CACHE}) and {where}; fetch it once with the "
                       f"network, or give a local folder or .gguf file") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise TfqError(f"{repo}: the hub at {constants.ENDPOINT} answered {status}; try again later, or give a local "
                       f"folder or .gguf file") from None
