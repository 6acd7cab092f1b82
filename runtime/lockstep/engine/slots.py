"""The runner's KV slots as the scheduler sees them: who runs in each, what a free one still caches.

Why it exists: the runner (runner.py, recompute.py) holds one KV cache row per slot and knows nothing
about requests. The scheduler decides which request uses which slot from this table: a running slot
belongs to its Sequence (its KV is valid for `tokens[:kv_len]`); a free slot keeps the KV of the last
sequence that ran in it as prefix cache, until the slot is needed (least recently used first).

Who calls it: lockstep.engine.scheduler only.
"""

from __future__ import annotations

import itertools

from lockstep.engine.requests import Sequence


def common_prefix(a: list[int], b: list[int], cap: int) -> int:
    """Length of the common prefix of a and b, at most cap."""
    n = min(len(a), len(b), cap)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotTable:
    """Slot -> running Sequence, or the tokens whose KV a free slot still holds; an LRU clock per slot."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        """KV slots in the runner (max_running_requests)."""
        self.running: dict[int, Sequence] = {}
        """Slot -> the sequence that owns it."""
        self.cached: list[list[int]] = [[] for _ in range(slots)]
        """Valid KV of each free slot (empty while running: the sequence describes the slot)."""
        self.cached_adapter: list[str | None] = [None] * slots
        """The LoRA adapter that computed each free slot's KV (None: the base): KV is per policy."""
        self._used = [0] * slots  # LRU clock per slot
        self._clock = itertools.count(1)

    def longest_prefix(
        self, tokens: list[int], cap: int, taken: set[int], adapter: str | None = None
    ) -> tuple[int, int]:
        """(slot, length) of the longest valid KV prefix of `tokens` (at most cap) outside `taken`,
        computed with the same LoRA adapter (or none); (-1, 0) when no slot shares a token."""
        best, best_len = -1, 0
        for s in range(self.slots):
            if s in taken:
                continue
            run = self.running.get(s)  # a running slot's KV is valid for its tokens[:kv_len]
            if (run.adapter if run is not None else self.cached_adapter[s]) != adapter:
                continue  # KV of another adapter (or of the base) is another policy's
            if run is None:
                n = common_prefix(self.cached[s], tokens, cap)
            else:
                n = common_prefix(run.tokens, tokens, min(cap, run.kv_len))
            if n > best_len:
                best, best_len = s, n
        return best, best_len

    def free_slot(self, avoid: set[int]) -> int | None:
        """A slot no sequence runs in, outside `avoid`: an empty one first, then the least recently used."""
        free = [s for s in range(self.slots) if s not in self.running and s not in avoid]
        if not free:
            return None
        return min(free, key=lambda s: (bool(self.cached[s]), self._used[s]))

    def touch(self, slot: int) -> None:
        """The slot was used this step (LRU)."""
        self._used[slot] = next(self._clock)

    def release(self, seq: Sequence) -> None:
        """The sequence leaves its slot; the slot keeps its KV as prefix cache."""
        if seq.slot >= 0 and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.cached[seq.slot] = seq.tokens[: seq.kv_len]
            self.cached_adapter[seq.slot] = seq.adapter
        seq.slot = -1

    def retract(self) -> list[Sequence]:
        """Take every running sequence out of its slot (their tokens kept; the KV stays cached, valid
        until the weights change); returns them from the highest slot down."""
        out = []
        for slot in sorted(self.running, reverse=True):
            seq = self.running.pop(slot)
            self.cached[slot] = seq.tokens[: seq.kv_len]
            self.cached_adapter[slot] = seq.adapter
            seq.slot, seq.kv_len = -1, 0
            out.append(seq)
        return out

    def drop_adapter(self, adapter: str) -> None:
        """Forget the cached KV an adapter computed (it is being unloaded)."""
        for s in range(self.slots):
            if s not in self.running and self.cached_adapter[s] == adapter:
                self.cached[s], self.cached_adapter[s] = [], None

    def flush(self) -> int:
        """Forget the cached KV of every free slot; returns how many were dropped."""
        n = 0
        for s in range(self.slots):
            if s not in self.running and self.cached[s]:
                self.cached[s] = []
                n += 1
        return n
