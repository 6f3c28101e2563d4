// One level of a packed append (the packed_kv_write contract, kv.codec.LevelWriter),
// written straight into the store's v3 blocks: bit for bit what the torch chain
// (kv.codec.encode_levels_chain) and the Triton level writer (kernels/triton/encode_jit.py)
// write. Built by kernels/cuda/encode_level.py for HEAD_DIM 128 and GROUP 32, 64 or 128,
// with ROWS (rows a thread owns) and MIN_CTAS defined.
//
// One CTA = one (page of this level, layer, KV head): 64 rows of K and V read where they
// lie in the paged pools, minus their reconstruction from the levels already written
// (each earlier level's minimum + scale * code, product and sum rounded on their own, in
// level order), quantized as the chain does (K per channel across the rows, V per row
// across each G channels, FP16 parameters, codes rounded half to even).
//
// Thread t owns code word w = t % 16 of rows t / 16 + STEP j (j < ROWS, STEP = G / ROWS): the four byte columns
// 4 w .. 4 w + 3 of a row, whose low nibbles hold channels c, c + 8, c + 1, c + 9 (A) and
// whose high nibbles those + 16 (B), c = 32 (w % 4) + 2 (w / 4) (kv/layout.py's order).
// Its K parameters are the four FP16 slots 4 w .. 4 w + 3 of each parameter row (columns
// 0, 2, 1, 3 of the word), and its V channels lie in group 32 (w % 4) / G.
#include "common.cuh"

#if HEAD_DIM != 128 || (GROUP != 32 && GROUP != 64 && GROUP != 128)
#error "the level writer is built for HEAD_DIM 128 and GROUP 32, 64 or 128"
#endif
#define POS_INF __int_as_float(0x7f800000)
constexpr int D = HEAD_DIM;
constexpr int G = GROUP;
constexpr int NG = D / G;                 // V groups per row
constexpr int ROW = D / 2;                // code bytes of a row
constexpr int BLOCK = D * (G + 8);        // bytes of one (page, layer, head) block
constexpr int V_CODES = G * ROW;          // byte offset of the V codes
constexpr int K_PARAMS = 2 * G * ROW;     // byte offset of the K scales, then minima
constexpr int V_RECORDS = K_PARAMS + 4 * D;  // byte offset of the V records
#ifndef MIN_CTAS
#define MIN_CTAS 1  // resident CTAs per SM the registers must allow
#endif
#ifndef ROWS
#define ROWS 4  // rows a thread owns
#endif
constexpr int WORDS = ROW / 4;             // code words of a row
constexpr int STEP = G / ROWS;             // a thread's rows are first + STEP j
constexpr int THREADS = WORDS * STEP;
constexpr int WARPS = THREADS / 32;
static_assert(WORDS == 16 && G % ROWS == 0 && STEP % 2 == 0, "a warp holds two rows of words");

struct Params {
    const u16* k;           // [NB, L, BS, Hkv, D] bf16 pools (row r: row r % BS of blocks[r / BS])
    const u16* v;
    const i64* blocks;      // [ceil(T / BS)] the blocks holding the append's rows
    const int* rows;        // [pages * G] the append's row in each slot of this level's pages
    const int* slots;       // [Lv, T] a row's slot in each level's pages, -1 absent
    const int* pages;       // [Lv, P] page ids of each level
    unsigned char* store;   // the store's blocks [pages, L, Hkv, BLOCK]
    i64 x_block, x_row, x_layer, x_head;  // pool strides, elements
    i64 page_bytes, layer_bytes;
    int level, block_rows, slot_level, page_level;
};

// min + scale * code with the product and the sum each rounded on their own
__device__ __forceinline__ float affine(float low, float scale, float code) {
    return __fadd_rn(low, __fmul_rn(scale, code));
}

// the INT4 code of x under the stored (FP16, widened) minimum and scale: rounded half to
// even as floor(r + 0.5) less one where r sat halfway on an odd result, clamped to 0..15,
// 0 where the scale is 0
__device__ __forceinline__ u32 int4_code(float x, float low, float scale) {
    const float ratio = __fdiv_rn(__fsub_rn(x, low), scale > 0.f ? scale : 1.f);
    const float up = floorf(__fadd_rn(ratio, 0.5f));
    const bool halfway = __fsub_rn(up, ratio) == 0.5f;
    const bool odd = up - 2.f * floorf(up * 0.5f) == 1.f;
    float code = halfway && odd ? up - 1.f : up;
    code = fminf(fmaxf(code, 0.f), 15.f);
    return scale > 0.f ? (u32)code : 0u;
}

