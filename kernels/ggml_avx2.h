// AVX2 parts of ggml_quants.c, included by it where AGENTRT_ISA == 1: the decoders of the
// chunked path, the fused kernel of the legacy types and the K-quant kernel with activations
// in blocks of 256. They use ggml_quants.c's definitions above the point of inclusion; not a
// standalone header.

#ifndef AGENTRT_GGML_AVX2_H
#define AGENTRT_GGML_AVX2_H

static inline float f16_avx2(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// Byte j = 0xff where bit j of the 32-bit little-endian value at p is set (ggml's trick).
static inline __m256i bytes_from_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                             0x0101010101010101, 0x0000000000000000);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    return _mm256_cmpeq_epi8(_mm256_or_si256(x, others), _mm256_set1_epi64x(-1));
}

// Q4_K / Q5_K: u of elements 64j .. 64j + 31 (the low nibbles of qs[32j ..]) and 64j + 32 ..
// 64j + 63 (the high ones); Q5_K adds bit 2j (2j + 1) of qh[l] as the fifth.
static inline void q45k_u(int qtype, const uint8_t *b, int j, __m256i *ul, __m256i *uh) {
    const uint8_t *qs = b + (qtype == T_Q4_K ? 16 : 48);
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
    *ul = _mm256_and_si256(q, low4);
    *uh = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    if (qtype == T_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m128i sl = _mm_cvtsi32_si128(2 * j), sh = _mm_cvtsi32_si128(2 * j + 1);
        *ul = _mm256_or_si256(*ul, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, sl), one), 4));
        *uh = _mm256_or_si256(*uh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, sh), one), 4));
    }
}

// Q6_K: u of elements 128h + 32k .. + 31: ql's nibbles (low for k = 0, 1, high for k = 2, 3;
// bytes 32 (k & 1) on) | two bits of qh[32h + l] (bits 2k, 2k + 1) << 4.
static inline __m256i q6k_u(const uint8_t *b, int h, int k) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (k & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), low2);
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

// Legacy types (blocks of 32), one block per 32 bytes of u.
static void decode_legacy_avx2(int qtype, const BlockType *bt, const uint8_t *blocks,
                               int num_blocks, Chunk *c) {
    const int bytes = bt->block_bytes, qs = bytes - 16;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int i = 0; i < 8; i++) {
        float d = 0.0f, m = 0.0f;
        __m256i u = _mm256_setzero_si256();
        if (i < num_blocks) {
            const uint8_t *b = blocks + i * bytes;
            d = f16_avx2(b);
            m = bt->has_min ? f16_avx2(b + 2) : 0.0f;
            if (qtype == T_Q8_0) {
                u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)),
                                     _mm256_set1_epi8((char)0x80));
            } else {
                const __m128i q = _mm_loadu_si128((const __m128i *)(b + qs));
                u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4),
                                     _mm_and_si128(q, low4));
                if (qtype == T_Q5_0 || qtype == T_Q5_1)
                    u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits(b + qs - 4),
                                                            _mm256_set1_epi8(16)));
            }
        }
        _mm256_store_si256((__m256i *)(c->u + 32 * i), u);
        c->scale[2 * i] = c->scale[2 * i + 1] = d;
        c->bias[2 * i] = c->bias[2 * i + 1] = m - (float)bt->offset * d;
    }
}

// Q4_K / Q5_K: one block (see decode_q45k_avx512).
static void decode_q45k_avx2(int qtype, const uint8_t *b, Chunk *c) {
    uint32_t s[4];
    k4_scales_mins(b, s); // bytes 0..7: the 8 scales (one per 32), 8..15: the 8 mins
    const __m128i raw = _mm_loadu_si128((const __m128i *)s);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)));
    const __m256 d = _mm256_set1_ps(f16_avx2(b)), dmin = _mm256_set1_ps(f16_avx2(b + 2));
    const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    _mm256_store_ps(c->scale, _mm256_mul_ps(d, _mm256_permutevar8x32_ps(sc, lo)));
    _mm256_store_ps(c->scale + 8, _mm256_mul_ps(d, _mm256_permutevar8x32_ps(sc, hi)));
    const __m256 zero = _mm256_setzero_ps();
    _mm256_store_ps(c->bias, _mm256_sub_ps(zero, _mm256_mul_ps(dmin, _mm256_permutevar8x32_ps(mn, lo))));
    _mm256_store_ps(c->bias + 8, _mm256_sub_ps(zero, _mm256_mul_ps(dmin, _mm256_permutevar8x32_ps(mn, hi))));
    for (int j = 0; j < 4; j++) {
        __m256i ul, uh;
        q45k_u(qtype, b, j, &ul, &uh);
        _mm256_store_si256((__m256i *)(c->u + 64 * j), ul);
        _mm256_store_si256((__m256i *)(c->u + 64 * j + 32), uh);
    }
}

