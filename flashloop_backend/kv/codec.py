"""The torch reference of the packed encoding, as :class:`~flashloop_backend.kv.store.
PackedKVStore` methods and the oracle :class:`LevelWriter`: a level quantized against the
running reconstruction and laid out in v3 blocks, pages decoded back, and a sequence's
reconstruction at a depth (what every reader is tested against)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from flashloop_backend.algorithms import QuantizedInt4, dequantize_int4, quantize_int4, unpack_codes
from flashloop_backend.device_copy import to_device
from flashloop_backend.kv.layout import pack_row, param_channels
from flashloop_backend.kv.rows import KVRows

if TYPE_CHECKING:
    from flashloop_backend.kv.store import PackedKVStore


class ReferenceCodec:
    """Encoding and decoding a store's pages in torch (a mixin of
    :class:`~flashloop_backend.kv.store.PackedKVStore`)."""

    def encode_level(
        self, k, v, recon_k, recon_v, present, pages: list[int], layers: slice, quantize
    ):
        """Quantize one level of ``layers`` (k, v [T, Lb, Hkv, D], residuals against the
        running reconstruction, only the ``present`` rows when compact) into ``pages``;
        return the updated reconstruction."""
        g = self.group_size
        target_k = k.float() if recon_k is None else k.float() - recon_k
        target_v = v.float() if recon_v is None else v.float() - recon_v
        if present is not None:
            target_k, target_v = target_k[present], target_v[present]
        count = target_k.shape[0]
        padded = len(pages) * g
        if padded != count:  # a compact level's last group: repeat its last row
            fill = torch.arange(padded, device=k.device).clamp(max=count - 1)
            target_k, target_v = target_k[fill], target_v[fill]
        qk = quantize(target_k, g, 0)  # per channel across rows
        qv = quantize(target_v, g, -1)  # per row across channels
        self._write(pages, layers, qk, qv)
        dk, dv = dequantize_int4(qk)[:count], dequantize_int4(qv)[:count]
        return _accumulate(recon_k, recon_v, dk, dv, present)

    def add_level(self, recon_k, recon_v, pages: list[int], present, layers: slice):
        """The running reconstruction (FP32 [T, Lb, Hkv, D] or None before level 0) plus
        one stored level of ``layers`` read from its ``pages`` (its compact rows
        ``present``; None: dense), as :meth:`encode_level` adds the level it writes."""
        count = len(pages) * self.group_size if present is None else present.numel()
        dk, dv = (part[:count] for part in self._decode_pages(pages, layers))
        if recon_k is not None:
            dk, dv = dk.to(recon_k.device), dv.to(recon_k.device)
        return _accumulate(recon_k, recon_v, dk, dv, present)

    def _write(self, pages: list[int], layers: slice, qk: QuantizedInt4, qv: QuantizedInt4) -> None:
        """``layers`` (Lb of them): qk codes [Lb, H, D, Pg, g/2] (groups along rows) and qv
        codes [T, Lb, H, D/g, g/2] (groups along channels), laid out as v3 blocks."""
        device = self.blocks.device
        lb = qk.codes.shape[0]
        _, heads, dim = self.shape
        g, count = self.group_size, len(pages)
        layout = self.layout
        k_codes = unpack_codes(qk).permute(3, 0, 1, 4, 2)  # [Pg, Lb, H, g tokens, D]
        columns = param_channels(dim, qk.scale.device)
        k_scale = qk.scale.permute(3, 0, 1, 2)[..., columns]  # [Pg, Lb, H, D]
        k_min = qk.minimum.permute(3, 0, 1, 2)[..., columns]
        v_codes = unpack_codes(qv).reshape(count, g, lb, heads, dim).permute(0, 2, 3, 1, 4)
        records = torch.stack((qv.minimum, qv.scale), -1)  # [T, Lb, H, D/g, 2]
        records = records.reshape(count, g, lb, heads, dim // g, 2).permute(0, 2, 3, 1, 4, 5)
        block = torch.cat(
            (
                pack_row(k_codes).flatten(-2),
                pack_row(v_codes).flatten(-2),
                k_scale.contiguous().view(torch.uint8),
                k_min.contiguous().view(torch.uint8),
                records.contiguous().view(torch.uint8).flatten(-3),
            ),
            dim=-1,
        )
        assert block.shape[-1] == layout.block_bytes
        index = to_device(torch.tensor(pages, dtype=torch.long), device)[:, None]
        at = (index, torch.arange(layers.start, layers.start + lb, device=device)[None, :])
        self.blocks[at] = block.to(device)

    def reconstruct(
        self, sequence: int, depth: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 K and V [T, Hkv, D] of ``sequence`` at ``depth`` and ``layer`` (the oracle
        the readers are tested against)."""
        levels = self.sequences[sequence]
        rows = levels.rows
        total_k = total_v = None
        for level in range(depth + 1):
            pages, mapping = levels.pages[level], levels.maps[level]
            if not pages:
                continue
            k, v = self._decode_pages(pages, layer)
            if mapping is None:
                total_k = k if total_k is None else total_k + k
                total_v = v if total_v is None else total_v + v
            else:
                present = mapping >= 0
                total_k[present] += k[mapping[present].long()]
                total_v[present] += v[mapping[present].long()]
        return total_k[:rows], total_v[:rows]

    def _decode_pages(
        self, pages: list[int], layers: int | slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 K and V [P * g, (Lb,) H, D] of ``pages`` at one layer or a slice of them."""
        index = to_device(torch.tensor(pages, dtype=torch.long), self.blocks.device)
        blocks = self.blocks[index, layers]  # [P, (Lb,) H, block bytes]
        k = self.layout.keys(blocks).movedim(-2, 1)  # [P, g, (Lb,) H, D]
        v = self.layout.values(blocks).movedim(-2, 1)
        return k.flatten(0, 1), v.flatten(0, 1)


def _accumulate(recon_k, recon_v, dk, dv, present):
    """The running reconstruction plus one level's values (of its ``present`` rows when
    compact; the first level, dense, starts it)."""
    if present is None:
        return (dk, dv) if recon_k is None else (recon_k + dk, recon_v + dv)
    recon_k, recon_v = recon_k.clone(), recon_v.clone()
    recon_k[present] += dk
    recon_v[present] += dv
    return recon_k, recon_v


class LevelWriter(Protocol):
    """Writes every level of one append into its pages (the ``packed_kv_write`` op):
    ``rows`` per depth its K and V (:class:`~flashloop_backend.kv.rows.KVRows`, in place in
    paged pools or as tensors), None for a level not written (one stored before, read from
    its ``pages``, or one above the written ones, with no pages); ``presents`` per depth
    the rows of a compact level (None: dense); ``pages`` per depth its page ids. Residuals
    are taken against the reconstruction of the levels before, as
    :func:`encode_levels_chain` does."""

    def __call__(
        self,
        store: PackedKVStore,
        rows: list[KVRows | None],
        presents: list[torch.Tensor | None],
        pages: list[list[int]],
    ) -> None: ...


def encode_levels_chain(
    store: PackedKVStore,
    rows: list[KVRows | None],
    presents: list[torch.Tensor | None],
    pages: list[list[int]],
    quantize=quantize_int4,
) -> None:
    """The oracle :class:`LevelWriter`: ``store.layers_per_pass`` layers at a time (the FP32
    reconstruction and the gathered copies are theirs, not all layers'), each level
    quantized by ``quantize`` against the running reconstruction of its rows."""
    num_layers = store.shape[0]
    for first in range(0, num_layers, store.layers_per_pass):
        layers = slice(first, min(first + store.layers_per_pass, num_layers))
        recon_k = recon_v = None
        for depth, depth_rows in enumerate(rows):
            if pages[depth] and depth_rows is None:  # appended before: read its pages
                recon_k, recon_v = store.add_level(
                    recon_k, recon_v, pages[depth], presents[depth], layers
                )
            elif pages[depth]:
                k, v = depth_rows.gather(layers)
                recon_k, recon_v = store.encode_level(
                    k,
                    v,
                    recon_k,
                    recon_v,
                    present=presents[depth],
                    pages=pages[depth],
                    layers=layers,
                    quantize=quantize,
                )
