"""Enough of the Hugging Face Hub's file API for `huggingface_hub` (2.x) to list and download files.

    GET      /api/models/<org>/<repo>[/revision/<rev>][?blobs=true]   siblings (+ size, blobId, lfs)
    HEAD/GET /<org>/<repo>/resolve/<rev>/<filename>                   X-Repo-Commit, ETag, X-Linked-*, Range

Files added with `lfs=True` behave as LFS files on the Hub: their ETag is the sha256 of the content,
and the listing carries `lfs: {sha256, size, pointerSize}`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from urllib.parse import unquote
from urllib.parse import urlsplit

from . import Handler
from . import Server


@dataclass
class HubFile:
    data: bytes | Path
    lfs: bool = True
    listed_sha256: str | None = None  # a fault switch: the sha256 the Hub claims, when it lies

    @property
    def claimed_sha256(self) -> str:
        return self.listed_sha256 or self.sha256

    @property
    def size(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.stat().st_size

    @property
    def sha256(self) -> str:
        if isinstance(self.data, bytes):
            return hashlib.sha256(self.data).hexdigest()
        from .registry import digest_of

        return digest_of(self.data).split(":", 1)[1]

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(f"{self.size}:{self.sha256}".encode()).hexdigest()


@dataclass
class HubRepo:
    files: dict[str, HubFile] = field(default_factory=dict)
    commit: str = ""


class HubHandler(Handler):
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        app: Hub = self.app
        app.record(self)
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = f"{parts[2]}/{parts[3]}"
            repo = app.repos.get(repo_id)
            if repo is None:
                self.repo_not_found()
                return
            blobs = "blobs=true" in (urlsplit(self.path).query or "").lower()
            siblings = []
            for name, f in sorted(repo.files.items()):
                entry: dict[str, object] = {"rfilename": name}
                if blobs:
                    entry.update(size=f.size, blobId=f.git_oid)
                    if f.lfs:
                        entry["lfs"] = {"sha256": f.claimed_sha256, "size": f.size, "pointerSize": 134}
                siblings.append(entry)
            self.send_json(
                200,
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": repo.commit,
                    "private": False,
                    "tags": ["gguf"],
                    "siblings": siblings,
                },
            )
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = app.repos.get(f"{parts[0]}/{parts[1]}")
            if repo is None:
                self.repo_not_found()
                return
            f = repo.files.get("/".join(parts[4:]))
            if f is None:
                self.send_json(
                    404,
                    {"error": "Entry not found"},
                    {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit},
                )
                return
            etag = f.claimed_sha256 if f.lfs else f.git_oid
            headers = {
                "X-Repo-Commit": repo.commit,
                "ETag": f'"{etag}"',
                "Content-Type": "application/octet-stream",
            }
            if f.lfs:
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(f.size)})
            self.send_ranged(f.data, headers, delay=app.delay)
            return
        self.send_json(404, {"error": "not found"})

    def repo_not_found(self) -> None:
        # what the Hub answers for a missing (or private) repo
        self.send_json(401, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})


class Hub(Server):
    handler = HubHandler

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.repos: dict[str, HubRepo] = {}
        self.delay = 0.0
        super().__init__(host)

    def add_repo(self, repo_id: str, files: dict[str, bytes | Path], *, lfs: bool = True) -> HubRepo:
        commit = hashlib.sha1(repo_id.encode() + str(sorted(files)).encode()).hexdigest()
        repo = HubRepo({name: HubFile(data, lfs) for name, data in files.items()}, commit)
        self.repos[repo_id] = repo
        return repo