// Q6_K: one block (see decode_q6k_avx512).
static void decode_q6k_avx2(const uint8_t *b, Chunk *c) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256 d = _mm256_set1_ps(f16_avx2(b + 208)), off = _mm256_set1_ps(-32.0f);
    const __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    const __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    _mm256_store_ps(c->scale, s0);
    _mm256_store_ps(c->scale + 8, s1);
    _mm256_store_ps(c->bias, _mm256_mul_ps(off, s0));
    _mm256_store_ps(c->bias + 8, _mm256_mul_ps(off, s1));
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            _mm256_store_si256((__m256i *)(c->u + 128 * h + 32 * k), q6k_u(b, h, k));
}

// ---- Q4_K, Q5_K and Q6_K with activations in blocks of 256 (ggml's Q8_K) ------------------
//
// ggml_avx512.h's K-quant kernel in 256-bit registers: per 32 weights one pmaddubsw (u times
// a, pairs into int16) and one pmaddwd by the groups' integer scales into int32; one fp32
// multiply-add per block for the scales and one for the mins. Activation rows as there
// (act8k_bytes): q int8, d per 256, the sum of q per 16 (int16).

static void quantize_row_q8k(const void *x, int bf16, int64_t k, uint8_t *out) {
    int8_t *q = (int8_t *)out;
    float *d = (float *)(out + k);
    int16_t *bsum = (int16_t *)(out + (k + k / 256 * 4 + 63) / 64 * 64);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / 256; b++) {
        __m256 v[32];
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) {
            const int64_t at = b * 256 + 8 * i;
            v[i] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at))), 16))
                        : _mm256_loadu_ps((const float *)x + at);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        const __m256 scale = _mm256_set1_ps(id);
        for (int i = 0; i < 32; i += 2) { // 16 values: one group's q and its sum
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], scale));
            // int32 -> int16 (packs works per 128-bit lane: restore the order) -> int8
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xd8);
            const __m128i p = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(q + b * 256 + 8 * i), p);
            __m256i s = _mm256_add_epi32(a, c);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            bsum[b * 16 + i / 2] = (int16_t)_mm_cvtsi128_si32(t);
        }
    }
}

typedef struct {
    __m256i u[8], scale[8]; // u of 32 elements each; int16 scales of their pmaddubsw lanes
    __m256i mins;           // int16 per group of 16: what multiplies its activation sum
    float d, dmin;          // y = d * da * sum(scale u a) - dmin * da * sum(mins bsum)
} KBlock;

static inline void kblock_q45k(int qtype, const uint8_t *b, KBlock *kb) {
    uint32_t s[4];
    k4_scales_mins(b, s); // bytes 0..7: the 8 scales (one per 32), 8..15: the 8 mins
    const __m128i raw = _mm_loadu_si128((const __m128i *)s);
    const __m128i sc16 = _mm_cvtepu8_epi16(raw); // 8 int16 scales
    for (int j = 0; j < 8; j++) // every lane of sub-block j: scale j (bytes 2j, 2j + 1)
        kb->scale[j] = _mm256_broadcastsi128_si256(
            _mm_shuffle_epi8(sc16, _mm_set1_epi16((short)(((2 * j + 1) << 8) | (2 * j)))));
    const __m128i mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(raw, 8));
    // each min twice: one per group of 16
    kb->mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
    kb->d = f16_avx2(b);
    kb->dmin = f16_avx2(b + 2);
    for (int j = 0; j < 4; j++) q45k_u(qtype, b, j, &kb->u[2 * j], &kb->u[2 * j + 1]);
}

