"""Torch engine mechanics on tiny random models: block pool, continuous batching, preemption,
cancellation, chunked prefill, prefix cache, paged memory use, KV quantization."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localrt.backends.base import CancelToken  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.torch import prefix_cache  # noqa: E402
from localrt.backends.torch.attention import PagedAttention  # noqa: E402
from localrt.backends.torch.attention import SeqChunk  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from localrt.backends.torch.kv_cache import BlockPool  # noqa: E402
from localrt.backends.torch.kv_cache import KVCache  # noqa: E402
from localrt.backends.torch.kv_cache import OutOfBlocks  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.llama import Transformer  # noqa: E402
from localrt.backends.torch.llama import random_transformer  # noqa: E402
from localrt.backends.torch.scheduler import Sequence  # noqa: E402
from localrt.errors import LocalrtError  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 96


def tiny_model(seed: int = 0, layers: int = 2, vocab: int = VOCAB) -> Transformer:
    return random_transformer(LlamaConfig("llama", vocab, 1024, 64, 128, layers, 4, 2, 16), seed=seed)


def make_engine(model: Transformer, **overrides: object) -> Engine:
    options: dict[str, object] = {"context_length": 1024, "kv_cache_type": "f32"}
    options.update(overrides)
    return Engine(model, EngineConfig(**options))  # type: ignore[arg-type]


@dataclass
class Req:
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    arrival: int = 0  # step at which it joins
    cancel_at: int | None = None  # step at which it is cancelled


def run_workload(engine: Engine, reqs: list[Req]) -> list[Sequence]:
    """Steps the engine, adding and cancelling requests at their steps."""
    seqs = [engine.new_sequence(r.prompt, r.sampling, max_new=r.max_new, cancel=CancelToken()) for r in reqs]
    step = 0
    with torch.inference_mode():
        while True:
            for r, s in zip(reqs, seqs):
                if r.arrival == step:
                    engine.add(s)
                if r.cancel_at == step:
                    s.cancel.cancel()
            engine.step()
            more = engine.has_work
            engine.pool.check()
            step += 1
            if not more and step > max(r.arrival for r in reqs):
                break
    return seqs


def solo(model: Transformer, req: Req) -> list[int]:
    engine = make_engine(model, prefix_caching=False)
    (seq,) = run_workload(engine, [Req(req.prompt, req.max_new, req.sampling)])
    return seq.tokens[len(req.prompt) :]


def generated(seq: Sequence) -> list[int]:
    return seq.tokens[seq.prompt_len :]


def assert_pool_empty(engine: Engine) -> None:
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.running
    assert not engine.scheduler.waiting


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model()


def random_requests(n: int, seed: int, *, cancel: bool = True) -> list[Req]:
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        sampling = (
            GREEDY if i % 3 == 0 else SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1000 + i)
        )
        cancel_at = int(rng.integers(3, 15)) if cancel and i % 5 == 4 else None
        reqs.append(
            Req(
                rng.integers(3, VOCAB, int(rng.integers(2, 90))).tolist(),
                int(rng.integers(4, 30)),
                sampling,
                arrival=int(rng.integers(0, 12)),
                cancel_at=cancel_at,
            )
        )
    return reqs


# ---- block pool ------------------------------------------------------------------------------------
def test_block_pool_free_list_and_ref_counts() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.retain(a)
    assert pool.num_free == 2
    assert pool.ref_count[a] == 2
    pool.release(a)
    assert pool.ref_count[a] == 1
    pool.allocate_many(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.cached[b] = True  # as the prefix cache marks it
    pool.release(b)
    assert pool.num_free == 1  # evictable counts as free
    evicted = []
    pool.on_evict = evicted.append
    assert pool.allocate() == b
    assert evicted == [b]
    pool.check()
    with pytest.raises(LocalrtError, match="free"):
        BlockPool(2).retain(0)  # a block nobody owns cannot be shared


# ---- continuous batching -----------------------------------------------------------------------------
def test_batching_is_invisible(model: Transformer) -> None:
    """16 requests: different lengths, arrival steps, seeds, cancellations -> the tokens of solo runs."""
    reqs = random_requests(16, seed=1)
    engine = make_engine(model, max_batch_tokens=64)
    seqs = run_workload(engine, reqs)
    cut_short = 0
    for req, seq in zip(reqs, seqs):
        alone = solo(model, req)
        got = generated(seq)
        assert alone  # every request generates: the comparison below is never of two empty lists
        if req.cancel_at is not None and len(got) < len(alone):
            assert got == alone[: len(got)]  # a cancelled request stops early, on the same path
            cut_short += 1
        else:
            assert got == alone
    assert cut_short > 0  # the workload really cancelled a request mid-answer
    assert_pool_empty(engine)


def test_chunked_prefill_keeps_decodes_running(model: Transformer) -> None:
    engine = make_engine(model, max_batch_tokens=24)
    short = engine.new_sequence([5, 6, 7], GREEDY, max_new=30)
    long = engine.new_sequence(list(range(3, 93)) * 3, GREEDY, max_new=2)  # 270 tokens: 12+ chunks
    with torch.inference_mode():
        engine.add(short)
        engine.step()
        engine.add(long)
        progress = []
        while long.request.first_token_ns == 0:
            before = len(short.tokens)
            engine.step()
            progress.append(len(short.tokens) - before)
    assert len(progress) >= 10
    assert all(p == 1 for p in progress[: len(progress) - 1])
    with torch.inference_mode():
        engine.run()
    assert generated(long) == solo(model, Req(long.tokens[:270], 2, GREEDY))
    assert_pool_empty(engine)


def test_preemption_by_recompute_keeps_output(model: Transformer) -> None:
    reqs = [
        Req(list(range(3 + i, 43 + i)), 40, GREEDY if i % 2 else SamplingParams(temperature=1.0, seed=i))
        for i in range(6)
    ]
    engine = make_engine(
        model, kv_budget_bytes=KVCache.bytes_per_block(2, 2, 16, "f32") * 14, prefix_caching=False
    )
    seqs = run_workload(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for req, seq in zip(reqs, seqs):
        assert generated(seq) == solo(model, req)
    assert_pool_empty(engine)


def test_cancel_frees_blocks_at_once(model: Transformer) -> None:
    engine = make_engine(model, prefix_caching=False)
    seq = engine.new_sequence(list(range(3, 60)), GREEDY, max_new=100)
    with torch.inference_mode():
        engine.add(seq)
        for _ in range(3):
            engine.step()
        assert engine.pool.num_used >= 4
        seq.cancel.cancel()
        outputs = engine.step()
    assert [(o.request, o.finish) for o in outputs] == [(seq.request, "cancel")]
    assert_pool_empty(engine)


def test_too_long_for_the_pool_fails_cleanly(model: Transformer) -> None:
    engine = make_engine(model, kv_budget_bytes=KVCache.bytes_per_block(2, 2, 16, "f32") * 3)
    seq = engine.new_sequence(list(range(3, 80)), GREEDY, max_new=4)
    with torch.inference_mode():
        engine.run([seq])
    assert seq.finished
    assert seq.error is not None
    assert "KV cache" in str(seq.error)
    assert_pool_empty(engine)


# ---- prefix cache ------------------------------------------------------------------------------------
def test_prefix_cache_hits_and_identical_output(model: Transformer) -> None:
    system = np.random.default_rng(3).integers(3, VOCAB, 100).tolist()
    questions = [[7, 8, 9], [10, 11], [12, 13, 14, 15]]
    engine = make_engine(model)
    fed = []
    outputs = []
    for q in questions:
        (seq,) = run_workload(engine, [Req([*system, *q], 8, GREEDY)])
        fed.append(seq.request.timings.prompt_eval_count)
        outputs.append(generated(seq))
    assert fed[0] == 103
    # later requests compute only their question: 6 full blocks are shared, the 4 system tokens of
    # the 7th block are copied from the previous request's cached tail (copy-on-write)
    assert fed[1] == 2
    assert fed[2] == 4
    assert engine.prefix.hit_tokens >= 2 * 96
    for q, out in zip(questions, outputs):
        assert out == solo(model, Req([*system, *q], 8, GREEDY))
    assert_pool_empty(engine)


def test_prefix_cache_continues_a_conversation_token_exact(model: Transformer) -> None:
    engine = make_engine(model)
    (first,) = run_workload(engine, [Req(list(range(3, 40)), 10, GREEDY)])
    follow = [*first.tokens, 50, 51, 52]
    (second,) = run_workload(engine, [Req(follow, 5, GREEDY)])
    # the last sampled token was never fed, so it and the 3 new ones are all that is computed
    assert second.request.timings.prompt_eval_count == 4
    assert generated(second) == solo(model, Req(follow, 5, GREEDY))
    assert_pool_empty(engine)


def test_prefix_cache_shares_blocks_between_running_sequences(model: Transformer) -> None:
    engine = make_engine(model)
    shared = list(range(3, 67))  # 4 full blocks
    a = engine.new_sequence([*shared, 70], GREEDY, max_new=20)
    b = engine.new_sequence([*shared, 71], GREEDY, max_new=20)
    with torch.inference_mode():
        engine.add(a)
        engine.step()
        engine.add(b)
        engine.step()
        assert a.block_table[:4] == b.block_table[:4]
        assert all(engine.pool.ref_count[blk] == 2 for blk in a.block_table[:4])
        engine.run()
    assert_pool_empty(engine)


def test_prefix_cache_evicts_least_recently_used(model: Transformer) -> None:
    engine = make_engine(model, kv_budget_bytes=KVCache.bytes_per_block(2, 2, 16, "f32") * 12)
    prompts = [np.random.default_rng(i).integers(3, VOCAB, 48).tolist() for i in range(6)]
    for p in prompts:
        run_workload(engine, [Req(p, 2, GREEDY)])
    # the pool holds 12 blocks: the latest prompts are still cached, the first were evicted
    assert engine.prefix.match(prompts[-1], 47)[1] >= 32
    assert engine.prefix.match(prompts[0], 47)[1] == 0
    assert_pool_empty(engine)


# Two 16-token blocks (one KV block each) whose keys under the old scheme, `hash((parent, tuple(tokens)))`,
# are equal for every parent: their tuple hashes collide. Found offline by tests/tuple_hash_collision.c
# (CPython's tuple hash is not salted, so anyone can search for such prompts); the first 11 tokens agree.
COLLIDING_BLOCKS = (
    [504, 3431, 282, 253, 1790, 288, 260, 4637, 30, 378, 3138, 2756, 11436, 9649, 4376, 1],
    [504, 3431, 282, 253, 1790, 288, 260, 4637, 30, 378, 3138, 5249, 21726, 17234, 26401, 0],
)


def old_chain_key(parent: object, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


@pytest.fixture(scope="module")
def wide_model() -> Transformer:
    """A vocabulary wide enough for the colliding token ids."""
    return random_transformer(LlamaConfig("llama", 32768, 256, 64, 128, 2, 4, 2, 16), seed=5)


def test_old_prefix_keys_of_the_crafted_blocks_collide() -> None:
    a, b = COLLIDING_BLOCKS
    assert a != b
    assert old_chain_key(0, a) == old_chain_key(0, b)  # the old key of a prompt's first block
    assert prefix_cache.chain_key(prefix_cache.ROOT_KEY, a) != prefix_cache.chain_key(
        prefix_cache.ROOT_KEY, b
    )


@pytest.mark.parametrize("keys", ["sha256", "old-hash"])
def test_prefix_cache_keeps_colliding_blocks_apart(
    wide_model: Transformer, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second prompt reuses only the 11 tokens it really shares with the first, and gives the tokens
    it gives alone. With the old 64-bit keys put back ("old-hash"), the stored-token comparison alone
    still keeps the blocks apart."""
    if keys == "old-hash":
        monkeypatch.setattr(prefix_cache, "chain_key", old_chain_key)
    a, b = COLLIDING_BLOCKS
    tail = [7, 8, 9]
    engine = make_engine(wide_model)
    run_workload(engine, [Req([*a, *tail], 4, GREEDY)])
    assert engine.prefix.match([*a, *tail], 18)[1] == 18  # the first prompt is cached
    assert engine.prefix.match([*b, *tail], 18)[1] == 11
    (second,) = run_workload(engine, [Req([*b, *tail], 4, GREEDY)])
    assert second.request.timings.prompt_eval_count == 19 - 11
    assert generated(second) == solo(wide_model, Req([*b, *tail], 4, GREEDY))
    assert_pool_empty(engine)


