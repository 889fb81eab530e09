// Linear layers over GGML's quantized block types, for the CPU (built on first use by
// ggml_linear.py through cpu_build.py, once per instruction set: AGENTRT_ISA 0 = portable C,
// 1 = AVX2, 2 = AVX-512 VNNI).
//
// The block layouts are GGML's (gguf-py's quants.py holds numpy versions of each). Every type
// is read the same way: a block is unpacked into one canonical form,
//
//     w[i] = scale[g] * (u[i] - OFFSET) + min[g]      u[i] uint8, g = i / 16 (a group of 16)
//
// with OFFSET a constant of the type (8 for Q4_0, 32 for Q6_K, 128 for Q8_0 whose signed
// bytes are stored as u = q + 128, 0 where the type has a min). `dequantize` evaluates that in
// gguf-py's order of operations, so it agrees with gguf's dequantize bit for bit. The
// products quantize each activation row to int8 in blocks of 32 (d = max|x| / 127, Q8_0's
// scheme; a K-quant's 16-element groups each lie inside one activation block), and take
//
//     y = sum_g da[g] * (scale[g] * sum_{i in g} u[i] a[i]  +  bias[g] * sum_{i in g} a[i])
//
// with bias[g] = min[g] - OFFSET * scale[g]: one integer dot product per group (vpdpbusd on
// AVX-512 VNNI: u unsigned, a signed; pmaddubsw on AVX2), the rest in fp32 per group.
//
// Weight-stationary: each weight row is walked once per step, a chunk of 256 weights at a
// time decoded into that form (SIMD decoders per type in ggml_avx512.h / ggml_avx2.h, the
// portable unpacking otherwise) and dotted with every activation row of the step, so a batch
// of T rows reads each weight byte from memory once. On AVX-512 the legacy types (blocks of
// 32 with one fp16 scale each) skip the chunk: pairs of blocks are decoded into registers and
// dotted with 8 activation rows at a time (ggml_avx512.h; on AVX2 one block and 4 rows,
// ggml_avx2.h); the legacy types (and on AVX-512 Q4_K, Q6_K) interleaved by 16 rows
// at load (`ggml_interleave`) take kernels whose vector lanes are those rows (x16_type). On AVX-512 and AVX2, Q4_K, Q5_K
// and Q6_K take their activations in blocks of 256 instead (ggml's Q8_K), which lets a
// block's group scales be applied in integers (ggml_avx512.h, ggml_avx2.h,
// `ggml_act_block`). OpenMP threads split the output rows. Every step size runs here; a long
// step's activation rows go a tile (~256 KiB quantized) at a time against every weight row.
// `ggml_dequantize_tile` decodes weights for a caller that wants them dense (a GPU).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if AGENTRT_ISA >= 1
#include <immintrin.h>
#endif

// gguf.GGMLQuantizationType values.
enum {
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q2_K = 10,
    T_Q3_K = 11,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
};

#define GROUP 16                // elements per scale group of the canonical form
#define ACT_BLOCK 32            // elements per activation scale
#define PARALLEL_WORK (1 << 16) // fewer weight elements than this run on one thread
#define ACT_TILE_BYTES (1 << 18)  // quantized activation rows a pass over the weight rows
#define X16K_BLOCK (64 + 128 + 128 + 2048) // a Q4_K block of 16 interleaved rows
#define X16Q6_BLOCK (16 * 210)               // a Q6_K block of 16 interleaved rows

static inline float fp16_to_f32(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) { // zero or subnormal: mant * 2^-24, exact in fp32
        f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// ---- The block types: size, offset, and the unpacking into (u, scale, min) ----------------

typedef struct {
    int block_elems, block_bytes, offset, has_min;
} BlockType;

static int block_type(int qtype, BlockType *bt) {
    switch (qtype) {
    case T_Q4_0: *bt = (BlockType){32, 18, 8, 0}; return 1;
    case T_Q4_1: *bt = (BlockType){32, 20, 0, 1}; return 1;
    case T_Q5_0: *bt = (BlockType){32, 22, 16, 0}; return 1;
    case T_Q5_1: *bt = (BlockType){32, 24, 0, 1}; return 1;
    case T_Q8_0: *bt = (BlockType){32, 34, 128, 0}; return 1;
    case T_Q2_K: *bt = (BlockType){256, 84, 0, 1}; return 1;
    case T_Q3_K: *bt = (BlockType){256, 110, 4, 0}; return 1;
    case T_Q4_K: *bt = (BlockType){256, 144, 0, 1}; return 1;
    case T_Q5_K: *bt = (BlockType){256, 176, 0, 1}; return 1;
    case T_Q6_K: *bt = (BlockType){256, 210, 32, 0}; return 1;
    default: return 0;
    }
}

// Legacy types (32 elements): element j < 16 is the low nibble of qs[j], 16 + j the high one.
static inline void nibbles32(const uint8_t *qs, uint8_t *u) {
    for (int j = 0; j < 16; j++) {
        u[j] = qs[j] & 15;
        u[j + 16] = qs[j] >> 4;
    }
}

// The fifth bit of Q5_0/Q5_1: bit j of the 32-bit little-endian qh belongs to element j.
static inline void high_bits32(const uint8_t *qh, uint8_t *u) {
    const uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) |
                       ((uint32_t)qh[3] << 24);
    for (int j = 0; j < 32; j++) u[j] |= ((h >> j) & 1) << 4;
}

