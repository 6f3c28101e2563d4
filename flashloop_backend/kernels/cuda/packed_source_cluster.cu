// The loop-2 source over packed INT4 KV (encoding v3, dense levels) in one launch, for few
// rows: a thread-block cluster of CLUSTER CTAs per (query head, row), CTA r over groups [r
// per_cta, (r + 1) per_cta). Built by kernels/cuda/packed_source_cluster.py with HEAD_DIM,
// GROUP, LEVELS, WARPS, STAGES and CLUSTER defined.
//  1. keys: each warp streams its groups' K halves (source_groups.cuh) and writes the
//     logits into the CTA's shared memory, never to global memory; the CTAs exchange their
//     (max, sum) and each merges the row's LSE. Each warp then fills the ring the keys
//     left free with its first V halves, so they arrive during the selection.
//  2. selection: the selection's histogram steps (selection.cuh: linear bins of lse -
//     logit, then three radix digits of the order key) over the CTAs' logits, each
//     histogram summed across the cluster in distributed shared memory (every CTA gathers
//     one slice of every CTA's bins, sums it and stores the sums into every CTA). Every CTA
//     then knows the threshold key and the ties to take; the CTAs exchange their counts
//     above and at it, and each writes its range's positions in order (ballots give the
//     slots) and keeps a bit per position of what it took.
//  3. values: the dense output and the contribution over the taken keys, as the values
//     pass; the CTAs' sums go to CTA 0, which writes the outputs and the mass.
#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#include "source_groups.cuh"
#include "selection.cuh"
#include "cluster.cuh"

constexpr int STAGE = LEVELS * HALF;
constexpr int THREADS = WARPS * 32;
constexpr int SLICE = BINS / CLUSTER;  // bins each CTA sums across the cluster
static_assert(STAGE % 16 == 0, "stages stay 16-byte aligned");
static_assert(BINS % (CLUSTER * 32) == 0 && 2 * D * CLUSTER <= BINS, "bins split by CTA");

struct ClusterParams {
    const u16* q;                 // [R, Hq, D] bf16
    const unsigned char* blocks;  // one layer's blocks [pages, L, Hkv, BLOCK] (layer offset)
    i64 page_bytes;
    const int* tables;            // [R, Lv, P]
    const int* kinds;             // [R, Lv]
    const int* packed;            // [R]
    const u16* k_cache;           // [NB, BS, Hkv, D] bf16
    const u16* v_cache;
    const int* block_tables;      // [R, MB]
    const int* lengths;           // [R]
    u16* out;                     // [R, Hq, D] bf16
    int* indices;                 // [R, Hq, Kb] positions in order, -1 past K
    float* mass;                  // [R, Hq]
    float* output;                // [R, Hq, D] FP32 dense output
    float* contribution;          // [R, Hq, D] FP32
    float scale;
    int q_row, q_head;
    int t_row, t_level, kind_row;
    int k_block, k_slot, k_head, v_block, v_slot, v_head, bt_row;
    int out_row, out_head, i_row, i_head, mass_row, output_row, output_head;
    int contrib_row, contrib_head;
    int ratio_num, ratio_den, bucket;
    int groups_per_cta, group_q, block_size;
};