static inline void kblock_q6k(const uint8_t *b, KBlock *kb) {
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    const __m128i lo = _mm256_castsi256_si128(sc), hi = _mm256_extracti128_si256(sc, 1);
    for (int m = 0; m < 8; m++) { // 32 elements: group 2m in lanes 0..7, 2m + 1 in 8..15
        const __m128i half = m < 4 ? lo : hi;
        const int g = 2 * (m % 4);
        const __m128i a = _mm_shuffle_epi8(half, _mm_set1_epi16((short)(((2 * g + 1) << 8) | (2 * g))));
        const __m128i c = _mm_shuffle_epi8(half, _mm_set1_epi16((short)(((2 * g + 3) << 8) | (2 * g + 2))));
        kb->scale[m] = _mm256_set_m128i(c, a);
    }
    kb->mins = _mm256_slli_epi16(sc, 5); // OFFSET 32 times the scale
    kb->d = kb->dmin = f16_avx2(b + 208);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) kb->u[4 * h + k] = q6k_u(b, h, k);
}

#define TT_MAX 4 // activation rows a pass: their sums stay in registers

static inline __attribute__((always_inline)) void kquant_rows(
    int qtype, const uint8_t *row, int64_t num_blocks, int bytes, const uint8_t *act,
    int64_t k, int64_t t0, const int TT, float *sums) {
    const int64_t stride = act8k_bytes(k), d_at = k, bsum_at = (k + k / 256 * 4 + 63) / 64 * 64;
    __m256 acc[TT_MAX], macc[TT_MAX];
    for (int tt = 0; tt < TT; tt++) acc[tt] = macc[tt] = _mm256_setzero_ps();
    for (int64_t i = 0; i < num_blocks; i++) {
        KBlock kb;
        if (qtype == T_Q6_K)
            kblock_q6k(row + i * bytes, &kb);
        else
            kblock_q45k(qtype, row + i * bytes, &kb);
        for (int tt = 0; tt < TT; tt++) {
            const uint8_t *a = act + (t0 + tt) * stride;
            const int8_t *q = (const int8_t *)a + 256 * i;
            const float da = ((const float *)(a + d_at))[i];
            __m256i isum = _mm256_setzero_si256();
            for (int m = 0; m < 8; m++)
                isum = _mm256_add_epi32(
                    isum, _mm256_madd_epi16(_mm256_maddubs_epi16(kb.u[m], _mm256_loadu_si256((const __m256i *)(q + 32 * m))),
                                            kb.scale[m]));
            const __m256i bs = _mm256_loadu_si256((const __m256i *)((const int16_t *)(a + bsum_at) + 16 * i));
            const __m256i msum = _mm256_madd_epi16(bs, kb.mins);
            acc[tt] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(kb.d * da), acc[tt]);
            macc[tt] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(kb.dmin * da), macc[tt]);
        }
    }
    for (int tt = 0; tt < TT; tt++) {
        const __m256 v = _mm256_sub_ps(acc[tt], macc[tt]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        sums[tt] = _mm_cvtss_f32(h);
    }
}

static void kquant_row(int qtype, const uint8_t *row, int64_t num_blocks, int bytes,
                       const uint8_t *act, int64_t k, int64_t rows, float *sums) {
#define PASS(t, n) kquant_rows(qtype, row, num_blocks, bytes, act, k, t, n, sums + (t))
    IN_PASSES(TT_MAX, rows, PASS);
#undef PASS
}

// ---- The legacy types on AVX2, fused ---------------------------------------------------------
//
// As ggml_avx512.h's: each block of 32 is decoded into one register and dotted with TT
// activation rows directly, its fp16 scale times each row's block scale; no chunk. Q8_0 keeps
// its signed bytes (|w| times a with w's sign: pmaddubsw's pair sums of u = q + 128 would
// saturate), so it has no bias; the others add bias = min - OFFSET * scale times the row's
// block sum.

