// Shared device helpers of the packed-KV kernels (encoding v3, kv/layout.py): asynchronous
// copies, FP16 pairs, the nibble conversion and the m16n8k16 tensor-core product. Written
// against PTX directly so that NVRTC needs no CUDA headers.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared without registers; completes at cp_async_wait
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint4 lds128(const void* p) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem_addr(p)));
    return v;
}

__device__ __forceinline__ float half_lo(u32 h2) {
    float f;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }\n" : "=f"(f) : "r"(h2));
    return f;
}
__device__ __forceinline__ float half_hi(u32 h2) {
    float f;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "r"(h2));
    return f;
}
// (lo, hi) floats -> one f16x2, round to nearest
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ float bf16_to_float(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ float half_to_float(u16 v) {
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "h"(v));
    return f;
}
#define NEG_INF __int_as_float(0xff800000)

// One word of a v3 row -> its four FP16 pairs: p[0] = low nibbles of bytes (0, 2), p[1] =
// low nibbles of bytes (1, 3), p[2], p[3] = their high nibbles times 16 (exact values: a
// nibble ORed into the mantissa of 1024 is 1024 + c or 1024 + 16 c; 1024 is subtracted).
__device__ __forceinline__ void nibbles(u32 w, u32 p[4]) {
    const u32 magic = 0x64006400u;
    u32 odd = w >> 8;
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(p[0]) : "r"(w), "r"(magic));
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(p[1]) : "r"(odd), "r"(magic));
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;\n" : "=r"(p[2]) : "r"(w), "r"(magic));
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;\n" : "=r"(p[3]) : "r"(odd), "r"(magic));
#pragma unroll
    for (int i = 0; i < 4; ++i) asm("sub.f16x2 %0, %0, %1;\n" : "+r"(p[i]) : "r"(magic));
}

// One word of a v3 row -> its four FP16 pairs of the codes themselves: p[0], p[1] as
// nibbles(); the high nibbles ORed into the mantissa of 64 (whose ulp is 1/16: 64 + c)
// less 64, so one weight multiplies all four pairs.
__device__ __forceinline__ void nibbles_unit(u32 w, u32 p[4]) {
    const u32 magic = 0x64006400u, magic_hi = 0x54005400u;
    u32 odd = w >> 8;
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(p[0]) : "r"(w), "r"(magic));
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(p[1]) : "r"(odd), "r"(magic));
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;\n" : "=r"(p[2]) : "r"(w), "r"(magic_hi));
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;\n" : "=r"(p[3]) : "r"(odd), "r"(magic_hi));
    asm("sub.f16x2 %0, %0, %1;\n" : "+r"(p[0]) : "r"(magic));
    asm("sub.f16x2 %0, %0, %1;\n" : "+r"(p[1]) : "r"(magic));
    asm("sub.f16x2 %0, %0, %1;\n" : "+r"(p[2]) : "r"(magic_hi));
    asm("sub.f16x2 %0, %0, %1;\n" : "+r"(p[3]) : "r"(magic_hi));
}

// One word of a v3 row -> its four pairs as FP16 1024 + c (p[0], p[1]) and 1024 + 16 c
// (p[2], p[3]): the nibbles ORed into the mantissa of 1024, nothing subtracted (a reader
// that sums in FP32 takes 1024 times its weights back once)
__device__ __forceinline__ void nibbles_biased(u32 w, u32 p[4]) {
    const u32 magic = 0x64006400u;
    u32 odd = w >> 8;
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(p[0]) : "r"(w), "r"(magic));
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(p[1]) : "r"(odd), "r"(magic));
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;\n" : "=r"(p[2]) : "r"(w), "r"(magic));
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;\n" : "=r"(p[3]) : "r"(odd), "r"(magic));
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 lds32(const void* p) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(p)));
    return v;
}

// D = A x B + D, m16n8k16, A row-major f16 (a[4] regs), B col-major f16 (b[2]), fp32 acc
__device__ __forceinline__ void mma16816(float d[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The LSE merged by one warp (lane ``lane``; every lane returns it) from split states
// (natural-log maxima ``part_max`` and sums ``part_sum``) at ``at`` over ``splits``
// splits: merge_lse's arithmetic, -inf for a row with no key
__device__ __forceinline__ float merge_split_lse(const float* part_max, const float* part_sum,
                                                 i64 at, int splits, int lane) {
    float top = NEG_INF;
    for (int s = lane; s < splits; s += 32) top = fmaxf(top, part_max[at + s]);
    top = warp_max(top);
    const float safe = top == NEG_INF ? 0.f : top;
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) sum += part_sum[at + s] * expf(part_max[at + s] - safe);
    sum = warp_sum(sum);
    return sum > 0.f ? safe + logf(sum) : NEG_INF;
}

// the channel of a v3 row segment's nibble: quad lane j, word m, pair p (0: +0/+1, 1: +8/+9,
// 2: +16/+17, 3: +24/+25 above 32 m + 2 j), half h
__device__ __forceinline__ int owned_channel(int j, int m, int p, int h) {
    return 32 * m + 2 * j + 8 * p + h;
}

// FP32 dot of a BF16 row's channels [D/4 j, D/4 (j + 1)) (``row`` points at the first)
// with the query's same channels ``qn``
template <int D>
__device__ __forceinline__ float bf16_dot(const u16* row, const float* qn) {
    const uint4* k = (const uint4*)row;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        const uint4 v = k[i];
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dot += qn[8 * i + 2 * e] * __uint_as_float(w[e] << 16);
            dot += qn[8 * i + 2 * e + 1] * __uint_as_float(w[e] & 0xffff0000u);
        }
    }
    return dot;
}

