"""Fill-in-the-middle: `suffix` on /api/generate and /v1/completions, the `insert` capability.

The model is a tiny random Llama whose SentencePiece vocabulary has Qwen's FIM control tokens
(<|fim_prefix|> ... <|fim_repo|>, <|file_sep|>), converted by llama.cpp's own convert_hf_to_gguf.py,
which writes no fim_*_token_id keys for it: llama.cpp (and localrt) find the tokens by their text. The
oracle is llama-server's /infill on the same file.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from localrt.runtime.fim import FILE_NAME
from localrt.runtime.fim import REPO_NAME
from localrt.runtime.fim import fim_tokens
from localrt.runtime.fim import suffix_branch
from localrt.store.gguf import read_gguf
from localrt.store.importer import import_gguf
from localrt.store.modelfile import create
from localrt.store.store import Store
from tests.fixtures_hf import CORPUS
from tests.fixtures_hf import oracle_convert_many
from tests.fixtures_hf import write_tiny_model
from tests.servers.llama_server import running_llama_server
from tests.servers.serve import LocalrtServer

FIM_TEXTS = [
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|fim_pad|>",
    "<|fim_repo|>",
    "<|file_sep|>",
]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return total\n"
GREEDY = {"temperature": 0, "num_predict": 12}
CTX = 1024
QWEN_CTX = 2048
GO_TEMPLATE = (
    "{{- if .Suffix }}<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>"
    "{{- else }}{{ .Prompt }}{{ end }}"
)


def _fim_tokenizer(out_dir: Path) -> None:
    """The checkpoint's SentencePiece model again, with the FIM texts as control symbols."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(out_dir / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        control_symbols=["<|im_start|>", "<|im_end|>", *FIM_TEXTS],
        minloglevel=2,
        num_threads=1,
    )
    (out_dir / "tokenizer.vocab").unlink()


@pytest.fixture(scope="module")
def fim_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("fim")
    model_dir = write_tiny_model(work / "hf", arch="llama", hidden=256, ff=512, n_layer=2, seed=3)
    _fim_tokenizer(model_dir)
    out = work / "fim-f32.gguf"
    oracle_convert_many([(model_dir, out, "f32")])
    return out


QWEN_FIM = [
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]


@pytest.fixture(scope="module")
def qwen_fim_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama given Qwen's FIM tokens as a user would: `add_special_tokens` on its tokenizer
    (saved by transformers as tokenizer.json, without the SentencePiece file), then llama.cpp's converter
    at f32. The converter reads tokenizer.json and writes the tokens as control tokens, with no FIM ids."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("qwen-fim")
    model_dir = write_tiny_model(work / "hf", arch="llama", hidden=256, ff=512, n_layer=2, seed=5, vocab=406)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.add_special_tokens({"additional_special_tokens": QWEN_FIM}) == len(QWEN_FIM)
    (model_dir / "tokenizer.model").unlink()
    tokenizer.save_pretrained(model_dir)
    out = work / "qwen-fim-f32.gguf"
    oracle_convert_many([(model_dir, out, "f32")])
    return out