// Q4_K / Q5_K: 8 pairs of 6-bit (scale, min), one per 32 elements, packed in 12 bytes.
static inline void k4_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One block -> u[block_elems], scale[block_elems / 16], min[block_elems / 16] (min only for
// types with has_min). The same arithmetic as gguf-py's dequantize, up to the last step.
static void unpack_block(int qtype, const uint8_t *b, uint8_t *u, float *scale, float *min) {
    switch (qtype) {
    case T_Q4_0: {
        const float d = fp16_to_f32(b);
        nibbles32(b + 2, u);
        scale[0] = scale[1] = d;
        break;
    }
    case T_Q4_1: {
        const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
        nibbles32(b + 4, u);
        scale[0] = scale[1] = d;
        min[0] = min[1] = m;
        break;
    }
    case T_Q5_0: {
        const float d = fp16_to_f32(b);
        nibbles32(b + 6, u);
        high_bits32(b + 2, u);
        scale[0] = scale[1] = d;
        break;
    }
    case T_Q5_1: {
        const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
        nibbles32(b + 8, u);
        high_bits32(b + 4, u);
        scale[0] = scale[1] = d;
        min[0] = min[1] = m;
        break;
    }
    case T_Q8_0: {
        const float d = fp16_to_f32(b);
        for (int j = 0; j < 32; j++) u[j] = b[2 + j] ^ 0x80; // int8 q -> q + 128
        scale[0] = scale[1] = d;
        break;
    }
    case T_Q2_K: { // scales[16] qs[64] d dmin; element 128h + 32j + l: (qs[32h + l] >> 2j) & 3
        const uint8_t *sc = b, *qs = b + 16;
        const float d = fp16_to_f32(b + 80), dmin = fp16_to_f32(b + 82);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    u[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
        for (int g = 0; g < 16; g++) {
            scale[g] = d * (float)(sc[g] & 15);
            min[g] = -(dmin * (float)(sc[g] >> 4));
        }
        break;
    }
    case T_Q3_K: { // hmask[32] qs[64] scales[12] d; q = low 2 bits - (high bit clear ? 4 : 0)
        const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
        const float d = fp16_to_f32(b + 108);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++) {
                const int bit = 4 * h + j;
                for (int l = 0; l < 32; l++)
                    u[128 * h + 32 * j + l] =
                        ((qs[32 * h + l] >> (2 * j)) & 3) | (((hm[l] >> bit) & 1) << 2);
            }
        for (int g = 0; g < 16; g++) {
            const int lo = (sc[g % 8] >> (4 * (g / 8))) & 15;
            const int hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
            scale[g] = d * (float)((lo | (hi << 4)) - 32);
        }
        break;
    }
    case T_Q4_K:
    case T_Q5_K: { // d dmin scales[12] (qh[32] for Q5_K) qs[128]
        const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (qtype == T_Q4_K ? 16 : 48);
        for (int j = 0; j < 4; j++) {
            for (int l = 0; l < 32; l++) {
                u[64 * j + l] = qs[32 * j + l] & 15;
                u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
            }
            if (qtype == T_Q5_K)
                for (int l = 0; l < 32; l++) {
                    u[64 * j + l] |= ((qh[l] >> (2 * j)) & 1) << 4;
                    u[64 * j + 32 + l] |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                }
        }
        for (int s = 0; s < 8; s++) {
            int isc, im;
            k4_scale_min(sc, s, &isc, &im);
            scale[2 * s] = scale[2 * s + 1] = d * (float)isc;
            min[2 * s] = min[2 * s + 1] = -(dmin * (float)im);
        }
        break;
    }
    case T_Q6_K: { // ql[128] qh[64] scales[16] (int8) d; element 128h + 32k + l
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = fp16_to_f32(b + 208);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                uint8_t *o = u + 128 * h + l;
                o[0] = (lo0 & 15) | ((hb & 3) << 4);
                o[32] = (lo1 & 15) | (((hb >> 2) & 3) << 4);
                o[64] = (lo0 >> 4) | (((hb >> 4) & 3) << 4);
                o[96] = (lo1 >> 4) | (((hb >> 6) & 3) << 4);
            }
        for (int g = 0; g < 16; g++) scale[g] = d * (float)sc[g];
        break;
    }
    }
}

// Blocks [0, num_blocks) of one row -> u, scale, min (see unpack_block).
static void unpack_row(int qtype, const BlockType *bt, const uint8_t *row, int64_t num_blocks,
                       uint8_t *u, float *scale, float *min) {
    const int groups = bt->block_elems / GROUP;
    for (int64_t i = 0; i < num_blocks; i++)
        unpack_block(qtype, row + i * bt->block_bytes, u + i * bt->block_elems,
                     scale + i * groups, min + i * groups);
}

// ---- Dequantization ----------------------------------------------------------------------

// w (N rows, `w_stride` bytes apart, K elements each) -> out (N, K) fp32 rows `out_stride`
// floats apart: gguf-py's dequantize, bit for bit. Returns 0, or -1 for an unknown type.
int ggml_dequantize(const uint8_t *w, int64_t w_stride, int qtype, int64_t rows, int64_t k,
                    float *out, int64_t out_stride, int num_threads) {
    BlockType bt;
    if (!block_type(qtype, &bt)) return -1;
    const int64_t num_blocks = k / bt.block_elems;
#pragma omp parallel num_threads(num_threads) if (rows * k >= PARALLEL_WORK)
    {
        uint8_t u[256];
        float scale[16], min[16] = {0};
#pragma omp for schedule(static)
        for (int64_t n = 0; n < rows; n++) {
            float *y = out + n * out_stride;
            for (int64_t i = 0; i < num_blocks; i++) {
                unpack_block(qtype, w + n * w_stride + i * bt.block_bytes, u, scale, min);
                for (int e = 0; e < bt.block_elems; e++) {
                    const float v = scale[e / GROUP] * (float)((int)u[e] - bt.offset);
                    y[i * bt.block_elems + e] = bt.has_min ? v + min[e / GROUP] : v;
                }
            }
        }
    }
    return 0;
}

// ---- Activations: int8 blocks of 32 -------------------------------------------------------