__device__ __forceinline__ float widened(float x) {  // x through FP16, as stored
    return half_lo(pack_half2(x, 0.f));
}

// the four values of an FP16 quad in slot order (columns 0, 2, 1, 3) as columns 0..3
__device__ __forceinline__ void slot_quad(uint2 q, float out[4]) {
    out[0] = half_lo(q.x);
    out[2] = half_hi(q.x);
    out[1] = half_lo(q.y);
    out[3] = half_hi(q.y);
}
__device__ __forceinline__ uint2 quad_slots(const float v[4]) {
    return make_uint2(pack_half2(v[0], v[2]), pack_half2(v[1], v[3]));
}

// a row's A and B channel values of a word from its pool row at channel c (four bf16 pairs)
__device__ __forceinline__ void load_word(const u16* at, float a[4], float b[4]) {
    const u32 p0 = *(const u32*)at, p1 = *(const u32*)(at + 8);
    const u32 p2 = *(const u32*)(at + 16), p3 = *(const u32*)(at + 24);
    a[0] = __uint_as_float(p0 << 16), a[2] = __uint_as_float(p0 & 0xffff0000u);
    a[1] = __uint_as_float(p1 << 16), a[3] = __uint_as_float(p1 & 0xffff0000u);
    b[0] = __uint_as_float(p2 << 16), b[2] = __uint_as_float(p2 & 0xffff0000u);
    b[1] = __uint_as_float(p3 << 16), b[3] = __uint_as_float(p3 & 0xffff0000u);
}

// recon = level 0's value, then recon + each later level's, where the row is present
__device__ __forceinline__ void accumulate(float& recon, float value, int earlier) {
    recon = earlier == 0 ? value : __fadd_rn(recon, value);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) encode_level(const Params P) {
    __shared__ float k_low[WARPS][WORDS][8], k_high[WARPS][WORDS][8];
    const int index = blockIdx.x, head = blockIdx.z, t = threadIdx.x;
    const i64 layer = blockIdx.y;
    const int w = t % WORDS, first_row = t / WORDS;
    const int c = 32 * (w % 4) + 2 * (w / 4);
    const int group = 32 * (w % 4) / G;
    const i64 head_at = layer * P.layer_bytes + (i64)head * BLOCK;

    int source[ROWS];
    i64 pool[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        const int r = first_row + STEP * j;
        source[j] = P.rows[index * G + r];
        const i64 block = P.blocks[source[j] / P.block_rows];
        pool[j] = block * P.x_block + (i64)(source[j] % P.block_rows) * P.x_row +
                  layer * P.x_layer + (i64)head * P.x_head + c;
    }
    const i64 target = P.pages[P.level * P.page_level + index];
    unsigned char* out = P.store + target * P.page_bytes + head_at;

    // ---- K: residuals, then one group per column across the page's rows
    float ka[ROWS][4], kb[ROWS][4];
    float recon_a[ROWS][4], recon_b[ROWS][4];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        load_word(P.k + pool[j], ka[j], kb[j]);
#pragma unroll
        for (int i = 0; i < 4; ++i) recon_a[j][i] = recon_b[j][i] = 0.f;
    }
    for (int earlier = 0; earlier < P.level; ++earlier) {
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            const int slot = P.slots[earlier * P.slot_level + source[j]];
            if (slot < 0) continue;
            const i64 page = P.pages[earlier * P.page_level + slot / G];
            const unsigned char* at = P.store + page * P.page_bytes + head_at;
            const u32 codes = *(const u32*)(at + (slot % G) * ROW + 4 * w);
            const uint2* params = (const uint2*)(at + K_PARAMS) + w;
            float scale_a[4], scale_b[4], low_a[4], low_b[4];
            slot_quad(params[0], scale_a);
            slot_quad(params[WORDS], scale_b);
            slot_quad(params[2 * WORDS], low_a);
            slot_quad(params[3 * WORDS], low_b);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 byte = codes >> (8 * i);
                accumulate(recon_a[j][i], affine(low_a[i], scale_a[i], (float)(byte & 15u)), earlier);
                accumulate(recon_b[j][i], affine(low_b[i], scale_b[i], (float)((byte >> 4) & 15u)), earlier);
            }
        }
    }
    float low[8], high[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) low[i] = POS_INF, high[i] = NEG_INF;
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            ka[j][i] = __fsub_rn(ka[j][i], recon_a[j][i]);
            kb[j][i] = __fsub_rn(kb[j][i], recon_b[j][i]);
            low[i] = fminf(low[i], ka[j][i]), high[i] = fmaxf(high[i], ka[j][i]);
            low[4 + i] = fminf(low[4 + i], kb[j][i]), high[4 + i] = fmaxf(high[4 + i], kb[j][i]);
        }
    const int warp = t / 32;
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // the warp's two row sets, then every warp's
        low[i] = fminf(low[i], __shfl_xor_sync(FULL_MASK, low[i], 16));
        high[i] = fmaxf(high[i], __shfl_xor_sync(FULL_MASK, high[i], 16));
        if (t % 32 < 16) k_low[warp][w][i] = low[i], k_high[warp][w][i] = high[i];
    }
    __syncthreads();
    float k_min[8], k_scale[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float lo = k_low[0][w][i], hi = k_high[0][w][i];
#pragma unroll
        for (int x = 1; x < WARPS; ++x) lo = fminf(lo, k_low[x][w][i]), hi = fmaxf(hi, k_high[x][w][i]);
        k_min[i] = widened(lo);
        k_scale[i] = widened(__fdiv_rn(__fsub_rn(hi, lo), 15.f));
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        u32 word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 code_a = int4_code(ka[j][i], k_min[i], k_scale[i]);
            const u32 code_b = int4_code(kb[j][i], k_min[4 + i], k_scale[4 + i]);
            word |= (code_a | code_b << 4) << (8 * i);
        }
        *(u32*)(out + (first_row + STEP * j) * ROW + 4 * w) = word;
    }
    if (t < WORDS) {
        uint2* params = (uint2*)(out + K_PARAMS) + w;
        params[0] = quad_slots(k_scale);
        params[WORDS] = quad_slots(k_scale + 4);
        params[2 * WORDS] = quad_slots(k_min);
        params[3 * WORDS] = quad_slots(k_min + 4);
    }

    // ---- V: residuals, then one group per row across each G channels
    float va[ROWS][4], vb[ROWS][4];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        load_word(P.v + pool[j], va[j], vb[j]);