# ---- paged memory ------------------------------------------------------------------------------------
def test_paged_memory_waste_and_admission(model: Transformer) -> None:
    """Random lengths: KV in use stays within one block per sequence of the tokens held, and a budget of
    4 max-length sequences admits far more than 4."""
    ctx = 1024
    per_block = KVCache.bytes_per_block(2, 2, 16, "f32")
    engine = make_engine(
        model,
        context_length=ctx,
        kv_budget_bytes=per_block * 4 * ctx // 16,
        max_seqs=64,
        max_batch_tokens=4096,
        prefix_caching=False,
    )
    rng = np.random.default_rng(5)
    seqs = [
        engine.new_sequence(
            rng.integers(3, VOCAB, int(rng.integers(100, 400))).tolist(),
            GREEDY,
            max_new=int(rng.integers(5, 60)),
        )
        for _ in range(40)
    ]
    wastes, concurrent = [], 0
    with torch.inference_mode():
        for s in seqs:
            engine.add(s)
        while engine.has_work:
            engine.step()
            running = engine.scheduler.running
            held = sum(s.num_computed for s in running)
            used = engine.pool.num_used * engine.pool.block_size
            assert used - held <= len(running) * engine.pool.block_size
            wastes.append((used - held) / max(1, used))
            concurrent = max(concurrent, len(running))
    assert float(np.mean(wastes)) < 0.04
    assert concurrent >= 12  # >= 3x the 4 sequences a max_len-per-sequence layout fits
    assert_pool_empty(engine)


