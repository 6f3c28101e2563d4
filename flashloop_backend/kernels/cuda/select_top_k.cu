// The loop-2 exact top-K selection in one launch: one CTA per (row, head) finds the K-th
// largest logit's order key exactly and writes the selected positions in position order
// with their probability mass (the contract of select_positions in
// kernels/triton/threshold_select.py, as one split), in three reads of the row:
//   1. a histogram of linear bins of (lse - logit). Attention logits crowd a few
//      exponents, so bins over the keys' top bits would send most of a warp's atomics to
//      one address; linear bins spread them. fl(lse - x) * 32 is monotone in x, so a
//      lower bin holds strictly larger logits and the K-th key lies in one bin;
//   2. that bin's keys and positions into a shared candidate list, and per warp the keys
//      in lower bins; three radix digits of the order key (11, 11, 10 bits) over the list
//      give the threshold (a list of up to RANK_LIST keys: each key's rank counted
//      directly), and the list gives each warp's keys above it and ties at it;
//   3. each warp writes its range's selected positions in order (ballots give the slots).
// A bin fuller than the list takes the same digits over the row instead (slower, exact).
// Warp w reads positions [w * per_warp, (w + 1) * per_warp), lanes consecutive.
#include "selection.cuh"

#ifndef THREADS
#define THREADS 1024
#endif
#define WARPS (THREADS / 32)
#define CANDIDATES 4096
#ifndef BATCH
#define BATCH 4  // tiles of 32 positions a warp loads before using any
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1
#endif
#ifndef RANK_LIST
#define RANK_LIST 0  // a list of up to this many keys (<= THREADS) is ranked directly (0: never)
#endif

struct Params {
    const float* logits;  // [R, H, T] scaled natural logits, valid below the row's length
    const float* lse;     // [R, H]
    const int* lengths;   // [R]
    int* plan;            // [R, H, 3]: threshold key, ties to take, last tie taken
    int* offsets;         // [R, H, 1, 2]: the one split's output offset and earlier ties
    int* indices;         // [R, H, Kb]: selected positions in order, -1 past K
    float* mass;          // [R, H]: sum exp(logit - lse) over the selected keys
    long long l_row, l_head;
    int e_row, i_row, i_head, m_row;
    int ratio_num, ratio_den, bucket;
    // the keys pass's split states [R, H, S] (natural-log maxima, sums): when given, the
    // row's lse is merged from them here and written to lse (nullptr: lse is read)
    const float* part_max;
    const float* part_sum;
    int s_row, s_head, splits;
    TRACE_FIELD  // points: entry, lse, read 1, its bin, read 2, digits, counts, read 3, end
};

// The row's LSE: read, or merged from the keys pass's split states by warp 0 and written
// for the values pass (merge_lse's arithmetic: -inf for a row with no key)
__device__ float row_lse(const Params& P, int row, int head) {
    __shared__ float merged;
    float* lse = (float*)P.lse + row * (long long)P.e_row + head;
    if (P.part_max == nullptr) return *lse;
    if (threadIdx.x < 32) {
        const long long at = row * (long long)P.s_row + head * (long long)P.s_head;
        const float value = merge_split_lse(P.part_max, P.part_sum, at, P.splits, threadIdx.x);
        if (threadIdx.x == 0) {
            merged = value;
            *lse = merged;
        }
    }
    __syncthreads();
    return merged;
}

