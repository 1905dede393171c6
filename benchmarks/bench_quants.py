"""Encoder speed (MB/s of float32 input) against llama.cpp's C reference, and end-to-end conversion time.

    python benchmarks/bench_quants.py                      # encoders: numpy (1 thread, all threads) vs C
    python benchmarks/bench_quants.py --types Q4_K Q6_K --mb 64
    python benchmarks/bench_quants.py --model HF_DIR       # also: localrt convert vs llama.cpp (Q4_K_M)
    python benchmarks/bench_quants.py --quality HF_DIR --text FILE   # README table: every file type
    python benchmarks/bench_quants.py --imatrix-speed GGUF --calib FILE [--chunks N]
        # localrt imatrix vs llama-imatrix: wall time, same model, text, context and threads
    python benchmarks/bench_quants.py --imatrix-table HF_DIR --calib FILE --text FILE
        # README table: Q4_0 / Q4_K_M / IQ4_XS with and without an imatrix, via `localrt eval --compare`

The C side is `ggml_quantize_chunk` from the installed llama-cpp-python (the function llama-quantize
calls per chunk, no importance matrix), one thread; llama-quantize spreads chunks over all cores, so
the fair multi-core comparison is "numpy, all threads" against "C x cores". The end-to-end run times
llama.cpp's convert_hf_to_gguf.py (fetched into the test cache) plus llama_model_quantize with all
cores, against `localrt.converters.convert.convert`, on the same model and machine.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from localrt.converters import quants  # noqa: E402

QT = GGMLQuantizationType
DEFAULT_TYPES = [t.name for t in quants.ENCODERS]


def c_quantizer():  # -> callable(x, qtype)
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]

    def run(x: np.ndarray, qtype: QT) -> np.ndarray:
        rows, n = x.shape
        block, size = GGML_QUANT_SIZES[qtype]
        out = np.empty((rows, n // block * size), np.uint8)
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
        return out

    return run


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_encoders(types: list[str], mb: float, repeats: int) -> None:
    rows = max(1, int(mb * 1e6 / 4 / 4096))
    x = (np.random.default_rng(0).standard_normal((rows, 4096)) * 0.02).astype(np.float32)
    size = x.nbytes / 1e6
    cores = os.cpu_count() or 1
    c = c_quantizer()
    print(f"input: {size:.0f} MB float32 ({x.size / 1e6:.1f}M weights), {cores} cores")
    print(
        f"{'type':6} {'C 1 thread':>11} {'numpy 1 thr':>12} {'numpy all':>10} {'ratio 1thr':>11}  identical"
    )
    for name in types:
        qtype = QT[name]
        tc = best_of(lambda q=qtype: c(x, q), repeats)
        t1 = best_of(lambda q=qtype: quants.quantize(x, q, threads=1), repeats)
        ta = best_of(lambda q=qtype: quants.quantize(x, q, threads=0), repeats)
        same = np.array_equal(c(x, qtype), quants.quantize(x, qtype))
        print(
            f"{name:6} {size / tc:8.1f} MB/s {size / t1:8.1f} MB/s {size / ta:6.1f} MB/s {t1 / tc:9.1f}x  {same}"
        )


def bench_convert(model: Path, quant: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_hf import auto_outtype
    from fixtures_hf import llama_cpp_src
    from fixtures_hf import oracle_quantize

    from localrt.converters.convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        auto = work / "auto.gguf"
        subprocess.run(
            [
                sys.executable,
                str(llama_cpp_src() / "convert_hf_to_gguf.py"),
                str(model),
                "--outfile",
                str(auto),
                "--outtype",
                auto_outtype(model),
            ],
            check=True,
            capture_output=True,
        )
        t_conv = time.perf_counter() - t
        t = time.perf_counter()
        oracle_quantize(auto, work / "llama.gguf", quant)
        t_quant = time.perf_counter() - t
        t = time.perf_counter()
        convert(model, work / "ours.gguf", quant)
        t_ours = time.perf_counter() - t
        same = (work / "ours.gguf").read_bytes() == (work / "llama.gguf").read_bytes()
    total = t_conv + t_quant
    print(
        f"{quant} of {model.name}: llama.cpp convert {t_conv:.1f} s + quantize {t_quant:.1f} s = {total:.1f} s; "
        f"localrt convert {t_ours:.1f} s ({t_ours / total:.2f}x); files identical: {same}"
    )


def quality_table(model: Path, text: Path, ctx: int, types: list[str]) -> None:
    """Markdown table: size, perplexity, KL vs the 16-bit conversion and top-1 agreement per file type."""
    import asyncio

    from localrt.converters import mixes
    from localrt.converters.convert import convert
    from localrt.eval import evaluate
    from localrt.eval import load

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_hf import auto_outtype

    with tempfile.TemporaryDirectory() as tmp:
        ref_type = auto_outtype(model).upper()
        ref_path = convert(model, Path(tmp) / f"{ref_type}.gguf", ref_type).path
        ref = load(str(ref_path), "llama.cpp", ctx)
        tokens = ref.tokenize(text.read_text(encoding="utf-8"), add_special=False)
        print(f"{model.name}, {len(tokens)} tokens of {text.name}, ctx {ctx}, reference {ref_type}\n")
        print("| file type | size (MB) | perplexity | KL vs " + ref_type + " | top-1 agreement |")
        print("|---|---:|---:|---:|---:|")
        for ft in types or list(mixes.FILE_TYPES):
            path = ref_path if ft == ref_type else convert(model, Path(tmp) / f"{ft}.gguf", ft).path
            m = load(str(path), "llama.cpp", ctx)
            r = asyncio.run(evaluate(m, tokens, ctx, ref))
            m.unload()
            print(
                f"| {ft} | {path.stat().st_size / 1e6:.1f} | {r.perplexity:.3f} | {r.kl:.5f} | "
                f"{100 * (r.top1 or 0):.2f}% |",
                flush=True,
            )
            if path != ref_path:
                path.unlink()
        ref.unload()


def bench_imatrix(model: Path, calib: Path, ctx: int, chunks: int, threads: int) -> None:
    """Wall time of `localrt imatrix` and `llama-imatrix` (built by tests/fixtures_hf.py) on the same input;
    both files are compared entry by entry."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_hf import llama_cpp_tools

    from localrt.converters import imatrix as imx

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "ours.gguf", Path(tmp) / "theirs.gguf"
        common = ["--ctx", str(ctx), "--chunks", str(chunks), "--threads", str(threads)]
        t = time.perf_counter()
        subprocess.run(
            [str(llama_cpp_tools() / "llama-imatrix"), "-m", str(model), "-f", str(calib), "-o", str(theirs),
             "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads)],
            check=True, capture_output=True,
        )  # fmt: skip
        t_theirs = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "localrt", "imatrix", str(model), "--text", str(calib), "-o", str(ours), *common],
            check=True, capture_output=True,
        )  # fmt: skip
        t_ours = time.perf_counter() - t
        a, b = imx.read(ours), imx.read(theirs)
        worst = max(
            float((np.abs(a.entries[n].sums - e.sums) / np.maximum(np.abs(e.sums), 1e-30)).max())
            for n, e in b.entries.items()
        )
        same = ours.read_bytes() == theirs.read_bytes()
    print(
        f"imatrix of {model.name}, {chunks} chunks of {ctx}, {threads} threads: llama-imatrix {t_theirs:.1f} s, "
        f"localrt imatrix {t_ours:.1f} s ({t_ours / t_theirs:.2f}x); worst relative difference {worst:.2g}; "
        f"files identical: {same}"
    )


