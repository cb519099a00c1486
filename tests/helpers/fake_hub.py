"""A small Hugging Face Hub on 127.0.0.1: the file protocol huggingface_hub speaks (HF_ENDPOINT).

Serves `/{repo}/resolve/{revision}/{path}` with HEAD metadata (X-Repo-Commit, ETag, sizes) and
GET with Range support, and the two API calls `snapshot_download` makes: the model's info
(`/api/models/{repo}/revision/{revision}`) and its file tree (`/api/models/{repo}/tree/{revision}`).
It counts the bytes it sends, and can misbehave on purpose: drop the connection part-way through a
file, corrupt the bytes of a range, or refuse a gated repository (403, X-Error-Code: GatedRepo).
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


class FakeHub:
    def __init__(self):
        self.repos = {}  # repo id -> (folder, commit)
        self.sent = {}  # (repo, path) -> bytes sent in bodies
        self.requests = []  # (method, repo, path, Range header)
        self.drop_after = {}  # path -> bytes to send before dropping the connection (once)
        self.corrupt = set()  # paths whose ranged bodies are corrupted
        self.gated = set()  # repo ids refused as gated (the user has not accepted their conditions)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, folder: Path) -> None:
        self.repos[repo] = (Path(folder), hashlib.sha1(repo.encode()).hexdigest())

    def body_bytes(self, repo=None, suffix="") -> int:
        return sum(n for (r, p), n in self.sent.items() if (repo is None or r == repo) and p.endswith(suffix))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _resolve(self):
                parts = unquote(self.path.split("?")[0]).lstrip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return None
                repo, path = "/".join(parts[:2]), "/".join(parts[4:])
                if repo in hub.gated:
                    return repo, path, None, None
                if repo not in hub.repos:
                    return repo, path, None, None
                folder, commit = hub.repos[repo]
                file = folder / path
                return repo, path, (file if file.is_file() else None), commit

            def _missing(self, repo_known: bool, commit=None, repo=None):
                gated = repo in hub.gated
                self.send_response(403 if gated else 404)
                self.send_header("X-Error-Code", "GatedRepo" if gated else "EntryNotFound" if repo_known else "RepoNotFound")
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _headers(self, file: Path, commit: str, length: int):
                self.send_header("X-Repo-Commit", commit)
                etag = hashlib.sha256(file.read_bytes()).hexdigest()
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(file.stat().st_size))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(length))

            def do_HEAD(self):
                found = self._resolve()
                hub.requests.append(("HEAD", *(found or (None, self.path))[:2], None))
                if not found or found[2] is None:
                    return self._missing(bool(found and found[3]), found and found[3], found and found[0])
                repo, path, file, commit = found
                self.send_response(200)
                self._headers(file, commit, file.stat().st_size)
                self.end_headers()

            def _api(self) -> bool:
                """The model info and file tree of a repo, as JSON; False when the path is no API call."""
                parts = unquote(self.path.split("?")[0]).lstrip("/").split("/")
                if len(parts) < 6 or parts[:2] != ["api", "models"] or parts[4] not in ("revision", "tree"):
                    return False
                repo = "/".join(parts[2:4])
                hub.requests.append(("GET", repo, "/".join(parts[4:]), None))
                if repo not in hub.repos or repo in hub.gated:
                    self._missing(False, repo=repo)
                    return True
                folder, commit = hub.repos[repo]
                files = sorted(f for f in folder.rglob("*") if f.is_file())
                names = [f.relative_to(folder).as_posix() for f in files]
                if parts[4] == "revision":
                    body = {"id": repo, "sha": commit, "siblings": [{"rfilename": n} for n in names]}
                else:  # one page: no Link header to follow
                    body = [{"type": "file", "path": n, "size": f.stat().st_size,
                             "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for n, f in zip(names, files)]
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return True

            def do_GET(self):
                if self._api():
                    return
                found = self._resolve()
                rng = self.headers.get("Range")
                hub.requests.append(("GET", *(found or (None, self.path))[:2], rng))
                if not found or found[2] is None:
                    return self._missing(bool(found and found[3]), found and found[3], found and found[0])
                repo, path, file, commit = found
                data = file.read_bytes()
                if rng:
                    start, end = rng.split("=")[1].split("-")
                    start, end = int(start), min(int(end), len(data) - 1)
                    body = data[start : end + 1]
                    if path in hub.corrupt and start > 8 and len(body) > 64:  # tensor data, not the header
                        body = body[:32] + b"\xff" * (len(body) - 32)  # NaN bit patterns
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                else:
                    body = data
                    self.send_response(200)
                self._headers(file, commit, len(body))
                self.end_headers()
                limit = hub.drop_after.pop(path, None) if rng and len(body) > 64 else None
                if limit is not None:
                    self.wfile.write(body[:limit])
                    hub.sent[(repo, path)] = hub.sent.get((repo, path), 0) + limit
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)
                hub.sent[(repo, path)] = hub.sent.get((repo, path), 0) + len(body)

        return Handler
