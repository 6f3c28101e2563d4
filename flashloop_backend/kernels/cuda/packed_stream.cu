// Streaming decode attention over packed INT4 KV (encoding v3), dense levels, plus the
// BF16 pages above each row's packed length. Built by kernels/cuda/packed_stream.py with
// HEAD_DIM, GROUP, LEVELS, WARPS and STAGES defined.
//
// One CTA = one (split, query head, row); its warps take the split's groups in turn and
// run independently (own online softmax, own output partial) until the CTA merges them.
// Per group a warp copies every level's whole block (D (G + 8) bytes: K codes, V codes,
// K parameters, V records) into its own ring of STAGES shared buffers with cp.async, so
// several groups' bytes are in flight while one is computed. With one stage (deep reads,
// whose blocks fill the shared memory) a group's copy goes in two halves instead, K's
// bytes and V's, each issued as soon as the previous group's half is read. With
// LEVEL_CHUNK set, a group's copy goes in units of LEVEL_CHUNK levels' K or V half
// through a ring of RING_UNITS units: a warp then holds a few units, not a whole group
// of every level, so more warps fit in shared memory beside each other (four levels).
//  K: each of the 8 rounds of 8 tokens runs D/16 m16n8k16 products: A is the query with
//     each level's K scales folded in (row 0, FP16 pairs), B the tokens' codes as the v3
//     byte order lays them out for lane (token, quad lane), unsubtracted; the bias q . min
//     and the codes' offset come from the tensor cores too; sums are FP32. (The loop-2
//     source's exact logits are packed_source.cu's.)
//  V: lane (token n, quad lane j) owns the 32 channels of its row segment and sums
//     p * V-scale * code over its tokens in FP16 pairs, flushed to FP32 every FLUSH
//     tokens of its own (its 8 tokens of a group: the products are all >= 0, so the FP16
//     sums' rounding stays below the BF16 output's).
#include "common.cuh"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif

constexpr int D = HEAD_DIM;
constexpr int G = GROUP;
constexpr int BLOCK = D * (G + 8);        // bytes of one (page, layer, head) block
constexpr int ROW = D / 2;                // bytes of one token's codes
constexpr int SEG = D / 8;                // bytes of a quad lane's row segment
constexpr int WORDS = D / 32;             // words of a segment
constexpr int NG = D / G;                 // V groups per token
constexpr int V_CODES = G * ROW;          // byte offsets in a block
constexpr int K_PARAMS = G * D;
constexpr int V_PARAMS = G * D + 4 * D;
constexpr int KSTEPS = D / 16;            // m16n8k16 k-steps per token row
constexpr int ROUNDS = G / 8;             // rounds of 8 tokens per group
constexpr int OWN = 8 * WORDS;            // channels a lane owns for V (32 at D = 128)
#ifndef FLUSH
#define FLUSH 8                           // a lane's tokens per FP32 flush of its V sums
#endif
// a group of 32 tokens gives a lane 4 of them: it flushes once per group
constexpr int FLUSH_ROUNDS = FLUSH < ROUNDS ? FLUSH : ROUNDS;
static_assert(ROUNDS % FLUSH_ROUNDS == 0, "whole flushes per group");
#ifndef SPLIT_COPY
#define SPLIT_COPY 0                      // one stage: copy each group in a K and a V half
#endif
#ifndef LEVEL_CHUNK
#define LEVEL_CHUNK 0                     // levels per copy unit (0: whole blocks or halves)
#endif
#ifndef RING_UNITS
#define RING_UNITS 3                      // copy units a warp's ring holds (with LEVEL_CHUNK)
#endif
constexpr bool CHUNKED = LEVEL_CHUNK > 0;
constexpr bool HALVES = STAGES == 1 && SPLIT_COPY && !CHUNKED;
constexpr float LOG2E = 1.4426950408889634f;
// V weights p * scale go to FP16 times this (and the FP32 sums come back divided by it):
// weights of tokens far below the page's largest stay normal FP16 numbers, while eight
// products of a weight of scale <= 4 and a code <= 15 stay below FP16's maximum
constexpr float V_WEIGHT = 64.f;
constexpr float LN2 = 0.6931471805599453f;

