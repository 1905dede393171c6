"""Reasoning sealed for stateless agents (localrt/api/sealing.py): the client cannot read a blob, and a
blob it altered or made up does not open; the key is private to the server's models directory."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest

from localrt.api.sealing import KEY_FILE
from localrt.api.sealing import PREFIX
from localrt.api.sealing import Sealer

THOUGHT = "The user wants the tests run first."


def altered(blob: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(blob[len(PREFIX) :]))
    raw[-1] ^= 1
    return PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode()


@pytest.fixture(params=["aes-gcm", "hmac-stream"])
def sealer(request: pytest.FixtureRequest, tmp_path: Path) -> Sealer:
    s = Sealer(tmp_path)
    if request.param == "hmac-stream":  # the construction used without the `cryptography` package
        s._aead = None
    return s


def test_a_sealed_text_opens_again(sealer: Sealer) -> None:
    assert sealer.open(sealer.seal(THOUGHT)) == THOUGHT


def test_the_blob_does_not_show_the_text(sealer: Sealer) -> None:
    blob = sealer.seal(THOUGHT)
    assert THOUGHT.encode() not in base64.urlsafe_b64decode(blob[len(PREFIX) :])


def test_an_altered_blob_does_not_open(sealer: Sealer) -> None:
    assert sealer.open(altered(sealer.seal(THOUGHT))) is None


@pytest.mark.parametrize("blob", ["", "plain text", PREFIX + "!!!", PREFIX + "AAAA", None, 42])
def test_a_made_up_blob_does_not_open(sealer: Sealer, blob: object) -> None:
    assert sealer.open(blob) is None


def test_another_servers_blob_does_not_open(sealer: Sealer, tmp_path: Path) -> None:
    other = Sealer(tmp_path / "other")
    assert sealer.open(other.seal(THOUGHT)) is None


def test_the_key_survives_a_restart_and_only_the_owner_reads_it(tmp_path: Path) -> None:
    blob = Sealer(tmp_path).seal(THOUGHT)
    assert Sealer(tmp_path).open(blob) == THOUGHT
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
