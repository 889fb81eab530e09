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
// Weight-stationary: a chunk of one weight row is unpacked once into a buffer the size of L1
// and dotted with every activation row of the step, so a batch of T rows reads each weight
// byte once. OpenMP threads split the output rows.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#define CHUNK 4096              // elements of a weight row unpacked at a time (fits L1)
#define PARALLEL_WORK (1 << 16) // fewer weight elements than this run on one thread

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

// One row x (K fp32, or bf16 when `bf16`) -> q (K int8), da (K / 16: each group's scale d,
// twice per block of 32) and fsum (K / 16: d * the group's sum of q).
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *q, float *da, float *fsum) {
    float v[ACT_BLOCK];
    for (int64_t b = 0; b < k / ACT_BLOCK; b++) {
        if (bf16)
            for (int i = 0; i < ACT_BLOCK; i++)
                v[i] = bf16_to_f32(((const uint16_t *)x)[b * ACT_BLOCK + i]);
        else
            memcpy(v, (const float *)x + b * ACT_BLOCK, sizeof v);
        float amax = 0.0f;
        for (int i = 0; i < ACT_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum[2] = {0, 0};
        for (int i = 0; i < ACT_BLOCK; i++) {
            const int r = (int)rintf(v[i] * id);
            q[b * ACT_BLOCK + i] = (int8_t)r;
            sum[i / GROUP] += r;
        }
        for (int h = 0; h < 2; h++) {
            da[2 * b + h] = d;
            fsum[2 * b + h] = d * (float)sum[h];
        }
    }
}

// ---- The dot product of an unpacked weight chunk with one quantized activation row --------
//
// u, a: n elements (n a multiple of 32); scale, bias, da, fsum: n / 16 groups. `wide`: the
// type's u spans 0..255 (Q8_0), which pmaddubsw's int16 sums cannot hold; the AVX2 path then
// multiplies signed (u - 128) instead, and its caller's bias counts OFFSET - 128.

__attribute__((unused)) static float dot_scalar(const uint8_t *u, const float *scale, const float *bias, const int8_t *a,
                        const float *da, const float *fsum, int64_t n) {
    float acc = 0.0f;
    for (int64_t g = 0; g < n / GROUP; g++) {
        int32_t isum = 0;
        for (int i = 0; i < GROUP; i++) isum += (int32_t)u[g * GROUP + i] * a[g * GROUP + i];
        acc += scale[g] * da[g] * (float)isum + bias[g] * fsum[g];
    }
    return acc;
}

__attribute__((unused)) static float bias_term(const float *bias, const float *fsum, int64_t groups) {
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; g++) acc += bias[g] * fsum[g];
    return acc;
}

#if AGENTRT_ISA == 2
// 64 elements (4 groups) a step: vpdpbusd sums 4 products per int32 lane, so lanes 4g..4g+3
// hold group g; each lane is scaled by its group's scale * da in fp32.
static float dot_avx512(const uint8_t *u, const float *scale, const float *bias, const int8_t *a,
                        const float *da, const float *fsum, int64_t n, int wide) {
    (void)wide;
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi32(4);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        const int64_t g = i / GROUP;
        const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scale + g), _mm512_loadu_ps(da + g));
        __m512i idx = spread;
        for (int k = 0; k < 4; k++) {
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                  _mm512_loadu_si512(u + i + 64 * k),
                                                  _mm512_loadu_si512(a + i + 64 * k));
            const __m512 sv = _mm512_permutexvar_ps(idx, s);
            if (k & 1)
                acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sv, acc1);
            else
                acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sv, acc0);
            idx = _mm512_add_epi32(idx, four);
        }
    }
    for (; i + 64 <= n; i += 64) {
        const int64_t g = i / GROUP;
        const __m512 s =
            _mm512_zextps128_ps512(_mm_mul_ps(_mm_loadu_ps(scale + g), _mm_loadu_ps(da + g)));
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(u + i),
                                              _mm512_loadu_si512(a + i));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(spread, s), acc0);
    }
    if (i < n) { // 32 left: two groups, in the low half of the lanes
        const int64_t g = i / GROUP;
        const __mmask16 half = 0x00ff;
        const __m512 s = _mm512_zextps128_ps512(
            _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(scale + g))),
                       _mm_castpd_ps(_mm_load_sd((const double *)(da + g)))));
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                              _mm512_maskz_loadu_epi32(half, u + i),
                                              _mm512_maskz_loadu_epi32(half, a + i));
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(spread, s), acc1);
    }
    const int64_t groups = n / GROUP;
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16)
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(bias + g), _mm512_loadu_ps(fsum + g), acc0);
    if (g < groups) {
        const __mmask16 m = (__mmask16)((1u << (groups - g)) - 1);
        acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, bias + g), _mm512_maskz_loadu_ps(m, fsum + g),
                               acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

