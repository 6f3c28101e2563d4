// The loop-2 source over packed INT4 KV (encoding v3, dense levels) as two streaming passes
// around the top-K selection. Built by kernels/cuda/packed_source.py with HEAD_DIM, GROUP,
// LEVELS, WARPS, STAGES, MIN_CTAS and PASS (1: keys, 2: values) defined.
//
// Each pass copies only its half of every level's block (keys: K codes and K parameters;
// values: V codes and V records, plus the group's logits), so a ring stage holds half the
// bytes of a full read and two stages fit where a full read fits one. One CTA = one (split,
// query head, row); its warps take the split's groups in turn, as in packed_stream.cu.
//  keys: exact logits (q times each level's K scales in FP16 hi and lo rows of the A
//        fragment, FP32 sums), written for the selection, and the split's max and sum.
//  values: p = exp(logit - lse) from those logits; the dense output sums p v and the
//        contribution the same sum over the keys the selection took (its threshold key,
//        and ties at it up to the last tie position it took): two FP16-pair sums per lane,
//        the second skipped for rounds of 8 tokens where no lane's token is taken.
#include "common.cuh"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif

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
constexpr int STAGE = LEVELS * HALF + (PASS == 2 ? 4 * G : 0);  // + the group's logits
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;  // keys pass: base-2 to natural logits
constexpr float V_WEIGHT = 64.f;  // as packed_stream.cu: V weights stay normal FP16 numbers

#ifndef MIN_CTAS
#define MIN_CTAS 1  // resident CTAs per SM the registers must allow
#endif

static_assert(D == 128, "a lane's row segment is one 16-byte load (D = 128)");
static_assert(CODES % 512 == 0 && PARAMS % 512 == 0, "a warp copies in rounds of 512 bytes");
static_assert(STAGE % 16 == 0, "stages stay 16-byte aligned");
static_assert(KSTEPS == 8, "a k-step per token lane folds the query (D = 128)");

struct KeyParams {
    const u16* q;                 // [R, Hq, D] bf16
    const unsigned char* blocks;  // one layer's blocks [pages, L, Hkv, BLOCK] (layer offset)
    i64 page_bytes;
    const int* tables;            // [R, Lv, P]
    const int* kinds;             // [R, Lv]
    const int* packed;            // [R]
    const u16* k_cache;           // [NB, BS, Hkv, D] bf16
    const int* block_tables;      // [R, MB]
    const int* lengths;           // [R]
    float* logits;                // [R, Hq, T] scaled natural logits
    float* part_max;              // [R, Hq, S] natural log
    float* part_sum;
    float scale;
    int q_row, q_head;
    int t_row, t_level, kind_row;
    int k_block, k_slot, k_head, bt_row;
    int g_row, g_head, s_row, s_head;
    int groups_per_split, group_q, block_size;
};

// The finish of the values pass, in the last CTA of each (row, head): the splits'
// partials summed (they are already scaled by the row's LSE) and the selection's mass
struct SourceFinish {
    int* counters;                // [R, Hq] arrivals, 0 between launches; nullptr: none
    const float* part_mass;       // [R, Hq, Sm] the selection's, contiguous
    float* output;                // [R, Hq, D] FP32 dense output
    u16* out;                     // [R, Hq, D] bf16
    float* mass;                  // [R, Hq]
    float* contribution;          // [R, Hq, D] FP32
    int output_row, output_head, out_row, out_head, mass_row, contrib_row, contrib_head;
    int mass_splits, value_splits;
};

struct ValueParams {
    const unsigned char* blocks;
    i64 page_bytes;
    const int* tables;
    const int* kinds;
    const int* packed;
    const u16* v_cache;           // [NB, BS, Hkv, D] bf16
    const int* block_tables;
    const int* lengths;
    const float* logits;          // [R, Hq, T] the keys pass's
    const float* lse;             // [R, Hq] natural
    const int* plan;              // [R, Hq, 3]: threshold key, ties to take, last tie taken
    float* part_out;              // [R, Hq, S, D] absolute sums p v
    float* part_contrib;          // same strides: over the taken keys
    int t_row, t_level, kind_row;
    int v_block, v_slot, v_head, bt_row;
    int g_row, g_head, e_row;
    int o_row, o_head, o_split;
    int groups_per_split, group_q, block_size;
    SourceFinish finish;          // the last CTA's finish (counters nullptr: none)
};

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

