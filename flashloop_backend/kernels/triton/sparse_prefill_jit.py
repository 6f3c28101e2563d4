"""Triton code for tiled prefill attention over nonconsecutive queries (wrapper in
``sparse_prefill.py``)."""

import triton
import triton.language as tl


@triton.jit
def sparse_prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, tile_start_ptr, num_tiles_ptr, out_ptr,
    scale,
    stride_qr, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tr,
    stride_or, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Tiles pid, pid + programs, ... below num_tiles, for one query head. A tile is up to
    BLOCK_M consecutive rows that share one block table (rows [tile_start[t],
    tile_start[t + 1])); row i sees keys [0, lengths[i]) of that table, so queries may sit
    at any absolute positions. FP32 online softmax; QK and PV on tensor cores; key blocks
    past the tile's longest row are never read."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    num_tiles = tl.load(num_tiles_ptr)
    while tile < num_tiles:
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_start_ptr + tile + 1)
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < end
        lengths = tl.load(lengths_ptr + rows, mask=row_mask, other=0)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + rows[:, None] * stride_qr + head * stride_qh + d[None, :],
                    mask=row_mask[:, None], other=0.0)  # fmt: skip
        table = tables_ptr + start.to(tl.int64) * stride_tr
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        longest = tl.max(lengths, 0)
        n = tl.arange(0, BLOCK_N)
        for first in range(0, longest, BLOCK_N):
            keys = first + n
            in_range = keys < longest
            page = tl.load(table + keys // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
            slot = keys % BLOCK_SIZE
            k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                        mask=in_range[:, None], other=0.0)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(keys[None, :] < lengths[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                        mask=in_range[:, None], other=0.0)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + rows[:, None] * stride_or + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])  # fmt: skip
        tile += tl.num_programs(0)