// sums[i] += p * row[i] over a BF16 row's channels [D/4 j, D/4 (j + 1))
template <int D>
__device__ __forceinline__ void bf16_accumulate(float* sums, const u16* row, float p) {
    const uint4* v = (const uint4*)row;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        const uint4 x = v[i];
        const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            sums[8 * i + 2 * e] += p * __uint_as_float(w[e] << 16);
            sums[8 * i + 2 * e + 1] += p * __uint_as_float(w[e] & 0xffff0000u);
        }
    }
}

// the sum over the eight lanes that share a quad lane (token lanes 0-7 of a warp)
__device__ __forceinline__ float sum_token_lanes(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 4);
    v += __shfl_xor_sync(FULL_MASK, v, 8);
    v += __shfl_xor_sync(FULL_MASK, v, 16);
    return v;
}

// A warp's output partial into ``out`` [D] (shared memory, natural channel order): the
// BF16 tail sums ``tail`` (channels [D/4 j, D/4 (j + 1)) of quad lane j) plus the packed
// sums ``owned`` (the 8 * WORDS channels of quad lane j's row segment), each already
// summed over the token lanes; lanes of token 0 write.
template <int D, int WORDS>
__device__ __forceinline__ void store_warp_partial(float* out, const float* owned,
                                                   const float* tail, int quad, int tok) {
    if (tok == 0) {
#pragma unroll
        for (int i = 0; i < D / 4; ++i) out[(D / 4) * quad + i] = tail[i];
    }
    __syncwarp();
    if (tok == 0) {
#pragma unroll
        for (int m = 0; m < WORDS; ++m)
#pragma unroll
            for (int p = 0; p < 4; ++p)
#pragma unroll
                for (int h = 0; h < 2; ++h) out[owned_channel(quad, m, p, h)] += owned[8 * m + 2 * p + h];
    }
}

// FP32 -> u32 in the same order (select_jit._order_key): -0.0 keys as +0.0, since torch
// (the reference) compares them equal
__device__ __forceinline__ u32 order_key(float logit) {
    const u32 raw = __float_as_uint(logit == 0.0f ? 0.0f : logit);
    return (raw & 0x80000000u) ? ~raw : (raw | 0x80000000u);
}

// ---- work finished by the last CTA of each (row, head) to write its split (the values
// pass's sums): every thread's writes fenced, one arrival counted per CTA, the pattern of
// a grid-wide barrier

__device__ __forceinline__ float ldcg(const float* p) {  // from L2: written by other SMs
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u16 float_to_bf16(float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
    return h;
}

// Whether this CTA, its partial written, is the last of its (row, head) to arrive; the
// last one resets the counter for the next launch (graph replays reuse it).
__device__ __forceinline__ bool last_split(int* counter, int splits) {
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(counter, 1) == splits - 1;
        if (is_last) {
            atomicExch(counter, 0);
            __threadfence();
        }
    }
    __syncthreads();
    return is_last;
}

// ---- phase timestamps (scripts/trace_loop2.py): a kernel built with TRACE defined as its
// count of points takes a u64 buffer [CTAs, TRACE, 2] as its parameters' last field, and
// thread 0 of each CTA writes (%globaltimer ns, clock64 cycles) at each point; without
// TRACE a point compiles to nothing
#ifdef TRACE
#define TRACE_AT(buffer, point)                                                             \
    do {                                                                                    \
        if (threadIdx.x == 0) {                                                             \
            u64 ns, cycles;                                                                 \
            asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));                        \
            asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(cycles));                        \
            const u64 cta = ((u64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x; \
            (buffer)[2 * (cta * TRACE + (point))] = ns;                                     \
            (buffer)[2 * (cta * TRACE + (point)) + 1] = cycles;                             \
        }                                                                                   \
    } while (0)
#define TRACE_FIELD u64* trace;
#else
#define TRACE_AT(buffer, point) \
    do {                        \
    } while (0)
#define TRACE_FIELD
#endif
