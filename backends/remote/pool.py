"""A pool of OpenAI-compatible endpoints: round-robin, health checks, backoff for the ones that failed.

An endpoint that fails (a request's connection error, a 5xx, garbage, or a failed health check) is taken
out and probed again after a backoff that doubles up to BACKOFF_MAX; a probe that answers brings it back.
Healthy endpoints are probed every HEALTH_INTERVAL seconds, so a dead one is usually out before a
request meets it. Probes run in one daemon thread per loaded model (plain blocking HTTP, no event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
HEALTH_INTERVAL = 10.0
TICK = 0.25  # how often the checker looks at the schedule


@dataclass
class Endpoint:
    url: str  # the OpenAI base, ending in /v1 (or the user's own path)
    healthy: bool = True
    failures: int = 0  # consecutive
    retry_at: float = 0.0  # monotonic: when a down endpoint is tried again
    checked_at: float = 0.0  # monotonic: the last probe
    last_error: str = ""

    @property
    def root(self) -> str:
        """The server root, where /health and /tokenize live."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def state(self) -> str:
        if self.healthy:
            return "ok"
        wait = max(0.0, self.retry_at - time.monotonic())
        return f"down ({self.last_error}; retry in {wait:.0f}s)"


class Pool:
    def __init__(self, urls: list[str], probe: Callable[[Endpoint], str | None]) -> None:
        """`probe(endpoint)` answers None when the endpoint is healthy, else why not (blocking)."""
        if not urls:
            raise ValueError("a pool needs at least one endpoint")
        self.endpoints = [Endpoint(u) for u in urls]
        self._probe = probe
        self._cursor = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def order(self) -> list[Endpoint]:
        """The endpoints to try for one request, in order: the healthy ones round-robin, then the down
        ones whose retry time has come; with none of those, the down one due soonest (a last try)."""
        with self._lock:
            start = self._cursor
            self._cursor = (start + 1) % len(self.endpoints)
        rotated = self.endpoints[start:] + self.endpoints[:start]
        now = time.monotonic()
        up = [e for e in rotated if e.healthy]
        due = [e for e in rotated if not e.healthy and e.retry_at <= now]
        if up or due:
            return up + due
        return [min(rotated, key=lambda e: e.retry_at)]

    def mark_ok(self, endpoint: Endpoint) -> None:
        with self._lock:
            endpoint.healthy, endpoint.failures, endpoint.last_error = True, 0, ""

    def mark_failed(self, endpoint: Endpoint, reason: str) -> None:
        with self._lock:
            endpoint.failures += 1
            endpoint.healthy = False
            endpoint.last_error = reason
            backoff = min(BACKOFF_MAX, BACKOFF_START * 2 ** (endpoint.failures - 1))
            endpoint.retry_at = time.monotonic() + backoff

    def describe(self) -> str:
        return "; ".join(f"{e.url} ({e.state()})" for e in self.endpoints)

    # ---- health checks -----------------------------------------------------------------------
    def check(self, endpoint: Endpoint) -> bool:
        endpoint.checked_at = time.monotonic()
        reason = self._probe(endpoint)
        if reason is None:
            self.mark_ok(endpoint)
            return True
        self.mark_failed(endpoint, reason)
        return False

    def check_all(self) -> bool:
        """Probe every endpoint now; True when at least one is healthy."""
        results = [self.check(e) for e in self.endpoints]
        return any(results)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="localrt-remote-health")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _due(self, endpoint: Endpoint, now: float) -> bool:
        if endpoint.healthy:
            return now - endpoint.checked_at >= HEALTH_INTERVAL
        return now >= endpoint.retry_at

    def _run(self) -> None:
        while not self._stop.wait(TICK):
            now = time.monotonic()
            for endpoint in self.endpoints:
                if self._stop.is_set():
                    return
                if self._due(endpoint, now):
                    try:
                        self.check(endpoint)
                    except Exception as e:  # e.g. the client closed by unload() mid-probe
                        if self._stop.is_set():
                            return
                        self.mark_failed(endpoint, f"health check failed: {type(e).__name__}")