// a lane's BATCH logits at first, first + 32, ... below end, issued before any is used
// (positions at or past end read as 0 and are masked by the caller)
__device__ __forceinline__ void load_batch(float* batch, const float* logits, int first, int end) {
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
        const int p = first + 32 * j;
        batch[j] = p < end ? logits[p] : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) select_top_k(const Params P) {
    __shared__ int hist[BINS];
    __shared__ u32 cand_key[CANDIDATES];
    __shared__ int cand_pos[CANDIDATES];
    __shared__ int warp_sum[WARPS], warp_gt[WARPS], warp_ties[WARPS];
    __shared__ float warp_mass[WARPS];
    __shared__ int cand_count;
    __shared__ Found found;
    const int head = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const long long pair = (long long)row * gridDim.x + head;
    TRACE_AT(P.trace, 0);
    const float lse = row_lse(P, row, head);
    TRACE_AT(P.trace, 1);
    const int length = P.lengths[row];
    const long long want = ((long long)length * P.ratio_num + P.ratio_den - 1) / P.ratio_den;
    const int count = (int)(want < length ? want : length);
    int* out = P.indices + row * (long long)P.i_row + head * (long long)P.i_head;
    for (int s = count + tid; s < P.bucket; s += THREADS) out[s] = -1;
    if (tid == 0) {
        P.offsets[pair * 2] = 0;
        P.offsets[pair * 2 + 1] = 0;
    }
    if (count == 0) {
        if (tid == 0) {
            P.plan[pair * 3] = 0;
            P.plan[pair * 3 + 1] = 0;
            P.plan[pair * 3 + 2] = -1;
            P.mass[row * (long long)P.m_row + head] = 0.0f;
        }
        return;
    }
    const float* logits = P.logits + row * P.l_row + head * P.l_head;
    const int per_warp = ((length + WARPS * 32 - 1) / (WARPS * 32)) * 32;
    const int begin = warp * per_warp;
    const int end = min(begin + per_warp, length);

    // read 1: the linear bins
    for (int b = tid; b < BINS; b += THREADS) hist[b] = 0;
    if (tid == 0) cand_count = 0;
    __syncthreads();
    for (int base = begin; base < end; base += 32 * BATCH) {
        float batch[BATCH];
        load_batch(batch, logits, base + lane, end);
#pragma unroll
        for (int j = 0; j < BATCH; ++j)
            if (base + lane + 32 * j < end) atomicAdd(&hist[linear_bin(order_key(batch[j]), lse)], 1);
    }
    __syncthreads();
    TRACE_AT(P.trace, 2);
    int rank = count - 1;  // of the K-th key among those still in the search
    const Found first = find_bin<WARPS, false>(hist, rank, warp_sum, &found);
    const int bin = first.bin;
    rank -= first.before;
    const bool listed = hist[bin] <= CANDIDATES;
    TRACE_AT(P.trace, 3);

    // read 2: the bin's keys into the list, each warp's keys in lower bins
    int gt = 0;
    for (int base = begin; base < end; base += 32 * BATCH) {
        float batch[BATCH];
        load_batch(batch, logits, base + lane, end);
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int p = base + lane + 32 * j;
            const u32 key = order_key(batch[j]);
            const int b = linear_bin(key, lse);
            gt += p < end && b < bin;
            if (p < end && b == bin && listed) {
                const int slot = atomicAdd(&cand_count, 1);
                cand_key[slot] = key;
                cand_pos[slot] = p;
            }
        }
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) gt += __shfl_xor_sync(FULL_MASK, gt, d);
    if (lane == 0) {
        warp_gt[warp] = gt;
        warp_ties[warp] = 0;
    }
    const int listed_count = listed ? hist[bin] : 0;
    TRACE_AT(P.trace, 4);

    u32 prefix = 0;
    if (RANK_LIST > 0 && listed && listed_count <= RANK_LIST) {
        // a short list ranked directly: the threshold is the key with exactly rank keys
        // of the list before it in (key down, position up) order, and the ties to take
        // are the ones at earlier positions and itself. The lanes of a slice share a
        // candidate, each counting over every slices-th key of the list.
        __shared__ u32 direct_key;
        __shared__ int direct_ties;
        int slices = 32;  // a power of two, as many as THREADS / listed_count allows
        while (slices > 1 && slices * listed_count > THREADS) slices >>= 1;
        const int c = tid / slices, part = tid % slices;
        const bool mine = c < listed_count;
        __syncthreads();  // the list is written
        const u32 key = mine ? cand_key[c] : 0u;
        const int pos = mine ? cand_pos[c] : 0;
        int above = 0, ties_before = 0;
        if (mine) {
            for (int j = part; j < listed_count; j += slices) {
                const u32 other = cand_key[j];
                above += other > key;
                ties_before += other == key && cand_pos[j] < pos;
            }
        }
        for (int o = 1; o < slices; o <<= 1) {
            above += __shfl_xor_sync(FULL_MASK, above, o);
            ties_before += __shfl_xor_sync(FULL_MASK, ties_before, o);
        }
        if (mine && part == 0 && above + ties_before == rank) {
            direct_key = key;
            direct_ties = ties_before;
        }
        __syncthreads();
        prefix = direct_key;
        rank = direct_ties;
    } else {
        // the digits over the list (or over the row's keys in the bin)
        u32 high = 0;
#pragma unroll 1
        for (int pass = 0; pass < 3; ++pass) {
            const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
            const u32 digit_mask = pass == 2 ? 0x3ffu : 0x7ffu;
            __syncthreads();  // the last search's reads of hist are done
            for (int b = tid; b < BINS; b += THREADS) hist[b] = 0;
            __syncthreads();
            if (listed) {
                for (int c = tid; c < listed_count; c += THREADS) {
                    const u32 key = cand_key[c];
                    if ((key & high) == prefix)
                        atomicAdd(&hist[(key >> shift) & digit_mask], 1);
                }
            } else {
                for (int p = begin + lane; p < end; p += 32) {
                    const u32 key = order_key(logits[p]);
                    if ((key & high) == prefix && linear_bin(key, lse) == bin)
                        atomicAdd(&hist[(key >> shift) & digit_mask], 1);
                }
            }
            __syncthreads();
            const Found digit = find_bin<WARPS, true>(hist, rank, warp_sum, &found);
            rank -= digit.before;
            prefix |= (u32)digit.bin << shift;
            high |= digit_mask << shift;
        }
    }
    const u32 threshold = prefix;
    TRACE_AT(P.trace, 5);
    const int remaining = rank + 1;  // ties at the threshold to take, earliest first

    // each warp's keys of the bin above the threshold and at it
    if (listed) {
        for (int c = tid; c < listed_count; c += THREADS) {
            const u32 key = cand_key[c];
            const int w = cand_pos[c] / per_warp;
            if (key > threshold) atomicAdd(&warp_gt[w], 1);
            if (key == threshold) atomicAdd(&warp_ties[w], 1);
        }
    } else {
        int above = 0, ties = 0;
        for (int p = begin + lane; p < end; p += 32) {
            const u32 key = order_key(logits[p]);
            above += key > threshold && linear_bin(key, lse) == bin;
            ties += key == threshold;
        }
#pragma unroll
        for (int d = 16; d; d >>= 1) {
            above += __shfl_xor_sync(FULL_MASK, above, d);
            ties += __shfl_xor_sync(FULL_MASK, ties, d);
        }
        if (lane == 0) {
            warp_gt[warp] += above;
            warp_ties[warp] = ties;
        }
    }
    __syncthreads();
    TRACE_AT(P.trace, 6);

    // read 3: each warp's selected positions in order at its offset
    const int lane_ties = lane < WARPS ? warp_ties[lane] : 0;
    const int ties_before_lane = warp_exclusive(lane_ties, lane);
    const int taken_ties = min(max(remaining - ties_before_lane, 0), lane_ties);
    const int lane_taken = (lane < WARPS ? warp_gt[lane] : 0) + taken_ties;
    const int taken_before_lane = warp_exclusive(lane_taken, lane);
    int written = __shfl_sync(FULL_MASK, taken_before_lane, warp);
    int ties_seen = __shfl_sync(FULL_MASK, ties_before_lane, warp);
    const u32 below = (1u << lane) - 1;
    float mass = 0.0f;
    for (int base = begin; base < end; base += 32 * BATCH) {
        float batch[BATCH];
        load_batch(batch, logits, base + lane, end);
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int p = base + lane + 32 * j;
            const u32 key = order_key(batch[j]);
            const bool tie = p < end && key == threshold;
            const u32 tie_bits = __ballot_sync(FULL_MASK, tie);
            const int tie_rank = ties_seen + __popc(tie_bits & below);
            const bool take = (p < end && key > threshold) || (tie && tie_rank < remaining);
            const u32 take_bits = __ballot_sync(FULL_MASK, take);
            if (take) {
                out[written + __popc(take_bits & below)] = p;
                mass += expf(batch[j] - lse);
                if (tie && tie_rank == remaining - 1) P.plan[pair * 3 + 2] = p;
            }
            written += __popc(take_bits);
            ties_seen += __popc(tie_bits);
        }
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) mass += __shfl_xor_sync(FULL_MASK, mass, d);
    if (lane == 0) warp_mass[warp] = mass;
    __syncthreads();
    TRACE_AT(P.trace, 7);
    if (warp == 0) {
        float total = lane < WARPS ? warp_mass[lane] : 0.0f;
#pragma unroll
        for (int d = 16; d; d >>= 1) total += __shfl_xor_sync(FULL_MASK, total, d);
        if (lane == 0) {
            P.mass[row * (long long)P.m_row + head] = total;
            P.plan[pair * 3] = (int)threshold;
            P.plan[pair * 3 + 1] = remaining;
        }
    }
    TRACE_AT(P.trace, 8);
}
