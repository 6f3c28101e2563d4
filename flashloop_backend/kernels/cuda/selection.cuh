// The exact top-K search of the one-launch selection (select_top_k.cu), for any CTA of
// NWARPS warps: linear bins of (lse - logit), then radix digits of the order key, each step
// finding the bin where a rank falls.
#pragma once
#include "common.cuh"

#define BINS 2048
#define BINS_PER_NAT 32.0f

__device__ __forceinline__ float key_logit(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
__device__ __forceinline__ int linear_bin(u32 key, float lse) {
    const float distance = __fmul_rn(__fsub_rn(lse, key_logit(key)), BINS_PER_NAT);
    return (int)fminf(fmaxf(distance, 0.0f), (float)(BINS - 1));
}

__device__ __forceinline__ int warp_inclusive(int value, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int up = __shfl_up_sync(FULL_MASK, value, d);
        if (lane >= d) value += up;
    }
    return value;
}
__device__ __forceinline__ int warp_exclusive(int value, int lane) {
    return warp_inclusive(value, lane) - value;
}

struct Found {
    int bin;     // the bin holding the rank-th key in scan order
    int before;  // keys in bins scanned before it
};

// The bin of hist [BINS] (scanned upward, or downward when DOWN) where the cumulative
// count passes rank; every thread returns it. Two barriers inside, hist read-only.
template <int NWARPS, bool DOWN>
__device__ Found find_bin(const int* hist, int rank, int* warp_sum, Found* found) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int SLICE = BINS / NWARPS;  // bins per warp, in scan order
    constexpr int PER_LANE = SLICE / 32;
    int mine = 0;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int o = warp * SLICE + lane * PER_LANE + j;
        mine += hist[DOWN ? BINS - 1 - o : o];
    }
    int total = mine;
#pragma unroll
    for (int d = 16; d; d >>= 1) total += __shfl_xor_sync(FULL_MASK, total, d);
    if (lane == 0) warp_sum[warp] = total;
    __syncthreads();
    // each warp finds the slice alone (no second barrier needed for the search itself)
    const int slice = lane < NWARPS ? warp_sum[lane] : 0;
    const int incl = warp_inclusive(slice, lane);
    const u32 hit = __ballot_sync(FULL_MASK, incl > rank);
    const int owner = hit ? __ffs(hit) - 1 : NWARPS - 1;
    const int slice_before = __shfl_sync(FULL_MASK, incl - slice, owner);
    if (warp == owner) {
        const int lane_incl = warp_inclusive(mine, lane);
        const u32 lane_hit = __ballot_sync(FULL_MASK, slice_before + lane_incl > rank);
        const int at = lane_hit ? __ffs(lane_hit) - 1 : 31;
        if (lane == at) {
            int before = slice_before + lane_incl - mine;
            int o = warp * SLICE + lane * PER_LANE;
            for (int j = 0; j < PER_LANE; ++j, ++o) {
                const int count = hist[DOWN ? BINS - 1 - o : o];
                if (before + count > rank || j == PER_LANE - 1) break;
                before += count;
            }
            found->bin = DOWN ? BINS - 1 - o : o;
            found->before = before;
        }
    }
    __syncthreads();
    return *found;
}