IMATRIX_TYPES = ("Q4_0", "Q4_K_M", "IQ4_XS")


def imatrix_table(model: Path, calib: Path, text: Path, ctx: int, out_dir: Path | None) -> None:
    """The README table: a BF16 conversion, its imatrix on `calib`, plain and weighted quantizations of it,
    all scored by `localrt eval --compare` on `text` (disjoint from `calib`) against the BF16 file."""
    from localrt.converters import imatrix as imx
    from localrt.converters.convert import convert
    from localrt.converters.requantize import requantize
    from localrt.runtime.calibration import compute

    work = out_dir or Path(tempfile.mkdtemp(prefix="imatrix-table-"))
    work.mkdir(parents=True, exist_ok=True)
    ref = work / "BF16.gguf"
    if not ref.is_file():
        convert(model, ref, "BF16")
    im_path = work / "imatrix.gguf"
    if not im_path.is_file():
        t = time.perf_counter()
        res = compute(ref, calib.read_text(encoding="utf-8"), calib.name, ctx=ctx)
        imx.write(res.imatrix, im_path)
        print(
            f"imatrix: {res.chunks} chunks of {ctx} in {time.perf_counter() - t:.0f} s, calibration PPL {res.perplexity:.3f}"
        )
    im = imx.read(im_path)
    names = []
    for ft in IMATRIX_TYPES:
        for weighted in (False, True):
            dst = work / f"{ft}{'-imatrix' if weighted else ''}.gguf"
            if not dst.is_file():
                requantize(ref, dst, ft, imatrix=im if weighted else None, imatrix_label="imatrix.gguf")
            names.append(str(dst))
    subprocess.run(
        [sys.executable, "-m", "localrt", "eval", names[0], "--reference", str(ref), "--text", str(text),
         "--ctx", str(ctx), "--backend", "llama.cpp", "--compare", *names[1:], "--plot", str(work / "kl.png")],
        check=True,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=DEFAULT_TYPES)
    ap.add_argument("--mb", type=float, default=32.0, help="float32 input size per type")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", type=Path, help="an HF model directory for the end-to-end comparison")
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--quality", type=Path, help="an HF model directory: print the README quality table")
    ap.add_argument("--text", type=Path, help="English text for --quality")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--imatrix-speed", type=Path, help="a GGUF: time localrt imatrix against llama-imatrix")
    ap.add_argument("--imatrix-table", type=Path, help="an HF model directory: the imatrix quality table")
    ap.add_argument("--calib", type=Path, help="calibration text for --imatrix-speed / --imatrix-table")
    ap.add_argument("--chunks", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", type=Path, default=None, help="keep --imatrix-table's files here")
    args = ap.parse_args()
    if args.imatrix_speed:
        bench_imatrix(args.imatrix_speed, args.calib, args.ctx, args.chunks, args.threads)
        return
    if args.imatrix_table:
        imatrix_table(args.imatrix_table, args.calib, args.text, args.ctx, args.work)
        return
    if args.quality:
        quality_table(args.quality, args.text, args.ctx, args.types if args.types != DEFAULT_TYPES else [])
        return
    bench_encoders(args.types, args.mb, args.repeats)
    if args.model:
        bench_convert(args.model, args.quant)


if __name__ == "__main__":
    main()
