"""Regenerate tests/golden/smollm2-imatrix-ctx64.npz: llama.cpp's own llama-imatrix on SmolLM2-135M
(the suite's Q4_1 GGUF) over tests/golden/imatrix_calibration.txt, chunks of 64 tokens.

Run from the repository root: `python tests/golden/make_imatrix_golden.py` (builds llama.cpp's tools
once, ~20 min on 2 cores). The fast test tests/test_imatrix.py::test_imatrix_matches_llama_imatrix_golden
compares `localrt imatrix` against what this stores: every entry of layers 0, 15 and 29 in full, and for
every entry its count and the sum of its column sums.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from localrt.converters import imatrix as imx  # noqa: E402
from tests.conftest import _fetch_smollm2  # noqa: E402
from tests.fixtures_hf import llama_cpp_tools  # noqa: E402

GOLDEN = Path(__file__).parent
CTX = 64
FULL_LAYERS = ("blk.0.", "blk.15.", "blk.29.")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "imatrix.gguf"
        subprocess.run(
            [
                str(llama_cpp_tools() / "llama-imatrix"),
                "-m", str(_fetch_smollm2()),
                "-f", "imatrix_calibration.txt",
                "-o", str(out),
                "-c", str(CTX),
                "-t", "2",
            ],
            cwd=GOLDEN,
            check=True,
            capture_output=True,
        )  # fmt: skip
        im = imx.read(out)
    arrays: dict[str, np.ndarray] = {
        "names": np.array(sorted(im.entries)),
        "counts": np.array([im.entries[n].counts[0] for n in sorted(im.entries)]),
        "totals": np.array([im.entries[n].sums.astype(np.float64).sum() for n in sorted(im.entries)]),
        "meta": np.array([im.chunk_count, im.chunk_size]),
    }
    for name in sorted(im.entries):
        if name.startswith(FULL_LAYERS):
            arrays["full/" + name] = im.entries[name].sums
    np.savez_compressed(GOLDEN / "smollm2-imatrix-ctx64.npz", **arrays)


if __name__ == "__main__":
    main()