static inline __m256i legacy_u(int qtype, const uint8_t *b, int bytes) {
    if (qtype == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2)); // signed q
    const int qs = bytes - 16; // after d (Q4_0), d m (Q4_1), d qh (Q5_0), d m qh (Q5_1)
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + qs)), low4 = _mm_set1_epi8(0x0f);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4));
    if (qtype == T_Q5_0 || qtype == T_Q5_1)
        u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits(b + qs - 4), _mm256_set1_epi8(16)));
    return u;
}

static inline __attribute__((always_inline)) void legacy_rows(
    int qtype, const BlockType *bt, const uint8_t *row, int64_t num_blocks, uint8_t *act,
    int64_t kp, int64_t t0, const int TT, float *sums) {
    const int bytes = bt->block_bytes, q8 = qtype == T_Q8_0;
    const __m256i ones = _mm256_set1_epi16(1);
    ActRow r[TT_MAX];
    __m256 acc[TT_MAX];
    float bias_acc[TT_MAX];
    for (int tt = 0; tt < TT; tt++) {
        r[tt] = act_row(act, kp, t0 + tt);
        acc[tt] = _mm256_setzero_ps();
        bias_acc[tt] = 0.0f;
    }
    for (int64_t i = 0; i < num_blocks; i++) {
        const uint8_t *b = row + i * bytes;
        const __m256i u = legacy_u(qtype, b, bytes);
        const __m256i w = q8 ? _mm256_abs_epi8(u) : u;
        const float d = f16_avx2(b);
        const float bias = q8 ? 0.0f : bt->has_min ? f16_avx2(b + 2) : -(float)bt->offset * d;
        for (int tt = 0; tt < TT; tt++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(r[tt].q + 32 * i));
            if (q8) a = _mm256_sign_epi8(a, u);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
            acc[tt] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * r[tt].d32[i]), acc[tt]);
            bias_acc[tt] += bias * r[tt].s32[i];
        }
    }
    for (int tt = 0; tt < TT; tt++) {
        const __m256 v = acc[tt];
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        sums[tt] = _mm_cvtss_f32(h) + bias_acc[tt];
    }
}

static void legacy_row(int qtype, const BlockType *bt, const uint8_t *row, int64_t num_blocks,
                       uint8_t *act, int64_t kp, int64_t rows, float *sums) {
#define PASS(t, n) legacy_rows(qtype, bt, row, num_blocks, act, kp, t, n, sums + (t))
    IN_PASSES(TT_MAX, rows, PASS);
#undef PASS
}

// ---- Q4_0, Q4_1, Q5_0 and Q5_1 interleaved by 16 rows (ggml_avx512.h has the layout) -------
//
// Each half of a group (8 rows, a 32-bit lane each) on its own, 8 columns of u at a time (the
// 16 registers allow no more): pmaddubsw of u and the activation's 4 bytes broadcast gives
// each row 2 int16 sums; columns are added in int16 (Q4: 8 of them, at most 8 * 2 * 15 * 128
// < 2^15; Q5: 4, 4 * 2 * 31 * 128 < 2^15), then pmaddwd by ones gives each row its int32 dot.
// A Q5 fifth bit comes from its mask's 32 bits of the half, spread to bytes (bytes_from_bits).
// Q8_0's u = q + 128 would saturate pmaddubsw: its columns go back to q, and |q| times the
// activation with q's sign (at most 2 * 128 * 127 < 2^15 a pair), one pmaddwd a column; no
// bias. The K-quants stay in the file's layout here: an interleaved Q4_K, Q5_K and Q6_K were
// measured slower than it when streaming weights from memory.

#define X16_TT 2 // activation rows a pass over a group's blocks

// The dot of 8 columns of u with the activation's dwords q[0 .. 8), per row (int32 lanes);
// `q5`: int16 sums of 4 columns at a time.
static inline __m256i x16_dot8(const __m256i *u, const int32_t *q, int q5) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(q[0])), r = _mm256_setzero_si256();
    for (int c = 1; c < 8; c++) {
        if (q5 && c == 4) {
            r = _mm256_madd_epi16(s, ones);
            s = _mm256_maddubs_epi16(u[c], _mm256_set1_epi32(q[c]));
            continue;
        }
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[c], _mm256_set1_epi32(q[c])));
    }
    return _mm256_add_epi32(r, _mm256_madd_epi16(s, ones));
}