// The cluster's histogram from every CTA's ``hist`` [BINS] into each CTA's ``total``, and
// the bin where ``rank`` falls (scanned downward when DOWN). ``gather`` [CLUSTER][SLICE]
// receives the other CTAs' bins of this CTA's slice.
template <bool DOWN>
__device__ Found cluster_find(const int* hist, int* total, int* gather, int rank, int me,
                              int* warp_sums, Found* found) {
    __syncthreads();  // the local histogram is complete
    for (int i = threadIdx.x; i < BINS; i += THREADS)
        cluster_store(cluster_map(gather + me * SLICE + i % SLICE, i / SLICE), hist[i]);
    cluster_sync();
    for (int j = threadIdx.x; j < SLICE; j += THREADS) {
        int sum = 0;
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) sum += gather[c * SLICE + j];
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) cluster_store(cluster_map(total + me * SLICE + j, c), sum);
    }
    cluster_sync();
    return find_bin<WARPS, DOWN>(total, rank, warp_sums, found);
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1)
packed_source_cluster(const ClusterParams P) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int hist[BINS];
    __shared__ int total[BINS];
    __shared__ __align__(16) int gather[BINS];  // then the CTAs' value sums [CLUSTER][2 D]
    __shared__ float merge[WARPS * (2 * D + 1)];
    __shared__ float states[CLUSTER][2];
    __shared__ int counts[CLUSTER][2];
    __shared__ float masses[CLUSTER];
    __shared__ int warp_sums[WARPS], warp_gt[WARPS], warp_ties[WARPS];
    __shared__ float warp_mass[WARPS];
    __shared__ Found found;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int quad = lane & 3, tok = lane >> 2;
    const int me = cluster_rank(), head = blockIdx.x / CLUSTER;
    const i64 row = blockIdx.y;
    const int kv_head = head / P.group_q;
    const int length = P.lengths[row];
    const int packed_groups = P.packed[row] / G;
    const int first = me * P.groups_per_cta;
    const int last = min(first + P.groups_per_cta, (length + G - 1) / G);
    const int base = first * G;                      // the CTA's first position
    const int n = max(min(last * G, length) - base, 0);  // its positions
    unsigned char* ring = smem + warp * (STAGES * STAGE);
    float* logits = (float*)(smem + WARPS * STAGES * STAGE);  // [groups_per_cta G]
    u32* taken_bits = (u32*)(logits + P.groups_per_cta * G);   // [groups_per_cta G / 32]

    int* indices = P.indices + row * P.i_row + (i64)head * P.i_head;
    const i64 want = ((i64)length * P.ratio_num + P.ratio_den - 1) / P.ratio_den;
    const int count = (int)(want < length ? want : length);
    for (int s = count + me * THREADS + tid; s < P.bucket; s += CLUSTER * THREADS) indices[s] = -1;
    if (count == 0) {  // an empty row, alike in every CTA of the cluster: zeros
        if (me == 0) {
            for (int d = tid; d < D; d += THREADS) {
                P.output[row * P.output_row + (i64)head * P.output_head + d] = 0.f;
                P.out[row * P.out_row + (i64)head * P.out_head + d] = 0;
                P.contribution[row * P.contrib_row + (i64)head * P.contrib_head + d] = 0.f;
            }
            if (tid == 0) P.mass[row * P.mass_row + head] = 0.f;
        }
        return;
    }

    // ---- 1. keys: logits into shared memory, the CTA's max and sum
    const u16* qrow = P.q + row * P.q_row + (i64)head * P.q_head;
    const float qs = P.scale * LOG2E;
    const QueryFold fold = fold_query(qrow, qs, quad, tok);
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];
    const int packed_end = min(last, packed_groups);
    const int mine = packed_end > first + warp ? (packed_end - first - warp + WARPS - 1) / WARPS : 0;
    auto issue = [&](int k, bool values) {
        if (k < mine) {
            unsigned char* stage = ring + (k % STAGES) * STAGE;
            const int group = first + warp + k * WARPS;
            if (values)
                copy_group<true>(stage, P, row, kv_head, kinds, group, lane);
            else
                copy_group<false>(stage, P, row, kv_head, kinds, group, lane);
        }
        cp_async_commit();
    };
    float m_run = NEG_INF, l_run = 0.f;
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(k, false);
    for (int k = 0; k < mine; ++k) {
        issue(k + STAGES - 1, false);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        keys_group(ring + (k % STAGES) * STAGE, kinds, fold, quad, tok, first + warp + k * WARPS,
                   length, logits, base, m_run, l_run);
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncwarp();
#pragma unroll
    for (int k = 0; k < STAGES; ++k) issue(k, true);  // V fills the ring during the selection
    keys_tail(P, row, kv_head, qrow, qs, max(first, packed_groups) * G, min(last * G, length),
              warp, WARPS, quad, tok, logits, base, m_run, l_run);
    if (lane == 0) {
        merge[2 * warp] = m_run;
        merge[2 * warp + 1] = l_run;
    }
    __syncthreads();
    if (tid < CLUSTER) {  // thread c stores this CTA's (max, sum), natural log, into CTA c
        float cta_max = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) cta_max = fmaxf(cta_max, merge[2 * w]);
        const float safe = cta_max == NEG_INF ? 0.f : cta_max;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += merge[2 * w + 1] * exp2f(merge[2 * w] - safe);
        cluster_store(cluster_map(&states[me][0], tid), cta_max * LN2);
        cluster_store(cluster_map(&states[me][1], tid), sum);
    }
    cluster_sync();
    float lse;  // merge_lse's arithmetic over the CTAs in rank order
    {
        float top = NEG_INF;
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) top = fmaxf(top, states[c][0]);
        const float safe = top == NEG_INF ? 0.f : top;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) sum += states[c][1] * expf(states[c][0] - safe);
        lse = sum > 0.f ? safe + logf(sum) : NEG_INF;
    }

    // ---- 2. selection: the bin of the K-th key, then its three digits
    for (int b = tid; b < BINS; b += THREADS) hist[b] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += THREADS) atomicAdd(&hist[linear_bin(order_key(logits[i]), lse)], 1);
    int rank = count - 1;
    const Found in_bins = cluster_find<false>(hist, total, gather, rank, me, warp_sums, &found);
    const int bin = in_bins.bin;
    rank -= in_bins.before;
    u32 prefix = 0, high = 0;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const u32 digit_mask = pass == 2 ? 0x3ffu : 0x7ffu;
        for (int b = tid; b < BINS; b += THREADS) hist[b] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += THREADS) {
            const u32 key = order_key(logits[i]);
            if ((key & high) == prefix && linear_bin(key, lse) == bin)
                atomicAdd(&hist[(key >> shift) & digit_mask], 1);
        }
        const Found digit = cluster_find<true>(hist, total, gather, rank, me, warp_sums, &found);
        rank -= digit.before;
        prefix |= (u32)digit.bin << shift;
        high |= digit_mask << shift;
    }
    const u32 threshold = prefix;
    const int remaining = rank + 1;  // ties at the threshold to take, earliest first

    // each warp's keys above the threshold and at it over its slice of the CTA's positions
    const int per_warp = ((n + THREADS - 1) / THREADS) * 32;
    const int begin = min(warp * per_warp, n), end = min(begin + per_warp, n);
    int gt = 0, ties = 0;
    for (int i = begin + lane; i < end; i += 32) {
        const u32 key = order_key(logits[i]);
        gt += key > threshold;
        ties += key == threshold;
    }
    gt = warp_sum_int(gt);
    ties = warp_sum_int(ties);
    if (lane == 0) {
        warp_gt[warp] = gt;
        warp_ties[warp] = ties;
    }
    __syncthreads();
    if (tid < CLUSTER) {
        int cta_gt = 0, cta_ties = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            cta_gt += warp_gt[w];
            cta_ties += warp_ties[w];
        }
        cluster_store(cluster_map(&counts[me][0], tid), cta_gt);
        cluster_store(cluster_map(&counts[me][1], tid), cta_ties);
    }
    cluster_sync();
    int ties_before = 0, taken_before = 0;  // in the CTAs before this one
    for (int c = 0; c < me; ++c) {
        taken_before += counts[c][0] + min(max(remaining - ties_before, 0), counts[c][1]);
        ties_before += counts[c][1];
    }
    const int lane_ties = lane < WARPS ? warp_ties[lane] : 0;
    const int ties_before_lane = ties_before + warp_exclusive(lane_ties, lane);
    const int taken_ties = min(max(remaining - ties_before_lane, 0), lane_ties);
    const int lane_taken = (lane < WARPS ? warp_gt[lane] : 0) + taken_ties;
    const int taken_before_lane = taken_before + warp_exclusive(lane_taken, lane);
    int written = __shfl_sync(FULL_MASK, taken_before_lane, warp);
    int ties_seen = __shfl_sync(FULL_MASK, ties_before_lane, warp);
    const u32 below = (1u << lane) - 1;
    float mass = 0.f;
    for (int at = begin; at < end; at += 32) {  // begin is a multiple of 32
        const int i = at + lane;
        const float logit = i < end ? logits[i] : 0.f;
        const u32 key = order_key(logit);
        const bool tie = i < end && key == threshold;
        const u32 tie_bits = __ballot_sync(FULL_MASK, tie);
        const int tie_rank = ties_seen + __popc(tie_bits & below);
        const bool take = (i < end && key > threshold) || (tie && tie_rank < remaining);
        const u32 take_bits = __ballot_sync(FULL_MASK, take);
        if (take) {
            indices[written + __popc(take_bits & below)] = base + i;
            mass += expf(logit - lse);
        }
        if (lane == 0) taken_bits[at / 32] = take_bits;
        written += __popc(take_bits);
        ties_seen += __popc(tie_bits);
    }
    mass = warp_sum(mass);
    if (lane == 0) warp_mass[warp] = mass;
    __syncthreads();  // the taken bits and the warps' masses

    // ---- 3. values: the dense output and the contribution
    auto is_taken = [&](int i) { return (taken_bits[i >> 5] >> (i & 31) & 1u) != 0u; };
    ValueSums sums;
    clear_sums(sums);
    for (int k = 0; k < mine; ++k) {
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const int group = first + warp + k * WARPS;
        float s[ROUNDS];
        bool take[ROUNDS];
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const int pos = group * G + 8 * r + tok, i = pos - base;
            s[r] = pos < length ? logits[i] * LOG2E : NEG_INF;
            take[r] = pos < length && is_taken(i);
        }
        values_group(ring + (k % STAGES) * STAGE, kinds, s, take, quad, tok, sums);
        __syncwarp();
        issue(k + STAGES, true);  // into the stage just read
    }
    cp_async_wait<0>();
    values_tail(
        P, row, kv_head, max(first, packed_groups) * G, min(last * G, length), warp, WARPS, quad,
        tok, [&](int pos) { return logits[pos - base]; },
        [&](int pos, float) { return is_taken(pos - base); }, sums);
    store_value_sums(sums, merge + warp * (2 * D + 1), lane, quad, tok);
    __syncthreads();

    // the CTA's sums made absolute by lse into CTA 0's parts[me], its mass into masses[me]
    float* parts = (float*)gather;  // [CLUSTER][2 D]: no CTA reads gather after the counts
    const float lse2 = lse * LOG2E;
    for (int d = tid; d < 2 * D; d += THREADS) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float m = merge[w * (2 * D + 1) + 2 * D];
            if (m != NEG_INF) v += merge[w * (2 * D + 1) + d] * exp2f(m - lse2);
        }
        cluster_store(cluster_map(parts + me * 2 * D + d, 0), v);
    }
    if (tid == 0) {
        float cta_mass = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) cta_mass += warp_mass[w];
        cluster_store(cluster_map(&masses[me], 0), cta_mass);
    }
    cluster_sync();
    if (me != 0) return;
    for (int d = tid; d < D; d += THREADS) {
        float dense = 0.f, contrib = 0.f;
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) {
            dense += parts[c * 2 * D + d];
            contrib += parts[c * 2 * D + D + d];
        }
        P.output[row * P.output_row + (i64)head * P.output_head + d] = dense;
        P.out[row * P.out_row + (i64)head * P.out_head + d] = float_to_bf16(dense);
        P.contribution[row * P.contrib_row + (i64)head * P.contrib_head + d] = contrib;
    }
    if (tid == 0) {
        float total_mass = 0.f;
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) total_mass += masses[c];
        P.mass[row * P.mass_row + head] = total_mass;
    }
}
