"""A Hugging Face Hub on 127.0.0.1 for the real `huggingface_hub` client (HF_ENDPOINT pointed at
it): the routes a model download uses, answered as the Hub answers them; and `write_cache`, a
Hub cache laid out by hand as the Hub's clients lay it out.

- `GET /api/models/ORG/NAME/revision/REV`: the model info (commit, files and their sizes); an
  unknown repo is 404 and a private one 401, each with the Hub's `X-Error-Code: RepoNotFound`.
- `HEAD` / `GET /ORG/NAME/resolve/REV/PATH`: a file's metadata (`X-Repo-Commit`, `ETag`,
  `Content-Length`) and its bytes, a `Range` answered with 206 (how a cut-off download resumes).

Every request is recorded (`requests`: (method, path) pairs; `ranges`: where each GET asked to
start); `cut(path, after, times)` ends the connection of that file's next `times` GETs after
`after` bytes, as a network that drops does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> {path: content}
        self.private: set[str] = set()
        self.claimed: dict[tuple[str, str], int] = {}  # (repo, path) -> the size its listing says
        self.requests: list[tuple[str, str]] = []
        self.cuts: dict[str, list[int]] = {}  # path -> [bytes sent before the cut, GETs left to cut]
        self.ranges: list[int] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo: str, files: dict[str, Path | bytes], sizes: dict[str, int] | None = None) -> None:
        """Serve `files` (repo path -> a file's path or its bytes) as `repo`; `sizes`: sizes the
        listing claims instead of the files' own."""
        self.repos[repo] = {name: f if isinstance(f, bytes) else Path(f).read_bytes() for name, f in files.items()}
        self.claimed |= {(repo, name): size for name, size in (sizes or {}).items()}

    def cut(self, path: str, after: int, times: int) -> None:
        self.cuts[path] = [after, times]

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1(repo.encode())
        for name, content in sorted(self.repos[repo].items()):
            digest.update(name.encode() + hashlib.sha256(content).digest())
        return digest.hexdigest()

    def downloaded(self, repo: str) -> list[str]:
        """The files of `repo` whose bytes were asked for (GET)."""
        prefix = f"/{repo}/resolve/"
        return sorted({p[len(prefix):].split("/", 1)[1] for m, p in self.requests if m == "GET" and p.startswith(prefix)})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] == "revision":
                repo = "/".join(parts[2:4])
                if self._refused(repo):
                    return
                files = hub.repos[repo]
                siblings = [{"rfilename": name, "size": hub.claimed.get((repo, name), len(data))}
                            for name, data in files.items()]
                self._send(200, json.dumps({"id": repo, "sha": hub.commit(repo), "siblings": siblings}).encode(),
                           {"Content-Type": "application/json"}, body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                if self._refused(repo):
                    return
                if name not in hub.repos[repo]:
                    self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                    return
                self._file(repo, name, body)
            else:
                self._send(404, b"", {}, body)

        def _refused(self, repo: str) -> bool:
            if repo in hub.repos and repo not in hub.private:
                return False
            status = 401 if repo in hub.private else 404
            self._send(status, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, True)
            return True

        def _file(self, repo: str, name: str, body: bool) -> None:
            data = hub.repos[repo][name]
            headers = {"X-Repo-Commit": hub.commit(repo), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            start = 0
            asked = self.headers.get("Range")
            if asked and body:
                start = int(asked.removeprefix("bytes=").split("-")[0])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if body:
                hub.ranges.append(start)
            cut = None
            if body and hub.cuts.get(name, [0, 0])[1] > 0:
                cut = hub.cuts[name][0]
                hub.cuts[name][1] -= 1
            self.send_response(206 if start else 200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if body:
                self.wfile.write(data[start:] if cut is None else data[start:start + cut])
                if cut is not None:
                    self.wfile.flush()
                    self.close_connection = True

        def _send(self, status: int, content: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if body:
                self.wfile.write(content)

    return Handler


def write_cache(cache: Path, repo: str, files: dict[str, Path], commit: str = "0" * 40) -> Path:
    """`files` (repo path -> file) as `repo` in the Hub cache `cache` (what HF_HUB_CACHE names):
    `models--ORG--NAME/blobs/<sha256>`, `snapshots/<commit>/<path>` linking to its blob, and
    `refs/main` naming the commit; returns the snapshot folder."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for name, source in files.items():
        blob = storage / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(source.resolve())  # the bytes themselves: no copy of a model needed
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(*[".."] * (len(Path(name).parts) + 1), "blobs", blob.name))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot
