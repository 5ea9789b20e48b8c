"""An expert cache any policy can keep on the GPU across layers and steps (options
`expert_cache=C`, `cache_policy=lru|lfu|hot-pinned`).

The emitter asks the cache before copying an expert: a hit reuses the buffer a copy filled
earlier (no transfer); a miss copies it and, when the cache is full, evicts an entry — the copy
that replaces it waits for the evicted buffer's last use and frees it. An entry fetched but not
yet used is never evicted (its compute op has not been emitted), so a cache smaller than one
layer's working set simply caches less. Policies free expert buffers as without a cache; the
emitter keeps the ones the cache holds.

- `lru`: evict the least recently used entry.
- `lfu`: evict the entry used least often so far (ties: the least recently used).
- `hot-pinned`: hold the C experts used most on the warm-up sequences for the whole run (loaded
  on first use, never evicted); every other expert streams as without a cache.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from klotski_sim.util.errors import UsageError

CACHE_POLICIES = ("lru", "lfu", "hot-pinned")
Key = tuple[int, int]  # (layer, expert)


@dataclass
class ExpertCache:
    slots: int
    policy: str
    pinned: frozenset[Key] = frozenset()  # hot-pinned: the experts it keeps
    entries: "OrderedDict[Key, str]" = field(default_factory=OrderedDict)  # key -> buffer, oldest use first
    last_use: dict[str, str] = field(default_factory=dict)  # buffer -> the last op that used it
    uses: Counter = field(default_factory=Counter)  # key -> uses so far (lfu)
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 0:
            raise UsageError(f"expert_cache must be a number of experts >= 0, got {self.slots!r}")
        if self.policy not in CACHE_POLICIES:
            raise UsageError(f"cache_policy must be one of {CACHE_POLICIES}, got {self.policy!r}")

    @staticmethod
    def hot_set(
        warmup_experts: np.ndarray | None,
        num_layers: int,
        num_experts: int,
        slots: int,
        moe_layers: Sequence[int] | None = None,
    ) -> frozenset[Key]:
        """The `slots` (layer, expert) pairs used most on the warm-up sequences, among the layers
        with experts (`moe_layers`, default every layer)."""
        routed = range(num_layers) if moe_layers is None else moe_layers
        counts = np.full((num_layers, num_experts), -1, dtype=np.int64)
        for layer in routed:
            counts[layer] = 0
            if warmup_experts is not None and len(warmup_experts):
                counts[layer] = np.bincount(warmup_experts[:, layer, :].ravel(), minlength=num_experts)[:num_experts]
        order = np.argsort(-counts.ravel(), kind="stable")[:slots]
        return frozenset((int(i) // num_experts, int(i) % num_experts) for i in order)

    def lookup(self, key: Key) -> str | None:
        """The buffer holding `key`, counting a hit or a miss."""
        buffer = self.entries.get(key)
        if buffer is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        self.uses[key] += 1
        self.last_use.pop(buffer, None)  # fetched again: in flight until its next use, not evictable
        return buffer

    def admit(self, key: Key) -> tuple[bool, str | None, str | None]:
        """Whether `key` will be cached once copied, and the evicted buffer (with its last use) to
        free first. Nothing is evicted that was fetched but not yet used."""
        if self.slots == 0 or (self.policy == "hot-pinned" and key not in self.pinned):
            return False, None, None
        if len(self.entries) < self.slots:
            return True, None, None
        evictable = [k for k in self.entries if self.entries[k] in self.last_use]
        if self.policy == "hot-pinned" or not evictable:
            return False, None, None
        victim = min(evictable, key=lambda k: self.uses[k]) if self.policy == "lfu" else evictable[0]
        buffer = self.entries.pop(victim)
        return True, buffer, self.last_use.pop(buffer)

    def insert(self, key: Key, buffer: str) -> None:
        self.entries[key] = buffer
        self.uses[key] += 1

    def holds(self, buffer: str) -> bool:
        return buffer in self.entries.values()

    def used_by(self, buffer: str, op: str) -> None:
        if self.holds(buffer):
            self.last_use[buffer] = op

    def stats(self) -> dict[str, float | int | str]:
        total = self.hits + self.misses
        return {
            "slots": self.slots,
            "policy": self.policy,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / total if total else 0.0,
        }