// A quantized activation row, zero-padded to kp = K rounded up to CHUNK_ELEMS: q int8; per
// group of 16, d16 (its block's d, so twice per block) and s16 (d * the group's sum of q);
// per block of 32, d32 and s32 likewise; per 4 elements (an int32 lane of vpdpbusd), dlane
// (its block's d). One allocation holds every row's (act_row_bytes).
typedef struct {
    int8_t *q;
    float *d16, *s16, *d32, *s32, *dlane;
} ActRow;

static inline int64_t act_row_bytes(int64_t kp) {
    return kp + (kp / 16 * 2 + kp / 32 * 2 + kp / 4) * 4;
}

static inline ActRow act_row(uint8_t *base, int64_t kp, int64_t t) {
    uint8_t *p = base + t * act_row_bytes(kp);
    float *f = (float *)(p + kp);
    return (ActRow){(int8_t *)p,     f, f + kp / 16, f + kp / 8, f + kp / 8 + kp / 32,
                    f + kp / 8 + kp / 16};
}

// One row x (K fp32, or bf16 when `bf16`) -> r (see ActRow), its padding zeroed.
static void quantize_row(const void *x, int bf16, int64_t k, int64_t kp, ActRow r) {
#if AGENTRT_ISA == 2
    for (int64_t b = 0; b < k / ACT_BLOCK; b++) { // as below, 32 lanes at a time
        __m512 v0, v1;
        if (bf16) {
            const __m512i h = _mm512_loadu_si512((const uint16_t *)x + b * ACT_BLOCK);
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        } else {
            v0 = _mm512_loadu_ps((const float *)x + b * ACT_BLOCK);
            v1 = _mm512_loadu_ps((const float *)x + b * ACT_BLOCK + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(r.q + b * ACT_BLOCK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(r.q + b * ACT_BLOCK + 16), _mm512_cvtepi32_epi8(q1));
        const int sum0 = _mm512_reduce_add_epi32(q0), sum1 = _mm512_reduce_add_epi32(q1);
        r.d16[2 * b] = r.d16[2 * b + 1] = r.d32[b] = d;
        r.s16[2 * b] = d * (float)sum0;
        r.s16[2 * b + 1] = d * (float)sum1;
        r.s32[b] = d * (float)(sum0 + sum1);
        _mm256_storeu_ps(r.dlane + b * ACT_BLOCK / 4, _mm256_set1_ps(d));
    }
#else
    float v[ACT_BLOCK];
    for (int64_t b = 0; b < k / ACT_BLOCK; b++) {
        if (bf16)
            for (int i = 0; i < ACT_BLOCK; i++)
                v[i] = bf16_to_f32(((const uint16_t *)x)[b * ACT_BLOCK + i]);
        else
            memcpy(v, (const float *)x + b * ACT_BLOCK, sizeof v);
        float amax = 0.0f;
        for (int i = 0; i < ACT_BLOCK; i++) {
            const float f = fabsf(v[i]);
            amax = f > amax ? f : amax;
        }
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum[2] = {0, 0};
        for (int i = 0; i < ACT_BLOCK; i++) {
            const int q = (int)rintf(v[i] * id);
            r.q[b * ACT_BLOCK + i] = (int8_t)q;
            sum[i / GROUP] += q;
        }
        for (int h = 0; h < 2; h++) {
            r.d16[2 * b + h] = d;
            r.s16[2 * b + h] = d * (float)sum[h];
        }
        r.d32[b] = d;
        r.s32[b] = d * (float)(sum[0] + sum[1]);
        for (int i = 0; i < ACT_BLOCK / 4; i++) r.dlane[b * ACT_BLOCK / 4 + i] = d;
    }
#endif
    memset(r.q + k, 0, kp - k);
    for (int64_t g = k / GROUP; g < kp / GROUP; g++) r.d16[g] = r.s16[g] = 0.0f;
    for (int64_t b = k / ACT_BLOCK; b < kp / ACT_BLOCK; b++) r.d32[b] = r.s32[b] = 0.0f;
    for (int64_t i = k / 4; i < kp / 4; i++) r.dlane[i] = 0.0f;
}

// ---- Chunks: 256 weights of a row in the canonical form ----------------------------------
//
// The product walks each weight row a chunk at a time: CHUNK_ELEMS weights (one K-quant
// block, or 8 legacy blocks; the row's last chunk may hold fewer legacy blocks, the rest
// zero) decoded into u, scale and bias = min - OFFSET * scale per group of 16, then dotted
// with every activation row. Activation rows are zero-padded to whole chunks, so a dot
// always spans a full chunk.

#define CHUNK_ELEMS 256
#define CHUNK_GROUPS (CHUNK_ELEMS / GROUP)

typedef struct {
    uint8_t u[CHUNK_ELEMS];
    float scale[CHUNK_GROUPS], bias[CHUNK_GROUPS];
} __attribute__((aligned(64))) Chunk;

// Any type: the portable unpacking, `num_blocks` blocks from `blocks`.
static void decode_generic(int qtype, const BlockType *bt, const uint8_t *blocks, int num_blocks,
                           Chunk *c) {
    float min[CHUNK_GROUPS] = {0};
    const int elems = num_blocks * bt->block_elems, groups = elems / GROUP;
    unpack_row(qtype, bt, blocks, num_blocks, c->u, c->scale, min);
    for (int g = 0; g < groups; g++) c->bias[g] = min[g] - (float)bt->offset * c->scale[g];
    if (elems < CHUNK_ELEMS) {
        memset(c->u + elems, 0, CHUNK_ELEMS - elems);
        memset(c->scale + groups, 0, (CHUNK_GROUPS - groups) * sizeof(float));
        memset(c->bias + groups, 0, (CHUNK_GROUPS - groups) * sizeof(float));
    }
}

// Q4_K / Q5_K on the SIMD builds: the block's 12 bytes of 6-bit (scale, min) pairs (see
// k4_scale_min) -> s, bytes 0..7 the 8 scales, 8..15 the 8 mins, ggml's bit shuffle.
static inline void k4_scales_mins(const uint8_t *b, uint32_t s[4]) {
    memcpy(s, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t mins_hi = ((s[2] >> 4) & m4) | (((s[1] >> 6) & m2) << 4);
    const uint32_t mins_lo = s[1] & m6;
    s[1] = (s[2] & m4) | (((s[0] >> 6) & m2) << 4);
    s[0] &= m6;
    s[2] = mins_lo;
    s[3] = mins_hi;
}

// A row of activations in blocks of 256 (ggml's Q8_K), for the K-quant kernels of the SIMD
// builds: q int8 (k), d (k / 256 floats), and per 16 elements the sum of q (int16), each
// part 64-byte aligned.
static inline int64_t act8k_bytes(int64_t kp) {
    return (kp + kp / 256 * 4 + 63) / 64 * 64 + (kp / 16 * 2 + 63) / 64 * 64;
}

// Rows [0, rows) in passes of `max` rows (a constant), the remainder as one last pass:
// PASS(t, n) runs rows t .. t + n with n a constant, so each pass is its own always-inline
// body with its sums in registers. The kernels of the SIMD headers all run so.
#define IN_PASSES(max, rows, PASS)                                                                 \
    do {                                                                                           \
        int64_t t_ = 0;                                                                            \
        for (; t_ + (max) <= (rows); t_ += (max)) PASS(t_, max);                                   \
        switch ((rows) - t_) {                                                                     \
        case 7: if (7 < (max)) PASS(t_, 7); break;                                                 \
        case 6: if (6 < (max)) PASS(t_, 6); break;                                                 \
        case 5: if (5 < (max)) PASS(t_, 5); break;                                                 \
        case 4: if (4 < (max)) PASS(t_, 4); break;                                                 \
        case 3: if (3 < (max)) PASS(t_, 3); break;                                                 \
        case 2: if (2 < (max)) PASS(t_, 2); break;                                                 \
        case 1: PASS(t_, 1); break;                                                                \
        }                                                                                          \
    } while (0)

#if AGENTRT_ISA == 2
#include "ggml_avx512.h"
#elif AGENTRT_ISA == 1
#include "ggml_avx2.h"
#endif

#if AGENTRT_ISA >= 1
// The 16 interleaved rows of `group` for `rows` activation rows from `act` -> sums (rows x
// 16), in passes of the ISA header's X16_TT rows through its x16_rows.
// Each type is its own inlined body (the type a constant in it).
static void x16_group(int qtype, const uint8_t *group, int64_t num_blocks, const uint8_t *act,
                      int64_t kp, int64_t rows, float *sums) {
    const int64_t stride = act_row_bytes(kp);
#define PASS(t, n) x16_rows(QT, group, num_blocks, act + (t) * stride, kp, n, sums + 16 * (t))
    switch (qtype) {
#define QT T_Q4_0
    case QT: IN_PASSES(X16_TT, rows, PASS); break;
#undef QT
#define QT T_Q4_1
    case QT: IN_PASSES(X16_TT, rows, PASS); break;
#undef QT
#define QT T_Q5_0
    case QT: IN_PASSES(X16_TT, rows, PASS); break;
#undef QT
#define QT T_Q5_1
    case QT: IN_PASSES(X16_TT, rows, PASS); break;
#undef QT
#define QT T_Q8_0
    case QT: IN_PASSES(X16_TT, rows, PASS); break;
#undef QT
    }
#undef PASS
}
#endif

// `num_blocks` blocks from `blocks` (one K-quant block, or up to 8 legacy ones) -> c.
static inline void decode_chunk(int qtype, const BlockType *bt, const uint8_t *blocks,
                                int num_blocks, Chunk *c) {
#if AGENTRT_ISA == 2
    switch (qtype) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1:
    case T_Q8_0: decode_legacy_avx512(qtype, bt, blocks, num_blocks, c); return;
    case T_Q4_K:
    case T_Q5_K: decode_q45k_avx512(qtype, blocks, c); return;
    case T_Q6_K: decode_q6k_avx512(blocks, c); return;
    case T_Q2_K:
    case T_Q3_K: decode_q23k_avx512(qtype, blocks, c); return;
    }
#endif
#if AGENTRT_ISA == 1
    switch (qtype) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1:
    case T_Q8_0: decode_legacy_avx2(qtype, bt, blocks, num_blocks, c); return;
    case T_Q4_K:
    case T_Q5_K: decode_q45k_avx2(qtype, blocks, c); return;
    case T_Q6_K: decode_q6k_avx2(blocks, c); return;
    }
#endif
    decode_generic(qtype, bt, blocks, num_blocks, c);
}

// w (N rows, `w_stride` bytes apart, K elements each) -> out (N, K) rows `out_stride`
// elements apart, fp32 (bf16 when out_bf16): scale * u + bias from the decoded chunks, for
// the large-step path (tiles into a GEMM). Not gguf's order of operations (`dequantize` is),
// so within an fp32 rounding of it. Returns 0, or -1 for an unknown type.
int ggml_dequantize_tile(const uint8_t *w, int64_t w_stride, int qtype, int64_t rows, int64_t k,
                         void *out, int64_t out_stride, int out_bf16, int num_threads) {
    BlockType bt;
    if (!block_type(qtype, &bt) || k % bt.block_elems) return -1;
    const int blocks_per_chunk = CHUNK_ELEMS / bt.block_elems;
    const int64_t row_blocks = k / bt.block_elems;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * k >= PARALLEL_WORK)
    for (int64_t n = 0; n < rows; n++) {
        Chunk c;
        for (int64_t b0 = 0; b0 < row_blocks; b0 += blocks_per_chunk) {
            const int nb = row_blocks - b0 < blocks_per_chunk ? (int)(row_blocks - b0)
                                                              : blocks_per_chunk;
            decode_chunk(qtype, &bt, w + n * w_stride + b0 * bt.block_bytes, nb, &c);
            const int64_t e0 = b0 * bt.block_elems, groups = nb * bt.block_elems / GROUP;
            for (int64_t g = 0; g < groups; g++) {
                float v[GROUP];
#if AGENTRT_ISA == 2 && defined(__AVX512BF16__)
                const __m512 f = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(c.u + g * GROUP)))),
                    _mm512_set1_ps(c.scale[g]), _mm512_set1_ps(c.bias[g]));
                if (out_bf16) {
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + n * out_stride + e0 + g * GROUP),
                                        (__m256i)_mm512_cvtneps_pbh(f));
                    continue;
                }
                _mm512_storeu_ps(v, f);