static_assert(D == 128, "a lane's row segment is one 16-byte load (D = 128)");
static_assert(G % 32 == 0, "V groups of whole words");
static_assert(BLOCK % 512 == 0, "a warp copies a block in rounds of 32 x 16 bytes");
static_assert(V_CODES % 512 == 0 && 4 * D == 512, "a half: code rounds plus one 512-B parameter round");
constexpr int HALF_BYTES = V_CODES + 4 * D;  // one level's K or V half: codes, then parameters
constexpr int CHUNK_LEVELS = CHUNKED ? LEVEL_CHUNK : 1;
constexpr int CHUNKS = LEVELS / CHUNK_LEVELS;  // units per half
constexpr int UNITS = 2 * CHUNKS;              // units per group
constexpr int UNIT = CHUNK_LEVELS * HALF_BYTES;
static_assert(!CHUNKED || (STAGES == 1 && LEVELS % LEVEL_CHUNK == 0), "units of whole levels, one stage");
static_assert(!CHUNKED || (RING_UNITS >= 2 && RING_UNITS - 1 <= UNITS),
              "the ring runs at most one group ahead");
constexpr int WARP_BYTES = CHUNKED ? RING_UNITS * UNIT : STAGES * LEVELS * BLOCK;

struct Params {
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
    float* part_out;              // [R, Hq, S, D]
    float* part_max;              // [R, Hq, S] natural log
    float* part_sum;
    float scale;
    int q_row, q_head;            // strides (elements)
    int t_row, t_level;
    int kind_row;
    int k_block, k_slot, k_head;  // strides of the BF16 caches (elements)
    int v_block, v_slot, v_head;
    int bt_row;
    int o_row, o_head, o_split;
    int s_row, s_head;
    int groups_per_split;
    int group_q;
    int block_size;
};

extern "C" __global__ void __launch_bounds__(WARPS * 32)
packed_stream(const Params P) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int quad = lane & 3, tok = lane >> 2;  // B-fragment lane: k pair quad, token tok
    const int split = blockIdx.x, head = blockIdx.y;
    const i64 row = blockIdx.z;
    const int kv_head = head / P.group_q;
    const int length = P.lengths[row];
    const int packed_groups = P.packed[row] / G;
    const int first = split * P.groups_per_split;
    const int last = min(first + P.groups_per_split, (length + G - 1) / G);
    if (first >= last) {  // no key of the row in this split (a row another op serves
        // reads length 0): the empty partial, before any load of the query or the pages
        float* out = P.part_out + row * P.o_row + (i64)head * P.o_head + (i64)split * P.o_split;
        for (int d = threadIdx.x; d < D; d += WARPS * 32) out[d] = 0.f;
        if (threadIdx.x == 0) {
            const i64 at = row * P.s_row + (i64)head * P.s_head + split;
            P.part_max[at] = NEG_INF;
            P.part_sum[at] = 0.f;
        }
        return;
    }
    unsigned char* ring = smem + warp * WARP_BYTES;
    float* merge = (float*)(smem + WARPS * WARP_BYTES);  // [WARPS][D + 2]

    // the query, scaled to base-2 logits, at the channels this lane's fragments hold
    const u16* qrow = P.q + row * P.q_row + (i64)head * P.q_head;
    const float qs = P.scale * LOG2E;
    float q[OWN];
#pragma unroll
    for (int m = 0; m < WORDS; ++m)
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                q[8 * m + 2 * p + h] = qs * bf16_to_float(qrow[owned_channel(quad, m, p, h)]);

    // the query's FP16 pairs (k-steps of B columns carry the 1/16) to fold K's
    // scales into, and A fragments of the query itself (row 0 FP16, row 1 the remainder)
    // for the bias sum q . min on the tensor cores
    u32 qpair[KSTEPS][2], qrows[KSTEPS][2];
#pragma unroll
    for (int m = 0; m < WORDS; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float a = q[8 * m + 2 * (2 * half + e)], b = q[8 * m + 2 * (2 * half + e) + 1];
                const float unit = half ? 1.f / 16.f : 1.f;
                qpair[2 * m + half][e] = pack_half2(a * unit, b * unit);
                const u32 hi = pack_half2(a, b);
                const u32 lo = pack_half2(a - half_lo(hi), b - half_hi(hi));
                qrows[2 * m + half][e] = tok == 0 ? hi : (tok == 1 ? lo : 0u);
            }
    int kinds[LEVELS];
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) kinds[l] = P.kinds[row * P.kind_row + l];

    float m_run = NEG_INF, l_run = 0.f;
    float acc[OWN];  // V sums of the owned channels (times V_WEIGHT), this lane's tokens
