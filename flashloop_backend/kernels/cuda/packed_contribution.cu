// The loop-2 contribution over the selected keys alone: sum p v over the positions the
// selection wrote, p = exp(logit - lse) from the keys pass's logits and the row's LSE, v
// the levels' sum (encoding v3, dense levels) below the packed length and the BF16 value
// above it. It reads no key and only the selected keys' V rows and records, so it can run
// on a side stream beside a values pass that sums the dense output alone. Built by
// kernels/cuda/packed_contribution.py with HEAD_DIM, GROUP, LEVELS and WARPS defined.
//
// One CTA = one (split, query head, row) over keys_per_split slots of the row's selected
// positions; its warps take 8 positions a round, lane (tok, quad) position tok's channels
// of row segment quad. p needs no running max: the LSE is the row's own.
#include "source_groups.cuh"

struct ContribParams {
    const int* indices;           // [R, Hq, Kb] increasing positions, -1 after them
    const float* logits;          // [R, Hq, T] natural logits (the keys pass's)
    const float* lse;             // [R, Hq] natural
    const unsigned char* blocks;  // one layer's blocks (layer offset)
    i64 page_bytes;
    const int* tables;            // [R, Lv, P]
    const int* kinds;             // [R, Lv]
    const int* packed;            // [R]
    const u16* v_cache;           // [NB, BS, Hkv, D] bf16
    const int* block_tables;      // [R, MB]
    float* part_contrib;          // [R, Hq, S, D]
    int* counters;                // [R, Hq] arrivals, 0 between launches
    float* contribution;          // [R, Hq, D]
    int i_row, i_head, g_row, g_head, e_row;
    int t_row, t_level, kind_row;
    int v_block, v_slot, v_head, bt_row;
    int o_row, o_head, o_split, c_row, c_head;
    int keys_per_split, bucket, group_q, block_size;
};

__device__ __forceinline__ uint4 ldg128(const unsigned char* p) { return *(const uint4*)p; }

extern "C" __global__ void __launch_bounds__(WARPS * 32) packed_contribution(const ContribParams P) {
    __shared__ float merge[WARPS][D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int quad = lane & 3, tok = lane >> 2;
    const int split = blockIdx.x, head = blockIdx.y;
    const i64 row = blockIdx.z;
    const int kv_head = head / P.group_q;
    const int packed = P.packed[row];
    const int* idx = P.indices + row * P.i_row + (i64)head * P.i_head;
    const float* logits = P.logits + row * P.g_row + (i64)head * P.g_head;
    const float lse2 = P.lse[row * P.e_row + head] * LOG2E;
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];
    const unsigned char* base = P.blocks + (i64)kv_head * BLOCK;
    const int start = split * P.keys_per_split;
    const int end = min(start + P.keys_per_split, P.bucket);

    float acc[OWN], mins[NG];
#pragma unroll
    for (int k = 0; k < OWN; ++k) acc[k] = 0.f;
#pragma unroll
    for (int n = 0; n < NG; ++n) mins[n] = 0.f;
    for (int i = start + 8 * warp; i < end; i += 8 * WARPS) {
        const int pos = i + tok < end ? idx[i + tok] : -1;
        // positions increase and -1 follows them: a round without one ends the warp's work
        if (!__any_sync(FULL_MASK, pos >= 0)) break;
        if (pos < 0) continue;
        const float p = exp2f(logits[pos] * LOG2E - lse2);
        if (pos < packed) {
#pragma unroll
            for (int l = 0; l < LEVELS; ++l) {
                if (kinds[l] != 0) continue;
                const int page = P.tables[row * P.t_row + (i64)l * P.t_level + pos / G];
                const unsigned char* block = base + page * P.page_bytes;
                const int r = pos % G;
                const uint4 v = ldg128(block + CODES + r * ROW + SEG * quad);
                const u16* record = (const u16*)(block + 2 * CODES + PARAMS) + r * 2 * NG;
                float weight[NG];
#pragma unroll
                for (int n = 0; n < NG; ++n) {
                    mins[n] += p * half_to_float(record[2 * n]);
                    weight[n] = p * half_to_float(record[2 * n + 1]);
                }
                const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int m = 0; m < WORDS; ++m) {
                    u32 pr[4];
                    nibbles_unit(words[m], pr);
                    const float w = weight[(32 * m) / G];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[8 * m + 2 * e] += w * half_lo(pr[e]);
                        acc[8 * m + 2 * e + 1] += w * half_hi(pr[e]);
                    }
                }
            }
        } else {
            const i64 page = P.block_tables[row * P.bt_row + pos / P.block_size];
            const u16* vrow = P.v_cache + page * P.v_block + (i64)(pos % P.block_size) * P.v_slot +
                              (i64)kv_head * P.v_head;
#pragma unroll
            for (int m = 0; m < WORDS; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 pair = *(const u32*)(vrow + owned_channel(quad, m, e, 0));
                    acc[8 * m + 2 * e] += p * __uint_as_float(pair << 16);
                    acc[8 * m + 2 * e + 1] += p * __uint_as_float(pair & 0xffff0000u);
                }
        }
    }

    // ---- the warp's sums over its token lanes, then the CTA's warps, then the splits
#pragma unroll
    for (int k = 0; k < OWN; ++k) acc[k] = sum_token_lanes(acc[k] + mins[(32 * (k / 8)) / G]);
    if (tok == 0) {
#pragma unroll
        for (int m = 0; m < WORDS; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    merge[warp][owned_channel(quad, m, e, h)] = acc[8 * m + 2 * e + h];
    }
    __syncthreads();
    const i64 first_part = row * P.o_row + (i64)head * P.o_head;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += merge[w][d];
        P.part_contrib[first_part + (i64)split * P.o_split + d] = v;
    }
    if (!last_split(P.counters + row * gridDim.y + head, gridDim.x)) return;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float v = 0.f;
        for (int s = 0; s < gridDim.x; ++s) v += ldcg(P.part_contrib + first_part + (i64)s * P.o_split + d);
        P.contribution[row * P.c_row + (i64)head * P.c_head + d] = v;
    }
}