#else
                for (int i = 0; i < GROUP; i++) v[i] = c.scale[g] * (float)c.u[g * GROUP + i] + c.bias[g];
#endif
                if (out_bf16)
                    for (int i = 0; i < GROUP; i++)
                        ((uint16_t *)out)[n * out_stride + e0 + g * GROUP + i] = f32_to_bf16(v[i]);
                else
                    memcpy((float *)out + n * out_stride + e0 + g * GROUP, v, sizeof v);
            }
        }
    }
    return 0;
}

// ---- One chunk dotted with one activation row -----------------------------------------------
//
// a: the row's CHUNK_ELEMS int8 at the chunk; da, fsum: its CHUNK_GROUPS group values. Adds
// sum_g da[g] (scale[g] sum_{i in g} u[i] a[i] + bias[g] sum_{i in g} a[i]) into `acc`
// (a vector of partial sums on SIMD builds, summed at the end of the row).

#if AGENTRT_ISA == 2
typedef __m512 Acc;
static inline Acc acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }

// vpdpbusd sums 4 products (u unsigned, a signed) per int32 lane: lanes 4g..4g+3 of each 64
// hold group g, scaled in fp32 by its scale * da.
static inline Acc dot_chunk(const Chunk *c, const int8_t *a, const float *da, const float *fsum,
                            Acc acc) {
    const __m512 s = _mm512_mul_ps(_mm512_load_ps(c->scale), _mm512_loadu_ps(da));
    const __m512i four = _mm512_set1_epi32(4);
    __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 part[2] = {_mm512_mul_ps(_mm512_load_ps(c->bias), _mm512_loadu_ps(fsum)),
                      _mm512_setzero_ps()};
    for (int k = 0; k < 4; k++) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                              _mm512_load_si512((const __m512i *)(c->u + 64 * k)),
                                              _mm512_loadu_si512(a + 64 * k));
        part[k & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, s),
                                      part[k & 1]);
        idx = _mm512_add_epi32(idx, four);
    }
    return _mm512_add_ps(acc, _mm512_add_ps(part[0], part[1]));
}
#elif AGENTRT_ISA == 1
typedef __m256 Acc;
static inline Acc acc_zero(void) { return _mm256_setzero_ps(); }
static inline float acc_sum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// pmaddubsw (pairs, int16) then pmaddwd by ones: int32 lanes of 4 products, lanes 4g..4g+3
// of each 32 holding group g. Only Q2_K and Q3_K come here (u < 8: no saturation); the other
// types run fused (ggml_avx2.h).
static inline Acc dot_chunk(const Chunk *c, const int8_t *a, const float *da, const float *fsum,
                            Acc acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i two = _mm256_set1_epi32(2);
    __m256 part[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < 2; h++) {
        const __m256 s = _mm256_mul_ps(_mm256_load_ps(c->scale + 8 * h), _mm256_loadu_ps(da + 8 * h));
        part[h] = _mm256_fmadd_ps(_mm256_load_ps(c->bias + 8 * h), _mm256_loadu_ps(fsum + 8 * h), part[h]);
        __m256i idx = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
        for (int k = 0; k < 4; k++) {
            const __m256i w = _mm256_load_si256((const __m256i *)(c->u + 128 * h + 32 * k));
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a + 128 * h + 32 * k));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
            part[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(s, idx),
                                          part[k & 1]);
            idx = _mm256_add_epi32(idx, two);
        }
    }
    return _mm256_add_ps(acc, _mm256_add_ps(part[0], part[1]));
}
#else
typedef float Acc;
static inline Acc acc_zero(void) { return 0.0f; }
static inline float acc_sum(Acc a) { return a; }

static inline Acc dot_chunk(const Chunk *c, const int8_t *a, const float *da, const float *fsum,
                            Acc acc) {
    for (int g = 0; g < CHUNK_GROUPS; g++) {
        int32_t isum = 0;
        for (int i = 0; i < GROUP; i++) isum += (int32_t)c->u[g * GROUP + i] * a[g * GROUP + i];
        acc += c->scale[g] * da[g] * (float)isum + c->bias[g] * fsum[g];
    }
    return acc;
}
#endif

// Whether this build runs the type with activations in blocks of 256 (ggml_avx512.h,
// ggml_avx2.h).
static inline int q8k_type(int qtype) {
    return AGENTRT_ISA >= 1 && (qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K);
}

// The activation block this build quantizes to for the type: 256 or 32.
int ggml_act_block(int qtype) { return q8k_type(qtype) ? 256 : 32; }

// The types this build runs interleaved by 16 rows (ggml_linear.py's `interleave`): the
// legacy types on AVX-512 and AVX2, Q4_K and Q6_K on AVX-512 (ggml_avx2.h says why not
// there). Each was measured faster than the file's layout when streaming weights from
// memory; Q5_K interleaved was slower (more decoding a column), so it is not.
static inline int x16_type(int qtype) {
    return AGENTRT_ISA >= 1 && (qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q5_0 ||
                                qtype == T_Q5_1 || qtype == T_Q8_0 ||
                                (AGENTRT_ISA == 2 && (qtype == T_Q4_K || qtype == T_Q6_K)));
}

