// AVX-512 (VNNI) parts of ggml_quants.c, included by it where AGENTRT_ISA == 2: the
// decoders of the chunked path and the fused kernel of the legacy types. They use
// ggml_quants.c's definitions above the point of inclusion; not a standalone header.

#ifndef AGENTRT_GGML_AVX512_H
#define AGENTRT_GGML_AVX512_H

// One fp16 field by F16C (vcvtph2ps): exact for every finite value; the fused kernels'
// scales are finite (a NaN payload may differ from fp16_to_f32's, which dequantize keeps).
static inline float fp16_fast(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// Each scale repeated twice: 8 per-32 values -> 16 per-16 groups.
static inline __m512 twice(__m256 v) {
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}

// The 8 fp16 values at byte `pos` of `num_blocks` (<= 8) blocks `bytes` apart (0 past them).
static inline __m256 fp16_fields(const uint8_t *blocks, int bytes, int num_blocks, int pos) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm256_set1_epi32(bytes));
    const __mmask8 live = (__mmask8)((1u << num_blocks) - 1);
    const __m256i raw =
        _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), live, idx, blocks + pos, 1);
    return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(raw));
}

// Legacy types (blocks of 32), two blocks per 64 bytes of u.
static void decode_legacy_avx512(int qtype, const BlockType *bt, const uint8_t *blocks,
                                 int num_blocks, Chunk *c) {
    const int bytes = bt->block_bytes, has_min = bt->has_min;
    const __m256 d = fp16_fields(blocks, bytes, num_blocks, 0);
    const __m256 m = has_min ? fp16_fields(blocks, bytes, num_blocks, 2) : _mm256_setzero_ps();
    _mm512_store_ps(c->scale, twice(d));
    _mm512_store_ps(c->bias, twice(_mm256_fnmadd_ps(_mm256_set1_ps((float)bt->offset), d, m)));
    const __m512i low4 = _mm512_set1_epi8(0x0f), pairs = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    for (int j = 0; j < 4; j++) {
        const int left = num_blocks - 2 * j; // blocks in this 64: 2, 1, or none
        __m512i u = _mm512_setzero_si512();
        const uint8_t *a = blocks + 2 * j * bytes, *b = a + bytes;
        if (left <= 0) {
        } else if (qtype == T_Q8_0) {
            const __m256i qa = _mm256_loadu_si256((const __m256i *)(a + 2));
            const __m256i qb =
                left > 1 ? _mm256_loadu_si256((const __m256i *)(b + 2)) : _mm256_set1_epi8(-128);
            u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
                                 _mm512_set1_epi8((char)0x80));
        } else {
            // qs after d (Q4_0), d m (Q4_1), d qh (Q5_0), d m qh (Q5_1)
            const int qs = bytes - 16;
            const __m128i qa = _mm_loadu_si128((const __m128i *)(a + qs));
            const __m128i qb = left > 1 ? _mm_loadu_si128((const __m128i *)(b + qs))
                                        : _mm_setzero_si128();
            // [a, a, b, b] by 16 bytes; the second copy of each shifted to its high nibbles
            __m512i z = _mm512_castsi256_si512(
                _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1));
            z = _mm512_permutexvar_epi64(pairs, z);
            u = _mm512_and_si512(_mm512_mask_srli_epi32(z, 0xf0f0, z, 4), low4);
            if (qtype == T_Q5_0 || qtype == T_Q5_1) {
                uint32_t ha, hb = 0;
                memcpy(&ha, a + qs - 4, 4);
                if (left > 1) memcpy(&hb, b + qs - 4, 4);
                const __mmask64 high = (__mmask64)ha | ((__mmask64)hb << 32);
                u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(16)));
            }
        }
        _mm512_store_si512((__m512i *)(c->u + 64 * j), u);
    }
}

// Q4_K / Q5_K: one block. The 12 bytes of 6-bit (scale, min) pairs -> 8 scales, 8 mins.
static void decode_q45k_avx512(int qtype, const uint8_t *b, Chunk *c) {
    uint32_t s[4];
    k4_scales_mins(b, s); // bytes 0..7: the 8 scales (one per 32), 8..15: the 8 mins
    const __m512 both = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)s)));
    const __m512 d = _mm512_set1_ps(fp16_to_f32(b)), dmin = _mm512_set1_ps(fp16_to_f32(b + 2));
    const __m512 dup_lo = _mm512_permutexvar_ps(
        _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), both);
    const __m512 dup_hi = _mm512_permutexvar_ps(
        _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), both);
    _mm512_store_ps(c->scale, _mm512_mul_ps(d, dup_lo));
    _mm512_store_ps(c->bias, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, dup_hi)));
    const uint8_t *qs = b + (qtype == T_Q4_K ? 16 : 48);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i qh = qtype == T_Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)))
                                       : _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
        __m512i u = _mm512_and_si512(_mm512_mask_srli_epi32(z, 0xff00, z, 4), low4);
        if (qtype == T_Q5_K) { // bit 2j of qh[l] for the low half, 2j + 1 for the high half
            const __m512i shift = _mm512_set_epi64(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                   2 * j, 2 * j, 2 * j, 2 * j);
            const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), _mm512_set1_epi8(1));
            u = _mm512_or_si512(u, _mm512_slli_epi64(bit, 4));
        }
        _mm512_store_si512((__m512i *)(c->u + 64 * j), u);
    }
}