#if AGENTRT_ISA == 1
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 32 elements (2 groups) a step: pmaddubsw (pairs, int16) then pmaddwd by ones (int32 lanes of
// 4 products), lanes 4g..4g+3 holding group g.
static float dot_avx2(const uint8_t *u, const float *scale, const float *bias, const int8_t *a,
                      const float *da, const float *fsum, int64_t n, int wide) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const __m256i spread = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i two = _mm256_set1_epi32(2);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        const int64_t g = i / GROUP;
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scale + g), _mm256_loadu_ps(da + g));
        __m256i idx = spread;
        for (int k = 0; k < 4; k++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(u + i + 32 * k));
            __m256i x = _mm256_loadu_si256((const __m256i *)(a + i + 32 * k));
            if (wide) { // signed w = u - 128: |w| times a with w's sign
                w = _mm256_xor_si256(w, flip);
                x = _mm256_sign_epi8(x, w);
                w = _mm256_abs_epi8(w);
            }
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
            const __m256 sv = _mm256_permutevar8x32_ps(s, idx);
            if (k & 1)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc1);
            else
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc0);
            idx = _mm256_add_epi32(idx, two);
        }
    }
    for (; i < n; i += 32) {
        const int64_t g = i / GROUP;
        const __m256 s = _mm256_castps128_ps256(
            _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(scale + g))),
                       _mm_castpd_ps(_mm_load_sd((const double *)(da + g)))));
        __m256i w = _mm256_loadu_si256((const __m256i *)(u + i));
        __m256i x = _mm256_loadu_si256((const __m256i *)(a + i));
        if (wide) {
            w = _mm256_xor_si256(w, flip);
            x = _mm256_sign_epi8(x, w);
            w = _mm256_abs_epi8(w);
        }
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(s, spread), acc0);
    }
    const int64_t groups = n / GROUP;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(bias + g), _mm256_loadu_ps(fsum + g), acc1);
    return hsum256(_mm256_add_ps(acc0, acc1)) + bias_term(bias + g, fsum + g, groups - g);
}
#endif

static inline float dot(const uint8_t *u, const float *scale, const float *bias, const int8_t *a,
                        const float *da, const float *fsum, int64_t n, int wide) {
#if AGENTRT_ISA == 2
    return dot_avx512(u, scale, bias, a, da, fsum, n, wide);
#elif AGENTRT_ISA == 1
    return dot_avx2(u, scale, bias, a, da, fsum, n, wide);
#else
    (void)wide;
    return dot_scalar(u, scale, bias, a, da, fsum, n);
#endif
}

// Whether this build's dot multiplies u - 128 (see above): Q8_0 on AVX2.
static inline int signed_wide(int qtype) { return AGENTRT_ISA == 1 && qtype == T_Q8_0; }

// ---- The product --------------------------------------------------------------------------

// out[t, n] = sum_k x[t, k] w[n, k] for t < T, n < N: x (T, K) fp32 (bf16 when x_bf16), rows
// contiguous; w N rows of K / block_elems blocks, `w_stride` bytes apart; out rows
// `out_stride` elements apart, fp32 (bf16 when out_bf16). Returns 0; -1 for an unknown type
// or K not a multiple of its block; -2 when memory runs out.
int ggml_linear(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *w,
                int64_t w_stride, int qtype, int64_t n_out, void *out, int64_t out_stride,
                int out_bf16, int num_threads) {
    BlockType bt;
    if (!block_type(qtype, &bt) || k % bt.block_elems) return -1;
    const int64_t groups = k / GROUP;
    // Quantized activations: per row, K int8 then K / 16 da and K / 16 fsum floats.
    int8_t *aq = malloc((size_t)rows * (size_t)k);
    float *ada = malloc((size_t)rows * (size_t)groups * 2 * sizeof(float));
    if (!aq || !ada) {
        free(aq);
        free(ada);
        return -2;
    }
    const int wide = signed_wide(qtype);
    const int offset = bt.offset - (wide ? 128 : 0);
    const int64_t chunk = CHUNK;
    int failed = 0;
    if (n_out * k < PARALLEL_WORK) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++)
            quantize_row((const char *)x + t * k * (x_bf16 ? 2 : 4), x_bf16, k, aq + t * k,
                         ada + t * groups * 2, ada + t * groups * 2 + groups);
        // Per thread: one unpacked chunk of a weight row, and the T sums of the row. Every
        // thread runs the loop below (a work-shared loop must be met by all), so one whose
        // buffers could not be had only marks the failure.
        uint8_t *u = malloc(chunk);
        float *scale = malloc(3 * (chunk / GROUP) * sizeof(float));
        float *acc = malloc(rows * sizeof(float));
        const int ok = u && scale && acc;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        float *min = ok ? scale + chunk / GROUP : NULL, *bias = ok ? min + chunk / GROUP : NULL;
        if (ok) memset(min, 0, (chunk / GROUP) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t nn = 0; nn < n_out; nn++) {
            if (!ok) continue;
            const uint8_t *row = w + nn * w_stride;
            for (int64_t t = 0; t < rows; t++) acc[t] = 0.0f;
            for (int64_t k0 = 0; k0 < k; k0 += chunk) {
                const int64_t len = k - k0 < chunk ? k - k0 : chunk, g0 = k0 / GROUP;
                unpack_row(qtype, &bt, row + (k0 / bt.block_elems) * bt.block_bytes,
                           len / bt.block_elems, u, scale, min);
                for (int64_t g = 0; g < len / GROUP; g++) bias[g] = min[g] - offset * scale[g];
                for (int64_t t = 0; t < rows; t++) {
                    const float *da = ada + t * groups * 2;
                    acc[t] += dot(u, scale, bias, aq + t * k + k0, da + g0, da + groups + g0, len,
                                  wide);
                }
            }
            if (out_bf16)
                for (int64_t t = 0; t < rows; t++)
                    ((uint16_t *)out)[t * out_stride + nn] = f32_to_bf16(acc[t]);
            else
                for (int64_t t = 0; t < rows; t++) ((float *)out)[t * out_stride + nn] = acc[t];
        }
        free(u);
        free(scale);
        free(acc);
    }
    free(aq);
    free(ada);
    return failed ? -2 : 0;
}

// The instruction set this library was built for (0 portable C, 1 AVX2, 2 AVX-512 VNNI).
int ggml_isa(void) { return AGENTRT_ISA; }
