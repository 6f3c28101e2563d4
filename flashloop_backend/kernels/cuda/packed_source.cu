// The loop-2 source over packed INT4 KV (encoding v3, dense levels) as two streaming passes
// around the top-K selection. Built by kernels/cuda/packed_source.py with HEAD_DIM, GROUP,
// LEVELS, WARPS, STAGES, MIN_CTAS and PASS (1: keys, 2: values) defined, and SELECTED 0 for
// a values pass that sums the dense output alone (source_groups.cuh).
//
// Each pass copies only its half of every level's block (keys: K codes and K parameters;
// values: V codes and V records, plus the group's logits), so a ring stage holds half the
// bytes of a full read and two stages fit where a full read fits one. One CTA = one (split,
// query head, row); its warps take the split's groups in turn, as in packed_stream.cu.
//  keys: exact logits (source_groups.cuh), written for the selection, and the split's max
//        and sum.
//  values: the dense output and the contribution over the keys the selection took (its
//        threshold key, and ties at it up to the last tie position it took); with SELECTED
//        0 the dense output alone, the row's LSE merged from the keys pass's split states
//        in each CTA, so that it needs nothing of the selection and can run beside it.
#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#include "source_groups.cuh"

constexpr int STAGE = LEVELS * HALF + (PASS == 2 ? 4 * G : 0);  // + the group's logits
static_assert(STAGE % 16 == 0, "stages stay 16-byte aligned");

#ifndef MIN_CTAS
#define MIN_CTAS 1  // resident CTAs per SM the registers must allow
#endif


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
    TRACE_FIELD  // points: entry, set up, first group's bytes, groups read, tail read, end
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

// The keys pass's split states, from which a values pass without the selection merges
// each row's LSE itself (part_max nullptr: lse is read)
struct LseStates {
    const float* part_max;        // [R, Hq, S] natural log
    const float* part_sum;
    int s_row, s_head, splits;
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
    LseStates states;
    TRACE_FIELD  // points: the keys pass's, then partials written, finish done
};