// Q2_K / Q3_K: one block. Two bits of qs[32h + l] (bits 2j, 2j + 1) for element
// 128h + 32j + l; Q3_K adds bit 4h + j of hmask[l] as the third (u = q + 4).
static void decode_q23k_avx512(int qtype, const uint8_t *b, Chunk *c) {
    const int q3 = qtype == T_Q3_K;
    const uint8_t *qs = b + (q3 ? 32 : 16);
    const __m512i low2 = _mm512_set1_epi8(0x03), one = _mm512_set1_epi8(0x01);
    const __m512i hm = q3 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b))
                          : _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) { // elements 64k..: h = k / 2, j = 2 (k % 2) and 2 (k % 2) + 1
        const int h = k / 2, j0 = 2 * (k % 2);
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * h)));
        const __m512i shift = _mm512_set_epi64(2 * j0 + 2, 2 * j0 + 2, 2 * j0 + 2, 2 * j0 + 2,
                                               2 * j0, 2 * j0, 2 * j0, 2 * j0);
        __m512i u = _mm512_and_si512(_mm512_srlv_epi64(q, shift), low2);
        if (q3) {
            const __m512i hshift = _mm512_set_epi64(4 * h + j0 + 1, 4 * h + j0 + 1, 4 * h + j0 + 1,
                                                    4 * h + j0 + 1, 4 * h + j0, 4 * h + j0,
                                                    4 * h + j0, 4 * h + j0);
            const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(hm, hshift), one);
            u = _mm512_or_si512(u, _mm512_slli_epi64(bit, 2));
        }
        _mm512_store_si512((__m512i *)(c->u + 64 * k), u);
    }
    if (q3) { // 16 6-bit scales, less 32; no min
        const uint8_t *sc = b + 96;
        int8_t v[16];
        for (int g = 0; g < 16; g++)
            v[g] = (int8_t)((((sc[g % 8] >> (4 * (g / 8))) & 15) |
                             (((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32);
        const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)v)));
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b + 108)), s);
        _mm512_store_ps(c->scale, scale);
        _mm512_store_ps(c->bias, _mm512_mul_ps(_mm512_set1_ps(-4.0f), scale));
    } else { // scales[16]: the scale in the low nibble, the min in the high one
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4));
        _mm512_store_ps(c->scale, _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b + 80)), lo));
        _mm512_store_ps(c->bias, _mm512_sub_ps(_mm512_setzero_ps(),
                                               _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b + 82)), hi)));
    }
}

// Q6_K: one block. u of elements 128h + 32k + l: ql's nibbles (low for k = 0, 1, high for
// k = 2, 3) | two bits of qh[32h + l] (bits 2k, 2k + 1) << 4.
static void decode_q6k_avx512(const uint8_t *b, Chunk *c) {
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b + 208)), sc);
    _mm512_store_ps(c->scale, scale);
    _mm512_store_ps(c->bias, _mm512_mul_ps(_mm512_set1_ps(-32.0f), scale));
    const __m512i low4 = _mm512_set1_epi8(0x0f), low2 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        for (int odd = 0; odd < 2; odd++) {
            const __m512i lo = _mm512_and_si512(odd ? _mm512_srli_epi16(ql, 4) : ql, low4);
            const __m512i shift = _mm512_set_epi64(4 * odd + 2, 4 * odd + 2, 4 * odd + 2, 4 * odd + 2,
                                                   4 * odd, 4 * odd, 4 * odd, 4 * odd);
            const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), low2);
            _mm512_store_si512((__m512i *)(c->u + 128 * h + 64 * odd),
                               _mm512_or_si512(lo, _mm512_slli_epi64(hi, 4)));
        }
    }
}

// ---- The legacy types on AVX-512, fused -----------------------------------------------------
//
// Blocks of 32 carry one fp16 scale each: decoding them into a chunk's per-group arrays
// would assemble vectors of scales from scattered fp16 fields (gathers: slow, on AMD
// especially). Here each pair of blocks is decoded into one register of 64 u, and its two
// scales multiply the two activation scales of each row directly. Rows of the step go TT at
// a time, their sums in registers; each pair is decoded once per TT rows (from L1).

