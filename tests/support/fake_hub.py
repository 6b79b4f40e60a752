"""A local HTTP server speaking as much of the Hugging Face Hub API as `huggingface_hub` needs to list a
model repository and download its files (`HF_ENDPOINT` pointed at it): `GET /api/models/OWNER/REPO`,
`HEAD`/`GET /OWNER/REPO/resolve/REV/FILE` with ranges. Downloads (from the first byte) are counted per file,
resumed ones listed apart, and a file can be cut off half way once, as a dropped connection would, to see the
client resume it.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves the folder `root/OWNER/REPO` as model repository OWNER/REPO at `self.url`."""

    def __init__(self, root: Path):
        self.root = root
        self.downloads: Counter[str] = Counter()
        self.tokens: set[str] = set()  # the Authorization headers of listings and downloads
        self.cut_once: set[str] = set()  # files whose next download stops half way
        self.resumed: list[tuple[str, int]] = []  # (file, first byte) of each ranged download
        self._etags: dict[Path, str] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = req.path.split("?")[0].strip("/").split("/")
        if path[:2] == ["api", "models"] and len(path) >= 4:
            return self._info(req, "/".join(path[2:4]), body)
        if len(path) >= 5 and path[2] == "resolve":
            return self._file(req, "/".join(path[:2]), "/".join(path[4:]), body)
        self._send(req, 404, {"X-Error-Code": "EntryNotFound"}, b"{}", body)

    def _info(self, req, repo_id: str, body: bool) -> None:
        self.tokens.add(req.headers.get("Authorization", ""))
        folder = self.root / repo_id
        if not folder.is_dir():
            return self._send(req, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}', body)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        info = {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": False,
                "siblings": [{"rfilename": f} for f in files]}
        self._send(req, 200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)

    def _file(self, req, repo_id: str, name: str, body: bool) -> None:
        self.tokens.add(req.headers.get("Authorization", ""))
        path = self.root / repo_id / name
        if not path.is_file():
            return self._send(req, 404, {"X-Error-Code": "EntryNotFound"}, b"{}", body)
        size = path.stat().st_size
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self._etag(path)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        status, start = 200, 0
        ranged = req.headers.get("Range", "")
        if ranged.startswith("bytes="):
            start = int(ranged[6:].split("-")[0] or 0)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        if body and start:
            self.resumed.append((name, start))
        elif body:
            self.downloads[name] += 1
        cut = body and name in self.cut_once
        if cut:
            self.cut_once.discard(name)
        req.send_response(status)
        for key, value in {**headers, "Content-Length": str(size - start)}.items():
            req.send_header(key, value)
        req.end_headers()
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                left = (size - start) // 2 if cut else size - start  # cut: the length says all, half comes
                while left > 0:
                    chunk = f.read(min(left, 1 << 20))
                    req.wfile.write(chunk)
                    left -= len(chunk)
        if cut:
            req.close_connection = True

    def _etag(self, path: Path) -> str:
        """The file's sha256, as the Hub's ETag of an LFS file; computed once per file."""
        if path not in self._etags:
            with open(path, "rb") as f:
                self._etags[path] = hashlib.file_digest(f, "sha256").hexdigest()
        return self._etags[path]

    @staticmethod
    def _send(req, status: int, headers: dict, data: bytes, body: bool) -> None:
        req.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            req.send_header(key, value)
        req.end_headers()
        if body:
            req.wfile.write(data)