#pragma unroll
        for (int i = 0; i < 4; ++i) recon_a[j][i] = recon_b[j][i] = 0.f;
    }
    for (int earlier = 0; earlier < P.level; ++earlier) {
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            const int slot = P.slots[earlier * P.slot_level + source[j]];
            if (slot < 0) continue;
            const i64 page = P.pages[earlier * P.page_level + slot / G];
            const unsigned char* at = P.store + page * P.page_bytes + head_at;
            const u32 codes = *(const u32*)(at + V_CODES + (slot % G) * ROW + 4 * w);
            const u32 record = *(const u32*)(at + V_RECORDS + (slot % G) * 4 * NG + 4 * group);
            const float low_v = half_lo(record), scale_v = half_hi(record);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 byte = codes >> (8 * i);
                accumulate(recon_a[j][i], affine(low_v, scale_v, (float)(byte & 15u)), earlier);
                accumulate(recon_b[j][i], affine(low_v, scale_v, (float)((byte >> 4) & 15u)), earlier);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        float lo = POS_INF, hi = NEG_INF;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            va[j][i] = __fsub_rn(va[j][i], recon_a[j][i]);
            vb[j][i] = __fsub_rn(vb[j][i], recon_b[j][i]);
            lo = fminf(lo, fminf(va[j][i], vb[j][i]));
            hi = fmaxf(hi, fmaxf(va[j][i], vb[j][i]));
        }
#pragma unroll
        for (int bit = 1; bit < WORDS; bit <<= 1) {  // the row's words of the same group
            if (bit < 4 && 32 * bit >= G) continue;  // bits of w % 4 that change the group
            lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, bit));
            hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, bit));
        }
        const float v_min = widened(lo);
        const float v_scale = widened(__fdiv_rn(__fsub_rn(hi, lo), 15.f));
        u32 word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 code_a = int4_code(va[j][i], v_min, v_scale);
            const u32 code_b = int4_code(vb[j][i], v_min, v_scale);
            word |= (code_a | code_b << 4) << (8 * i);
        }
        const int r = first_row + STEP * j;
        *(u32*)(out + V_CODES + r * ROW + 4 * w) = word;
        if (w < 4 && 32 * w % G == 0)  // the first word of each group
            *(u32*)(out + V_RECORDS + r * 4 * NG + 4 * group) = pack_half2(v_min, v_scale);
    }
}
