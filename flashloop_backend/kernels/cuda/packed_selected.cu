// Attention over the selected keys of packed INT4 KV (encoding v3): the loop 3-4 sparse
// correction's softmax partials. Built by kernels/cuda/packed_selected.py with HEAD_DIM,
// GROUP, LEVELS, WARPS, COMPACT_FROM and MIN_CTAS defined.
//
// One CTA = one (split, query head, row) over a range of the row's sorted selected
// positions; each warp takes a quarter of the range in blocks of up to 16 keys that touch,
// at every level, at most 8 runs of keys on one page (a dense level's pages follow the
// positions, a compact level's its compact rows, both increasing), however far apart.
//  K: per level, the query with each run's page K scales folded in is the B operand
//     (column n: run n) of m16n8k16 products whose A operand is the 16 keys' code rows
//     (the v3 byte order lays a key's row out as an A fragment); each key keeps its own
//     run's score plus that run's bias q . min. Products exact, sums FP32.
//  V: lane (key, quad lane) sums p * scale * code over its row segment's 32 channels in
//     FP32, and p * min per V group.
// Positions at or above the row's packed length come after the packed ones and are read
// from the BF16 pages (channels [32 j, 32 j + 32) per quad lane j).
#include "common.cuh"

constexpr int D = HEAD_DIM;
constexpr int G = GROUP;
constexpr int BLOCK = D * (G + 8);
constexpr int ROW = D / 2;
constexpr int SEG = D / 8;
constexpr int WORDS = D / 32;
constexpr int NG = D / G;
constexpr int V_CODES = G * ROW;
constexpr int K_PARAMS = G * D;
constexpr int V_PARAMS = G * D + 4 * D;
constexpr int NPW = 8;  // page rows per level a block may touch (the products' N)
constexpr int OWN = 8 * WORDS;
constexpr int COMPACT = 1, EMPTY = 2;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

static_assert(D == 128, "a lane's row segment is one 16-byte load (D = 128)");
static_assert(G % 32 == 0, "V groups of whole words");

struct Params {
    const u16* q;                 // [R, Hq, D] bf16
    const int* indices;           // [R, Hq, Kb] increasing positions, -1 after them
    const unsigned char* blocks;  // one layer's blocks (layer offset)
    i64 page_bytes;
    const int* tables;            // [R, Lv, P]
    const int* maps;              // [R, Lv, Tp]
    const int* kinds;             // [R, Lv]
    const int* packed;            // [R]
    const u16* k_cache;           // [NB, BS, Hkv, D] bf16
    const u16* v_cache;
    const int* block_tables;      // [R, MB]
    float* part_out;              // [R, Hq, S, D]
    float* part_max;              // [R, Hq, S] natural log
    float* part_sum;
    float scale;
    int q_row, q_head;
    int i_row, i_head;
    int t_row, t_level, m_row, m_level, kind_row;
    int k_block, k_slot, k_head, v_block, v_slot, v_head, bt_row;
    int o_row, o_head, o_split, s_row, s_head;
    int keys_per_split, bucket, group_q, block_size;
};

__device__ __forceinline__ uint4 ldg128(const unsigned char* p) {
    return *(const uint4*)p;
}

// exact values of a word's eight codes (the high nibbles' pairs carry 16 c)
__device__ __forceinline__ void codes8(u32 w, float c[8]) {
    u32 p[4];
    nibbles(w, p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        c[2 * i] = half_lo(p[i]) * (i >= 2 ? 1.f / 16.f : 1.f);
        c[2 * i + 1] = half_hi(p[i]) * (i >= 2 ? 1.f / 16.f : 1.f);
    }
}

#if MIN_CTAS > 0  // registers capped so that MIN_CTAS CTAs fit on an SM
#define SELECTED_BOUNDS __launch_bounds__(WARPS * 32, MIN_CTAS)
#else
#define SELECTED_BOUNDS __launch_bounds__(WARPS * 32)
#endif

extern "C" __global__ void SELECTED_BOUNDS packed_selected(const Params P) {
    __shared__ float merge[WARPS][D + 2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int quad = lane & 3, g = lane >> 2;
    const int split = blockIdx.x, head = blockIdx.y;
    const i64 row = blockIdx.z;
    const int kv_head = head / P.group_q;
    const int packed = P.packed[row];
    const int* idx = P.indices + row * P.i_row + (i64)head * P.i_head;
    const int start = split * P.keys_per_split;
    const int end = min(start + P.keys_per_split, P.bucket);
    const int share = (max(end - start, 0) + WARPS - 1) / WARPS;
    int i = min(start + warp * share, end);
    const int warp_end = min(i + share, end);
    const u16* qrow = P.q + row * P.q_row + (i64)head * P.q_head;
    const float qs = P.scale * LOG2E;
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];
    const unsigned char* base = P.blocks + (i64)kv_head * BLOCK;
    float q[OWN];  // the query (base-2 logits) at the channels of this lane's segment
#pragma unroll
    for (int m = 0; m < WORDS; ++m)
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                q[8 * m + 2 * p + h] = qs * bf16_to_float(qrow[owned_channel(quad, m, p, h)]);
    float m_run = NEG_INF, l_run = 0.f;
    float acc[OWN], mins[NG];
#pragma unroll
    for (int k = 0; k < OWN; ++k) acc[k] = 0.f;
#pragma unroll
    for (int n = 0; n < NG; ++n) mins[n] = 0.f;

    // ---- packed keys: blocks of up to 16, key k of the block in lane k (lanes 16-31 idle)
    int window = (lane < 16 && i + lane < warp_end) ? idx[i + lane] : -1;
    while (i < warp_end) {
        const int pos = window;
        const int lead = __shfl_sync(FULL_MASK, pos, 0);
        if (lead < 0 || lead >= packed) break;
        const bool valid = pos >= 0 && pos < packed;
        // per level, a run is a key whose page differs from the lane before it and the
        // keys after it on the same page; a key's rank is its run's number in the block (a
        // page met again after a key absent at the level takes a second run: same sums)
        int rows[LEVELS], ranks[LEVELS];
        u32 runs[LEVELS];
        bool outside = false;
#pragma unroll
        for (int l = 0; l < LEVELS; ++l) {
            int r = valid ? pos : -1;
            if (l >= COMPACT_FROM && kinds[l] == COMPACT && valid)
                r = P.maps[row * P.m_row + (i64)l * P.m_level + pos];
            if (kinds[l] == EMPTY) r = -1;
            rows[l] = r;
            const int page_row = r >= 0 ? r / G : -1;
            const int before = __shfl_up_sync(FULL_MASK, page_row, 1);
            runs[l] = __ballot_sync(FULL_MASK, r >= 0 && (lane == 0 || before != page_row));
            ranks[l] = __popc(runs[l] & (0xffffffffu >> (31 - lane))) - 1;
            outside |= r >= 0 && ranks[l] >= NPW;
        }
        const u32 out_mask = __ballot_sync(FULL_MASK, outside);
        const int valid_count = __popc(__ballot_sync(FULL_MASK, valid));
        const int take = out_mask ? min(__ffs(out_mask) - 1, valid_count) : valid_count;
        // the next block's positions load while this block's pages are read
        window = (lane < 16 && i + take + lane < warp_end) ? idx[i + take + lane] : -1;
        int pages[LEVELS];
#pragma unroll
        for (int l = 0; l < LEVELS; ++l) {
            if (lane >= take) rows[l] = -1;
            runs[l] &= (1u << take) - 1u;  // take <= 16
            pages[l] = rows[l] >= 0 ? P.tables[row * P.t_row + (i64)l * P.t_level + rows[l] / G] : 0;
        }
        // p of keys g and g + 8 of the block (this lane's quad)
        float p0, p1;
        {
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int l = 0; l < LEVELS; ++l) {
                const bool here = rows[l] >= 0;
                if (!__any_sync(FULL_MASK, here)) continue;
                const int rel = here ? ranks[l] : -1;
                // B: run g's page K scales folded into the query (this lane's k pairs); run
                // g starts at the (g+1)-th set bit of runs[l]
                u32 first_keys = runs[l];
#pragma unroll
                for (int j = 0; j < NPW - 1; ++j)
                    if (j < g) first_keys &= first_keys - 1u;
                const int run_key = first_keys ? __ffs(first_keys) - 1 : 0;
                const int page = __shfl_sync(FULL_MASK, pages[l], run_key);
                u32 fold[2 * WORDS][2];
                float bias = 0.f;
                if (first_keys) {
                    const unsigned char* params = base + page * P.page_bytes + K_PARAMS;
                    // scales and minima of this lane's 16 A columns and 16 B columns
                    u32 sc[2][8], mn[2][8];
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const uint4* s4 = (const uint4*)(params + half * D + 32 * quad);
                        const uint4* m4 = (const uint4*)(params + 2 * D + half * D + 32 * quad);
                        const uint4 a = s4[0], b = s4[1], c = m4[0], d = m4[1];
                        const u32 sv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                        const u32 mv[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
                        for (int k = 0; k < 8; ++k) {
                            sc[half][k] = sv[k];
                            mn[half][k] = mv[k];
                        }
                    }
#pragma unroll
                    for (int m = 0; m < WORDS; ++m)
#pragma unroll
                        for (int half = 0; half < 2; ++half)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {  // columns (4m, 4m+1), (4m+2, 4m+3)
                                const u32 s2 = sc[half][2 * m + e], m2 = mn[half][2 * m + e];
                                const float qa = q[8 * m + 2 * (2 * half + e)];
                                const float qb = q[8 * m + 2 * (2 * half + e) + 1];
                                const float unit = half ? 1.f / 16.f : 1.f;
                                fold[2 * m + half][e] =
                                    pack_half2(qa * half_lo(s2) * unit, qb * half_hi(s2) * unit);
                                bias += qa * half_lo(m2) + qb * half_hi(m2);
                            }
                } else {
#pragma unroll
                    for (int k = 0; k < 2 * WORDS; ++k) fold[k][0] = fold[k][1] = 0u;
                }
                bias += __shfl_xor_sync(FULL_MASK, bias, 1);
                bias += __shfl_xor_sync(FULL_MASK, bias, 2);
                // A: the code rows of keys g and g + 8 (segment quad)
                const int page_a = __shfl_sync(FULL_MASK, pages[l], g);
                const int row_a = __shfl_sync(FULL_MASK, rows[l], g);
                const int page_b = __shfl_sync(FULL_MASK, pages[l], g + 8);
                const int row_b = __shfl_sync(FULL_MASK, rows[l], g + 8);
                uint4 ka = make_uint4(0, 0, 0, 0), kb = make_uint4(0, 0, 0, 0);
                if (row_a >= 0) ka = ldg128(base + page_a * P.page_bytes + (row_a % G) * ROW + SEG * quad);
                if (row_b >= 0) kb = ldg128(base + page_b * P.page_bytes + (row_b % G) * ROW + SEG * quad);
                const u32 wa[4] = {ka.x, ka.y, ka.z, ka.w}, wb[4] = {kb.x, kb.y, kb.z, kb.w};
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int m = 0; m < WORDS; ++m) {
                    u32 pa[4], pb[4];
                    nibbles(wa[m], pa);
                    nibbles(wb[m], pb);
                    const u32 a0[4] = {pa[0], pb[0], pa[1], pb[1]};
                    const u32 a1[4] = {pa[2], pb[2], pa[3], pb[3]};
                    mma16816(c, a0, fold[2 * m][0], fold[2 * m][1]);
                    mma16816(c, a1, fold[2 * m + 1][0], fold[2 * m + 1][1]);
                }
                // each key keeps the score of its own page row (rows 2 quad, 2 quad + 1 here)
                const int rel_a = __shfl_sync(FULL_MASK, rel, g);
                const int rel_b = __shfl_sync(FULL_MASK, rel, g + 8);
                const float bias0 = __shfl_sync(FULL_MASK, bias, 8 * quad);
                const float bias1 = __shfl_sync(FULL_MASK, bias, 8 * quad + 4);
                if (rel_a == 2 * quad) s0 += c[0] + bias0;
                if (rel_a == 2 * quad + 1) s0 += c[1] + bias1;
                if (rel_b == 2 * quad) s1 += c[2] + bias0;
                if (rel_b == 2 * quad + 1) s1 += c[3] + bias1;
            }
            s0 += __shfl_xor_sync(FULL_MASK, s0, 1);
            s0 += __shfl_xor_sync(FULL_MASK, s0, 2);
            s1 += __shfl_xor_sync(FULL_MASK, s1, 1);
            s1 += __shfl_xor_sync(FULL_MASK, s1, 2);
            s0 = g < take ? s0 : NEG_INF;
            s1 = g + 8 < take ? s1 : NEG_INF;
            const float m_new = fmaxf(m_run, warp_max(fmaxf(s0, s1)));
            const float alpha = exp2f(m_run - m_new);
            l_run *= alpha;
#pragma unroll
            for (int k = 0; k < OWN; ++k) acc[k] *= alpha;
#pragma unroll
            for (int n = 0; n < NG; ++n) mins[n] *= alpha;
            m_run = m_new;
            p0 = exp2f(s0 - m_run);
            p1 = exp2f(s1 - m_run);
            l_run += warp_sum(quad == 0 ? p0 + p1 : 0.f);
        }
        // ---- V of keys g (p0) and g + 8 (p1) at every level, FP32 sums
#pragma unroll
        for (int l = 0; l < LEVELS; ++l) {
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int page = __shfl_sync(FULL_MASK, pages[l], g + 8 * k);
                const int r = __shfl_sync(FULL_MASK, rows[l], g + 8 * k);
                const float p = k ? p1 : p0;
                if (r < 0) continue;
                const unsigned char* block = base + page * P.page_bytes;
                const uint4 v = ldg128(block + V_CODES + (r % G) * ROW + SEG * quad);
                const u16* record = (const u16*)(block + V_PARAMS) + (r % G) * 2 * NG;
                const u32 w4[4] = {v.x, v.y, v.z, v.w};
                float weight[NG];
#pragma unroll
                for (int n = 0; n < NG; ++n) {
                    mins[n] += p * half_to_float(record[2 * n]);
                    weight[n] = p * half_to_float(record[2 * n + 1]);
                }
#pragma unroll
                for (int m = 0; m < WORDS; ++m) {
                    float c8[8];
                    codes8(w4[m], c8);
                    const float w = weight[(32 * m) / G];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[8 * m + e] += w * c8[e];
                }
            }
        }
        i += take;
    }

    // ---- the BF16 positions: 8 keys a round, lane (key g, quad lane) over channels
    // [D/4 quad, D/4 (quad + 1)) in natural order
    float tail[D / 4];
#pragma unroll
    for (int k = 0; k < D / 4; ++k) tail[k] = 0.f;
    float qn[D / 4];
#pragma unroll
    for (int k = 0; k < D / 4; ++k) qn[k] = qs * bf16_to_float(qrow[(D / 4) * quad + k]);
    while (i < warp_end) {
        const int pos = i + g < warp_end ? idx[i + g] : -1;
        if (__shfl_sync(FULL_MASK, pos, 0) < 0) break;
        i64 page = 0;
        if (pos >= 0) page = P.block_tables[row * P.bt_row + pos / P.block_size];
        float logit = NEG_INF;
        if (pos >= 0) {
            const i64 slot = page * P.k_block + (i64)(pos % P.block_size) * P.k_slot +
                             (i64)kv_head * P.k_head;
            logit = bf16_dot<D>(P.k_cache + slot + (D / 4) * quad, qn);
        }
        logit += __shfl_xor_sync(FULL_MASK, logit, 1);
        logit += __shfl_xor_sync(FULL_MASK, logit, 2);
        const float m_new = fmaxf(m_run, warp_max(logit));
        if (m_new > m_run) {
            const float alpha = exp2f(m_run - m_new);
            l_run *= alpha;
#pragma unroll
            for (int k = 0; k < OWN; ++k) acc[k] *= alpha;
#pragma unroll
            for (int n = 0; n < NG; ++n) mins[n] *= alpha;
#pragma unroll
            for (int k = 0; k < D / 4; ++k) tail[k] *= alpha;
            m_run = m_new;
        }
        const float p = pos >= 0 ? exp2f(logit - m_run) : 0.f;
        l_run += warp_sum(quad == 0 ? p : 0.f);
        if (pos >= 0) {
            const i64 vslot = page * P.v_block + (i64)(pos % P.block_size) * P.v_slot +
                              (i64)kv_head * P.v_head;
            bf16_accumulate<D>(tail, P.v_cache + vslot + (D / 4) * quad, p);
        }
        i += 8;
    }

    // ---- the warp's partial over the channels, then the CTA's warps at one max
#pragma unroll
    for (int k = 0; k < OWN; ++k) acc[k] = sum_token_lanes(acc[k] + mins[(32 * (k / 8)) / G]);
#pragma unroll
    for (int k = 0; k < D / 4; ++k) tail[k] = sum_token_lanes(tail[k]);
    store_warp_partial<D, WORDS>(merge[warp], acc, tail, quad, g);
    if (lane == 0) {
        merge[warp][D] = m_run;
        merge[warp][D + 1] = l_run;
    }
    __syncthreads();
    float* out = P.part_out + row * P.o_row + (i64)head * P.o_head + (i64)split * P.o_split;
    float cta_max = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) cta_max = fmaxf(cta_max, merge[w][D]);
    const float safe = cta_max == NEG_INF ? 0.f : cta_max;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += merge[w][d] * exp2f(merge[w][D] - safe);
        out[d] = v;
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += merge[w][D + 1] * exp2f(merge[w][D] - safe);
        const i64 at = row * P.s_row + (i64)head * P.s_head + split;
        P.part_max[at] = cta_max * LN2;
        P.part_sum[at] = total;
    }
}