static inline void store_out(void *out, int out_bf16, int64_t at, float v) {
    if (out_bf16)
        ((uint16_t *)out)[at] = f32_to_bf16(v);
    else
        ((float *)out)[at] = v;
}

static inline int fused_legacy(int qtype) {
    return AGENTRT_ISA >= 1 && (qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q5_0 ||
                                qtype == T_Q5_1 || qtype == T_Q8_0);
}

// ---- The product --------------------------------------------------------------------------

// Activation row t of x (T, K) fp32 (bf16 when x_bf16) quantized into `act` (rows of
// `act_bytes`): in blocks of 256 for the types that take them (q8k_type), else of 32.
static void quantize_act(int qtype, const void *x, int x_bf16, int64_t k, int64_t kp,
                         uint8_t *act, int64_t act_bytes, int64_t t) {
    const char *xt = (const char *)x + t * k * (x_bf16 ? 2 : 4);
#if AGENTRT_ISA >= 1
    if (q8k_type(qtype)) {
        quantize_row_q8k(xt, x_bf16, k, act + t * act_bytes);
        return;
    }
#endif
    quantize_row(xt, x_bf16, k, kp, act_row(act, kp, t));
}

// out[t, n] = sum_k x[t, k] w[n, k] for t < T, n < N: x (T, K) fp32 (bf16 when x_bf16), rows
// contiguous; w N rows of K / block_elems blocks, `w_stride` bytes apart; out rows
// `out_stride` elements apart, fp32 (bf16 when out_bf16). Returns 0; -1 for an unknown type
// or K not a multiple of its block; -2 when memory runs out.
int ggml_linear(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *w,
                int64_t w_stride, int qtype, int64_t n_out, void *out, int64_t out_stride,
                int out_bf16, int num_threads, int interleaved) {
    BlockType bt;
    if (!block_type(qtype, &bt) || k % bt.block_elems) return -1;
    if (interleaved && !(x16_type(qtype) && n_out % 16 == 0)) return -1;
    // Units of work: weight rows, or groups of 16 interleaved ones (`w_stride` apart).
    const int64_t rows_per_unit = interleaved ? 16 : 1, units = n_out / rows_per_unit;
    const int64_t kp = (k + CHUNK_ELEMS - 1) / CHUNK_ELEMS * CHUNK_ELEMS;
#if AGENTRT_ISA >= 1
    const int64_t act_bytes = q8k_type(qtype) ? act8k_bytes(k) : act_row_bytes(kp);
#else
    const int64_t act_bytes = act_row_bytes(kp);
#endif
    uint8_t *act = aligned_alloc(64, (size_t)(rows * act_bytes));
    if (!act) return -2;
    const int64_t tile = ACT_TILE_BYTES / act_bytes < 8 ? 8 : ACT_TILE_BYTES / act_bytes / 8 * 8;
    const int blocks_per_chunk = CHUNK_ELEMS / bt.block_elems;
    const int64_t row_blocks = k / bt.block_elems;
    int failed = 0;
    if (n_out * k < PARALLEL_WORK) num_threads = 1;
    const int64_t grab = units / (8 * num_threads) > 4 ? units / (8 * num_threads) : 4;
    // One activation row (a decode step) is quantized before the team starts: a work-shared
    // loop of one row would only add a barrier the other threads wait at. The team's threads
    // then meet once, at its end (the row loops' `nowait`: no thread reads another's output).
    if (rows == 1) quantize_act(qtype, x, x_bf16, k, kp, act, act_bytes, 0);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        if (rows > 1) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows; t++)
                quantize_act(qtype, x, x_bf16, k, kp, act, act_bytes, t);
        }
        // Per thread: one decoded chunk, the T partial sums of the row and their totals.
        // Every thread runs the loop below (a work-shared loop must be met by all), so one
        // whose buffer could not be had only marks the failure.
        Chunk chunk;
        Acc *acc = aligned_alloc(64, ((rows * sizeof(Acc) + 63) / 64) * 64);
        float *sums = malloc(rows * rows_per_unit * sizeof(float));
        if (!acc || !sums) {
#pragma omp atomic write
            failed = 1;
        }
        // Activation rows go `tile` at a time (their quantized form within ~L2), each tile
        // against every weight row: a long step then streams its activations from L2, not
        // from memory, once per weight row. Threads take the units in chunks, each the next
        // one when it is free (at most ~8 a thread): one the OS runs late, or one that gets
        // less of the memory's bandwidth, leaves its chunks to the others instead of holding
        // the team at its end (llama.cpp's products take chunks so too). A unit's sums do
        // not depend on the thread that runs it.
        for (int64_t t0 = 0; t0 < rows; t0 += tile) {
            const int64_t tr = rows - t0 < tile ? rows - t0 : tile;
            uint8_t *at = act + t0 * act_bytes;
#pragma omp for schedule(dynamic, grab) nowait
            for (int64_t nn = 0; nn < units; nn++) {
                if (!acc || !sums) continue;
                const uint8_t *row = w + nn * w_stride;
#if AGENTRT_ISA >= 1
                if (interleaved) {
#if AGENTRT_ISA == 2
                    if (qtype == T_Q4_K || qtype == T_Q6_K)
                        x16kq_group(qtype, row, row_blocks, at, k, tr, sums);
                    else
#endif
                        x16_group(qtype, row, row_blocks, at, kp, tr, sums);
                    for (int64_t t = 0; t < tr; t++)
                        for (int r = 0; r < 16; r++)
                            store_out(out, out_bf16, (t0 + t) * out_stride + 16 * nn + r,
                                      sums[16 * t + r]);
                    continue;
                }
#endif
#if AGENTRT_ISA >= 1
                if (fused_legacy(qtype)) {
                    legacy_row(qtype, &bt, row, row_blocks, at, kp, tr, sums);
                } else if (q8k_type(qtype)) {
                    kquant_row(qtype, row, row_blocks, bt.block_bytes, at, k, tr, sums);
                } else
#endif
                {
                    for (int64_t t = 0; t < tr; t++) acc[t] = acc_zero();
                    for (int64_t b0 = 0; b0 < row_blocks; b0 += blocks_per_chunk) {
                        const int nb = row_blocks - b0 < blocks_per_chunk ? (int)(row_blocks - b0)
                                                                          : blocks_per_chunk;
                        decode_chunk(qtype, &bt, row + b0 * bt.block_bytes, nb, &chunk);
                        const int64_t e0 = b0 * bt.block_elems, g0 = e0 / GROUP;
                        for (int64_t t = 0; t < tr; t++) {
                            const ActRow r = act_row(at, kp, t);
                            acc[t] =
                                dot_chunk(&chunk, r.q + e0, r.d16 + g0, r.s16 + g0, acc[t]);
                        }
                    }
                    for (int64_t t = 0; t < tr; t++) sums[t] = acc_sum(acc[t]);
                }
                for (int64_t t = 0; t < tr; t++)
                    store_out(out, out_bf16, (t0 + t) * out_stride + nn, sums[t]);
            }
        }
        free(acc);
        free(sums);
    }
    free(act);
    return failed ? -2 : 0;
}

