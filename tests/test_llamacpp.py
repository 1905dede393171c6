"""What only the llama.cpp backend does: KV cache types, grammars, seeded sampling under speculation."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from localrt.backends import registry  # noqa: E402
from localrt.backends.base import DoneEvent  # noqa: E402
from localrt.backends.base import GenerateRequest  # noqa: E402
from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.base import TextEvent  # noqa: E402
from localrt.backends.llamacpp import LlamaCppBackend  # noqa: E402
from localrt.backends.llamacpp import LlamaCppModel  # noqa: E402
from localrt.backends.lookup import NgramProposer  # noqa: E402
from localrt.errors import LocalrtError  # noqa: E402
from localrt.errors import OptionError  # noqa: E402

CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
# One decode thread by default: on a busy 2-core runner, spinning thread pools slow down many-fold.
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))


@pytest.fixture(scope="module")
def model(smollm2_gguf: Path) -> Iterator[LlamaCppModel]:
    loaded = LlamaCppBackend.load(smollm2_gguf, LoadOptions(num_ctx=1024, num_thread=THREADS, num_batch=256))
    yield loaded
    loaded.unload()


def generate(model: LlamaCppModel, request: GenerateRequest) -> tuple[str, list[int], DoneEvent]:
    async def collect() -> tuple[str, list[int], DoneEvent]:
        text, ids, done = "", [], None
        async for event in model.generate(request):
            if isinstance(event, TextEvent):
                text += event.text
                ids += event.token_ids
            else:
                done = event
        assert done is not None
        return text, ids, done

    return asyncio.run(collect())


def ask(model: LlamaCppModel, question: str) -> list[int]:
    return model.tokenize(CHAT.format(q=question), add_special=True, parse_special=True)


PARAGRAPH = (
    "The old lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, "
    "and watched the ships pass safely through the rocky strait until dawn."
)


def test_capabilities() -> None:
    caps = LlamaCppBackend.capabilities()
    assert caps.speculative == frozenset({"draft", "lookup"})
    assert {"f16", "q8_0", "q4_0"} <= set(caps.kv_cache_types)
    assert "cpu" in caps.devices
    assert caps.grammar
    assert caps.embedding
    assert caps.parallel_slots == 1
    assert registry.status("llama.cpp").installed  # the import checks and the backend's own


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_cache(kv: str, smollm2_gguf: Path, model: LlamaCppModel) -> None:
    m = LlamaCppBackend.load(smollm2_gguf, LoadOptions(num_ctx=1024, num_thread=THREADS, kv_cache_type=kv))
    try:
        text, _, _ = generate(
            m, GenerateRequest(ask(m, "What is the capital of Germany?"), GREEDY, num_predict=10)
        )
        assert text.strip()
        # q4_0 is too lossy for a 135M model to keep its answer. Not France: its first token is a
        # near-tie ("The" 24.14 against "La" 24.05) that the cache's 8-bit rounding flips on some CPUs.
        if kv == "q8_0":
            assert "Berlin" in text
        assert m.memory_bytes < model.memory_bytes  # same context, smaller cache
    finally:
        m.unload()


def test_bad_kv_cache_settings(smollm2_gguf: Path) -> None:
    with pytest.raises(OptionError, match="fp8.*not supported by the llama.cpp backend"):
        LlamaCppBackend.load(smollm2_gguf, LoadOptions(num_ctx=256, kv_cache_type="fp8"))
    with pytest.raises(OptionError, match="flash attention"):
        LlamaCppBackend.load(smollm2_gguf, LoadOptions(num_ctx=256, kv_cache_type="q8_0", flash_attn=False))


def test_json_format(model: LlamaCppModel) -> None:
    ids = ask(model, "Describe a cat as JSON with name and age.")
    text, _, _ = generate(model, GenerateRequest(ids, GREEDY, num_predict=60, format="json"))
    assert isinstance(json.loads(text), (dict, list))


def test_json_schema_format(model: LlamaCppModel) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    text, _, done = generate(
        model,
        GenerateRequest(
            ask(model, "Give the capital of France as JSON."), GREEDY, num_predict=60, format=schema
        ),
    )
    obj = json.loads(text)
    assert set(obj) == {"city", "population"}
    assert isinstance(obj["population"], int)
    assert done.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_speculation_keeps_the_distribution(model: LlamaCppModel) -> None:
    # a text to repeat gives prompt lookup something to guess, and sampling rejects some of the guesses
    ids = ask(model, f"Repeat this text exactly:\n{PARAGRAPH}")
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    _, a, _ = generate(model, GenerateRequest(ids, sampled, num_predict=40))
    _, b, _ = generate(model, GenerateRequest(ids, sampled, num_predict=40))
    assert a == b
    # drafts are checked by the target's own sampler token by token, so even sampled output is the same,
    # rejected guesses and their KV rollback included
    _, c, done = generate(
        model, GenerateRequest(ids, sampled, num_predict=40, speculative="lookup", num_draft=6)
    )
    assert c == a
    assert 0 < done.timings.draft_accepted_count < done.timings.draft_count


def test_logits_do_not_depend_on_the_cache_state(model: LlamaCppModel) -> None:
    """Flash attention (auto) makes one-token and batched decodes agree bit for bit, so a reused prefix or
    a batched speculative check never changes a greedy answer."""
    ids = ask(model, "Tell me about the moon.")
    asyncio.run(model.score([ids[0] + 1]))  # empty the cache: the prompt is decoded in one batch
    _, fresh, _ = generate(model, GenerateRequest(ids, GREEDY, num_predict=30, logprobs=True))
    _, reused, done = generate(model, GenerateRequest(ids, GREEDY, num_predict=30))  # last prompt token alone
    assert done.timings.prompt_eval_count == 1
    assert reused == fresh


def test_greedy_pick_is_the_greedy_chains_across_decodes(model: LlamaCppModel) -> None:
    """The plain greedy sampler keeps a view of each row's logits by address. Across decodes of 1, 40
    and 1 output rows (llama.cpp grows its output buffer when it must) it picks what llama.cpp's own
    greedy chain picks, at every row."""
    from llama_cpp import _internals

    from localrt.backends.llamacpp.lib import ArgmaxSampler
    from localrt.backends.llamacpp.lib import Batch
    from localrt.backends.llamacpp.lib import context_params
    from localrt.backends.llamacpp.lib import create_context
    from localrt.backends.llamacpp.lib import sample

    tokens = model.tokenize(PARAGRAPH * 2, add_special=True, parse_special=False)
    assert len(tokens) > 41
    ctx = create_context(
        model.model, context_params(LoadOptions(num_ctx=256), 256, 64, 1, THREADS, unified=False)
    )
    fast, chain, batch = ArgmaxSampler(model.n_vocab), _internals.LlamaSampler(), Batch(64)
    chain.add_greedy()
    picks, pos = [], 0
    try:
        for part in ([tokens[0]], tokens[1:41], [tokens[41]]):
            batch.clear()
            batch.add(part, pos, 0, True)
            pos += len(part)
            assert batch.decode(ctx.ctx) == 0
            picks += [(fast.pick(ctx.ctx, row), sample(chain, ctx.ctx, row)) for row in range(len(part))]
    finally:
        batch.close()
        chain.close()
        ctx.close()
    assert [ours for ours, _ in picks] == [theirs for _, theirs in picks]


def test_speculative_errors(model: LlamaCppModel) -> None:
    with pytest.raises(OptionError, match="'self' is not supported by the llama.cpp backend"):
        generate(model, GenerateRequest(ask(model, "Hi"), GREEDY, num_predict=2, speculative="self"))
    with pytest.raises(OptionError, match="needs a draft model"):
        generate(model, GenerateRequest(ask(model, "Hi"), GREEDY, num_predict=2, speculative="draft"))
    # auto without a draft model is plain decoding
    _, _, done = generate(model, GenerateRequest(ask(model, "Hi"), GREEDY, num_predict=2, speculative="auto"))
    assert done.timings.draft_count == 0


def test_bad_token_ids(model: LlamaCppModel) -> None:
    with pytest.raises(LocalrtError, match="outside the vocabulary"):
        generate(model, GenerateRequest([1, 10**6], GREEDY, num_predict=2))
    with pytest.raises(LocalrtError, match="empty"):
        generate(model, GenerateRequest([], GREEDY, num_predict=2))


def test_mirostat_and_penalties_run(model: LlamaCppModel) -> None:
    for params in (
        SamplingParams(mirostat=2, seed=1),
        SamplingParams(
            repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, repeat_last_n=-1, seed=1
        ),
    ):
        _, ids, done = generate(model, GenerateRequest(ask(model, "Say something."), params, num_predict=8))
        assert ids
        assert done.finish_reason in ("length", "stop")


def test_cpu_build_reports_cpu(model: LlamaCppModel, smollm2_gguf: Path) -> None:
    from localrt.backends.llamacpp import gpu_offload_supported

    if gpu_offload_supported():
        pytest.skip("llama.cpp was built with GPU offload")
    assert model.on_gpu is False
    assert LlamaCppBackend.capabilities().devices == ("cpu",)
    assert model.memory_bytes > smollm2_gguf.stat().st_size


def test_lookup_proposer_finds_latest_match() -> None:
    p = NgramProposer(sizes=(3, 2))
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 2, 3]
    assert p.propose(history, 3) == [7, 8, 2]  # "2 3" last followed by 7 8 ...
    assert p.propose([*history, 7], 2) == [8, 2]  # "3 7" (and "2 3 7") seen before
    assert NgramProposer().propose([1, 2, 3], 4) == []


def test_lookup_continuation_that_reaches_the_present_repeats_its_period() -> None:
    """A text in a loop: "1 2 3" last followed by "1 2 3", which is where the history ends; the drafts go on
    with the loop's period."""
    assert NgramProposer(sizes=(3,)).propose([1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_parallel_slots_give_each_request_its_own_output(smollm2_gguf: Path, model: LlamaCppModel) -> None:
    """Two slots on one set of weights, a draft context per slot: side by side = one at a time."""
    questions = ["What is the capital of France?", "Name three colours of the rainbow."]
    alone = [
        generate(model, GenerateRequest(prompt_tokens=ask(model, q), sampling=GREEDY, num_predict=24))[1]
        for q in questions
    ]
    opts = LoadOptions(
        num_ctx=1024,
        num_thread=THREADS,
        num_batch=256,
        num_parallel=2,
        draft_model=smollm2_gguf,
        batch_invariant=True,
    )
    two = LlamaCppBackend.load(smollm2_gguf, opts)
    try:
        assert two.capabilities.parallel_slots == 2

        async def both() -> list[list[int]]:
            async def one(q: str) -> list[int]:
                ids: list[int] = []
                req = GenerateRequest(
                    prompt_tokens=ask(two, q), sampling=GREEDY, num_predict=24, speculative="draft"
                )
                async for event in two.generate(req):
                    if isinstance(event, TextEvent):
                        ids += event.token_ids
                return ids

            return list(await asyncio.gather(*(one(q) for q in questions)))

        assert asyncio.run(both()) == alone
    finally:
        two.unload()
    with pytest.raises(LocalrtError, match="unloaded"):
        generate(two, GenerateRequest(prompt_tokens=ask(model, "Hi"), sampling=GREEDY, num_predict=2))