#define TT_MAX 8 // activation rows a pass: their sums stay in registers

// Blocks a and (when `two`) b = a + bytes -> 64 u (b's 32 zero without it).
static inline __m512i legacy_pair(int qtype, const uint8_t *a, int bytes, int two) {
    const uint8_t *b = a + bytes;
    if (qtype == T_Q8_0) {
        const __m256i qa = _mm256_loadu_si256((const __m256i *)(a + 2));
        const __m256i qb =
            two ? _mm256_loadu_si256((const __m256i *)(b + 2)) : _mm256_set1_epi8(-128);
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
                                _mm512_set1_epi8((char)0x80));
    }
    const int qs = bytes - 16; // after d (Q4_0), d m (Q4_1), d qh (Q5_0), d m qh (Q5_1)
    const __m128i qa = _mm_loadu_si128((const __m128i *)(a + qs));
    const __m128i qb = two ? _mm_loadu_si128((const __m128i *)(b + qs)) : _mm_setzero_si128();
    // [a, a, b, b] by 16 bytes, the second copy of each shifted to its high nibbles
    __m512i z =
        _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1));
    z = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), z);
    __m512i u = _mm512_and_si512(_mm512_mask_srli_epi32(z, 0xf0f0, z, 4), _mm512_set1_epi8(0x0f));
    if (qtype == T_Q5_0 || qtype == T_Q5_1) { // bit j of the block's qh: element j's fifth bit
        uint32_t ha, hb = 0;
        memcpy(&ha, a + qs - 4, 4);
        if (two) memcpy(&hb, b + qs - 4, 4);
        const __mmask64 high = (__mmask64)ha | ((__mmask64)hb << 32);
        u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(16)));
    }
    return u;
}

// out[t][n] for rows t0 .. t0 + TT of one weight row (TT a constant once inlined).
static inline __attribute__((always_inline)) void legacy_rows(
    int qtype, const BlockType *bt, const uint8_t *row, int64_t num_blocks, uint8_t *act,
    int64_t kp, int64_t t0, const int TT, float *sums) {
    const int bytes = bt->block_bytes;
    const __m128 offset = _mm_set1_ps((float)bt->offset);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    // Row tt's q, dlane and s32 at fixed offsets from its base (see act_row).
    const int64_t stride = act_row_bytes(kp), dlane_at = kp + (kp / 8 + kp / 16) * 4;
    const int64_t s32_at = kp + (kp / 8 + kp / 32) * 4;
    const uint8_t *base = act + t0 * stride;
    __m512 acc[TT_MAX];
    __m128 bias_acc[TT_MAX];
    for (int tt = 0; tt < TT; tt++) {
        acc[tt] = _mm512_setzero_ps();
        bias_acc[tt] = _mm_setzero_ps();
    }
    for (int64_t i = 0; i < num_blocks; i += 2) {
        const uint8_t *a = row + i * bytes;
        const int two = i + 1 < num_blocks;
        const __m512i u = legacy_pair(qtype, a, bytes, two);
        // The first 4 bytes of each block (d, and m for Q4_1 / Q5_1) as fp16 -> [da ma db mb]
        uint32_t ha, hb = 0;
        memcpy(&ha, a, 4);
        if (two) memcpy(&hb, a + bytes, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi64_si128((int64_t)(((uint64_t)hb << 32) | ha)));
        const __m128 d = _mm_shuffle_ps(dm, dm, _MM_SHUFFLE(3, 3, 2, 0)); // [da db . .]
        const __m128 m = bt->has_min ? _mm_shuffle_ps(dm, dm, _MM_SHUFFLE(3, 3, 3, 1))
                                     : _mm_setzero_ps();
        const __m128 bias = _mm_fnmadd_ps(offset, d, m);
        const __m512 wd = _mm512_permutexvar_ps(halves, _mm512_zextps128_ps512(d));
        const uint8_t *at = base + 32 * i;
        for (int tt = 0; tt < TT; tt++, at += stride) {
            const __m512i p =
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(at));
            const __m512 s = _mm512_mul_ps(wd, _mm512_load_ps((const float *)(at + dlane_at)));
            acc[tt] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[tt]);
            const __m128 as = _mm_castpd_ps(_mm_load_sd((const double *)(at + s32_at - 28 * i)));
            bias_acc[tt] = _mm_fmadd_ps(bias, as, bias_acc[tt]);
        }
    }
    for (int tt = 0; tt < TT; tt++) {
        const __m128 b = bias_acc[tt];
        sums[tt] = _mm512_reduce_add_ps(acc[tt]) + _mm_cvtss_f32(_mm_add_ps(b, _mm_movehdup_ps(b)));
    }
}