#pragma unroll
    for (int i = 0; i < OWN; ++i) acc[i] = 0.f;
    float mins[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) mins[g] = 0.f;

    // ---- packed groups: this warp's are first + warp, first + warp + WARPS, ...
    const int packed_end = min(last, packed_groups);
    const int mine = packed_end > first + warp ? (packed_end - first - warp + WARPS - 1) / WARPS : 0;
    auto issue = [&](int k) {  // copy the blocks of the warp's k-th group into its stage
        if (k < mine) {
            const int group = first + warp + k * WARPS;
            unsigned char* stage = ring + (k % STAGES) * (LEVELS * BLOCK);
#pragma unroll
            for (int l = 0; l < LEVELS; ++l) {
                if (kinds[l] != 0) continue;
                const int page = P.tables[row * P.t_row + (i64)l * P.t_level + group];
                const unsigned char* src = P.blocks + page * P.page_bytes + (i64)kv_head * BLOCK;
#pragma unroll
                for (int c = 0; c < BLOCK / 512; ++c)
                    cp_async16(stage + l * BLOCK + 16 * (lane + 32 * c), src + 16 * (lane + 32 * c));
            }
        }
        cp_async_commit();
    };
    // HALVES (one stage, from two levels): each group's copy in two halves, K (codes and
    // parameters) then V (codes and records), so the next group's K half lands while this group's V is
    // summed and its V half while its K is scored; the pages' numbers are loaded a group ahead
    int pages[LEVELS];
    auto load_pages = [&](int k) {
        if (k < mine) {
            const int group = first + warp + k * WARPS;
#pragma unroll
            for (int l = 0; l < LEVELS; ++l)
                pages[l] = kinds[l] == 0 ? P.tables[row * P.t_row + (i64)l * P.t_level + group] : 0;
        }
    };
    auto issue_half = [&](int k, int half) {
        if (k < mine) {
            const int codes = half ? V_CODES : 0, params = half ? V_PARAMS : K_PARAMS;
#pragma unroll
            for (int l = 0; l < LEVELS; ++l) {
                if (kinds[l] != 0) continue;
                const unsigned char* src = P.blocks + pages[l] * P.page_bytes + (i64)kv_head * BLOCK;
                unsigned char* dst = ring + l * BLOCK;
#pragma unroll
                for (int c = 0; c < V_CODES / 512; ++c)
                    cp_async16(dst + codes + 16 * (lane + 32 * c), src + codes + 16 * (lane + 32 * c));
                cp_async16(dst + params + 16 * lane, src + params + 16 * lane);
            }
        }
        cp_async_commit();
    };
    // CHUNKED: unit u is group u / UNITS, K then V (u % UNITS < CHUNKS: K), levels
    // LEVEL_CHUNK (u % CHUNKS) on; it lands in ring slot u % RING_UNITS, each level's half
    // as its codes then its parameters. The ring runs at most one group ahead, so the
    // pages of this group and the next are in registers.
    int pages_now[LEVELS], pages_next[LEVELS];
    int group_now = 0;
    auto table_pages = [&](int k, int (&out)[LEVELS]) {
        if (k < mine) {
            const int group = first + warp + k * WARPS;
#pragma unroll
            for (int l = 0; l < LEVELS; ++l)
                out[l] = kinds[l] == 0 ? P.tables[row * P.t_row + (i64)l * P.t_level + group] : 0;
        }
    };
    auto unit_at = [&](int u) { return ring + (u % RING_UNITS) * UNIT; };
    auto issue_unit = [&](int u) {
        const int k = u / UNITS, part = u % UNITS;
        if (k < mine) {
            const bool v_half = part >= CHUNKS;
            const int chunk = part % CHUNKS;
            const int codes = v_half ? V_CODES : 0, params = v_half ? V_PARAMS : K_PARAMS;
            unsigned char* dst = unit_at(u);
#pragma unroll
            for (int ch = 0; ch < CHUNKS; ++ch) {  // levels stay compile-time register indices
                if (ch != chunk) continue;
#pragma unroll
                for (int c = 0; c < CHUNK_LEVELS; ++c) {
                    const int l = ch * CHUNK_LEVELS + c;
                    if (kinds[l] != 0) continue;
                    const int page = k == group_now ? pages_now[l] : pages_next[l];
                    const unsigned char* src = P.blocks + page * P.page_bytes + (i64)kv_head * BLOCK;
                    unsigned char* to = dst + c * HALF_BYTES;
#pragma unroll
                    for (int r = 0; r < V_CODES / 512; ++r)
                        cp_async16(to + 16 * (lane + 32 * r), src + codes + 16 * (lane + 32 * r));
                    cp_async16(to + V_CODES + 16 * lane, src + params + 16 * lane);
                }
            }
        }
        cp_async_commit();
    };
    // unit u's bytes landed; the slot read before it takes unit u + RING_UNITS - 1
    auto unit_ready = [&](int u) {
        __syncwarp();
        issue_unit(u + RING_UNITS - 1);
        cp_async_wait<RING_UNITS - 1>();
        __syncwarp();
    };
    if constexpr (CHUNKED) {
        table_pages(0, pages_now);
        table_pages(1, pages_next);
#pragma unroll
        for (int u = 0; u < RING_UNITS - 1; ++u) issue_unit(u);
    } else if constexpr (HALVES) {
        load_pages(0);
        issue_half(0, 0);
        issue_half(0, 1);
    } else {
#pragma unroll
        for (int k = 0; k < STAGES - 1; ++k) issue(k);
    }
    for (int k = 0; k < mine; ++k) {
        if constexpr (CHUNKED) {
            if (k > 0) {
#pragma unroll
                for (int l = 0; l < LEVELS; ++l) pages_now[l] = pages_next[l];
                group_now = k;
                table_pages(k + 1, pages_next);
            }
        } else if constexpr (HALVES) {
            cp_async_wait<1>();  // this group's K half (its V half may still be in flight)
            __syncwarp();
            load_pages(k + 1);
        } else {
            issue(k + STAGES - 1);
            cp_async_wait<STAGES - 1>();
            __syncwarp();
        }
        const unsigned char* stage = ring + (k % STAGES) * (LEVELS * BLOCK);
        const int group = first + warp + k * WARPS;
        float c[ROUNDS][4];
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) c[r][0] = c[r][1] = c[r][2] = c[r][3] = 0.f;
        float bias = 0.f;
