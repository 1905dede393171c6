"""Prompt lookup ("lookup" speculation, vLLM's n-gram method), shared by every engine: the draft
tokens are what followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from collections.abc import Sequence

LOOKUP_NGRAM_SIZES = (4, 3, 2)  # longest first: longer matches predict better


class NgramProposer:
    """One request's n-gram index over its tokens so far; proposes the tokens that followed the latest
    earlier occurrence of its last n tokens (where they run up to the present, their repetition).

    The index grows with the history (each call indexes only the new n-grams), so proposing is
    amortised O(new tokens) per step rather than a scan of the whole context. Nothing runs a model:
    its draft tokens cost nothing to propose and are deterministic (q one-hot in the verifier).
    """

    cost_per_draft = 0.0

    def __init__(self, sizes: Sequence[int] = LOOKUP_NGRAM_SIZES) -> None:
        self.sizes = tuple(sizes)
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed_to = 0  # n-grams ending before this position are indexed

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens after `history` (none when its tail was not seen before)."""
        end = len(history) - 1  # the n-gram ending at the last token must not find itself
        for n in self.sizes:
            table = self.index[n]
            for e in range(max(self.indexed_to, n), end + 1):
                table[tuple(history[e - n : e])] = e
        self.indexed_to = max(self.indexed_to, end + 1)
        for n in self.sizes:
            if len(history) < n:
                continue
            pos = self.index[n].get(tuple(history[-n:]))
            if pos is not None:
                drafts = list(history[pos : pos + k])
                # a continuation that reaches the present goes on with itself: the tokens since the match
                # repeat with its period (a text in a loop)
                period = len(history) - pos
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []
