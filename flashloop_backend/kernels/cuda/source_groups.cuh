// The loop-2 source's work on one group of GROUP tokens (encoding v3, dense levels), shared
// by the keys and values passes of the two-pass source (packed_source.cu). The including
// file defines HEAD_DIM, GROUP and LEVELS, and SELECTED 0 where the values pass sums the
// dense output alone (the contribution gathered apart, packed_contribution.cu).
//  keys: exact logits (q times each level's K scales in FP16 hi and lo rows of the A
//        fragment, FP32 sums) and the warp's running max and sum (base 2).
//  values: p = exp(logit - max) on the group's logits; the dense output sums p v and the
//        contribution the same sum over the taken keys: two FP16-pair sums per lane, the
//        second skipped for rounds of 8 tokens where no lane's token is taken.
#pragma once
#include "common.cuh"
#include "page_window.cuh"

#ifndef SELECTED
#define SELECTED 1
#endif
constexpr bool SELECTS = SELECTED != 0;  // the values pass also sums the taken keys

constexpr int D = HEAD_DIM;
constexpr int G = GROUP;
constexpr int BLOCK = D * (G + 8);   // bytes of one (page, layer, head) block
constexpr int ROW = D / 2;           // bytes of one token's codes
constexpr int SEG = D / 8;           // bytes of a quad lane's row segment
constexpr int WORDS = D / 32;        // words of a segment
constexpr int NG = D / G;            // V groups per token
constexpr int CODES = G * ROW;       // bytes of a block's K (or V) codes
constexpr int PARAMS = 4 * D;        // bytes of a block's K parameters (or V records)
constexpr int HALF = CODES + PARAMS; // bytes of one pass's half of a block
constexpr int KSTEPS = D / 16;
constexpr int ROUNDS = G / 8;
constexpr int OWN = 8 * WORDS;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;  // keys: base-2 to natural logits
constexpr float V_WEIGHT = 64.f;  // as packed_stream.cu: V weights stay normal FP16 numbers

static_assert(D == 128, "a lane's row segment is one 16-byte load (D = 128)");
static_assert(CODES % 512 == 0 && PARAMS % 512 == 0, "a warp copies in rounds of 512 bytes");
static_assert(KSTEPS == 8, "a k-step per token lane folds the query (D = 128)");

// copies one half of a block (codes at ``codes``, parameters at ``params``) into ``dst``
__device__ __forceinline__ void copy_half(unsigned char* dst, const unsigned char* codes,
                                          const unsigned char* params, int lane) {
#pragma unroll
    for (int c = 0; c < CODES / 512; ++c)
        cp_async16(dst + 16 * (lane + 32 * c), codes + 16 * (lane + 32 * c));
#pragma unroll
    for (int c = 0; c < PARAMS / 512; ++c)
        cp_async16(dst + CODES + 16 * (lane + 32 * c), params + 16 * (lane + 32 * c));
}

// issues one pass's halves of the warp's k-th group's blocks at every dense level into
// ``stage``, its pages from the window (k grows by at most one between calls; the whole warp
// calls it): VALUES false takes K codes and K parameters, true V codes and V records
template <bool VALUES, class Params>
__device__ __forceinline__ void copy_group(unsigned char* stage, const Params& P, i64 row,
                                           int kv_head, unsigned dense, int first, int warp,
                                           int warps, int mine, int k, PageWindow& w, int lane) {
    advance_window(P, row, dense, first, warp, warps, mine, k, w, lane);
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) {
        if (!(dense >> l & 1u)) continue;
        const int page = window_page(w, k, l);
        const unsigned char* src = P.blocks + page * P.page_bytes + (i64)kv_head * BLOCK;
        if (VALUES)
            copy_half(stage + l * HALF, src + CODES, src + 2 * CODES + PARAMS, lane);
        else
            copy_half(stage + l * HALF, src, src + 2 * CODES, lane);
    }
}

// The query folded for the keys: the lane's share of every fold, k-step tok (word tok / 2,
// its half tok % 2), the query at that k-step's four columns of its quad lane (times the
// 1/16 the B columns of a high half carry, for the scales; without, for the minima)
struct QueryFold {
    float scale[2][2], min[2][2];
};
__device__ __forceinline__ QueryFold fold_query(const u16* qrow, float qs, int quad, int tok) {
    QueryFold f;
    const int fold_word = tok >> 1, fold_half = tok & 1;
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int channel = owned_channel(quad, fold_word, 2 * fold_half + e, h);
            f.min[e][h] = qs * bf16_to_float(qrow[channel]);
            f.scale[e][h] = f.min[e][h] * (fold_half ? 1.f / 16.f : 1.f);
        }
    return f;
}

// One group's logits from its K halves in ``stage``: dst[pos - base] = the natural logit
// of each position below length (tok-0 lanes write), and the warp's running max and sum
// (base 2) updated.
__device__ __forceinline__ void keys_group(const unsigned char* stage, const int* kinds,
                                           const QueryFold& q, int quad, int tok, int group,
                                           int length, float* dst, int base, float& m_run,
                                           float& l_run) {
    const int fold_word = tok >> 1, fold_half = tok & 1;
    float c[ROUNDS][4];
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) c[r][0] = c[r][1] = c[r][2] = c[r][3] = 0.f;
    float bias = 0.f;
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) {
        if (kinds[l] != 0) continue;
        const unsigned char* half = stage + l * HALF;
        // folded query fragments: row 0 (lanes 0-3) FP16, row 1 (lanes 4-7) the
        // remainder. Each lane folds its own k-step's four columns, hi and lo, and adds
        // their q . min; lanes 0-7 then gather every k-step's pairs from its lanes.
        const u16* params = (const u16*)(half + CODES) + 4 * WORDS * quad + fold_half * (D / 2) +
                            4 * fold_word;
        u32 hi[2], lo[2];
        float part = 0.f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 sc = lds32(params + 2 * e), mn = lds32(params + D + 2 * e);
            const float f0 = q.scale[e][0] * half_lo(sc), f1 = q.scale[e][1] * half_hi(sc);
            part += q.min[e][0] * half_lo(mn) + q.min[e][1] * half_hi(mn);
            hi[e] = pack_half2(f0, f1);
            lo[e] = pack_half2(f0 - half_lo(hi[e]), f1 - half_hi(hi[e]));
        }
        part = warp_sum(part);
        u32 fold[KSTEPS][2];
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 h = __shfl_sync(FULL_MASK, hi[e], 4 * k + quad);
                const u32 l = __shfl_sync(FULL_MASK, lo[e], 4 * k + quad);
                fold[k][e] = tok == 0 ? h : (tok == 1 ? l : 0u);
            }
        bias += part;
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const uint4 seg = lds128(half + (8 * r + tok) * ROW + SEG * quad);
            const u32 words[4] = {seg.x, seg.y, seg.z, seg.w};
#pragma unroll
            for (int m = 0; m < WORDS; ++m) {
                u32 pr[4];
                nibbles(words[m], pr);
                const u32 a0[4] = {fold[2 * m][0], 0u, fold[2 * m][1], 0u};
                const u32 a1[4] = {fold[2 * m + 1][0], 0u, fold[2 * m + 1][1], 0u};
                mma16816(c[r], a0, pr[0], pr[1]);
                mma16816(c[r], a1, pr[2], pr[3]);
            }
        }
    }
    // logits of tokens 8 r + 2 quad (+1): row 0 in lanes 0-3 plus its remainder row 1
    float s[ROUNDS][2];
    float page_max = NEG_INF;
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = c[r][h] + __shfl_down_sync(FULL_MASK, c[r][h], 4);
            const int pos = group * G + 8 * r + 2 * quad + h;
            const float v = pos < length ? sum + bias : NEG_INF;
            s[r][h] = v;
            if (tok == 0) {
                page_max = fmaxf(page_max, v);
                if (pos < length) dst[pos - base] = v * LN2;
            }
        }
    page_max = warp_max(page_max);
    if (page_max > m_run) {
        l_run *= exp2f(m_run - page_max);
        m_run = page_max;
    }
    float psum = 0.f;
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r)
        psum += tok == 0 ? exp2f(s[r][0] - m_run) + exp2f(s[r][1] - m_run) : 0.f;
    l_run += warp_sum(psum);
}

// The BF16 keys at positions [first, end) above the packed length, 8 tokens a round per
// warp (``warps`` warps from ``warp``); lane (tok, quad) takes channels [D/4 quad, D/4
// (quad + 1)) of token tok: dst[pos - base] = natural logits, running max and sum updated.
template <class Params>
__device__ __forceinline__ void keys_tail(const Params& P, i64 row, int kv_head, const u16* qrow,
                                          float qs, int first, int end, int warp, int warps,
                                          int quad, int tok, float* dst, int base, float& m_run,
                                          float& l_run) {
    float qn[D / 4];
#pragma unroll
    for (int i = 0; i < D / 4; ++i) qn[i] = qs * bf16_to_float(qrow[(D / 4) * quad + i]);
    for (int at = first + 8 * warp; at < end; at += 8 * warps) {
        const int pos = at + tok;
        float logit = NEG_INF;
        if (pos < end) {
            const i64 page = P.block_tables[row * P.bt_row + pos / P.block_size];
            const i64 slot = page * P.k_block + (i64)(pos % P.block_size) * P.k_slot +
                             (i64)kv_head * P.k_head;
            logit = bf16_dot<D>(P.k_cache + slot + (D / 4) * quad, qn);
        }
        logit += __shfl_xor_sync(FULL_MASK, logit, 1);
        logit += __shfl_xor_sync(FULL_MASK, logit, 2);
        if (quad == 0 && pos < end) dst[pos - base] = logit * LN2;
        const float m_new = fmaxf(m_run, warp_max(logit));
        if (m_new > m_run) {
            l_run *= exp2f(m_run - m_new);
            m_run = m_new;
        }
        const float p = pos < end ? exp2f(logit - m_run) : 0.f;
        l_run += warp_sum(quad == 0 ? p : 0.f);
    }
}

// A warp's value sums: acc and sel [OWN] (times V_WEIGHT, relative to m_run, base 2) over
// every key and over the taken ones, and the V minima's weights
struct ValueSums {
    float m_run;
    float acc[OWN], sel[OWN];
    float mins[NG], mins_sel[NG];
};
__device__ __forceinline__ void clear_sums(ValueSums& v) {
    v.m_run = NEG_INF;
#pragma unroll
    for (int i = 0; i < OWN; ++i) v.acc[i] = v.sel[i] = 0.f;
#pragma unroll
    for (int g = 0; g < NG; ++g) v.mins[g] = v.mins_sel[g] = 0.f;
}
__device__ __forceinline__ void rescale_sums(ValueSums& v, float m_new) {
    if (m_new > v.m_run) {
        const float alpha = exp2f(v.m_run - m_new);
#pragma unroll
        for (int i = 0; i < OWN; ++i) {
            v.acc[i] *= alpha;
            v.sel[i] *= alpha;
        }
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            v.mins[g] *= alpha;
            v.mins_sel[g] *= alpha;
        }
        v.m_run = m_new;
    }
}

// One group's values from its V halves in ``stage``: s[r] = base-2 logit of token 8 r +
// tok (-inf past the length), take[r] whether the selection took it.
__device__ __forceinline__ void values_group(const unsigned char* stage, const int* kinds,
                                             const float* s, const bool* take, int quad, int tok,
                                             ValueSums& v) {
    float page_max = NEG_INF;
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) page_max = fmaxf(page_max, s[r]);
    rescale_sums(v, warp_max(page_max));
    float p[ROUNDS];
    unsigned any = 0;  // bit r: some lane's token of round r is taken
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        p[r] = exp2f(s[r] - v.m_run);
        if (SELECTS) any |= __any_sync(FULL_MASK, take[r]) ? 1u << r : 0u;
    }
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) {
        if (kinds[l] != 0) continue;
        const unsigned char* half = stage + l * HALF;
        u32 sums[WORDS][4], sums_sel[WORDS][4];
#pragma unroll
        for (int m = 0; m < WORDS; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) sums[m][e] = sums_sel[m][e] = 0u;
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const int t = 8 * r + tok;
            const u16* record = (const u16*)(half + CODES) + t * 2 * NG;
            const uint4 seg = lds128(half + t * ROW + SEG * quad);
            const u32 words[4] = {seg.x, seg.y, seg.z, seg.w};
            u32 w[NG];
            float vmin[NG], vscale[NG];
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                vmin[g] = half_to_float(record[2 * g]);
                vscale[g] = V_WEIGHT * half_to_float(record[2 * g + 1]);
                v.mins[g] += p[r] * vmin[g];
                const float wg = p[r] * vscale[g];
                w[g] = pack_half2(wg, wg);
            }
            u32 pr[WORDS][4];
#pragma unroll
            for (int m = 0; m < WORDS; ++m) {
                const int g = (32 * m) / G;
                nibbles_unit(words[m], pr[m]);
#pragma unroll
                for (int e = 0; e < 4; ++e) sums[m][e] = hfma2(w[g], pr[m][e], sums[m][e]);
            }
            if (SELECTS && (any >> r & 1u)) {  // warp-uniform: skipped for rounds none takes
                const float ps = take[r] ? p[r] : 0.f;
                u32 ws[NG];
#pragma unroll
                for (int g = 0; g < NG; ++g) {
                    v.mins_sel[g] += ps * vmin[g];
                    const float wg = ps * vscale[g];
                    ws[g] = pack_half2(wg, wg);
                }
#pragma unroll
                for (int m = 0; m < WORDS; ++m) {
                    const int g = (32 * m) / G;
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        sums_sel[m][e] = hfma2(ws[g], pr[m][e], sums_sel[m][e]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < WORDS; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                v.acc[8 * m + 2 * e] += half_lo(sums[m][e]);
                v.acc[8 * m + 2 * e + 1] += half_hi(sums[m][e]);
                if (SELECTS) {
                    v.sel[8 * m + 2 * e] += half_lo(sums_sel[m][e]);
                    v.sel[8 * m + 2 * e + 1] += half_hi(sums_sel[m][e]);
                }
            }
    }
}

// The BF16 values at positions [first, end) above the packed length, 8 tokens a round per
// warp; lane (tok, quad) adds token tok's values at its owned channels. logit(pos) gives
// the natural logit, taken(pos, logit) whether the selection took it.
template <class Params, class Logit, class Taken>
__device__ __forceinline__ void values_tail(const Params& P, i64 row, int kv_head, int first,
                                            int end, int warp, int warps, int quad, int tok,
                                            Logit logit_at, Taken taken, ValueSums& v) {
    for (int at = first + 8 * warp; at < end; at += 8 * warps) {
        const int pos = at + tok;
        const float logit = pos < end ? logit_at(pos) : NEG_INF;
        const float s = pos < end ? logit * LOG2E : NEG_INF;
        rescale_sums(v, fmaxf(v.m_run, warp_max(s)));
        if (pos < end) {
            const float w = V_WEIGHT * exp2f(s - v.m_run);
            const float ws = SELECTS && taken(pos, logit) ? w : 0.f;
            const i64 page = P.block_tables[row * P.bt_row + pos / P.block_size];
            const u16* vrow = P.v_cache + page * P.v_block + (i64)(pos % P.block_size) * P.v_slot +
                              (i64)kv_head * P.v_head;
#pragma unroll
            for (int m = 0; m < WORDS; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 pair = *(const u32*)(vrow + owned_channel(quad, m, e, 0));
                    const float lo = __uint_as_float(pair << 16);
                    const float hi = __uint_as_float(pair & 0xffff0000u);
                    v.acc[8 * m + 2 * e] += w * lo;
                    v.acc[8 * m + 2 * e + 1] += w * hi;
                    if (SELECTS) {
                        v.sel[8 * m + 2 * e] += ws * lo;
                        v.sel[8 * m + 2 * e + 1] += ws * hi;
                    }
                }
        }
    }
}

// The warp's sums summed over its token lanes into ``mine`` [2 D + 1] (shared memory:
// dense output, contribution (SELECTS only), then the warp's max), relative to that max
__device__ __forceinline__ void store_value_sums(ValueSums& v, float* mine, int lane, int quad,
                                                 int tok) {
#pragma unroll
    for (int i = 0; i < OWN; ++i) {
        const int g = (32 * (i / 8)) / G;
        v.acc[i] = sum_token_lanes(v.acc[i] * (1.f / V_WEIGHT) + v.mins[g]);
        if (SELECTS) v.sel[i] = sum_token_lanes(v.sel[i] * (1.f / V_WEIGHT) + v.mins_sel[g]);
    }
    if (tok == 0) {
#pragma unroll
        for (int m = 0; m < WORDS; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int ch = owned_channel(quad, m, e, h);
                    mine[ch] = v.acc[8 * m + 2 * e + h];
                    if (SELECTS) mine[D + ch] = v.sel[8 * m + 2 * e + h];
                }
    }
    if (lane == 0) mine[2 * D] = v.m_run;
}