// ggml_linear with its 13 arguments in one int64 array, in order (pointers as integers): one
// ctypes argument to convert instead of twelve (~1 us a call from Python).
int ggml_linear_packed(const int64_t *a) {
    return ggml_linear((const void *)a[0], (int)a[1], a[2], a[3], (const uint8_t *)a[4], a[5],
                       (int)a[6], a[7], (void *)a[8], a[9], (int)a[10], (int)a[11],
                       (int)a[12]);
}

// The instruction set this library was built for (0 portable C, 1 AVX2, 2 AVX-512 VNNI).
int ggml_isa(void) { return AGENTRT_ISA; }

// Whether this build runs the type interleaved by 16 rows (ggml_linear.py's `interleave`).
int ggml_interleaves(int qtype) { return x16_type(qtype); }

// ---- The layout interleaved by 16 rows (ggml_linear.py's `interleave` describes it) --------
//
// One block of a row <-> its place among the 16 rows' block (`o`, the group's block b;
// lane r). Legacy types: the fp16 fields side by side; Q5_0's and Q5_1's 32 fifth bits as 8
// masks of 64 bits (mask c, bits 4r .. 4r + 3: the row's bits 4c .. 4c + 3); then the quants by
// 4-byte column (Q8_0's as u = q + 128). Q4_K: d, dmin, then the 8 scales and the 8 mins
// unpacked from their 12 bytes of 6-bit fields (scales [8][16], mins by pairs [4][16][2]),
// then the columns. Q6_K: each byte of the row's block moves (q6k_place; ggml_avx512.h's
// x16q6k_rows has the layout).