# ---- KV quantization ---------------------------------------------------------------------------------
def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.fixture(scope="module")
def smollm2_paged(smollm2_gguf: Path) -> tuple[Transformer, list[int], torch.Tensor]:
    """SmolLM2, a 192-token input and its logits with an fp32 KV cache."""
    from localrt.backends.torch.gguf_load import GGUFTensors

    model = Transformer.from_gguf(GGUFTensors(smollm2_gguf), torch.float32, "cpu")
    tokens = np.random.default_rng(0).integers(100, 20000, 192).tolist()
    return model, tokens, paged_logits(model, tokens, "f32")


def paged_logits(model: Transformer, tokens: list[int], kv_type: str) -> torch.Tensor:
    cache = KVCache(model.cfg.block_count, 16, 3, 64, kv_type, torch.float32, "cpu")
    with torch.inference_mode():
        return model(
            torch.tensor(tokens), PagedAttention(cache, [SeqChunk(192, 192, list(range(12)))], "cpu")
        )


@pytest.mark.parametrize("kv_type", ["q8_0", "f16", "bf16"])
def test_quantized_kv_is_close_to_fp32(
    kv_type: str, smollm2_paged: tuple[Transformer, list[int], torch.Tensor]
) -> None:
    model, tokens, reference = smollm2_paged
    logits = paged_logits(model, tokens, kv_type)
    bound = {"q8_0": 5e-3, "f16": 1e-4, "bf16": 2e-2}[kv_type]
    divergence = kl(reference, logits)
    assert divergence < bound, divergence
    assert (reference.argmax(-1) == logits.argmax(-1)).float().mean() > 0.9


def test_int8_kv_memory_is_about_half_of_f16() -> None:
    f16 = KVCache.bytes_per_block(30, 3, 64, "f16")
    q8 = KVCache.bytes_per_block(30, 3, 64, "q8_0")
    assert q8 < 0.6 * f16
