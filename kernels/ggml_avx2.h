// AVX2 parts of ggml_quants.c, included by it where AGENTRT_ISA == 1: the decoders of the
// chunked path. They use ggml_quants.c's definitions above the point of inclusion; not a
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

// Legacy types (blocks of 32), one block per 32 bytes of u.
static void decode_legacy_avx2(int qtype, const BlockType *bt, const uint8_t *blocks,
                               int num_blocks, int offset, Chunk *c) {
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
        c->bias[2 * i] = c->bias[2 * i + 1] = m - (float)offset * d;
    }
}

// Q4_K / Q5_K: one block (see decode_q45k_avx512).
static void decode_q45k_avx2(int qtype, const uint8_t *b, Chunk *c) {
    uint32_t s[4];
    memcpy(s, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t mins_hi = ((s[2] >> 4) & m4) | (((s[1] >> 6) & m2) << 4);
    const uint32_t mins_lo = s[1] & m6;
    s[1] = (s[2] & m4) | (((s[0] >> 6) & m2) << 4);
    s[0] &= m6;
    s[2] = mins_lo;
    s[3] = mins_hi; // bytes 0..7: the 8 scales, 8..15: the 8 mins
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
    const uint8_t *qs = b + (qtype == T_Q4_K ? 16 : 48);
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i ul = _mm256_and_si256(q, low4), uh = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if (qtype == T_Q5_K) { // bit 2j of qh[l] for the low nibbles, 2j + 1 for the high
            const __m128i sl = _mm_cvtsi32_si128(2 * j), sh = _mm_cvtsi32_si128(2 * j + 1);
            ul = _mm256_or_si256(ul, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, sl), one), 4));
            uh = _mm256_or_si256(uh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, sh), one), 4));
        }
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
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        for (int k = 0; k < 4; k++) {
            const __m256i ql = k & 1 ? ql1 : ql0;
            const __m256i lo = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), low2);
            _mm256_store_si256((__m256i *)(c->u + 128 * h + 32 * k),
                               _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
    }
}

#endif
