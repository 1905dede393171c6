"""Options: Ollama's names and defaults once for every backend, strict validation, precedence."""

from __future__ import annotations

import pytest

from localrt.errors import OptionError
from localrt.runtime.options import OPEN_ENDED_CONTEXTS
from localrt.runtime.options import OPTION_NAMES
from localrt.runtime.options import Options
from localrt.runtime.options import parse_option_value


def test_ollama_defaults() -> None:
    o = Options.merge()
    assert (o.temperature, o.top_k, o.top_p, o.min_p, o.typical_p) == (0.8, 40, 0.9, 0.0, 1.0)
    assert (o.repeat_penalty, o.repeat_last_n, o.presence_penalty, o.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert (o.seed, o.stop, o.num_predict, o.num_keep, o.num_batch, o.num_gpu) == (-1, [], -1, 4, 512, -1)
    assert o.num_ctx == 4096
    assert (o.backend, o.kv_cache_type, o.speculative, o.draft_model, o.num_draft) == (
        "auto",
        "f16",
        "auto",
        None,
        None,
    )


def test_every_spec_option_is_known() -> None:
    spec = (
        "temperature top_k top_p min_p typical_p repeat_penalty repeat_last_n presence_penalty "
        "frequency_penalty seed stop num_predict num_ctx num_keep num_thread num_gpu num_batch "
        "backend kv_cache_type speculative draft_model num_draft"
    ).split()
    assert set(spec) <= OPTION_NAMES


def test_precedence_request_over_model_over_defaults() -> None:
    model_params = {"temperature": 0.2, "top_k": 10, "stop": ["<|im_end|>"]}
    o = Options.merge(model_params, {"temperature": 0.7})
    assert o.temperature == 0.7  # request wins
    assert o.top_k == 10  # model parameter beats the default
    assert o.stop == ["<|im_end|>"]
    assert o.top_p == 0.9  # default


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRT_BACKEND", "llamacpp")
    monkeypatch.setenv("LOCALRT_KV_CACHE_TYPE", "int8")
    o = Options.merge()
    assert (o.backend, o.kv_cache_type) == ("llama.cpp", "q8_0")
    assert Options.merge({"backend": "torch"}).backend == "torch"  # a model/request value still wins
    monkeypatch.setenv("LOCALRT_BACKEND", "tensorflow")
    with pytest.raises(OptionError, match="LOCALRT_BACKEND"):
        Options.merge()


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("temprature", 0.5, "unknown option 'temprature'"),
        ("temperature", "hot", "'temperature' must be a number"),
        ("temperature", True, "'temperature' must be a number, got a boolean"),
        ("top_k", 1.5, "'top_k' must be an integer"),
        ("top_k", False, "'top_k' must be an integer, got a boolean"),
        ("num_ctx", "2048", "'num_ctx' must be an integer, got a string"),
        ("temprature", None, "unknown option 'temprature'"),
        ("grammar", 5, "'grammar' must be a GBNF grammar"),
        ("grammar", 'start ::= "a"', "must define the rule 'root'"),
        ("top_p", 1.5, "'top_p' is out of range"),
        ("temperature", -1, "'temperature' is out of range"),
        ("temperature", float("nan"), "finite"),
        ("num_predict", -3, "'num_predict'"),
        ("num_ctx", 0, "'num_ctx' is out of range"),
        ("stop", 5, "'stop' must be a string or a list of strings"),
        ("stop", ["a", 1], "'stop' must be a string or a list of strings"),
        ("backend", "tensorflow", "unknown backend"),
        ("kv_cache_type", "q3", "unknown KV cache type"),
        ("speculative", "sometimes", "'speculative' must be one of"),
        ("draft_model", 3, "'draft_model' must be a model name"),
        ("num_draft", 1000, "'num_draft' is out of range"),
    ],
)
def test_bad_values_name_the_option(name: str, value: object, message: str) -> None:
    with pytest.raises(OptionError, match=message.replace("(", r"\(")):
        Options.merge({name: value})