static void legacy_row(int qtype, const BlockType *bt, const uint8_t *row, int64_t num_blocks,
                       uint8_t *act, int64_t kp, int64_t rows, float *sums) {
#define PASS(t, n) legacy_rows(qtype, bt, row, num_blocks, act, kp, t, n, sums + (t))
    IN_PASSES(TT_MAX, rows, PASS);
#undef PASS
}


// ---- The legacy types interleaved by 16 rows -------------------------------------------------
//
// ggml_linear.py's `interleave` lays 16 weight rows out block by block (its docstring has the
// layout): the 16 rows' d (fp16), their m (Q4_1, Q5_1), Q5_0's and Q5_1's fifth bits as 8
// masks of 64 bits, then the block's quants by 4-element column, each column one 64-byte
// register whose lane r is row r's 4 values (Q4_0 / Q4_1 / Q5_0 / Q5_1: a byte holds column
// c's element in its low nibble and column c + 4's in its high one; Q8_0: u = q + 128). Mask
// c's bit 4r + i is the fifth bit of row r's element 4c + i: one masked byte add puts it in
// (no decoding of qh). One vpdpbusd per column against the activation's 4 bytes of that
// column, broadcast, sums each row's products in its own lane: the 16 rows' scales are one
// vector, no sum across lanes is left at the end, and the decoded block serves X16_TT
// activation rows.

#define X16_TT 4 // activation rows a pass over a group's blocks

// The interleaved kernels spend long on each block when they take several activation rows:
// the hardware prefetcher alone left weights streamed from memory at 0.6-0.9x the rate of
// their file layout. A pass of several rows prefetches, from each block in use, the lines
// PREFETCH_AHEAD bytes further on (4, 8 and 12 KiB measured alike, within the noise of a
// loaded machine). A pass of one row (a decode) does not: there the hardware prefetcher keeps
// up, and the prefetches cost (AMD EPYC, 1 thread, CPU time, streamed, load ~18: one row
// without them Q6_K 128256x2048 x1.39, Q4_K 16384x2048 x1.20, Q8_0 151936x896 x1.19, Q5_0
// 9728x896 x1.11; four rows with them Q4_K x1.14-1.16).
#define PREFETCH_AHEAD 8192

// always_inline: a call would be dropped, GCC taking a function of prefetches alone for one
// without side effects.
static inline __attribute__((always_inline)) void prefetch_lines(const uint8_t *from, int lines) {
    for (int c = 0; c < lines; c++) _mm_prefetch((const char *)(from + 64 * c), _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void x16_rows(int qtype, const uint8_t *group,
                                                           int64_t num_blocks, const uint8_t *act,
                                                           int64_t kp, const int TT, float *sums) {
    const int q8 = qtype == T_Q8_0, has_min = qtype == T_Q4_1 || qtype == T_Q5_1;
    const int q5 = qtype == T_Q5_0 || qtype == T_Q5_1;
    const int64_t block = 16 * (q8 ? 34 : 18 + 2 * has_min + 4 * q5);
    const __m512 offset = _mm512_set1_ps(q8 ? -128.0f : q5 ? -16.0f : -8.0f);
    // Row tt's q, d32 and s32 at fixed offsets from its base (see act_row).
    const int64_t stride = act_row_bytes(kp), d32_at = kp + kp / 2;
    const int64_t s32_at = kp + 4 * (kp / 8 + kp / 32);
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    __m512 acc[X16_TT];
    for (int tt = 0; tt < TT; tt++) acc[tt] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *p = group + b * block;
        if (TT > 1) // see PREFETCH_AHEAD
            prefetch_lines(p + PREFETCH_AHEAD, (int)((block + 63) / 64));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 bias = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)))
                                    : _mm512_mul_ps(d, offset);
        const uint8_t *masks = p + (has_min ? 64 : 32), *qs = masks + (q5 ? 64 : 0);
        __m512i u[8];
        if (q8) {
            for (int c = 0; c < 8; c++) u[c] = _mm512_loadu_si512(qs + 64 * c);
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * c);
                u[c] = _mm512_and_si512(v, low);
                u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (q5)
                for (int c = 0; c < 8; c++) {
                    uint64_t m;
                    memcpy(&m, masks + 8 * c, 8);
                    u[c] = _mm512_mask_add_epi8(u[c], _cvtu64_mask64(m), u[c], sixteen);
                }
        }
        for (int tt = 0; tt < TT; tt++) {
            const uint8_t *a = act + tt * stride;
            const int32_t *q = (const int32_t *)(a + 32 * b);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                s0 = _mm512_dpbusd_epi32(s0, u[c], _mm512_set1_epi32(q[c]));
                s1 = _mm512_dpbusd_epi32(s1, u[c + 1], _mm512_set1_epi32(q[c + 1]));
            }
            const float da = ((const float *)(a + d32_at))[b], sa = ((const float *)(a + s32_at))[b];
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[tt] = _mm512_fmadd_ps(d, _mm512_mul_ps(dot, _mm512_set1_ps(da)), acc[tt]);
            acc[tt] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sa), acc[tt]);
        }
    }
    for (int tt = 0; tt < TT; tt++) _mm512_storeu_ps(sums + 16 * tt, acc[tt]);
}