#if PASS == 1
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
packed_source_keys(const KeyParams P) {
    extern __shared__ __align__(16) unsigned char smem[];
    TRACE_AT(P.trace, 0);
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
    const QueryFold fold = fold_query(qrow, qs, quad, tok);
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];

    float m_run = NEG_INF, l_run = 0.f;
    TRACE_AT(P.trace, 1);
    const int packed_end = min(last, packed_groups);
    const int mine = packed_end > first + warp ? (packed_end - first - warp + WARPS - 1) / WARPS : 0;
    const unsigned dense = dense_levels(kinds);
    PageWindow pages = open_windows(P, row, dense, first, warp, WARPS, mine, lane);
    auto issue = [&](int k) {
        if (k < mine) {
            unsigned char* stage = ring + (k % STAGES) * STAGE;
            copy_group<false>(stage, P, row, kv_head, dense, first, warp, WARPS, mine, k, pages,
                              lane);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(k);
    for (int k = 0; k < mine; ++k) {
        issue(k + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        if (k == 0) TRACE_AT(P.trace, 2);
        keys_group(ring + (k % STAGES) * STAGE, kinds, fold, quad, tok, first + warp + k * WARPS,
                   length, logits, 0, m_run, l_run);
        __syncwarp();
    }
    cp_async_wait<0>();
    TRACE_AT(P.trace, 3);

    // ---- the BF16 pages above the packed length
    keys_tail(P, row, kv_head, qrow, qs, max(first, packed_groups) * G, min(last * G, length),
              warp, WARPS, quad, tok, logits, 0, m_run, l_run);
    TRACE_AT(P.trace, 4);

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
    TRACE_AT(P.trace, 5);
}
#endif

#if PASS == 2
// the selection's rule on a logit: above the threshold key, or at it and not after the last
// tie the compaction took
__device__ __forceinline__ bool taken(float logit, int pos, u32 threshold, int last_tie) {
    const u32 key = order_key(logit);
    return key > threshold || (key == threshold && pos <= last_tie);
}

// The row's LSE in base 2: read, or merged by warp 0 from the split states (merge_lse's
// arithmetic: -inf for a row with no key)
__device__ float row_lse2(const ValueParams& P, i64 row, int head) {
    __shared__ float merged;
    const LseStates& S = P.states;
    if (S.part_max == nullptr) return P.lse[row * P.e_row + head] * LOG2E;
    if (threadIdx.x < 32) {
        const i64 at = row * S.s_row + (i64)head * S.s_head;
        const float value = merge_split_lse(S.part_max, S.part_sum, at, S.splits, threadIdx.x);
        if (threadIdx.x == 0) merged = value * LOG2E;
    }
    __syncthreads();
    return merged;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
packed_source_values(const ValueParams P) {
    extern __shared__ __align__(16) unsigned char smem[];
    TRACE_AT(P.trace, 0);
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
    u32 threshold = 0xffffffffu;
    int last_tie = -1;
    if (SELECTS) {
        const int* plan = P.plan + (row * gridDim.y + head) * 3;
        threshold = (u32)plan[0];
        last_tie = plan[2];
    }
    const float lse2 = row_lse2(P, row, head);
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];

    ValueSums sums;
    clear_sums(sums);
    TRACE_AT(P.trace, 1);
    const int packed_end = min(last, packed_groups);
    const int mine = packed_end > first + warp ? (packed_end - first - warp + WARPS - 1) / WARPS : 0;
    const unsigned dense = dense_levels(kinds);
    PageWindow pages = open_windows(P, row, dense, first, warp, WARPS, mine, lane);
    auto issue = [&](int k) {
        if (k < mine) {
            const int group = first + warp + k * WARPS;
            unsigned char* stage = ring + (k % STAGES) * STAGE;
            copy_group<true>(stage, P, row, kv_head, dense, first, warp, WARPS, mine, k, pages,
                             lane);
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
        if (k == 0) TRACE_AT(P.trace, 2);
        const unsigned char* stage = ring + (k % STAGES) * STAGE;
        const float* group_logits = (const float*)(stage + LEVELS * HALF);
        const int group = first + warp + k * WARPS;
        float s[ROUNDS];
        bool take[ROUNDS];
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const int t = 8 * r + tok, pos = group * G + t;
            const float logit = group_logits[t];
            s[r] = pos < length ? logit * LOG2E : NEG_INF;
            take[r] = SELECTS && pos < length && taken(logit, pos, threshold, last_tie);
        }
        values_group(stage, kinds, s, take, quad, tok, sums);
        __syncwarp();
    }
    cp_async_wait<0>();
    TRACE_AT(P.trace, 3);

    // ---- the BF16 pages above the packed length
    values_tail(
        P, row, kv_head, max(first, packed_groups) * G, min(last * G, length), warp, WARPS, quad,
        tok, [&](int pos) { return logits[pos]; },
        [&](int pos, float logit) { return taken(logit, pos, threshold, last_tie); }, sums);
    TRACE_AT(P.trace, 4);

    // ---- this warp's partials relative to its max, then the CTA's, made absolute by lse
    store_value_sums(sums, merge + warp * (2 * D + 1), lane, quad, tok);
    __syncthreads();
    const i64 at = row * P.o_row + (i64)head * P.o_head + (i64)split * P.o_split;
    for (int d = threadIdx.x; d < (SELECTS ? 2 : 1) * D; d += WARPS * 32) {
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
    TRACE_AT(P.trace, 5);
    const SourceFinish& F = P.finish;
    if (F.counters == nullptr || !last_split(F.counters + row * gridDim.y + head, F.value_splits))
        return;
    const i64 pair = row * gridDim.y + head;
    const i64 first_part = row * P.o_row + (i64)head * P.o_head;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float dense = 0.f, contrib = 0.f;
        for (int s = 0; s < F.value_splits; ++s) {
            dense += ldcg(P.part_out + first_part + (i64)s * P.o_split + d);
            if (SELECTS) contrib += ldcg(P.part_contrib + first_part + (i64)s * P.o_split + d);
        }
        F.output[row * F.output_row + (i64)head * F.output_head + d] = dense;
        F.out[row * F.out_row + (i64)head * F.out_head + d] = float_to_bf16(dense);
        if (SELECTS) F.contribution[row * F.contrib_row + (i64)head * F.contrib_head + d] = contrib;
    }
    if (SELECTS && threadIdx.x == 0) {
        float mass = 0.f;
        for (int s = 0; s < F.mass_splits; ++s) mass += F.part_mass[pair * F.mass_splits + s];
        F.mass[row * F.mass_row + head] = mass;
    }
    TRACE_AT(P.trace, 6);
}
#endif
