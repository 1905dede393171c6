"""The torch engine: one model, one paged KV cache, a scheduler, and a loop that runs steps.

A step = schedule -> (propose) -> the runner's one batched forward over every scheduled chunk -> sample
(every plain decode in one batch, one host sync) or verify per sequence -> commit, and it returns its
outputs (`engine.EngineOutput`): the tokens each request gained, their logprobs when asked, the requests
that ended, and a prompt-only request's pooled vector or scores once its last chunk ran. Nothing is
called back from inside a step. On CUDA, a step made only of single-token decodes replays a captured
CUDA graph instead (`cuda_graphs.DecodeGraphs`). `step()` is synchronous (tests drive it directly);
`start(sink)` runs it on the engine's thread, which hands each step's outputs to `sink`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch

from localrt.backends.base import CancelToken
from localrt.backends.base import GenerateRequest
from localrt.backends.base import SamplingParams
from localrt.backends.engine import EngineOutput
from localrt.backends.engine import EngineRequest
from localrt.backends.engine import Pooled
from localrt.backends.engine import StepOutputs
from localrt.backends.engine import take_each
from localrt.backends.engine_thread import EngineThread
from localrt.backends.grammar import Grammar
from localrt.backends.grammar import GrammarDeadEnd
from localrt.backends.lookup import NgramProposer
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import verify
from localrt.backends.speculation import verify_cost_per_draft
from localrt.errors import LocalrtError

from .attention import fused_available
from .cuda_graphs import DecodeGraphs
from .kv_cache import BLOCK_SIZE
from .kv_cache import BlockPool
from .kv_cache import KVCache
from .kv_cache import num_blocks_for
from .llama import Transformer
from .llama import weight_bytes
from .prefix_cache import PrefixCache
from .runner import ModelRunner
from .runner import StepBatch
from .runner import logprobs_of
from .sampling import RequestSampler
from .sampling import Sampled
from .scheduler import Scheduled
from .scheduler import Scheduler
from .scheduler import Sequence
from .sliding import WindowBlocks
from .sliding import window_pool_blocks
from .speculative import DraftModelProposer
from .speculative import DraftTokens
from .speculative import SelfProposer


@dataclass
class EngineConfig:
    context_length: int = 4096  # longest sequence (prompt + output)
    kv_cache_type: str = "f16"
    kv_budget_bytes: int | None = None  # None: room for `kv_budget_seqs` full-length sequences
    kv_budget_seqs: int | None = None  # None: max_seqs (context_length x parallel sequences, as llama.cpp)
    max_seqs: int = 16  # sequences decoding together
    max_batch_tokens: int = 512  # tokens per step (prefill chunk + decodes + draft tokens)
    prefix_caching: bool = True
    self_spec_layers: int | None = None  # None: four fifths of the layers (shallower exits rarely agree)
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = BLOCK_SIZE
    cuda_graphs: bool = True  # decode-only steps replay captured graphs (CUDA with Triton only)


@dataclass
class _Work:
    plan: list[Scheduled]
    q: dict[int, torch.Tensor | None] = field(default_factory=dict)


class Engine(EngineThread):
    thread_name = "torch-engine"

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        device: torch.device | str = "cpu",
        draft_model: Transformer | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        cfg = model.cfg
        dtype = model.dtype
        windows = model.windows  # per layer: its sliding window in tokens, 0 for full attention
        window = max(windows, default=0)
        windowed = [w > 0 for w in windows]
        bs = config.block_size
        per_block, per_window_block = (
            KVCache.bytes_per_block(
                n, cfg.attention_head_count_kv, cfg.attention_key_length, config.kv_cache_type, bs
            )
            for n in (windowed.count(False), windowed.count(True))
        )
        seqs = config.kv_budget_seqs or config.max_seqs
        context_blocks = -(-config.context_length // bs)
        window_blocks = (
            window_pool_blocks(window, seqs, config.max_batch_tokens, context_blocks * seqs, bs)
            if window
            else 0
        )
        budget = config.kv_budget_bytes
        if budget is None:  # the global layers for every sequence's context, the sliding ones for its window
            budget = per_block * context_blocks * seqs + per_window_block * window_blocks
        if per_block:
            num_blocks = num_blocks_for(budget - per_window_block * window_blocks, per_block)
        else:  # every layer slides: the global pool only numbers positions, it holds no tensors
            num_blocks = context_blocks * seqs
        window_blocks = min(window_blocks, num_blocks)
        self.pool = BlockPool(num_blocks, bs)
        self.window_pool = BlockPool(window_blocks, bs) if window else None
        # CUDA graphs decode through the Triton kernel, which walks whole block tables with plain scores:
        # no sliding window, no soft-cap (StaticDecodeAttention serves neither)
        plain = all(not b.attn_layer.window and not b.attn_layer.softcap for b in model.blk)
        use_graphs = config.cuda_graphs and _graphs_available(self.device) and plain
        # graphs pad the batch; padded rows write their K/V into one extra block the pool never hands out
        self.cache = KVCache(
            cfg.block_count,
            num_blocks + (1 if use_graphs else 0),
            cfg.attention_head_count_kv,
            cfg.attention_key_length,
            config.kv_cache_type,
            dtype,
            self.device,
            bs,
            windowed=windowed,
            window_blocks=window_blocks,
        )
        self.graphs = (
            DecodeGraphs(model, self.cache, num_blocks, config.max_seqs, config.context_length, self.device)
            if use_graphs
            else None
        )
        self.prefix = PrefixCache(self.pool, enabled=config.prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            self.cache,
            self.prefix,
            config,
            window=None
            if self.window_pool is None
            else WindowBlocks(self.window_pool, self.cache, window, config.prefix_caching),
        )
        self.runner = ModelRunner(model, self.cache, self.device, self.graphs)
        verify_cost = verify_cost_per_draft(self.device.type != "cpu")
        layers = config.self_spec_layers or max(1, cfg.block_count - cfg.block_count // 5)
        # the model-based proposers; "lookup" drafts from each sequence's own n-gram index (SpecState.ngram)
        self.proposers: dict[str, Any] = {"self": SelfProposer(model, self.cache, self.device, layers)}
        self.verify_cost = verify_cost
        self.draft_model = draft_model
        if draft_model is not None:
            self.proposers["draft"] = self._make_draft_proposer(draft_model, num_blocks)
        self.eos = set(config.eos_token_ids)
        self._init_thread()
        self.steps = 0

    def _make_draft_proposer(self, draft: Transformer, num_blocks: int) -> DraftModelProposer:
        dc = draft.cfg
        if dc.vocab_size != self.model.cfg.vocab_size:
            raise LocalrtError("the draft model does not share the model's vocabulary")
        dtype = draft.dtype
        cache = KVCache(
            dc.block_count,
            num_blocks,
            dc.attention_head_count_kv,
            dc.attention_key_length,
            self.config.kv_cache_type,
            dtype,
            self.device,
            self.config.block_size,
        )
        pool = BlockPool(num_blocks, self.config.block_size)
        ratio = sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in self.model.parameters())
        return DraftModelProposer(draft, cache, pool, self.device, ratio)

    # ---- requests ---------------------------------------------------------------------------
    def sequence(self, request: EngineRequest) -> Sequence:
        """The engine's sequence for a checked request (the adapter checked its prompt and method)."""
        tokens = list(request.prompt)
        ctx = self.config.context_length
        if request.prompt_only:
            seq = Sequence(request, tokens, len(tokens), len(tokens))
            seq.pooled = Pooled() if request.task == "embed" else None
        else:
            room = ctx - len(tokens)
            max_new = request.req.num_predict
            max_len = len(tokens) + (room if max_new < 0 else min(max_new, room))
            sampler = RequestSampler(request.req.sampling, self.device, ctx, request.grammar)
            seq = Sequence(request, tokens, len(tokens), max_len, sampler)
            request.spec = self._spec_state(request)
        return seq

    def new_sequence(
        self,
        prompt: Iterable[int],
        sampling: SamplingParams,
        *,
        max_new: int = -1,
        speculative: str = "off",
        num_draft: int | None = None,
        cancel: CancelToken | None = None,
        grammar: Grammar | None = None,
        top_logprobs: int = -1,
    ) -> Sequence:
        """A sequence from loose settings, for synchronous use (tests, benchmarks): `add` it, `step`."""
        req = GenerateRequest(list(prompt), sampling, num_predict=max_new, num_draft=num_draft)
        req.logprobs, req.top_logprobs = top_logprobs >= 0, max(0, top_logprobs)
        req.cancel = cancel or req.cancel
        return self.sequence(EngineRequest(req, method=speculative, grammar=grammar))

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (engine thread or synchronous use)."""
        self.scheduler.add(seq)

    def _take(self, queued: list[EngineRequest]) -> list[EngineOutput]:
        return take_each(lambda request: self.add(self.sequence(request)), queued)

    def _spec_state(self, request: EngineRequest) -> SpecState | None:
        """The request's speculation: prompt lookup, or a model-based proposer (the adapter checked that
        its method is there)."""
        method = request.method
        if method == "lookup":
            return SpecState.begin(
                method, request.req.num_draft, NgramProposer.cost_per_draft, self.verify_cost
            )
        if method in self.proposers:
            cost = self.proposers[method].cost_per_draft
            return SpecState.begin(method, request.req.num_draft, cost, self.verify_cost)
        return None

    # ---- one step ---------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[EngineOutput]:
        """Run one iteration; returns what it did to each request (`has_work` says whether more is left)."""
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            if seq.cancel.cancelled:
                sched.finish(seq, "cancel")  # frees its blocks at once
        plan = sched.schedule(self._draft_len)
        self._release_spec()
        outputs = StepOutputs()
        if plan:
            work = _Work(plan)
            self._propose(work)
            batch = self.runner.forward(plan)
            self.steps += 1
            members = [
                i
                for i, item in enumerate(plan)
                if i in batch.rows
                and not item.drafts
                and not item.seq.prompt_only
                and item.seq.sampler is not None
                and item.seq.sampler.grammar is None
            ]
            sampled = self.runner.sample(plan, batch, members)
            for i, item in enumerate(plan):
                if item.seq.prompt_only:
                    self._pool(item, batch, i, outputs)
                else:
                    self._advance(item, batch, i, work.q.get(i), sampled.get(i), outputs)
        return self._collect(outputs)

    def _collect(self, outputs: StepOutputs) -> list[EngineOutput]:
        """The step's outputs plus every request that ended (cancelled, failed, finished) on the way."""
        for seq, reason in self.scheduler.finished:
            outputs.end(seq.request, reason)
        self.scheduler.finished.clear()
        self._release_spec()
        return outputs.take()

    @property
    def graph_replays(self) -> int:
        """Steps that replayed a captured CUDA graph (0 off CUDA or with `cuda_graphs=False`)."""
        return 0 if self.graphs is None else self.graphs.replays

    def weight_bytes(self) -> int:
        """Resident bytes of the model's weights and the draft model's."""
        total = weight_bytes(self.model)
        return total + (weight_bytes(self.draft_model) if self.draft_model is not None else 0)

    def _draft_len(self, seq: Sequence) -> int:
        if seq.spec is None or not seq.spec.enabled:
            return 0
        return max(0, min(seq.spec.k, seq.max_len - len(seq.tokens) - 1))

    def _propose(self, work: _Work) -> None:
        by_mode: dict[str, list[int]] = {}
        for i, item in enumerate(work.plan):
            if item.num_draft > 0 and item.seq.spec is not None:
                by_mode.setdefault(item.seq.spec.mode, []).append(i)
        for mode, members in by_mode.items():
            seqs = [work.plan[i].seq for i in members]
            ks = [work.plan[i].num_draft for i in members]
            if mode == "lookup":  # each sequence's own n-gram index: nothing runs a model, so no q
                drafts = [DraftTokens(_ngram_of(seq).propose(seq.tokens, k)) for seq, k in zip(seqs, ks)]
            else:
                drafts = self.proposers[mode].propose(seqs, ks)
            for i, draft in zip(members, drafts):
                n = min(len(draft.tokens), work.plan[i].num_draft)
                work.plan[i].drafts = draft.tokens[:n]
                work.q[i] = None if draft.q is None else draft.q[:n]

    def _advance(
        self,
        item: Scheduled,
        batch: StepBatch,
        i: int,
        q: torch.Tensor | None,
        drawn: Sampled | None,
        outputs: StepOutputs,
    ) -> None:
        seq, sched, request = item.seq, self.scheduler, item.seq.request
        seq.num_computed += item.num_tokens
        if request.first_token_ns == 0:
            request.timings.prompt_eval_count += item.num_tokens
        span = batch.rows.get(i)
        if span is None:  # a prefill chunk that has not reached the end of the prompt
            sched.commit(seq)
            return
        logits = batch.logits[span[0] : span[1]]
        if drawn is None:
            try:
                drawn = self._draw_alone(item, logits, q)
            except GrammarDeadEnd as error:  # this request's grammar, not the batch's fault
                seq.error = error
                sched.finish(seq, "error")
                return
        if request.first_token_ns == 0:
            request.first_token_ns = time.perf_counter_ns()
        out = outputs.of(request)
        reason = None
        for j, token in enumerate(drawn.tokens):
            seq.tokens.append(token)
            request.generated += 1
            if token in self.eos:  # ends the sequence; not part of its output
                reason = "stop"
                break
            out.tokens.append(token)
            lp = drawn.logprob[j]
            out.logprobs.append(None if lp is None else (lp, drawn.top[j]))
            if len(seq.tokens) >= seq.max_len:
                reason = "length"
            if reason is not None:
                break
        # KV past the kept tokens (a draft token after an early stop) is never looked at again
        seq.num_computed = min(seq.num_computed, len(seq.tokens))
        if reason is not None:
            sched.finish(seq, reason)
        else:
            sched.commit(seq)

    def _pool(self, item: Scheduled, batch: StepBatch, i: int, outputs: StepOutputs) -> None:
        """A prompt-only request's chunk: its hidden rows into the pooled vector, or its rows' logprobs
        into the scores; after its last chunk, the answer."""
        seq, request = item.seq, item.seq.request
        start = seq.num_computed
        seq.num_computed += item.num_tokens
        request.timings.prompt_eval_count += item.num_tokens
        a, b = batch.rows[i]
        if seq.pooled is not None:
            assert batch.hidden is not None
            seq.pooled.add(batch.hidden[a:b].float().cpu().numpy())
        elif request.scores is not None:
            fill_scores(request.scores, seq.tokens, start, batch.logits[a:b])
        if seq.num_computed < len(seq.tokens):
            self.scheduler.commit(seq)
            return
        outputs.of(request).result = seq.pooled.vector() if seq.pooled is not None else request.scores
        self.scheduler.finish(seq, "stop")

    def _draw_alone(self, item: Scheduled, logits: torch.Tensor, q: torch.Tensor | None) -> Sampled:
        """Tokens for a row outside the batched sampler: draft tokens to verify, or a grammar's constraint."""
        seq = item.seq
        if item.drafts:
            tokens, accepted = verify(seq.sampler, logits, item.drafts, q, seq.tokens)
            seq.num_computed += accepted
            assert seq.spec is not None
            seq.spec.record(len(item.drafts), accepted)
        else:
            assert seq.sampler is not None
            tokens = [seq.sampler.sample(logits[0], seq.tokens)]
        if seq.top_logprobs >= 0:
            return logprobs_of(logits, tokens, seq.top_logprobs)
        return Sampled(tokens, [None] * len(tokens), [[] for _ in tokens])

    def _release_spec(self) -> None:
        """Speculative proposers free the state of sequences that gave their blocks back."""
        for seq in self.scheduler.released:
            if seq.spec is not None and seq.spec.mode in self.proposers:
                self.proposers[seq.spec.mode].release(seq)
        self.scheduler.released.clear()

    # ---- threaded mode (engine_thread.py) ---------------------------------------------------------
    def _thread_context(self) -> Any:
        return torch.inference_mode()

    def _fail_step(self, error: Exception) -> list[EngineOutput]:
        """A failed step fails the sequences in flight; the waiting ones and the engine go on."""
        for seq in [*self.scheduler.running]:
            seq.error = error
            self.scheduler.finish(seq, "error")
        return self._collect(StepOutputs())

    def _unload(self, queued: list[EngineRequest], error: LocalrtError) -> list[EngineOutput]:
        outputs = StepOutputs()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.error = error
            self.scheduler.finish(seq, "error")
        for request in queued:
            outputs.end(request, "error", error)
        return self._collect(outputs)


def fill_scores(scores: Any, tokens: list[int], start: int, logits: torch.Tensor) -> None:
    """Rows `logits` [m, V] after tokens[start .. start+m-1] into a `ScoreResult`: each row scores the
    token that follows (the prompt's last token scores nothing). Log-softmax and gather on the device:
    only the chosen logprobs cross to the host."""
    m = min(len(logits), len(tokens) - 1 - start)
    if m <= 0:
        return
    rows = logits[:m].float()
    targets = torch.tensor(tokens[start + 1 : start + 1 + m], device=rows.device)
    lp = torch.log_softmax(rows.double(), -1)
    scores.logprobs[start : start + m] = lp.gather(1, targets[:, None]).squeeze(1).cpu().numpy()
    if scores.logits is not None:
        scores.logits[start : start + m] = rows.cpu().numpy()


def _ngram_of(seq: Sequence) -> NgramProposer:
    assert seq.spec is not None and seq.spec.ngram is not None
    return seq.spec.ngram


def _graphs_available(device: torch.device) -> bool:
    return device.type == "cuda" and fused_available(device)  # the graphs' attention is the Triton kernel