#pragma unroll
        for (int l = 0; l < LEVELS; ++l) {
            if constexpr (CHUNKED) {
                if (l % CHUNK_LEVELS == 0) unit_ready(k * UNITS + l / CHUNK_LEVELS);
            }
            if (kinds[l] != 0) continue;
            // K codes [G][ROW] and K parameters of level l
            const unsigned char* block =
                CHUNKED ? unit_at(k * UNITS + l / CHUNK_LEVELS) + (l % CHUNK_LEVELS) * HALF_BYTES
                        : stage + l * BLOCK;
            const unsigned char* k_params = block + (CHUNKED ? V_CODES : K_PARAMS);
            // folded query (row 0, lanes 0-3): the lane's K scale pairs times its query pairs
            const unsigned char* params = k_params + 8 * WORDS * quad;
            u32 fold[KSTEPS][2];
            float extra[4] = {0.f, 0.f, 0.f, 0.f};  // bias (q . min) and offset, column 0
#pragma unroll
            for (int m = 0; m < WORDS; ++m)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const u32 sc = lds32(params + half * D + 4 * (2 * m + e));
                        fold[2 * m + half][e] = tok == 0 ? hmul2(qpair[2 * m + half][e], sc) : 0u;
                    }
                    // q . min: the query's rows against the minima (column 0: lanes 0-3)
                    const u32 mn0 = lds32(params + 2 * D + half * D + 4 * (2 * m));
                    const u32 mn1 = lds32(params + 2 * D + half * D + 4 * (2 * m + 1));
                    const u32 a[4] = {qrows[2 * m + half][0], 0u, qrows[2 * m + half][1], 0u};
                    mma16816(extra, a, tok == 0 ? mn0 : 0u, tok == 0 ? mn1 : 0u);
                }
            // the codes go in as 1024 + c (and 1024 + 16 c): a token of codes 0 (column 0,
            // rows 0) scores the offset to take back
            float offset[4] = {0.f, 0.f, 0.f, 0.f};
            const u32 magic = tok == 0 ? 0x64006400u : 0u;
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                const u32 a[4] = {fold[k][0], 0u, fold[k][1], 0u};
                mma16816(offset, a, magic, magic);
            }
            // row 0 (lane 0) + row 1 (lane 4) of column 0, less the offset (lane 0)
            bias += __shfl_sync(FULL_MASK, extra[0], 0) + __shfl_sync(FULL_MASK, extra[0], 4) -
                    __shfl_sync(FULL_MASK, offset[0], 0);