#if PASS == 1
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
packed_source_keys(const KeyParams P) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int quad = lane & 3, tok = lane >> 2;
    const int split = blockIdx.x, head = blockIdx.y;
    const i64 row = blockIdx.z;
    const int kv_head = head / P.group_q;
    const int length = P.lengths[row];
    const int packed_groups = P.packed[row] / G;
    const int first = split * P.groups_per_split;
    const int last = min(first + P.groups_per_split, (length + G - 1) / G);
    unsigned char* ring = smem + warp * (STAGES * STAGE);
    float* merge = (float*)(smem + WARPS * STAGES * STAGE);  // [WARPS][2]
    float* logits = P.logits + row * P.g_row + (i64)head * P.g_head;

    const u16* qrow = P.q + row * P.q_row + (i64)head * P.q_head;
    const float qs = P.scale * LOG2E;
    // the lane's share of every fold: k-step tok (word tok / 2, its half tok % 2), the
    // query at that k-step's four columns of its quad lane (times the 1/16 the B columns
    // of a high half carry, for the scales; without, for the minima)
    const int fold_word = tok >> 1, fold_half = tok & 1;
    float q_scale[2][2], q_min[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int channel = owned_channel(quad, fold_word, 2 * fold_half + e, h);
            q_min[e][h] = qs * bf16_to_float(qrow[channel]);
            q_scale[e][h] = q_min[e][h] * (fold_half ? 1.f / 16.f : 1.f);
        }
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];

    float m_run = NEG_INF, l_run = 0.f;
    const int packed_end = min(last, packed_groups);
    const int mine = packed_end > first + warp ? (packed_end - first - warp + WARPS - 1) / WARPS : 0;
    auto issue = [&](int k) {
        if (k < mine) {
            const int group = first + warp + k * WARPS;
            unsigned char* stage = ring + (k % STAGES) * STAGE;
#pragma unroll
            for (int l = 0; l < LEVELS; ++l) {
                if (kinds[l] != 0) continue;
                const int page = P.tables[row * P.t_row + (i64)l * P.t_level + group];
                const unsigned char* src = P.blocks + page * P.page_bytes + (i64)kv_head * BLOCK;
                copy_half(stage + l * HALF, src, src + 2 * CODES, lane);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(k);
    for (int k = 0; k < mine; ++k) {
        issue(k + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const unsigned char* stage = ring + (k % STAGES) * STAGE;
        const int group = first + warp + k * WARPS;
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
            const u16* params = (const u16*)(half + CODES) + 4 * WORDS * quad +
                                fold_half * (D / 2) + 4 * fold_word;
            u32 hi[2], lo[2];
            float part = 0.f;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 sc = lds32(params + 2 * e), mn = lds32(params + D + 2 * e);
                const float f0 = q_scale[e][0] * half_lo(sc), f1 = q_scale[e][1] * half_hi(sc);
                part += q_min[e][0] * half_lo(mn) + q_min[e][1] * half_hi(mn);
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
                    if (pos < length) logits[pos] = v * LN2;
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
        __syncwarp();
    }
    cp_async_wait<0>();

    // ---- the BF16 pages above the packed length: 8 tokens a round, lane (tok, quad) takes
    // channels [D/4 quad, D/4 (quad + 1)) of token tok
    float qn[D / 4];
#pragma unroll
    for (int i = 0; i < D / 4; ++i) qn[i] = qs * bf16_to_float(qrow[(D / 4) * quad + i]);
    const int tail_first = max(first, packed_groups) * G;
    const int tail_end = min(last * G, length);
    for (int base = tail_first + 8 * warp; base < tail_end; base += 8 * WARPS) {
        const int pos = base + tok;
        float logit = NEG_INF;
        if (pos < tail_end) {
            const i64 page = P.block_tables[row * P.bt_row + pos / P.block_size];
            const i64 slot = page * P.k_block + (i64)(pos % P.block_size) * P.k_slot +
                             (i64)kv_head * P.k_head;
            logit = bf16_dot<D>(P.k_cache + slot + (D / 4) * quad, qn);
        }
        logit += __shfl_xor_sync(FULL_MASK, logit, 1);
        logit += __shfl_xor_sync(FULL_MASK, logit, 2);
        if (quad == 0 && pos < tail_end) logits[pos] = logit * LN2;
        const float m_new = fmaxf(m_run, warp_max(logit));
        if (m_new > m_run) {
            l_run *= exp2f(m_run - m_new);
            m_run = m_new;
        }
        const float p = pos < tail_end ? exp2f(logit - m_run) : 0.f;
        l_run += warp_sum(quad == 0 ? p : 0.f);
    }

    if (lane == 0) {
        merge[2 * warp] = m_run;
        merge[2 * warp + 1] = l_run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float cta_max = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) cta_max = fmaxf(cta_max, merge[2 * w]);
        const float safe = cta_max == NEG_INF ? 0.f : cta_max;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += merge[2 * w + 1] * exp2f(merge[2 * w] - safe);
        const i64 at = row * P.s_row + (i64)head * P.s_head + split;
        P.part_max[at] = cta_max * LN2;
        P.part_sum[at] = total;
    }
}
#endif

#if PASS == 2
// the selection's rule on a logit: above the threshold key, or at it and not after the last
// tie the compaction took
__device__ __forceinline__ bool taken(float logit, int pos, u32 threshold, int last_tie) {
    const u32 key = order_key(logit);
    return key > threshold || (key == threshold && pos <= last_tie);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
packed_source_values(const ValueParams P) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int quad = lane & 3, tok = lane >> 2;
    const int split = blockIdx.x, head = blockIdx.y;
    const i64 row = blockIdx.z;
    const int kv_head = head / P.group_q;
    const int length = P.lengths[row];
    const int packed_groups = P.packed[row] / G;
    const int first = split * P.groups_per_split;
    const int last = min(first + P.groups_per_split, (length + G - 1) / G);
    unsigned char* ring = smem + warp * (STAGES * STAGE);
    float* merge = (float*)(smem + WARPS * STAGES * STAGE);  // [WARPS][2 D + 1]
    const float* logits = P.logits + row * P.g_row + (i64)head * P.g_head;
    const int* plan = P.plan + (row * gridDim.y + head) * 3;
    const u32 threshold = (u32)plan[0];
    const int last_tie = plan[2];
    const float lse2 = P.lse[row * P.e_row + head] * LOG2E;
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];

    float m_run = NEG_INF;
    float acc[OWN], sel[OWN];  // V sums of the owned channels (times V_WEIGHT): all, taken
#pragma unroll
    for (int i = 0; i < OWN; ++i) acc[i] = sel[i] = 0.f;
    float mins[NG], mins_sel[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) mins[g] = mins_sel[g] = 0.f;

    const int packed_end = min(last, packed_groups);
    const int mine = packed_end > first + warp ? (packed_end - first - warp + WARPS - 1) / WARPS : 0;
    auto issue = [&](int k) {
        if (k < mine) {
            const int group = first + warp + k * WARPS;
            unsigned char* stage = ring + (k % STAGES) * STAGE;
#pragma unroll
            for (int l = 0; l < LEVELS; ++l) {
                if (kinds[l] != 0) continue;
                const int page = P.tables[row * P.t_row + (i64)l * P.t_level + group];
                const unsigned char* src = P.blocks + page * P.page_bytes + (i64)kv_head * BLOCK;
                copy_half(stage + l * HALF, src + CODES, src + 2 * CODES + PARAMS, lane);
            }
            if (lane < G / 4)  // the group's G logits, 16 bytes a lane
                cp_async16(stage + LEVELS * HALF + 16 * lane, logits + group * G + 4 * lane);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(k);
    for (int k = 0; k < mine; ++k) {
        issue(k + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const unsigned char* stage = ring + (k % STAGES) * STAGE;
        const float* group_logits = (const float*)(stage + LEVELS * HALF);
        const int group = first + warp + k * WARPS;
        float s[ROUNDS];
        bool take[ROUNDS];
        float page_max = NEG_INF;
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const int t = 8 * r + tok, pos = group * G + t;
            const float logit = group_logits[t];
            s[r] = pos < length ? logit * LOG2E : NEG_INF;
            take[r] = pos < length && taken(logit, pos, threshold, last_tie);
            page_max = fmaxf(page_max, s[r]);
        }
        page_max = warp_max(page_max);
        if (page_max > m_run) {
            const float alpha = exp2f(m_run - page_max);
#pragma unroll
            for (int i = 0; i < OWN; ++i) {
                acc[i] *= alpha;
                sel[i] *= alpha;
            }
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                mins[g] *= alpha;
                mins_sel[g] *= alpha;
            }
            m_run = page_max;
        }
        float p[ROUNDS];
        unsigned any = 0;  // bit r: some lane's token of round r is taken
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            p[r] = exp2f(s[r] - m_run);
            any |= __any_sync(FULL_MASK, take[r]) ? 1u << r : 0u;
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
                    mins[g] += p[r] * vmin[g];
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
                if (any >> r & 1u) {  // warp-uniform: skipped for rounds with no taken key
                    const float ps = take[r] ? p[r] : 0.f;
                    u32 ws[NG];
#pragma unroll
                    for (int g = 0; g < NG; ++g) {
                        mins_sel[g] += ps * vmin[g];
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
                    acc[8 * m + 2 * e] += half_lo(sums[m][e]);
                    acc[8 * m + 2 * e + 1] += half_hi(sums[m][e]);
                    sel[8 * m + 2 * e] += half_lo(sums_sel[m][e]);
                    sel[8 * m + 2 * e + 1] += half_hi(sums_sel[m][e]);
                }
        }
        __syncwarp();
    }
    cp_async_wait<0>();

    // ---- the BF16 pages above the packed length: 8 tokens a round, lane (tok, quad) adds
    // token tok's values at its owned channels (pairs of BF16) into the same sums
    const int tail_first = max(first, packed_groups) * G;
    const int tail_end = min(last * G, length);
    for (int base = tail_first + 8 * warp; base < tail_end; base += 8 * WARPS) {
        const int pos = base + tok;
        const float logit = pos < tail_end ? logits[pos] : NEG_INF;
        const float s = pos < tail_end ? logit * LOG2E : NEG_INF;
        const float m_new = fmaxf(m_run, warp_max(s));
        if (m_new > m_run) {
            const float alpha = exp2f(m_run - m_new);
#pragma unroll
            for (int i = 0; i < OWN; ++i) {
                acc[i] *= alpha;
                sel[i] *= alpha;
            }
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                mins[g] *= alpha;
                mins_sel[g] *= alpha;
            }
            m_run = m_new;
        }
        if (pos < tail_end) {
            const float w = V_WEIGHT * exp2f(s - m_run);
            const float ws = taken(logit, pos, threshold, last_tie) ? w : 0.f;
            const i64 page = P.block_tables[row * P.bt_row + pos / P.block_size];
            const u16* v = P.v_cache + page * P.v_block + (i64)(pos % P.block_size) * P.v_slot +
                           (i64)kv_head * P.v_head;
#pragma unroll
            for (int m = 0; m < WORDS; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 pair = *(const u32*)(v + owned_channel(quad, m, e, 0));
                    const float lo = __uint_as_float(pair << 16);
                    const float hi = __uint_as_float(pair & 0xffff0000u);
                    acc[8 * m + 2 * e] += w * lo;
                    acc[8 * m + 2 * e + 1] += w * hi;
                    sel[8 * m + 2 * e] += ws * lo;
                    sel[8 * m + 2 * e + 1] += ws * hi;
                }
        }
    }

    // ---- this warp's partials relative to its max, then the CTA's, made absolute by lse
#pragma unroll
    for (int i = 0; i < OWN; ++i) {
        const int g = (32 * (i / 8)) / G;
        acc[i] = sum_token_lanes(acc[i] * (1.f / V_WEIGHT) + mins[g]);
        sel[i] = sum_token_lanes(sel[i] * (1.f / V_WEIGHT) + mins_sel[g]);
    }
    float* mine_out = merge + warp * (2 * D + 1);
    if (tok == 0) {
#pragma unroll
        for (int m = 0; m < WORDS; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int ch = owned_channel(quad, m, e, h);
                    mine_out[ch] = acc[8 * m + 2 * e + h];
                    mine_out[D + ch] = sel[8 * m + 2 * e + h];
                }
    }
    if (lane == 0) mine_out[2 * D] = m_run;
    __syncthreads();
    const i64 at = row * P.o_row + (i64)head * P.o_head + (i64)split * P.o_split;
    for (int d = threadIdx.x; d < 2 * D; d += WARPS * 32) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float m = merge[w * (2 * D + 1) + 2 * D];
            if (m != NEG_INF) v += merge[w * (2 * D + 1) + d] * exp2f(m - lse2);
        }
        if (d < D)
            P.part_out[at + d] = v;
        else
            P.part_contrib[at + d - D] = v;
    }
    const SourceFinish& F = P.finish;
    if (F.counters == nullptr || !last_split(F.counters + row * gridDim.y + head, F.value_splits))
        return;
    const i64 pair = row * gridDim.y + head;
    const i64 first_part = row * P.o_row + (i64)head * P.o_head;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float dense = 0.f, contrib = 0.f;
        for (int s = 0; s < F.value_splits; ++s) {
            dense += ldcg(P.part_out + first_part + (i64)s * P.o_split + d);
            contrib += ldcg(P.part_contrib + first_part + (i64)s * P.o_split + d);
        }
        F.output[row * F.output_row + (i64)head * F.output_head + d] = dense;
        F.out[row * F.out_row + (i64)head * F.out_head + d] = float_to_bf16(dense);
        F.contribution[row * F.contrib_row + (i64)head * F.contrib_head + d] = contrib;
    }
    if (threadIdx.x == 0) {
        float mass = 0.f;
        for (int s = 0; s < F.mass_splits; ++s) mass += F.part_mass[pair * F.mass_splits + s];
        F.mass[row * F.mass_row + head] = mass;
    }
}
#endif
