"""Prometheus text exposition for /metrics: requests, tokens, TTFT and tokens/s histograms, queue, models.

Hand-rolled (a few counters and histograms) to avoid a dependency for forty lines of text.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
_THREAD_SUFFIX = re.compile(r"(\s*\(.*\))?([_-]?\d+)?(\s*\(.*\))?$")  # "asyncio_3", "Thread-7 (run)"


class Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft: dict[str, Histogram] = {}
        self.rate: dict[str, Histogram] = {}

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def observe_generation(
        self, model: str, ttft_s: float | None, prompt_tokens: int, eval_count: int, eval_s: float
    ) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += eval_count
            if ttft_s is not None:
                self.ttft.setdefault(model, Histogram(TTFT_BUCKETS)).observe(ttft_s)
            if eval_count > 0 and eval_s > 0:
                self.rate.setdefault(model, Histogram(RATE_BUCKETS)).observe(eval_count / eval_s)

    def render(self, queue_depth: Callable[[], dict[str, int]], loaded: Callable[[], list[str]]) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        with self._lock:
            family("localrt_requests_total", "counter", "HTTP requests by route and status.")
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'localrt_requests_total{{route="{route}",status="{status}"}} {n}')
            family("localrt_prompt_tokens_total", "counter", "Prompt tokens evaluated.")
            lines.append(f"localrt_prompt_tokens_total {self.prompt_tokens}")
            family("localrt_generated_tokens_total", "counter", "Tokens generated.")
            lines.append(f"localrt_generated_tokens_total {self.generated_tokens}")
            for metric, hists, help_text in (
                ("localrt_time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("localrt_decode_tokens_per_second", self.rate, "Decode speed per request."),
            ):
                family(metric, "histogram", help_text)
                for model, h in sorted(hists.items()):
                    for bound, n in zip(h.buckets, h.counts):
                        lines.append(f'{metric}_bucket{{model="{model}",le="{bound}"}} {n}')
                    lines.append(f'{metric}_bucket{{model="{model}",le="+Inf"}} {h.count}')
                    lines.append(f'{metric}_sum{{model="{model}"}} {h.total}')
                    lines.append(f'{metric}_count{{model="{model}"}} {h.count}')
        family("localrt_queue_depth", "gauge", "Requests waiting or running per model.")
        for model, depth in sorted(queue_depth().items()):
            lines.append(f'localrt_queue_depth{{model="{model}"}} {depth}')
        family("localrt_loaded_models", "gauge", "Models loaded in memory.")
        names = loaded()
        lines.append(f"localrt_loaded_models {len(names)}")
        family(
            "localrt_threads",
            "gauge",
            "The server's Python threads, by name (a pool's workers counted together).",
        )
        for name, n in sorted(
            Counter(_THREAD_SUFFIX.sub("", t.name, count=1) for t in threading.enumerate()).items()
        ):
            lines.append(f'localrt_threads{{name="{name}"}} {n}')
        return "\n".join(lines) + "\n"


class RequestCounter:
    """ASGI middleware: counts responses by route template (not raw path, to keep labels few)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope.get("route")
            self.metrics.count_request(getattr(route, "path", "other"), status)