#pragma unroll
            for (int r = 0; r < ROUNDS; ++r) {
                const uint4 seg = lds128(block + (8 * r + tok) * ROW + SEG * quad);
                const u32 words[4] = {seg.x, seg.y, seg.z, seg.w};
#pragma unroll
                for (int m = 0; m < WORDS; ++m) {
                    u32 pr[4];
                    nibbles_biased(words[m], pr);
                    const u32 a0[4] = {fold[2 * m][0], 0u, fold[2 * m][1], 0u};
                    const u32 a1[4] = {fold[2 * m + 1][0], 0u, fold[2 * m + 1][1], 0u};
                    mma16816(c[r], a0, pr[0], pr[1]);
                    mma16816(c[r], a1, pr[2], pr[3]);
                }
            }
        }
        // logits of tokens 8 r + 2 quad (+1): row 0, lanes 0-3
        float s[ROUNDS][2];
        float page_max = NEG_INF;
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v = c[r][h];
                const int pos = group * G + 8 * r + 2 * quad + h;
                v = (pos < length) ? v + bias : NEG_INF;
                s[r][h] = v;
                page_max = fmaxf(page_max, tok == 0 ? v : NEG_INF);
            }
        }
        page_max = warp_max(page_max);
        const float m_new = fmaxf(m_run, page_max);
        if (m_new > m_run) {
            const float alpha = exp2f(m_run - m_new);
            l_run *= alpha;
#pragma unroll
            for (int i = 0; i < OWN; ++i) acc[i] *= alpha;
#pragma unroll
            for (int g = 0; g < NG; ++g) mins[g] *= alpha;
            m_run = m_new;
        }
        float mine_p[ROUNDS];  // p of this lane's V token 8 r + tok
        float psum = 0.f;
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const float p0 = exp2f(s[r][0] - m_run), p1 = exp2f(s[r][1] - m_run);
            psum += tok == 0 ? p0 + p1 : 0.f;
            const float a = __shfl_sync(FULL_MASK, p0, tok >> 1);
            const float b = __shfl_sync(FULL_MASK, p1, tok >> 1);
            mine_p[r] = (tok & 1) ? b : a;
        }
        l_run += warp_sum(psum);
        if constexpr (HALVES) {  // the K half is read: the next group's may land there
            __syncwarp();
            issue_half(k + 1, 0);
            cp_async_wait<1>();  // this group's V half
            __syncwarp();
        }
        // ---- V: p * scale per (token, group) against the codes, FP16 pairs, FP32 flushes