// ---- Q4_K interleaved by 16 rows -------------------------------------------------------------
//
// A block of 16 rows (X16K_BLOCK bytes, `ggml_interleave`): d[16], dmin[16] (fp16); the 6-bit
// scales unpacked, [8 sub-blocks][16 rows] bytes; the mins by pairs of sub-blocks, [4][16
// rows][2] bytes (one int16 pair a lane once widened, for vpdpwssd against the activation's
// pair of sub-block sums); the quants by 4-byte column, [32][16 rows][4]. Columns 8j .. 8j + 7
// hold sub-block 2j in their low nibbles and 2j + 1 in their high ones (Q4_K's own order).
// Activations in blocks of 256 (act8k): y = d da sum_s sc_s P_s - dmin da sum_s m_s S_s, with
// P_s the integer dot of sub-block s and S_s the sum of its activations.

static inline __attribute__((always_inline)) void x16k_rows(const uint8_t *group,
                                                            int64_t num_blocks, const uint8_t *act,
                                                            int64_t k, const int TT, float *sums) {
    const int64_t stride = act8k_bytes(k), bsum_at = (k + k / 256 * 4 + 63) / 64 * 64;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[X16_TT];
    for (int tt = 0; tt < TT; tt++) acc[tt] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *p = group + b * X16K_BLOCK;
        __m512i isum[X16_TT];
        for (int tt = 0; tt < TT; tt++) isum[tt] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) { // sub-blocks 2j (low nibbles) and 2j + 1 (high)
            const uint8_t *qs = p + 320 + 512 * j;
            if (TT > 1) // see PREFETCH_AHEAD
                prefetch_lines(p + PREFETCH_AHEAD + 640 * j, 10);
            __m512i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * c);
                lo[c] = _mm512_and_si512(v, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 + 32 * j)));
            const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 80 + 32 * j)));
            for (int tt = 0; tt < TT; tt++) {
                const int32_t *q = (const int32_t *)(act + tt * stride + 256 * b + 64 * j);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) {
                    s0 = _mm512_dpbusd_epi32(s0, lo[c], _mm512_set1_epi32(q[c]));
                    s1 = _mm512_dpbusd_epi32(s1, hi[c], _mm512_set1_epi32(q[8 + c]));
                }
                isum[tt] = _mm512_add_epi32(isum[tt], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0),
                                                                       _mm512_mullo_epi32(s1, sc1)));
            }
        }
        __m512i m[4];
        for (int h = 0; h < 4; h++)
            m[h] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 192 + 32 * h)));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        for (int tt = 0; tt < TT; tt++) {
            const uint8_t *a = act + tt * stride;
            // the 8 sub-block sums as int16 pairs: lane 0 (S0 S1)(S2 S3), lane 1 (S4 S5)(S6 S7)
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(a + bsum_at + 32 * b));
            const __m256i s = _mm256_madd_epi16(bs, _mm256_set1_epi16(1));
            const __m256i pairs = _mm256_packs_epi32(s, s);
            __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), m[0],
                                               _mm512_set1_epi32(_mm256_extract_epi32(pairs, 0)));
            msum = _mm512_dpwssd_epi32(msum, m[1], _mm512_set1_epi32(_mm256_extract_epi32(pairs, 1)));
            msum = _mm512_dpwssd_epi32(msum, m[2], _mm512_set1_epi32(_mm256_extract_epi32(pairs, 4)));
            msum = _mm512_dpwssd_epi32(msum, m[3], _mm512_set1_epi32(_mm256_extract_epi32(pairs, 5)));
            const __m512 da = _mm512_set1_ps(((const float *)(a + k))[b]);
            acc[tt] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[tt]), da), acc[tt]);
            acc[tt] = _mm512_fnmadd_ps(dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(msum), da), acc[tt]);
        }
    }
    for (int tt = 0; tt < TT; tt++) _mm512_storeu_ps(sums + 16 * tt, acc[tt]);
}


