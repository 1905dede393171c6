"""The prompt cache: finished sequences' KV caches, kept for the conversations that come back.

An entry is the tokens a sequence's caches hold and those caches. A new request starts from the
entry sharing the longest prefix with its prompt: it gets a copy of that prefix (`Cache.prefix`; the
entry stays, another request may reuse it too) and evaluates only the rest. Entries live in LRU
order under a byte budget: a hit makes an entry the most recent, an insert evicts the least recent
ones only while the total is over the budget, and an entry whose tokens start another, newer
entry's (the same conversation's earlier turn) is dropped as redundant.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from itertools import count
from typing import Any

from localrt.backends.base import common_prefix


@dataclass
class Entry:
    tokens: tuple[int, ...]
    caches: list[Any]  # per layer; never written once kept (a hit gets copies: `Cache.prefix`)
    nbytes: int = field(init=False)
    # the shortest prefix every layer can give (sliding layers keep only a tail)
    min_prefix: int = field(init=False)

    def __post_init__(self) -> None:
        # fixed while the entry is kept, so counted once (`insert` sums every entry's size)
        self.nbytes = sum(c.nbytes for c in self.caches)
        self.min_prefix = max((c.min_prefix for c in self.caches), default=0)


@dataclass(eq=False)
class PromptCache:
    budget_bytes: int
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict, init=False)  # least recent first
    _ids: Iterator[int] = field(default_factory=count, init=False)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def lookup(self, prompt: Sequence[int], keep_last: int = 1) -> tuple[list[Any] | None, int]:
        """Caches holding the longest cached prefix of `prompt` (leaving at least `keep_last` tokens
        to evaluate), and its length; (None, 0) when nothing is shared."""
        best, best_n = None, 0
        limit = max(0, len(prompt) - keep_last)
        for key, entry in self.entries.items():
            n = min(common_prefix(entry.tokens, prompt), limit)
            if n < entry.min_prefix:
                continue  # its sliding layers no longer hold the window before position n
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return [c.prefix(best_n) for c in self.entries[best].caches], best_n

    def insert(self, tokens: Sequence[int], caches: list[Any]) -> None:
        """Keep a finished sequence's caches (holding exactly `tokens`), evicting under the budget."""
        if not tokens:
            return
        entry = Entry(tuple(tokens), caches)
        for key in [k for k, e in self.entries.items() if entry.tokens[: len(e.tokens)] == e.tokens]:
            del self.entries[key]  # an earlier turn of this conversation: the new entry covers it
        if entry.nbytes > self.budget_bytes:
            return
        self.entries[next(self._ids)] = entry
        total = self.nbytes
        while total > self.budget_bytes:
            _, old = self.entries.popitem(last=False)
            total -= old.nbytes

    def clear(self) -> None:
        self.entries.clear()
