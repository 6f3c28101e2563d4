"""Prefix reuse (RFC §6.6): completed prompts publish their leading whole units (BF16
blocks on every depth plane, and which rows ran each depth under token-sparse prefill); a
later prompt that starts with the same tokens shares those blocks and runs only the rest.

A unit is the least common multiple of the block size and the selection window: a prefix
of whole windows chose its rows from its own tokens alone (scores per token, budgets per
window), so a later suffix cannot change it; a partially shared window is recomputed.
Within one engine the model and the backend's configuration are fixed, so the tokens are
the identity. Published blocks are read, never written: copy-on-exit and new tokens write
positions past them, and packing reads them in place before giving the request's
reference back."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashloop_backend.host.kvcache import PagedKVCache


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    blocks: list[list[int]]  # [depth plane] -> block ids of positions [0, len(tokens))
    active: torch.Tensor | None  # [depths, len(tokens)] bool: rows that ran each depth
    last_used: int
    keys: int = 0  # lookup keys that still lead here
    packed: object | None = None  # the backend's hold of the prompt's stored (packed) rows


class PrefixCache:
    def __init__(
        self,
        kv: PagedKVCache,
        window_size: int | None,
        drop_packed: Callable[[object], None] | None = None,
        frees_on_drop: Callable[[object], bool] | None = None,
    ) -> None:
        """``drop_packed``: gives back an entry's hold of packed rows when it is dropped;
        ``frees_on_drop``: whether that would return a packed page to the pool."""
        self.kv, self.drop_packed = kv, drop_packed
        self.frees_on_drop = frees_on_drop or (lambda _: False)
        self.unit = math.lcm(kv.block_size, window_size or 1)
        self._by_key: dict[tuple[int, int], tuple[_Entry, int]] = {}  # (hash, length)
        self._entries: list[_Entry] = []
        self._clock = 0
        self.lookups = self.hits = self.reused_tokens = 0

    def _keys(self, tokens) -> list[tuple[tuple[int, int], int]]:
        """(key, length) at every whole unit of ``tokens``: a chained hash (one pass)."""
        keys, digest = [], 0
        for end in range(self.unit, len(tokens) + 1, self.unit):
            digest = hash((digest, tuple(tokens[end - self.unit : end])))
            keys.append(((digest, end), end))
        return keys

    def lookup(self, prompt: list[int]) -> tuple[int, _Entry | None]:
        """(positions to reuse, their entry): the longest published whole-unit prefix of
        ``prompt`` that leaves its last token to compute (it predicts the first output).
        The longest key found by hash is confirmed by one comparison of its tokens, and a
        shorter one tried after a collision. Counted by :meth:`record` once the request is
        admitted with it."""
        found = []
        for key, _ in self._keys(prompt[: len(prompt) - 1]):
            if key not in self._by_key:
                break
            found.append(self._by_key[key])
        for entry, length in reversed(found):
            if entry.tokens[:length] == tuple(prompt[:length]):
                return length, entry
        return 0, None

    def common_units(self, published: list[int], prompt: list[int]) -> int:
        """Positions of the whole units ``prompt`` could reuse once ``published`` (a prompt
        still prefilling) is published: their common start, in whole units, below
        ``prompt``'s last token and within ``published``'s whole units."""
        limit = min(len(published) // self.unit * self.unit, len(prompt) - 1)
        same = 0
        while same < limit and published[same] == prompt[same]:
            same += 1
        return same // self.unit * self.unit

    def record(self, length: int, entry: _Entry | None) -> None:
        """An admitted request reused ``length`` positions of ``entry`` (0, None: a miss)."""
        self.lookups += 1
        if entry is not None:
            self.hits += 1
            self.reused_tokens += length
            self._clock += 1
            entry.last_used = self._clock

    def shared_blocks(self, entry: _Entry, length: int) -> list[list[int]]:
        return [plane[: length // self.kv.block_size] for plane in entry.blocks]

    def publish(
        self, prompt: list[int], request_id: int, active: torch.Tensor | None
    ) -> _Entry | None:
        """Publish the whole units of a prompt that has run every depth (its blocks then
        hold their final KV). ``active`` [depths, len(prompt)] bool or None (all ran).
        Returns the entry (None: no whole unit)."""
        length = len(prompt) // self.unit * self.unit
        if not length:
            return None
        blocks = [
            self.kv.block_table(request_id, depth)[: length // self.kv.block_size]
            for depth in range(self.kv.num_depths)
        ]
        self.kv.retain([b for plane in blocks for b in plane])
        self._clock += 1
        entry = _Entry(tuple(prompt[:length]), blocks, None, self._clock)
        if active is not None:
            entry.active = active[:, :length].clone()
        for key, end in self._keys(prompt[:length]):
            old = self._by_key.get(key)
            self._by_key[key] = (entry, end)
            entry.keys += 1
            if old is not None:
                old[0].keys -= 1
                if old[0].keys == 0:  # no lookup reaches it any more
                    self._drop(old[0])
        self._entries.append(entry)
        return entry

    def attach_packed(self, entry: _Entry, packed: object) -> None:
        """The backend's hold of the entry's stored rows, once its prompt is packed (given
        straight back when the entry is gone already)."""
        if any(e is entry for e in self._entries):
            entry.packed = packed
        elif self.drop_packed is not None:
            self.drop_packed(packed)

    def evict_one(self, packed: bool = False) -> bool:
        """Drop the least recently used entry that frees a block (one no running request
        shares), or with ``packed`` a packed page; False when no entry would."""
        if packed:
            freeing = [
                e for e in self._entries if e.packed is not None and self.frees_on_drop(e.packed)
            ]
        else:
            freeing = [e for e in self._entries if self._cache_only(e)]
        if not freeing:
            return False
        entry = min(freeing, key=lambda e: e.last_used)
        for key, (found, _) in list(self._by_key.items()):
            if found is entry:
                del self._by_key[key]
        self._drop(entry)
        return True

    def _cache_only(self, entry: _Entry) -> list[int]:
        return [b for plane in entry.blocks for b in plane if self.kv.holders(b) == 1]

    def clear(self) -> None:
        """Drop every entry: blocks no request shares go back to the pool now."""
        for entry in list(self._entries):
            self._drop(entry)
        self._by_key.clear()

    def _drop(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        self.kv.give_back([b for plane in entry.blocks for b in plane])
        if entry.packed is not None and self.drop_packed is not None:
            self.drop_packed(entry.packed)
            entry.packed = None

    def held(self) -> dict[str, int]:
        """Entries, distinct blocks they hold, and those no request holds (every holder an
        entry: entries of prompts with a common start share its blocks)."""
        refs = Counter(b for e in self._entries for plane in e.blocks for b in plane)
        only = sum(self.kv.holders(b) == n for b, n in refs.items())
        return {
            "prefix_entries": len(self._entries),
            "prefix_entries_packed": sum(e.packed is not None for e in self._entries),
            "prefix_blocks": len(refs),
            "prefix_blocks_cache_only": only,
        }