// ---- Q6_K interleaved by 16 rows -------------------------------------------------------------
//
// A block of 16 rows (X16Q6_BLOCK = 16 x 210 bytes, `ggml_interleave`), in the order the
// kernel reads it: d[16] (fp16); the int8 scales, [16 sub-blocks][16 rows]; then four steps
// s = 2n + h, each [column][16 rows][4] for ql[64n + 16h + 4i ..] (i < 4), the same for
// qh[32n + 16h + 4i ..], and for ql[64n + 32 + 16h + 4i ..]: 12 columns of 64 bytes, in the
// order the kernel first touches them. (The qh columns last, read before the second ql set,
// streamed from memory ~35% slower on AMD Zen 4: a hop back defeats its prefetcher.) With
// l = 16h + 4i + j, Q6_K's elements 128n + 32k + l (k < 4) take the low nibble of the first
// (k = 0) or second (k = 1) column, or their high nibble (k = 2, 3), and bits 2k, 2k + 1 of
// the qh column, as u = q + 32: a step decodes the 4 columns of each of sub-blocks
// 8n + 2k + h. y = d da sum_s sc_s (P_s - 32 S_s), P_s the integer dot of sub-block s, S_s
// the sum of its activations (act8k's sums): each sub-block's dot starts from -32 S_s (one
// vpdpwssd against the pair of sums it is in), then one vpmulld by its scale.

#define X16Q6_TT 8 // activation rows a pass over a group's blocks

// Bits 2k, 2k + 1 of each byte of qh at bits 4-5, the others 0: one affine bit map (GFNI)
// where the CPU has it.
static inline __m512i q6_high(__m512i qh, const int k) {
#ifdef __GFNI__
    const uint64_t a = ((uint64_t)(1u << (2 * k)) << 24) | ((uint64_t)(1u << (2 * k + 1)) << 16);
    return _mm512_gf2p8affine_epi64_epi8(qh, _mm512_set1_epi64((long long)a), 0);
#else
    const __m512i at45 = k == 0   ? _mm512_slli_epi16(qh, 4)
                         : k == 1 ? _mm512_slli_epi16(qh, 2)
                         : k == 2 ? qh
                                  : _mm512_srli_epi16(qh, 2);
    return _mm512_and_si512(at45, _mm512_set1_epi8(0x30));
#endif
}

static inline __attribute__((always_inline)) void x16q6k_rows(const uint8_t *group,
                                                              int64_t num_blocks,
                                                              const uint8_t *act, int64_t k,
                                                              const int TT, float *sums) {
    const int64_t stride = act8k_bytes(k), bsum_at = (k + k / 256 * 4 + 63) / 64 * 64;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    // (-32, 0) or (0, -32) per int16 pair: -32 times the even or the odd sum of a pair
    const __m512i off[2] = {_mm512_set1_epi32(0xffe0), _mm512_set1_epi32((int)0xffe00000u)};
    __m512 acc[X16Q6_TT];
    for (int tt = 0; tt < TT; tt++) acc[tt] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *p = group + b * X16Q6_BLOCK;
        __m512i isum[X16Q6_TT];
        for (int tt = 0; tt < TT; tt++) isum[tt] = _mm512_setzero_si512();
        for (int s = 0; s < 4; s++) {
            const int n = s / 2, h = s % 2;
            const uint8_t *q = p + 288 + 768 * s;
            if (TT > 1) // see PREFETCH_AHEAD
                prefetch_lines(p + PREFETCH_AHEAD + 896 * s, 14);
            for (int kk = 0; kk < 4; kk++) { // sub-block 8n + 2kk + h
                const int g = 8 * n + 2 * kk + h;
                const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * g)));
                __m512i u[4];
                for (int i = 0; i < 4; i++) {
                    const __m512i lo = _mm512_loadu_si512(q + 512 * (kk & 1) + 64 * i);
                    const __m512i high = q6_high(_mm512_loadu_si512(q + 256 + 64 * i), kk);
                    // (nibble & 0x0f) | high
                    u[i] = _mm512_ternarylogic_epi32(kk < 2 ? lo : _mm512_srli_epi16(lo, 4), m4,
                                                     high, 0xEA);
                }
                for (int tt = 0; tt < TT; tt++) {
                    const uint8_t *a = act + tt * stride;
                    const int32_t *qa = (const int32_t *)(a + 256 * b + 16 * g);
                    const int32_t *pair = (const int32_t *)(a + bsum_at) + 8 * b + g / 2;
                    __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), off[h],
                                                      _mm512_set1_epi32(*pair));
                    for (int i = 0; i < 4; i++)
                        dot = _mm512_dpbusd_epi32(dot, u[i], _mm512_set1_epi32(qa[i]));
                    isum[tt] = _mm512_add_epi32(isum[tt], _mm512_mullo_epi32(dot, sc));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        for (int tt = 0; tt < TT; tt++) {
            const __m512 da = _mm512_set1_ps(((const float *)(act + tt * stride + k))[b]);
            acc[tt] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[tt]), da), acc[tt]);
        }
    }
    for (int tt = 0; tt < TT; tt++) _mm512_storeu_ps(sums + 16 * tt, acc[tt]);
}