static int interleaved_block(int qtype, int *head) {
    *head = 0;
    switch (qtype) {
    case T_Q4_0: *head = 2; return 18;
    case T_Q4_1: *head = 4; return 20;
    case T_Q5_0: *head = 2; return 22;
    case T_Q5_1: *head = 4; return 24;
    case T_Q8_0: *head = 2; return 34;
    case T_Q4_K: *head = 4; return 144;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

// Q6_K: byte `at` of row r's block -> its offset in the group's block. ql's and qh's bytes
// move in runs of 4 (`at` a multiple of 4: the next 3 follow it).
static inline int q6k_place(int at, int r) {
    if (at >= 208) return 2 * r + at - 208;                                       // d
    if (at >= 192) return 32 + 16 * (at - 192) + r;                              // scales
    // ql[64n + 32 half + l] or qh[32n + l], l = 16h + 4i + j: step 2n + h, then its columns
    // in the order the kernel first reads them: ql's first set (half 0), qh, ql's second
    // set (half 1); column 4 part + i
    const int qh = at >= 128, q = qh ? at - 128 : at;
    const int n = qh ? q / 32 : q / 64, part = qh ? 1 : 2 * (q % 64 / 32), l = q % 32;
    return 288 + 768 * (2 * n + l / 16) + 256 * part + 64 * (l % 16 / 4) + 4 * r + l % 4;
}

static inline int has_qh(int qtype) { return qtype == T_Q5_0 || qtype == T_Q5_1; }

static void interleave_block(int qtype, const uint8_t *blk, uint8_t *o, int r) {
    int head;
    const int size = interleaved_block(qtype, &head);
    if (qtype == T_Q6_K) {
        for (int at = 0; at < 192; at += 4) memcpy(o + q6k_place(at, r), blk + at, 4);
        for (int at = 192; at < size; at++) o[q6k_place(at, r)] = blk[at];
        return;
    }
    for (int f = 0; f < head; f += 2) memcpy(o + 16 * f + 2 * r, blk + f, 2);
    const uint8_t *q = blk + head;
    uint8_t *cols = o + 16 * head;
    int n_cols = (size - head) / 4;
    if (has_qh(qtype)) { // row r's nibble of each mask: byte r / 2, bits 4 (r % 2) ..
        uint32_t qh;
        memcpy(&qh, q, 4);
        const int shift = 4 * (r % 2);
        for (int c = 0; c < 8; c++) {
            uint8_t *m = cols + 8 * c + r / 2;
            *m = (uint8_t)((*m & ~(15 << shift)) | (((qh >> (4 * c)) & 15) << shift));
        }
        q += 4;
        cols += 64;
        n_cols -= 1;
    }
    if (qtype == T_Q4_K) {
        for (int j = 0; j < 8; j++) {
            int sc, m;
            k4_scale_min(blk + 4, j, &sc, &m);
            o[64 + 16 * j + r] = (uint8_t)sc;
            o[192 + 32 * (j / 2) + 2 * r + (j & 1)] = (uint8_t)m;
        }
        q = blk + 16;
        cols = o + 320;
        n_cols = 32;
    }
    for (int c = 0; c < n_cols; c++) {
        uint8_t *dst = cols + 64 * c + 4 * r;
        memcpy(dst, q + 4 * c, 4);
        if (qtype == T_Q8_0)
            for (int i = 0; i < 4; i++) dst[i] ^= 0x80;
    }
}

static void deinterleave_block(int qtype, const uint8_t *o, int r, uint8_t *blk) {
    int head;
    const int size = interleaved_block(qtype, &head);
    if (qtype == T_Q6_K) {
        for (int at = 0; at < 192; at += 4) memcpy(blk + at, o + q6k_place(at, r), 4);
        for (int at = 192; at < size; at++) blk[at] = o[q6k_place(at, r)];
        return;
    }
    for (int f = 0; f < head; f += 2) memcpy(blk + f, o + 16 * f + 2 * r, 2);
    uint8_t *q = blk + head;
    const uint8_t *cols = o + 16 * head;
    int n_cols = (size - head) / 4;
    if (has_qh(qtype)) {
        uint32_t qh = 0;
        for (int c = 0; c < 8; c++)
            qh |= (uint32_t)((cols[8 * c + r / 2] >> (4 * (r % 2))) & 15) << (4 * c);
        memcpy(q, &qh, 4);
        q += 4;
        cols += 64;
        n_cols -= 1;
    }
    if (qtype == T_Q4_K) { // the 6-bit fields packed back (the inverse of k4_scale_min)
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = o[64 + 16 * j + r];
            m[j] = o[192 + 32 * (j / 2) + 2 * r + (j & 1)];
        }
        for (int j = 0; j < 4; j++) {
            blk[4 + j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
            blk[8 + j] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
            blk[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
        }
        q = blk + 16;
        cols = o + 320;
        n_cols = 32;
    }
    for (int c = 0; c < n_cols; c++) {
        memcpy(q + 4 * c, cols + 64 * c + 4 * r, 4);
        if (qtype == T_Q8_0)
            for (int i = 0; i < 4; i++) q[4 * c + i] ^= 0x80;
    }
}

// Bytes of one interleaved block of 16 rows.
static inline int64_t group_block_bytes(int qtype) {
    int head;
    return qtype == T_Q4_K ? X16K_BLOCK : 16 * interleaved_block(qtype, &head);
}

// n rows of w (`w_stride` bytes apart) -> out, interleaved by 16. Returns 0; -1 for a type
// without the layout, n not a multiple of 16 or K not of the block.
int ggml_interleave(const uint8_t *w, int64_t w_stride, int qtype, int64_t n, int64_t k,
                    uint8_t *out, int num_threads) {
    int head;
    BlockType bt;
    const int size = interleaved_block(qtype, &head);
    if (!size || !block_type(qtype, &bt)) return -1;
    const int elems = bt.block_elems;
    if (k % elems || n % 16) return -1;
    const int64_t num_blocks = k / elems, block = group_block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < n / 16; g++)
        for (int64_t b = 0; b < num_blocks; b++)
            for (int r = 0; r < 16; r++)
                interleave_block(qtype, w + (16 * g + r) * w_stride + b * size,
                                 out + (g * num_blocks + b) * block, r);
    return 0;
}

// Many ggml_interleave calls in one (so a caller's lock, Python's GIL, is released through
// all of them): `jobs` holds n_jobs records of 8 int64, ggml_interleave's w, w_stride, qtype,
// n, k and out, then pages of w (address, bytes; 0 bytes: none) to drop with MADV_DONTNEED
// once copied. Each caller's thread takes the next job from the shared counter `next`, one
// thread each. Returns 0; 1 + the index of a job ggml_interleave refused.
int ggml_interleave_jobs(const int64_t *jobs, int64_t n_jobs, int64_t *next) {
    for (;;) {
        const int64_t j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (j >= n_jobs) return 0;
        const int64_t *job = jobs + 8 * j;
        if (ggml_interleave((const uint8_t *)job[0], job[1], (int)job[2], job[3], job[4],
                            (uint8_t *)job[5], 1))
            return (int)(j + 1);
        if (job[7] > 0) madvise((void *)job[6], (size_t)job[7], MADV_DONTNEED);
    }
}

// Rows `index[0 .. count)` of an interleaved weight (`w_stride` bytes a group of 16) -> out,
// in the file's layout (`out_stride` bytes apart). Returns 0; -1 as ggml_interleave.
int ggml_deinterleave_rows(const uint8_t *w, int64_t w_stride, int qtype, const int64_t *index,
                           int64_t count, int64_t k, uint8_t *out, int64_t out_stride) {
    int head;
    BlockType bt;
    const int size = interleaved_block(qtype, &head);
    if (!size || !block_type(qtype, &bt)) return -1;
    const int elems = bt.block_elems;
    if (k % elems) return -1;
    const int64_t num_blocks = k / elems, block = group_block_bytes(qtype);
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *group = w + index[i] / 16 * w_stride;
        for (int64_t b = 0; b < num_blocks; b++)
            deinterleave_block(qtype, group + b * block, (int)(index[i] % 16),
                               out + i * out_stride + b * size);
    }
    return 0;
}