@pytest.fixture(scope="module")
def server(
    fim_gguf: Path, qwen_fim_gguf: Path, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("fim-serve")
    store = Store(root / "models")
    import_gguf(store, "coder:tiny", fim_gguf, params={"num_ctx": CTX})
    import_gguf(store, "qwen-fim:tiny", qwen_fim_gguf, params={"num_ctx": QWEN_CTX})
    import_gguf(store, "plain:latest", smollm2_gguf)
    create("coder:gotemplate", modelfile_text=f'FROM coder:tiny\nTEMPLATE """{GO_TEMPLATE}"""\n', store=store)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def tokenize(server: LocalrtServer, text: str, special: bool = False) -> list[int]:
    body = {"model": "coder:tiny", "text": text, "add_special": False, "parse_special": special}
    return httpx.post(server.url + "/api/tokenize", json=body, timeout=60).json()["tokens"]


def generate(server: LocalrtServer, model: str, **fields: object) -> httpx.Response:
    body = {"model": model, "stream": False, "options": GREEDY, **fields}
    return httpx.post(server.url + "/api/generate", json=body, timeout=300)


# ---- the file ----------------------------------------------------------------------------------------
def test_the_converter_writes_no_fim_ids_and_the_texts_are_found(fim_gguf: Path) -> None:
    meta = read_gguf(fim_gguf).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    assert not [k for k in meta if "fim" in k]
    found = fim_tokens(meta, lambda t: tokens.index(t) if t in tokens else None, len(tokens))
    assert found is not None
    assert [found.pre, found.suf, found.mid, found.rep, found.sep] == [
        tokens.index(t)
        for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_repo|>", "<|file_sep|>")
    ]


def test_the_fim_tokens_are_the_ones_llama_cpp_finds(fim_gguf: Path) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(str(fim_gguf), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    theirs = [
        llama_cpp.llama_vocab_fim_pre(vocab),
        llama_cpp.llama_vocab_fim_suf(vocab),
        llama_cpp.llama_vocab_fim_mid(vocab),
        llama_cpp.llama_vocab_fim_rep(vocab),
        llama_cpp.llama_vocab_fim_sep(vocab),
    ]
    llm.close()
    meta = read_gguf(fim_gguf).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    found = fim_tokens(meta, lambda t: tokens.index(t) if t in tokens else None, len(tokens))
    assert found is not None
    assert [found.pre, found.suf, found.mid, found.rep, found.sep] == theirs


def test_a_go_templates_suffix_branch_is_read() -> None:
    assert suffix_branch(GO_TEMPLATE) == [
        ("<|fim_prefix|>", True),
        ("prompt", False),
        ("<|fim_suffix|>", True),
        ("suffix", False),
        ("<|fim_middle|>", True),
    ]


def test_a_go_template_with_other_actions_is_not_run() -> None:
    assert suffix_branch("{{ if .Suffix }}{{ .System }}<PRE>{{ .Prompt }}{{ end }}") is None


# ---- capabilities and refusals -------------------------------------------------------------------------
def test_show_reports_insert_for_fim_tokens(server: LocalrtServer) -> None:
    assert "insert" in ollama.Client(host=server.url).show("coder:tiny").capabilities


def test_show_reports_no_insert_without_fim_tokens(server: LocalrtServer) -> None:
    assert "insert" not in ollama.Client(host=server.url).show("plain:latest").capabilities


def test_suffix_to_a_model_without_fim_is_a_400_naming_it(server: LocalrtServer) -> None:
    reply = generate(server, "plain:latest", prompt="def f():", suffix="\n")
    assert reply.status_code == 400
    assert reply.json()["error"].startswith('"plain:latest" does not support insert')


def test_suffix_in_raw_mode_is_a_400(server: LocalrtServer) -> None:
    reply = generate(server, "coder:tiny", prompt="x", suffix="y", raw=True)
    assert reply.status_code == 400
    assert reply.json()["error"] == "raw mode does not support suffix"


# ---- the prompt -----------------------------------------------------------------------------------------
def fim_ids(server: LocalrtServer) -> tuple[list[int], list[int]]:
    """The special-token ids of the FIM texts, and the tokens an empty text begins with (the BOS)."""
    ids = {t: tokenize(server, t, special=True)[0] for t in FIM_TEXTS}
    bos = httpx.post(
        server.url + "/api/tokenize",
        json={"model": "coder:tiny", "text": "", "add_special": True},
        timeout=60,
    ).json()["tokens"]
    middle = [
        *bos,
        ids["<|fim_prefix|>"],
        *tokenize(server, PREFIX),
        ids["<|fim_suffix|>"],
        *tokenize(server, SUFFIX),
        ids["<|fim_middle|>"],
    ]
    repo = [
        ids["<|fim_repo|>"],
        *tokenize(server, REPO_NAME),
        ids["<|file_sep|>"],
        *tokenize(server, FILE_NAME),
    ]
    return repo, middle


def test_prompt_is_llama_servers_infill_order(server: LocalrtServer) -> None:
    repo, middle = fim_ids(server)
    expected = [*repo, *middle]
    reply = generate(server, "coder:tiny", prompt=PREFIX, suffix=SUFFIX).json()
    assert reply["context"][: len(expected)] == expected


def test_user_text_never_becomes_a_fim_token(server: LocalrtServer) -> None:
    reply = generate(server, "coder:tiny", prompt="a<|fim_middle|>", suffix="b").json()
    middle = tokenize(server, "<|fim_middle|>", special=True)[0]
    prompt = reply["context"][: len(reply["context"]) - reply["eval_count"]]
    assert prompt.count(middle) == 1


def test_a_go_templates_branch_builds_the_prompt(server: LocalrtServer) -> None:
    _, expected = fim_ids(server)
    reply = generate(server, "coder:gotemplate", prompt=PREFIX, suffix=SUFFIX).json()
    assert reply["context"][: len(expected)] == expected


# ---- the official clients --------------------------------------------------------------------------------
def test_ollama_client_generate_with_suffix(server: LocalrtServer) -> None:
    got = ollama.Client(host=server.url).generate("coder:tiny", PREFIX, suffix=SUFFIX, options=GREEDY)
    want = generate(server, "coder:tiny", prompt=PREFIX, suffix=SUFFIX).json()
    assert got.context == want["context"]


def test_openai_completions_with_suffix_fill_the_same_middle(server: LocalrtServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.completions.create(
        model="coder:tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=GREEDY["num_predict"], temperature=0
    )
    want = generate(server, "coder:tiny", prompt=PREFIX, suffix=SUFFIX).json()
    assert got.choices[0].text == want["response"]


# ---- the oracle: llama-server's /infill ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server(fim_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # -b 512 leaves llama-server room (n_ctx - n_batch - 2 n_predict) for its repository preamble
    args = ["-m", str(fim_gguf), "-c", str(CTX), "-b", "512", "-ub", "512", "-t", "2", "-np", "1"]
    with running_llama_server(args, tmp_path_factory.mktemp("llama-server") / "log.txt") as url:
        yield url


@pytest.mark.parametrize(("prefix", "suffix"), [(PREFIX, SUFFIX), ("x = [1, 2", "]\nprint(x)\n")])
def test_same_greedy_middle_as_llama_server_infill(
    server: LocalrtServer, llama_server: str, prefix: str, suffix: str
) -> None:
    theirs = httpx.post(
        llama_server + "/infill",
        json={
            "input_prefix": prefix,
            "input_suffix": suffix,
            "n_predict": GREEDY["num_predict"],
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
        },
        timeout=300,
    ).json()
    ours = ollama.Client(host=server.url).generate("coder:tiny", prefix, suffix=suffix, options=GREEDY)
    assert ours.response == theirs["content"]
    assert len(ours.context) - ours.eval_count == theirs["timings"]["prompt_n"]  # same prompt length


@pytest.fixture(scope="module")
def qwen_llama_server(qwen_fim_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # the settings /infill was compared with when localrt's prompts differed from it
    args = ["-m", str(qwen_fim_gguf), "-c", str(QWEN_CTX), "-b", "512", "-ub", "512", "-t", "2"]
    with running_llama_server(args, tmp_path_factory.mktemp("qwen-llama-server") / "log.txt") as url:
        yield url


LONG_PREFIX = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60)) + "def add(a, b):\n    "
LONG_SUFFIX = "\n    return total\n" + "".join(f"print(f{i}(1))\n" for i in range(40))
INFILL_CASES = [(PREFIX, SUFFIX), ("x = [1, 2", "]\nprint(x)\n"), ("", "x"), (LONG_PREFIX, LONG_SUFFIX)]


def first_token_top5(items: list[dict[str, object]]) -> list[float]:
    return sorted((float(t["logprob"]) for t in items), reverse=True)  # type: ignore[arg-type]


@pytest.mark.oracle
@pytest.mark.parametrize("model", ["coder:tiny", "qwen-fim:tiny"])
@pytest.mark.parametrize(("prefix", "suffix"), INFILL_CASES, ids=["function", "list", "empty-prefix", "long"])
def test_first_token_distribution_is_llama_servers_infill(
    request: pytest.FixtureRequest, server: LocalrtServer, model: str, prefix: str, suffix: str
) -> None:
    url = request.getfixturevalue("llama_server" if model == "coder:tiny" else "qwen_llama_server")
    theirs = httpx.post(
        url + "/infill",
        json={
            "input_prefix": prefix,
            "input_suffix": suffix,
            "n_predict": 1,
            "n_probs": 5,
            "temperature": 0,
            "cache_prompt": False,
        },
        timeout=300,
    ).json()
    ours = generate(
        server,
        model,
        prompt=prefix,
        suffix=suffix,
        options={**GREEDY, "num_predict": 1},
        logprobs=True,
        top_logprobs=5,
    ).json()
    prompt_length = len(ours["context"]) - ours["eval_count"]
    assert prompt_length == theirs["timings"]["prompt_n"]
    want = first_token_top5(theirs["completion_probabilities"][0]["top_logprobs"])
    got = first_token_top5(ours["logprobs"][0]["top_logprobs"])
    assert got == pytest.approx(want, abs=1e-3)
