"""Fault injection for tests: named points in the store's writes where a test stops the process, and
named points in an engine where a test makes the work fail.

`LOCALRT_TEST_PAUSE=POINT[@BYTES][#N]` (tests only) makes a localrt process print
`localrt-test: paused at POINT` on stderr and stop itself (SIGSTOP) the Nth time (default the first) it
reaches POINT. The test then kills it there (SIGKILL: a crash at exactly that step) or changes the world
(fills the disk) and lets it go on (SIGCONT). `write@BYTES` is reached when one file being written into
the store (a download, an upload, a copy, a merge, a conversion's output) passes BYTES bytes. Unset, each
point costs one environment lookup.

The points, in the order a write reaches them (`POINTS`); the kill tests walk them all.

`LOCALRT_TEST_FAULT=POINT[#N]` (tests only) makes the Nth time (default the first) this process reaches
one of the engine's `FAULTS` fail there, as the real fault would: a test shows what the server does after it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

from localrt import config

POINTS = {
    "write": "a file being written into the store has passed the given byte count (`write@BYTES`)",
    "scratch.written": "a converted or quantized GGUF is complete in the store's scratch folder",
    "blob.synced": "a blob's bytes are verified and on disk, before it is renamed into blobs/",
    "blob.placed": "a blob has been renamed into place (before the next blob or the manifest)",
    "manifest.synced": "a manifest's temporary file is on disk, before it is renamed into place",
    "manifest.placed": "a manifest is in place, before the operation reports success",
    "rm.aside": "`rm` has renamed a manifest aside (the model is gone), before it collects its blobs",
    "rm.collected": "`rm` has deleted one unreferenced blob, before the others",
    "push.blob": "`push` has uploaded one blob, before the next blob or the manifest",
}

FAULTS = {
    "decode": "a llama.cpp decode of the engine's batch: it returns an error code, not the one for a full "
    "KV memory, and decodes nothing",
    "engine": "an engine thread takes requests from its inbox: an error escapes its loop, outside a step",
}

_SPEC = re.compile(r"^(?P<point>[a-z.]+)(?:@(?P<bytes>\d+))?(?:#(?P<nth>\d+))?$")
_seen: dict[str, int] = {}
_lock = threading.Lock()


def reach(point: str, before: int = 0, after: int = 0) -> None:
    """Mark that this process reached `point` (for `write`: one file went from `before` to `after`
    bytes); stops the process there when LOCALRT_TEST_PAUSE asks for it."""
    spec = config.test_pause()
    if not spec:
        return
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    m = _SPEC.match(spec)
    if m is None or m["point"] != point:
        return
    if m["bytes"] is not None and not before < int(m["bytes"]) <= after:
        return
    with _lock:
        _seen[spec] = _seen.get(spec, 0) + 1
        hit = _seen[spec] == int(m["nth"] or 1)
    if hit:
        print(f"localrt-test: paused at {spec} (pid {os.getpid()})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def injected(point: str) -> bool:
    """Whether this reach of the engine's fault point `point` must fail (LOCALRT_TEST_FAULT asks for it);
    each reach counts, so `POINT#N` fails the Nth one only."""
    spec = config.test_fault()
    if not spec:
        return False
    if point not in FAULTS:
        raise ValueError(f"unknown fault point {point!r}")
    m = _SPEC.match(spec)
    if m is None or m["point"] != point or m["bytes"] is not None:
        return False
    key = f"fault {spec}"  # counted apart from a pause of the same spelling
    with _lock:
        _seen[key] = _seen.get(key, 0) + 1
        return _seen[key] == int(m["nth"] or 1)