#pragma unroll
        for (int l = 0; l < LEVELS; ++l) {
            if constexpr (CHUNKED) {
                if (l % CHUNK_LEVELS == 0) unit_ready(k * UNITS + CHUNKS + l / CHUNK_LEVELS);
            }
            if (kinds[l] != 0) continue;
            // V codes [G][ROW] and V records of level l
            const unsigned char* v_codes =
                CHUNKED ? unit_at(k * UNITS + CHUNKS + l / CHUNK_LEVELS) + (l % CHUNK_LEVELS) * HALF_BYTES
                        : stage + l * BLOCK + V_CODES;
            const unsigned char* v_records = v_codes + (CHUNKED ? V_CODES : V_PARAMS - V_CODES);
#pragma unroll
            for (int r0 = 0; r0 < ROUNDS; r0 += FLUSH_ROUNDS) {
                u32 sums[WORDS][4];
#pragma unroll
                for (int m = 0; m < WORDS; ++m)
#pragma unroll
                    for (int p = 0; p < 4; ++p) sums[m][p] = 0u;
#pragma unroll
                for (int r = r0; r < r0 + FLUSH_ROUNDS; ++r) {
                    const int t = 8 * r + tok;
                    const u16* record = (const u16*)v_records + t * 2 * NG;
                    const uint4 seg = lds128(v_codes + t * ROW + SEG * quad);
                    const u32 words[4] = {seg.x, seg.y, seg.z, seg.w};
                    u32 w[NG];  // p * scale of each V group
#pragma unroll
                    for (int g = 0; g < NG; ++g) {
                        mins[g] += mine_p[r] * half_to_float(record[2 * g]);
                        const float wg = V_WEIGHT * mine_p[r] * half_to_float(record[2 * g + 1]);
                        w[g] = pack_half2(wg, wg);
                    }
#pragma unroll
                    for (int m = 0; m < WORDS; ++m) {
                        const int g = (32 * m) / G;
                        u32 pr[4];
                        nibbles_unit(words[m], pr);
#pragma unroll
                        for (int e = 0; e < 4; ++e) sums[m][e] = hfma2(w[g], pr[e], sums[m][e]);
                    }
                }
#pragma unroll
                for (int m = 0; m < WORDS; ++m)
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        acc[8 * m + 2 * p] += half_lo(sums[m][p]);
                        acc[8 * m + 2 * p + 1] += half_hi(sums[m][p]);
                    }
            }
        }
        __syncwarp();
        if constexpr (HALVES) issue_half(k + 1, 1);
    }
    cp_async_wait<0>();

    // ---- the BF16 pages above the packed length: 8 tokens a round, lane (tok, quad)
    // takes channels [D/4 quad, D/4 (quad + 1)) of token tok in natural order
    float tail[D / 4];
#pragma unroll
    for (int i = 0; i < D / 4; ++i) tail[i] = 0.f;
    float qn[D / 4];
#pragma unroll
    for (int i = 0; i < D / 4; ++i) qn[i] = qs * bf16_to_float(qrow[(D / 4) * quad + i]);
    const int tail_first = max(first, packed_groups) * G;
    const int tail_end = min(last * G, length);
    for (int base = tail_first + 8 * warp; base < tail_end; base += 8 * WARPS) {
        const int pos = base + tok;
        float logit = NEG_INF;
        i64 page = 0;
        if (pos < tail_end) {
            page = P.block_tables[row * P.bt_row + pos / P.block_size];
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
            for (int i = 0; i < OWN; ++i) acc[i] *= alpha;
#pragma unroll
            for (int g = 0; g < NG; ++g) mins[g] *= alpha;
#pragma unroll
            for (int i = 0; i < D / 4; ++i) tail[i] *= alpha;
            m_run = m_new;
        }
        const float p = pos < tail_end ? exp2f(logit - m_run) : 0.f;
        l_run += warp_sum(quad == 0 ? p : 0.f);
        if (pos < tail_end) {
            const i64 vslot = page * P.v_block + (i64)(pos % P.block_size) * P.v_slot +
                              (i64)kv_head * P.v_head;
            bf16_accumulate<D>(tail, P.v_cache + vslot + (D / 4) * quad, p);
        }
    }

    // ---- this warp's partial: sum the lanes that own the same channels, then the CTA's
    // warps, each rescaled to the CTA's max
#pragma unroll
    for (int i = 0; i < OWN; ++i)  // the V sums carry V_WEIGHT
        acc[i] = sum_token_lanes(acc[i] * (1.f / V_WEIGHT) + mins[(32 * (i / 8)) / G]);
#pragma unroll
    for (int i = 0; i < D / 4; ++i) tail[i] = sum_token_lanes(tail[i]);
    float* mine_out = merge + warp * (D + 2);
    store_warp_partial<D, WORDS>(mine_out, acc, tail, quad, tok);
    if (lane == 0) {
        mine_out[D] = m_run;
        mine_out[D + 1] = l_run;
    }
    __syncthreads();
    float cta_max = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) cta_max = fmaxf(cta_max, merge[w * (D + 2) + D]);
    const float safe = cta_max == NEG_INF ? 0.f : cta_max;
    float* out = P.part_out + row * P.o_row + (i64)head * P.o_head + (i64)split * P.o_split;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            v += merge[w * (D + 2) + d] * exp2f(merge[w * (D + 2) + D] - safe);
        out[d] = v;
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            total += merge[w * (D + 2) + D + 1] * exp2f(merge[w * (D + 2) + D] - safe);
        const i64 at = row * P.s_row + (i64)head * P.s_head + split;
        P.part_max[at] = cta_max * LN2;
        P.part_sum[at] = total;
    }
}