// Q4_K or Q6_K interleaved: the 16 rows of `group` for `rows` activation rows (act8k) -> sums
// (rows x 16), in passes of each kernel's rows.
static void x16kq_group(int qtype, const uint8_t *group, int64_t num_blocks, const uint8_t *act,
                        int64_t k, int64_t rows, float *sums) {
    const int64_t stride = act8k_bytes(k);
    if (qtype == T_Q4_K) {
#define PASS(t, n) x16k_rows(group, num_blocks, act + (t) * stride, k, n, sums + 16 * (t))
        IN_PASSES(X16_TT, rows, PASS);
#undef PASS
        return;
    }
#define PASS(t, n) x16q6k_rows(group, num_blocks, act + (t) * stride, k, n, sums + 16 * (t))
    IN_PASSES(X16Q6_TT, rows, PASS);
#undef PASS
}

// ---- Q4_K, Q5_K and Q6_K with activations in blocks of 256 (ggml's Q8_K) ------------------
//
// One activation scale per 256 lets a K-quant block's integer sums be scaled in integers:
// pmaddubsw (u times a, pairs into int16: at most 2 * 63 * 127) then pmaddwd by the group's
// integer scale (6-bit, or Q6_K's int8) into int32, one fp32 multiply-add per block for the
// scales and one for the mins (sum_g min_g * the group's activation sum, in pmaddwd too).
// Activation rows (act8k_row): q int8 (kp), d (kp / 256 floats), and per 16 elements the sum
// of q (int16), each part 64-byte aligned.

static void quantize_row_q8k(const void *x, int bf16, int64_t k, uint8_t *out) {
    int8_t *q = (int8_t *)out;
    float *d = (float *)(out + k);
    int16_t *bsum = (int16_t *)(out + (k + k / 256 * 4 + 63) / 64 * 64);
    for (int64_t b = 0; b < k / 256; b++) {
        __m512 v[16];
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) {
            const int64_t at = b * 256 + 16 * i;
            v[i] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at))), 16))
                        : _mm512_loadu_ps((const float *)x + at);
            m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
        }
        const float amax = _mm512_reduce_max_ps(m);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int i = 0; i < 16; i++) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(q + b * 256 + 16 * i), _mm512_cvtepi32_epi8(qi));
            bsum[b * 16 + i] = (int16_t)_mm512_reduce_add_epi32(qi);
        }
    }
}

typedef struct {
    __m512i u[4], scale[4]; // u of 64 elements each; int16 scales of their pmaddubsw lanes
    __m256i mins;           // int16 per group of 16: what multiplies its activation sum
    float d, dmin;          // y = d * da * sum(scale u a) - dmin * da * sum(mins bsum)
} KBlock;

static inline void kblock_q45k(int qtype, const uint8_t *b, KBlock *kb) {
    uint32_t s[4];
    k4_scales_mins(b, s); // bytes 0..7: the 8 scales (one per 32), 8..15: the 8 mins
    const __m512i both = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)s)));
    for (int k = 0; k < 4; k++) // lanes 0..15: sub-block 2k, 16..31: 2k + 1
        kb->scale[k] = _mm512_permutexvar_epi16(
            _mm512_set_epi16(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                             2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                             2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k, 2 * k, 2 * k,
                             2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k,
                             2 * k, 2 * k, 2 * k, 2 * k),
            both);
    kb->mins = _mm512_castsi512_si256(_mm512_permutexvar_epi16(
        _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 14, 14, 13, 13,
                         12, 12, 11, 11, 10, 10, 9, 9, 8, 8),
        both));
    kb->d = fp16_fast(b);
    kb->dmin = fp16_fast(b + 2);
    const uint8_t *qs = b + (qtype == T_Q4_K ? 16 : 48);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i qh = qtype == T_Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)))
                                       : _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
        __m512i u = _mm512_and_si512(_mm512_mask_srli_epi32(z, 0xff00, z, 4), low4);
        if (qtype == T_Q5_K) {
            const __m512i shift = _mm512_set_epi64(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                   2 * j, 2 * j, 2 * j, 2 * j);
            const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), _mm512_set1_epi8(1));
            u = _mm512_or_si512(u, _mm512_slli_epi64(bit, 4));
        }
        kb->u[j] = u;
    }
}

