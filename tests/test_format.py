"""localrt/format.py: sizes, times and tables as Ollama prints them (one module for the CLI and the TUI)."""

from __future__ import annotations

import io

import pytest

from localrt.client import _epoch
from localrt.format import format_bytes
from localrt.format import go_duration
from localrt.format import human_ago
from localrt.format import human_size
from localrt.format import human_until
from localrt.format import print_table

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (512_000, "512 KB"),
        (98_363_392, "98 MB"),
        (4_700_000_000, "4.7 GB"),
        (2_000_000_000, "2 GB"),
    ],
)
def test_human_size(n: int, text: str) -> None:
    assert human_size(n) == text


@pytest.mark.parametrize(
    "ago,text",
    [(0.2, "Less than a second ago"), (1, "1 second ago"), (120, "2 minutes ago"), (3 * 86400, "3 days ago")],
)
def test_human_ago(ago: float, text: str) -> None:
    assert human_ago(NOW - ago, now=NOW) == text


@pytest.mark.parametrize(
    "left,text",
    [(None, "Forever"), (-5, "Stopping..."), (0.5, "Stopping..."), (30, "30 seconds from now"),
     (299, "4 minutes from now"), (7200, "2 hours from now"), (20 * 365 * 86400, "Forever")],
)  # fmt: skip
def test_human_until(left: float | None, text: str) -> None:
    assert human_until(None if left is None else NOW + left, now=NOW) == text


def test_go_zero_time_from_the_server_reads_as_kept_forever() -> None:
    assert _epoch("0001-01-01T00:00:00Z") is None
    assert human_until(_epoch("0001-01-01T00:00:00Z")) == "Forever"
    assert _epoch("2023-11-14T22:13:20Z") == NOW


@pytest.mark.parametrize(
    "ns,text",
    [(999, "999ns"), (1_500, "1.5µs"), (56_700_000, "56.7ms"), (1_234_000_000, "1.234s"),
     (61_500_000_000, "1m1.5s"), (3_723_000_000_000, "1h2m3s")],
)  # fmt: skip
def test_go_duration(ns: int, text: str) -> None:
    assert go_duration(ns) == text


def test_format_bytes_keeps_one_decimal() -> None:
    assert format_bytes(98_362_432) == "98.4 MB"
    assert format_bytes(12) == "12 B"


def test_print_table_pads_columns_four_spaces_apart() -> None:
    out = io.StringIO()
    print_table([["NAME", "SIZE"], ["smollm2:135m", "98 MB"]], out)
    assert out.getvalue() == "NAME            SIZE\nsmollm2:135m    98 MB\n"
