"""The engine: one model, one paged KV cache, a scheduler, and a loop that runs steps.

A step = schedule -> (guess) -> one batched forward over every scheduled chunk -> sample (every plain
decode in one batch, one host sync) or verify per sequence -> commit. On CUDA, a step made only of
single-token decodes replays a captured CUDA graph instead (`cuda_graphs.DecodeGraphs`). `step()` is
synchronous (tests drive it directly); `start()` runs it in a background thread that also executes
jobs (`call`, for score/embed) between steps.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch

from localrt.backends.base import CancelToken, SamplingParams
from localrt.backends.grammar import Grammar
from localrt.errors import LocalrtError

from .attention import PagedAttention, SeqChunk, fused_available
from .cuda_graphs import DecodeGraphs
from .kv_cache import BLOCK_SIZE, BlockPool, KVCache, num_blocks_for
from .model import DenseCausal, Transformer
from .prefix_cache import PrefixCache
from .sampling import RequestSampler, sample_batch
from .scheduler import Scheduled, Scheduler, Sequence
from .speculative import (
    DEFAULT_NUM_DRAFT,
    DraftModelProposer,
    LookupProposer,
    Proposal,
    SelfProposer,
    SpecState,
    verify,
)

# Extra query rows are not free on a CPU (compute-bound); on a GPU decode is bandwidth-bound.
VERIFY_COST_PER_DRAFT = {"cpu": 0.25, "cuda": 0.03}


@dataclass
class EngineConfig:
    context_length: int = 4096  # longest sequence (prompt + output)
    kv_cache_type: str = "f16"
    kv_budget_bytes: int | None = None  # None: room for `kv_budget_seqs` full-length sequences
    kv_budget_seqs: int = 4
    max_seqs: int = 16  # sequences decoding together
    max_batch_tokens: int = 512  # tokens per step (prefill chunk + decodes + guesses)
    prefix_caching: bool = True
    self_spec_layers: int | None = None  # None: four fifths of the layers (shallower exits rarely agree)
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = BLOCK_SIZE
    cuda_graphs: bool = True  # decode-only steps replay captured graphs (CUDA with Triton only)


@dataclass
class _Work:
    plan: list[Scheduled]
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # plan index -> logits rows [a, b)
    q: dict[int, torch.Tensor | None] = field(default_factory=dict)


class Engine:
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
        dtype = model.token_embd.weight.dtype
        per_block = KVCache.bytes_per_block(
            cfg.block_count,
            cfg.attention_head_count_kv,
            cfg.attention_key_length,
            config.kv_cache_type,
            config.block_size,
        )
        budget = config.kv_budget_bytes
        if budget is None:
            budget = per_block * -(-config.context_length // config.block_size) * config.kv_budget_seqs
        num_blocks = num_blocks_for(budget, per_block)
        self.pool = BlockPool(num_blocks, config.block_size)
        use_graphs = config.cuda_graphs and _graphs_available(self.device)
        # graphs pad the batch; padded rows write their K/V into one extra block the pool never hands out
        self.cache = KVCache(
            cfg.block_count,
            num_blocks + (1 if use_graphs else 0),
            cfg.attention_head_count_kv,
            cfg.attention_key_length,
            config.kv_cache_type,
            dtype,
            self.device,
            config.block_size,
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
            max_batch_tokens=config.max_batch_tokens,
            max_seqs=config.max_seqs,
        )
        self.scheduler.on_release = self._release_spec
        verify_cost = VERIFY_COST_PER_DRAFT.get(self.device.type, 0.1)
        layers = config.self_spec_layers or max(1, cfg.block_count - cfg.block_count // 5)
        self.proposers: dict[str, Any] = {
            "lookup": LookupProposer(),
            "self": SelfProposer(model, self.cache, self.device, layers),
        }
        self.verify_cost = verify_cost
        self.draft_model = draft_model
        if draft_model is not None:
            self.proposers["draft"] = self._make_draft_proposer(draft_model, num_blocks)
        self.eos = set(config.eos_token_ids)
        self.dense_attention: Callable[[int, torch.device], Any] = DenseCausal  # the whole-sequence passes
        self._ids = count()
        # threaded mode
        self._cv = threading.Condition()
        self._inbox: deque[Sequence] = deque()
        self._jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0

    def _make_draft_proposer(self, draft: Transformer, num_blocks: int) -> DraftModelProposer:
        dc = draft.cfg
        if dc.vocab_size != self.model.cfg.vocab_size:
            raise LocalrtError("the draft model does not share the model's vocabulary")
        dtype = draft.token_embd.weight.dtype
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
    ) -> Sequence:
        tokens = list(prompt)
        ctx = self.config.context_length
        if not tokens:
            raise LocalrtError("the prompt is empty")
        if len(tokens) >= ctx:
            raise LocalrtError(
                f"the prompt is {len(tokens)} tokens, which does not fit the context length of "
                f"{ctx} tokens (raise num_ctx or shorten the input)"
            )
        room = ctx - len(tokens)
        max_len = len(tokens) + (room if max_new < 0 else min(max_new, room))
        seq = Sequence(
            next(self._ids),
            tokens,
            len(tokens),
            max_len,
            RequestSampler(sampling, self.device, ctx, grammar),
            cancel or CancelToken(),
        )
        if speculative not in ("off", "auto"):
            if speculative not in self.proposers:
                raise LocalrtError(
                    f"speculative mode {speculative!r} needs a draft model"
                    if speculative == "draft"
                    else f"speculative mode {speculative!r} is not supported"
                )
            proposer = self.proposers[speculative]
            k = num_draft or DEFAULT_NUM_DRAFT[speculative]
            seq.spec = SpecState(speculative, k, proposer.cost_per_draft + self.verify_cost)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (engine thread or synchronous use)."""
        self.scheduler.add(seq)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence from any thread."""
        with self._cv:
            if self._stopping:
                raise LocalrtError("the model was unloaded")
            self._inbox.append(seq)
            self._cv.notify()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one iteration; returns whether work remains."""
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            if seq.cancel.cancelled:
                sched.finish(seq, "cancel")  # frees its blocks at once
        plan = sched.schedule(self._draft_len)
        if not plan:
            return sched.has_work
        work = _Work(plan)
        self._propose(work)
        feed: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        for i, item in enumerate(plan):
            seq = item.seq
            start = seq.num_computed
            tokens = seq.tokens[start : start + item.num_tokens] + item.drafts
            chunks.append(SeqChunk(len(tokens), start + len(tokens), seq.block_table))
            if start + item.num_tokens == len(seq.tokens):  # caught up: logits for the last token (+ guesses)
                first = len(feed) + item.num_tokens - 1
                work.rows[i] = (len(rows), len(rows) + 1 + len(item.drafts))
                rows.extend(range(first, len(feed) + len(tokens)))
            feed.extend(tokens)
        if self.graphs is not None and len(feed) == len(rows) == len(plan) and self.graphs.fits(len(plan)):
            logits = self.graphs.run(feed, chunks)  # every item is one decode token, logits row i for item i
        else:
            ctx = PagedAttention(self.cache, chunks, self.device)
            tokens_t = torch.tensor(feed, dtype=torch.long, device=self.device)
            logits = self.model(tokens_t, ctx, rows=torch.tensor(rows, dtype=torch.long, device=self.device))
        self.steps += 1
        sampled = self._sample(work, logits)
        for i, item in enumerate(plan):
            span = work.rows.get(i)
            self._advance(
                item, None if span is None else logits[span[0] : span[1]], work.q.get(i), sampled.get(i)
            )
        return sched.has_work

    def _sample(self, work: _Work, logits: torch.Tensor) -> dict[int, int]:
        """Plan index -> token for every plain decode (no guesses, no grammar), with one host sync in all."""
        members = [
            i
            for i, item in enumerate(work.plan)
            if i in work.rows and not item.drafts and item.seq.sampler.grammar is None
        ]
        if not members:
            return {}
        seqs = [work.plan[i].seq for i in members]
        tokens = sample_batch(
            [s.sampler for s in seqs], [logits[work.rows[i][0]] for i in members], [s.tokens for s in seqs]
        )
        return dict(zip(members, tokens))

    @property
    def graph_replays(self) -> int:
        """Steps that replayed a captured CUDA graph (0 off CUDA or with `cuda_graphs=False`)."""
        return 0 if self.graphs is None else self.graphs.replays

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
            proposals: list[Proposal] = self.proposers[mode].propose(
                [work.plan[i].seq for i in members], [work.plan[i].num_draft for i in members]
            )
            for i, proposal in zip(members, proposals):
                n = min(len(proposal.tokens), work.plan[i].num_draft)
                work.plan[i].drafts = proposal.tokens[:n]
                work.q[i] = None if proposal.q is None else proposal.q[:n]

    def _advance(
        self, item: Scheduled, logits: torch.Tensor | None, q: torch.Tensor | None, token: int | None = None
    ) -> None:
        seq, sched = item.seq, self.scheduler
        seq.num_computed += item.num_tokens
        if seq.first_token_ns == 0:
            seq.prefill_fed += item.num_tokens
        if logits is None:  # a prefill chunk that has not reached the end of the prompt
            sched.commit(seq)
            return
        if item.drafts:
            new_tokens, accepted = verify(seq.sampler, logits, item.drafts, q, seq.tokens)
            seq.num_computed += accepted
            assert seq.spec is not None
            seq.spec.record(len(item.drafts), accepted)
            seq.timings.draft_count += len(item.drafts)
            seq.timings.draft_accepted_count += accepted
        elif token is not None:  # sampled with the rest of the batch
            new_tokens = [token]
        else:
            new_tokens = [seq.sampler.sample(logits[0], seq.tokens)]
        if seq.first_token_ns == 0:
            seq.first_token_ns = time.perf_counter_ns()
        reason = None
        for j, token in enumerate(new_tokens):
            seq.tokens.append(token)
            if token in self.eos:
                reason = "stop"
            elif seq.on_token is not None and seq.on_token(seq, token, logits[j]):
                reason = "stop"
            elif len(seq.tokens) >= seq.max_len:
                reason = "length"
            if reason is not None:
                break
        # KV past the kept tokens (a guess after an early stop) is never looked at again
        seq.num_computed = min(seq.num_computed, len(seq.tokens))
        if reason is not None:
            sched.finish(seq, reason)
        else:
            sched.commit(seq)

    def _release_spec(self, seq: Sequence) -> None:
        if seq.spec is not None and seq.spec.mode in self.proposers:
            self.proposers[seq.spec.mode].release(seq)

    def run(self, seqs: Iterable[Sequence] = ()) -> None:
        """Synchronous: queue seqs and step until nothing is left."""
        for seq in seqs:
            self.add(seq)
        while self.step():
            pass

    # ---- whole-sequence passes (score, embed) -------------------------------------------------
    @torch.inference_mode()
    def hidden_states(self, tokens: list[int]) -> torch.Tensor:
        """Final-normed hidden states [n, dim] of one sequence, dense (no cache)."""
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model.hidden(t, self.dense_attention(len(tokens), self.device))

    # ---- threaded mode ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run fn on the engine thread between steps."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise LocalrtError("the model was unloaded")
            self._jobs.append((fn, future))
            self._cv.notify()
        return future

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]:
            seq.error = LocalrtError("the model was unloaded")
            self.scheduler.finish(seq, "error")
        self._inbox.clear()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._jobs or self.scheduler.has_work):
                        self._cv.wait()
                    if self._stopping:
                        jobs = list(self._jobs)
                        self._jobs.clear()
                        for _, future in jobs:
                            future.set_exception(LocalrtError("the model was unloaded"))
                        return
                    jobs = list(self._jobs)
                    self._jobs.clear()
                    while self._inbox:
                        self.scheduler.add(self._inbox.popleft())
                for fn, future in jobs:
                    try:
                        future.set_result(fn())
                    except BaseException as e:
                        future.set_exception(e)
                try:
                    self.step()
                except Exception as e:  # a failed step fails the sequences in flight, the engine goes on
                    for seq in [*self.scheduler.running]:
                        seq.error = e
                        self.scheduler.finish(seq, "error")


def _graphs_available(device: torch.device) -> bool:
    return device.type == "cuda" and fused_available(device)  # the graphs' attention is the Triton kernel