def test_null_means_not_set() -> None:
    # what LangChain's OllamaEmbeddings sends for every option it has no value for
    sent = {"mirostat": None, "num_ctx": None, "stop": None, "temperature": None, "tfs_z": None}
    o = Options.merge({"temperature": 0.3, "num_ctx": 1024}, sent)
    assert o.temperature == 0.3
    assert o.num_ctx == 1024
    assert o.mirostat == Options().mirostat
    assert o.stop == []


def test_normalisation() -> None:
    o = Options.merge(
        {
            "stop": "END",
            "top_k": 20.0,
            "temperature": 1,
            "backend": "LLAMA.CPP",
            "kv_cache_type": "int8",
            "speculative": "Lookup",
            "draft_num_predict": 5,
        }
    )
    assert o.stop == ["END"]
    assert o.top_k == 20
    assert isinstance(o.top_k, int)
    assert o.temperature == 1.0
    assert isinstance(o.temperature, float)
    assert (o.backend, o.kv_cache_type, o.speculative, o.num_draft) == ("llama.cpp", "q8_0", "lookup", 5)


def test_ollama_only_options_are_accepted_and_ignored() -> None:
    o = Options.merge({"use_mmap": True, "numa": False, "main_gpu": 0, "penalize_newline": True})
    assert o.as_dict() == Options.merge().as_dict()


def test_num_predict_without_shift_is_bounded_by_the_context() -> None:
    o = Options.merge({"num_predict": -1})
    assert o.max_new_tokens(prompt_tokens=100, context_length=512) == 412
    assert Options.merge({"num_predict": -2}).max_new_tokens(100, 512) == 412
    assert Options.merge({"num_predict": 50}).max_new_tokens(100, 512) == 50
    assert Options.merge({"num_predict": 5000}).max_new_tokens(100, 512) == 412
    assert Options.merge({"num_predict": 0}).max_new_tokens(100, 512) == 0


def test_num_predict_with_shift_is_ollamas_open_ended_cap() -> None:
    """Ollama's rule where the context shifts: -1 (the default too) and anything above 10 x num_ctx
    mean 10 x num_ctx new tokens; -2 still fills the context; an explicit count may pass its end."""
    assert Options.merge().max_new_tokens(100, 512, shift=True) == OPEN_ENDED_CONTEXTS * 512
    assert Options.merge({"num_predict": -1}).max_new_tokens(100, 512, shift=True) == 5120
    assert Options.merge({"num_predict": 9000}).max_new_tokens(100, 512, shift=True) == 5120
    assert Options.merge({"num_predict": 2000}).max_new_tokens(100, 512, shift=True) == 2000
    assert Options.merge({"num_predict": -2}).max_new_tokens(100, 512, shift=True) == 412


def test_text_values_from_modelfile_and_set_parameter() -> None:
    assert parse_option_value("temperature", "0.5") == 0.5
    assert parse_option_value("num_ctx", "2048") == 2048
    assert parse_option_value("stop", '"<|im_end|>"') == ["<|im_end|>"]
    with pytest.raises(OptionError, match="'num_ctx' must be an integer"):
        parse_option_value("num_ctx", "big")
    # Modelfile layers may hold text; they are converted, request layers are not
    o = Options.merge(
        {"temperature": "0.3", "num_ctx": "1024", "num_gqa": 8}, {"top_k": 5}, lenient=(True, False)
    )
    assert (o.temperature, o.num_ctx, o.top_k) == (0.3, 1024, 5)  # unknown model parameters are skipped
    with pytest.raises(OptionError, match="unknown option 'num_gqa'"):
        Options.merge({}, {"num_gqa": 8}, lenient=(True, False))


def test_views_for_the_backend() -> None:
    o = Options.merge(
        {"temperature": 0, "seed": 42, "num_ctx": 100_000, "num_thread": 3, "kv_cache_type": "q8_0"}
    )
    s = o.sampling()
    assert s.greedy
    assert s.seed == 42
    lo = o.load_options(model_context_length=8192)
    assert (lo.num_ctx, lo.num_thread, lo.kv_cache_type) == (8192, 3, "q8_0")


def test_options_must_be_an_object() -> None:
    with pytest.raises(OptionError, match="object"):
        Options.merge(["temperature", 1])  # type: ignore[arg-type]
