"""benchmarks/soak.py as a test: a real `localrt serve` under mixed load loses nothing and leaks nothing.

The default run soaks for 2 minutes (4 clients, a tiny random-weight model, so the server's own work is what
runs); `-m slow` for 10. The figures come from the script's `--json` file, each check asserted on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "minutes",
    [2, pytest.param(10, marks=[pytest.mark.slow, pytest.mark.timeout(1500)])],
)
def test_a_soak_serves_every_request_and_leaks_nothing(tmp_path: Path, minutes: int) -> None:
    figures = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--minutes", str(minutes), "--clients", "4", "--warmup", "20"]
        + ["--tiny", "--json", str(figures)],
        cwd=ROOT,
        # the server under the product's default (one KV pool, prompts in num_batch rows), not the tests'
        env={k: v for k, v in os.environ.items() if k != "LOCALRT_BATCH_INVARIANT"},
        capture_output=True,
        text=True,
        timeout=minutes * 60 + 420,
    )
    assert figures.exists(), done.stdout + done.stderr
    report = json.loads(figures.read_text())
    statuses = Counter(o["status"] for o in report["outcomes"])
    # the load was the mix it says: answers, refusals of bad bodies, dropped and cancelled requests
    assert statuses["200"] > 100 * minutes
    assert statuses["400"] > 0
    assert statuses["413"] > 0
    assert statuses["client-closed"] > 0
    checks = report["checks"]
    assert checks["no 5xx but 503"], done.stdout
    assert checks["no stream ended in an error"], done.stdout
    assert checks["no transport error"], done.stdout
    assert checks["every bad request got its 4xx"], done.stdout
    assert checks["RSS grew less than 10%"], done.stdout
    assert checks["file descriptors back to idle"], done.stdout
    assert checks["threads back to idle (the loop's pool within its cap)"], done.stdout
    assert checks["no active request at the end"], done.stdout
    assert checks["the server logged no traceback"], done.stdout
    assert done.returncode == 0, done.stdout
