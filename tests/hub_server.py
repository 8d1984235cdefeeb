"""A small local HTTP server that speaks the parts of the hub's file API huggingface_hub's snapshot_download uses
(a repository's revision, its file tree, each file's headers and bytes), for repositories a test writes: models by
their hub names are tested with nothing reaching the network. A gated repository answers 403 with the hub's
GatedRepo code unless the request carries its token; an unknown one answers 404 with RepoNotFound."""
from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse


class Repo:
    def __init__(self, files: dict[str, bytes], token: str | None = None):
        self.files, self.token = files, token  # token: the repository is gated behind it
        self.sha = hashlib.sha1(b"".join(n.encode() + files[n] for n in sorted(files))).hexdigest()

    @classmethod
    def of_folder(cls, folder: Path, token: str | None = None, names: dict[str, str] | None = None) -> "Repo":
        """A repository of a folder's files (names: a file's name in the repository, where it differs)."""
        return cls({(names or {}).get(f.name, f.name): f.read_bytes() for f in folder.iterdir() if f.is_file()}, token)


def _handler(repos: dict[str, Repo], hits: list[str]):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the test reads `hits`
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(data)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _refuse(self, status: int, code: str, body: bool) -> None:
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                                      "Content-Type": "application/json"}, body)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hits.append(path)
            api = path.startswith("/api/models/")
            parts = path.split("/")[3:] if api else path.split("/")[1:]
            repo_id = "/".join(parts[:2])
            repo = repos.get(repo_id)
            if repo is None:
                return self._refuse(404, "RepoNotFound", body)
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._refuse(403, "GatedRepo", body)
            if api and parts[2] == "revision":
                info = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                        "siblings": [{"rfilename": n} for n in sorted(repo.files)]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            if api and parts[2] == "tree":
                tree = [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for n, d in sorted(repo.files.items())]
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
            if not api and len(parts) >= 5 and parts[2] == "resolve":
                name = "/".join(parts[4:])
                if name not in repo.files:
                    return self._refuse(404, "EntryNotFound", body)
                data = repo.files[name]
                return self._send(200, data, {"X-Repo-Commit": repo.sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                              "Content-Type": "application/octet-stream"}, body)
            return self._refuse(404, "EntryNotFound", body)

    return Handler


@contextmanager
def hub(repos: dict[str, Repo]) -> Iterator[tuple[str, list[str]]]:
    """The server on 127.0.0.1 (a free port), in a thread: (its URL, for HF_ENDPOINT; the paths it was asked for)."""
    hits: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(repos, hits))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