static inline void kblock_q6k(const uint8_t *b, KBlock *kb) {
    const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
    // One permute puts groups m, 4 + m, 8 + m, 12 + m in 128-bit lane m; then one in-lane
    // shuffle per k repeats group 4k + m over lane m (the lanes of u[k]'s group 4k + m).
    const __m512i by_lane = _mm512_permutexvar_epi16(
        _mm512_set_epi16(0, 0, 0, 0, 15, 11, 7, 3, 0, 0, 0, 0, 14, 10, 6, 2, 0, 0, 0, 0, 13, 9, 5,
                         1, 0, 0, 0, 0, 12, 8, 4, 0),
        sc);
    for (int k = 0; k < 4; k++)
        kb->scale[k] = _mm512_shuffle_epi8(by_lane, _mm512_set1_epi16((short)((2 * k + 1) << 8 | 2 * k)));
    kb->mins = _mm256_slli_epi16(_mm512_castsi512_si256(sc), 5); // OFFSET 32 times the scale
    kb->d = kb->dmin = fp16_fast(b + 208);
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        for (int odd = 0; odd < 2; odd++) {
            // Each byte's 2 bits of qh (bits 4 odd, then 4 odd + 2 in the upper half) rotated
            // to bits 4-5 within its qword: no other byte's bits land there.
            const __m512i turn = _mm512_set_epi64(60 * odd + 2, 60 * odd + 2, 60 * odd + 2,
                                                  60 * odd + 2, 4 - 4 * odd, 4 - 4 * odd,
                                                  4 - 4 * odd, 4 - 4 * odd);
            const __m512i hi = _mm512_and_si512(_mm512_rolv_epi64(qh, turn), bits45);
            // (lo & 0x0f) | hi in one ternary op: hi has bits 4-5 only
            kb->u[2 * h + odd] = _mm512_ternarylogic_epi32(odd ? _mm512_srli_epi16(ql, 4) : ql, low4, hi, 0xEA);
        }
    }
}

static inline __attribute__((always_inline)) void kquant_rows(
    int qtype, const uint8_t *row, int64_t num_blocks, int bytes, const uint8_t *act,
    int64_t k, int64_t t0, const int TT, float *sums) {
    const int64_t stride = act8k_bytes(k), d_at = k, bsum_at = (k + k / 256 * 4 + 63) / 64 * 64;
    __m512 acc[TT_MAX];
    __m256 macc[TT_MAX];
    for (int tt = 0; tt < TT; tt++) {
        acc[tt] = _mm512_setzero_ps();
        macc[tt] = _mm256_setzero_ps();
    }
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
            // pairs of u a (int16), times their scale, summed (VNNI); two chains of two
            __m512i isum = _mm512_setzero_si512(), isum1 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j += 2) {
                isum = _mm512_dpwssd_epi32(
                    isum, _mm512_maddubs_epi16(kb.u[j], _mm512_loadu_si512(q + 64 * j)), kb.scale[j]);
                isum1 = _mm512_dpwssd_epi32(isum1,
                                            _mm512_maddubs_epi16(kb.u[j + 1], _mm512_loadu_si512(q + 64 * j + 64)),
                                            kb.scale[j + 1]);
            }
            isum = _mm512_add_epi32(isum, isum1);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)((const int16_t *)(a + bsum_at) + 16 * i));
            const __m256i msum = _mm256_madd_epi16(bs, kb.mins);
            if (qtype == T_Q6_K) { // d = dmin: the offset's sum comes off in integers
                isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(msum));
            } else {
                macc[tt] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(kb.dmin * da), macc[tt]);
            }
            acc[tt] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(kb.d * da), acc[tt]);
        }
    }
    for (int tt = 0; tt < TT; tt++) {
        const __m256 m = macc[tt];
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        sums[tt] = _mm512_reduce_add_ps(acc[tt]) - _mm_cvtss_f32(h);
    }
}

// Each type its own inlined body (the type a constant in it).
static void kquant_row(int qtype, const uint8_t *row, int64_t num_blocks, int bytes,
                       const uint8_t *act, int64_t k, int64_t rows, float *sums) {
#define PASS(t, n) kquant_rows(QT, row, num_blocks, bytes, act, k, t, n, sums + (t))
    switch (qtype) {
#define QT T_Q6_K
    case QT: IN_PASSES(TT_MAX, rows, PASS); break;
#undef QT
#define QT T_Q4_K
    case QT: IN_PASSES(TT_MAX, rows, PASS); break;
#undef QT
#define QT T_Q5_K
    case QT: IN_PASSES(TT_MAX, rows, PASS); break;
#undef QT
    }
#undef PASS
}

#endif