static inline __attribute__((always_inline)) void x16_q8_rows(const uint8_t *group,
                                                              int64_t num_blocks, const uint8_t *act,
                                                              int64_t kp, const int TT, float *sums) {
    const int64_t stride = act_row_bytes(kp), d32_at = kp + kp / 2;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        __m256 acc[X16_TT];
        for (int tt = 0; tt < TT; tt++) acc[tt] = _mm256_setzero_ps();
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *p = group + b * 16 * 34;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * half)));
            __m256i isum[X16_TT];
            for (int tt = 0; tt < TT; tt++) isum[tt] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i q = _mm256_xor_si256(
                    _mm256_loadu_si256((const __m256i *)(p + 32 + 64 * c + 32 * half)), flip);
                const __m256i w = _mm256_abs_epi8(q);
                for (int tt = 0; tt < TT; tt++) {
                    const int32_t *qa = (const int32_t *)(act + tt * stride + 32 * b);
                    const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(qa[c]), q);
                    isum[tt] = _mm256_add_epi32(
                        isum[tt], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones));
                }
            }
            for (int tt = 0; tt < TT; tt++) {
                const float da = ((const float *)(act + tt * stride + d32_at))[b];
                acc[tt] = _mm256_fmadd_ps(
                    d, _mm256_mul_ps(_mm256_cvtepi32_ps(isum[tt]), _mm256_set1_ps(da)), acc[tt]);
            }
        }
        for (int tt = 0; tt < TT; tt++) _mm256_storeu_ps(sums + 16 * tt + 8 * half, acc[tt]);
    }
}

static inline __attribute__((always_inline)) void x16_rows(int qtype, const uint8_t *group,
                                                           int64_t num_blocks, const uint8_t *act,
                                                           int64_t kp, const int TT, float *sums) {
    const int has_min = qtype == T_Q4_1 || qtype == T_Q5_1;
    const int q5 = qtype == T_Q5_0 || qtype == T_Q5_1;
    const int64_t stride = act_row_bytes(kp), d32_at = kp + kp / 2;
    const int64_t s32_at = kp + 4 * (kp / 8 + kp / 32);
    const __m256i low = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(16);
    if (qtype == T_Q8_0) {
        x16_q8_rows(group, num_blocks, act, kp, TT, sums);
        return;
    }
    const int64_t block = 16 * (18 + 2 * has_min + 4 * q5);
    for (int half = 0; half < 2; half++) {
        __m256 acc[X16_TT];
        for (int tt = 0; tt < TT; tt++) acc[tt] = _mm256_setzero_ps();
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *p = group + b * block;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * half)));
            const __m256 bias =
                has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * half)))
                        : _mm256_mul_ps(d, _mm256_set1_ps(q5 ? -16.0f : -8.0f));
            const uint8_t *masks = p + (has_min ? 64 : 32);
            const uint8_t *qs = masks + (q5 ? 64 : 0) + 32 * half;
            __m256i u[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * c));
                u[c] = _mm256_and_si256(v, low);
                u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            if (q5)
                for (int c = 0; c < 8; c++)
                    u[c] = _mm256_or_si256(
                        u[c], _mm256_and_si256(bytes_from_bits(masks + 8 * c + 4 * half), sixteen));
            for (int tt = 0; tt < TT; tt++) {
                const uint8_t *a = act + tt * stride;
                const __m256 dot = _mm256_cvtepi32_ps(x16_dot8(u, (const int32_t *)(a + 32 * b), q5));
                const float da = ((const float *)(a + d32_at))[b], sa = ((const float *)(a + s32_at))[b];
                acc[tt] = _mm256_fmadd_ps(d, _mm256_mul_ps(dot, _mm256_set1_ps(da)), acc[tt]);
                acc[tt] = _mm256_fmadd_ps(bias, _mm256_set1_ps(sa), acc[tt]);
            }
        }
        for (int tt = 0; tt < TT; tt++) _mm256_storeu_ps(sums + 16 * tt + 8 * half, acc[tt]);
    }
}

#endif
