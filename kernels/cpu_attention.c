// Paged varlen attention for the CPU (built on first use by cpu_attention.py).
//
// Every request of a step (a decode, a jump-forward chunk, a prefill chunk) attends causally to
// its context, read in place from the block-paged KV cache: cache (num_blocks, 2, block_size,
// num_kv_heads, head_dim), index 0 = K, 1 = V. A request's query tokens are split into tiles of
// up to MAX_ROWS / group tokens; work items are (tile, KV head) pairs, spread over OpenMP
// threads (the libgomp torch has loaded, so torch's thread settings apply). An item holds the
// tile's query rows (tokens x the query heads sharing the KV head) in fp32, walks the keys up
// to its last token in groups of 16, converts each group's K and V rows to fp32 once for all
// its rows, and keeps an online softmax per row: a running max, a running sum and an fp32
// accumulator, rescaled when the max grows. Outputs are written in the cache dtype.
//
// Vectors are GCC/Clang vector extensions of 16 floats, so one source serves AVX-512, AVX2
// and narrower targets. The 16 dot products of a row with a key group are summed across lanes
// by a shuffle tree (hsum16) rather than 16 separate horizontal reductions. Where the compiler
// targets AVX512-BF16, bf16 caches take attend_tile_bf16 instead, which multiplies bf16 pairs
// directly (vdpbf16ps) at twice the rate and without converting K and V.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16 // query heads per KV head
#define MAX_ROWS 48  // query rows (tokens x group) per work item
#define KEYS 16      // keys per group: one vector of scores

enum { F32 = 0, BF16 = 1 };

typedef uint16_t vh __attribute__((vector_size(32)));

// 16 values at p (fp32 or bf16) as fp32.
static inline vf load16(const void *p, int dtype) {
    if (dtype == BF16) {
        vh h;
        memcpy(&h, p, sizeof h);
        return (vf)(__builtin_convertvector(h, vu) << 16);
    }
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

// Lane t of the result = the sum of x[t]'s 16 lanes. Each level adds pairs of vectors after
// interleaving their halves, which leaves the sums in bit-reversed lane order; the last
// shuffle restores it.
static inline vf hsum16(const vf *x) {
    vf y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                       10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                       14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                       26, 27, 14, 15, 30, 31);
    const vf r = __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26,
                                         12, 28, 14, 30) +
                 __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27,
                                         13, 29, 15, 31);
    return __builtin_shufflevector(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

static inline vf vmax(vf a, vf b) {
    const vi a_bigger = a > b;
    return (vf)(((vi)a & a_bigger) | ((vi)b & ~a_bigger));
}

// The butterfly partner of each lane at distance `step` (8, 4, 2, 1).
#define SWAP8(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define SWAP4(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define SWAP2(x) __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define SWAP1(x) __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)

// The max (hmax) or sum (hadd) of x's 16 lanes, by a butterfly of 4 steps.
static inline float hmax(vf x) {
    x = vmax(x, SWAP8(x));
    x = vmax(x, SWAP4(x));
    x = vmax(x, SWAP2(x));
    return vmax(x, SWAP1(x))[0];
}

static inline float hadd(vf x) {
    x += SWAP8(x);
    x += SWAP4(x);
    x += SWAP2(x);
    return (x + SWAP1(x))[0];
}

// fp32 to bf16, rounding to nearest even (NaN stays NaN).
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

typedef struct {
    const char *query, *cache;
    char *out;
    const int32_t *table;
    int dtype;
    int64_t heads, kv_heads, block;
    float scale;
    int64_t window; // a row at position p sees keys (p - window, p]; 0: every earlier key
    float softcap;  // scores become softcap * tanh(scores / softcap); 0: none
} Step;

// The key group at `pos`: up to KEYS keys before `end`, within one block (*n of them).
// Returns the address of its first K row for `kv_head`; the V rows are one block further.
static inline const char *key_group(const Step *s, int64_t pos, int64_t end, int64_t kv_head,
                                    int64_t dim, int64_t *n) {
    const int64_t esize = s->dtype == BF16 ? 2 : 4, in_block = s->block - pos % s->block;
    *n = end - pos < KEYS ? end - pos : KEYS;
    *n = *n < in_block ? *n : in_block;
    const int64_t row0 = (int64_t)s->table[pos / s->block] * 2 * s->block + pos % s->block;
    return s->cache + (row0 * s->kv_heads * dim + kv_head * dim) * esize;
}

// Ask for the K and V rows of the key group at `pos` while the current group is computed:
// the blocks of a request lie anywhere in the cache, so the hardware prefetchers cannot guess
// the next one.
static inline void prefetch_group(const Step *s, int64_t pos, int64_t end, int64_t kv_head,
                                  int64_t dim) {
    if (pos >= end) return;
    int64_t n;
    const char *kp = key_group(s, pos, end, kv_head, dim, &n);
    const int64_t esize = s->dtype == BF16 ? 2 : 4, row_bytes = s->kv_heads * dim * esize;
    const char *vp = kp + s->block * row_bytes;
    for (int64_t t = 0; t < n; t++)
        for (int64_t b = 0; b < dim * esize; b += 64) {
            __builtin_prefetch(kp + t * row_bytes + b);
            __builtin_prefetch(vp + t * row_bytes + b);
        }
}

static inline vf ld(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }

// The query/out head of a work item's row r: token first + r / group, head
// kv_head * group + r % group.
static inline int64_t row_head(const Step *s, int64_t first, int64_t r, int64_t kv_head) {
    const int64_t group = s->heads / s->kv_heads;
    return (first + r / group) * s->heads + kv_head * group + r % group;
}

// The first key position that rows from `pos0` on may see: 0, or the window's start.
static inline int64_t first_key(const Step *s, int64_t pos0) {
    return s->window && pos0 >= s->window ? pos0 - s->window + 1 : 0;
}

// Row r's visible lanes [*from, return) of the key group at `pos` (n keys): up to its own
// position, and within its window. Returns 0 or less when it sees none of them.
static inline int64_t visible_lanes(const Step *s, int64_t row_pos, int64_t pos, int64_t n,
                                    int64_t *from) {
    const int64_t visible = row_pos - pos + 1;
    *from = s->window ? row_pos - s->window + 1 - pos : 0;
    *from = *from > 0 ? *from : 0;
    if (*from >= n) return 0;
    return visible < n ? visible : n;
}

// tanh soft-capping (Gemma 2): cap * tanh(x / cap), with tanh|y| = (1 - e) / (1 + e),
// e = exp(-2|y|), and the sign put back.
static inline vf soft_cap(vf x, float cap) {
    const vu sign = (vu)x & 0x80000000u, mag = (vu)x & 0x7fffffffu;
    const vf e = exp_neg((vf)mag * (-2.0f / cap));
    return (vf)((vu)((1.0f - e) / (1.0f + e) * cap) | sign);
}

// Online softmax over one key group for one row: the scores in lanes [from, visible) count,
// the rest are masked. Updates the row's running max and sum, returns the group's weights and sets
// *rescale to the factor the row's accumulator must be scaled by first (1 when the max did
// not grow).
static inline vf online_softmax(vf scores, int64_t from, int64_t visible, float *max,
                                float *sum, float *rescale) {
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vi seen = (lane < (vi){0} + (int32_t)visible) & (lane >= (vi){0} + (int32_t)from);
    scores = (vf)(((vi)scores & seen) | ((vi)splat(-1e30f) & ~seen));
    const float block_max = hmax(scores);
    const float new_max = block_max > *max ? block_max : *max;
    const vf p = (vf)((vi)exp_neg(scores - new_max) & seen);
    *rescale = new_max > *max ? exp_neg1(*max - new_max) : 1.0f;
    *max = new_max;
    *sum = *sum * *rescale + hadd(p);
    return p;
}

// One work item: query tokens [first, first + tokens) (flat rows) of a request at positions
// [pos0, pos0 + tokens), for the `group` query heads of KV head `kv_head`. Row r = token
// (r / group), head (r % group) attends positions [0, its own position] (within its window, if
// any: keys wholly before the tile's windows are never read). nv = head_dim / 16.
static inline __attribute__((always_inline)) void
attend_tile(const Step *s, int64_t first, int64_t tokens, int64_t pos0, int64_t kv_head,
            const int nv) {
    const int64_t group = s->heads / s->kv_heads, rows = tokens * group, dim = nv * KEYS;
    const int64_t esize = s->dtype == BF16 ? 2 : 4, token_stride = s->kv_heads * dim;
    // fp32 buffers: the rows' scaled queries and accumulators, one key group's K and V.
    float q[MAX_ROWS * MAX_HEAD_DIM], acc[MAX_ROWS * MAX_HEAD_DIM];
    float k[KEYS * MAX_HEAD_DIM], v[KEYS * MAX_HEAD_DIM];
    float max[MAX_ROWS], sum[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = row_head(s, first, r, kv_head);
        for (int c = 0; c < nv; c++) {
            const vf qc = load16(s->query + (head * dim + c * KEYS) * esize, s->dtype);
            st(q + r * dim + c * KEYS, qc * s->scale);
            st(acc + r * dim + c * KEYS, splat(0.0f));
        }
        max[r] = -1e30f; // finite, so the first rescale is exp(-huge) = 0, never inf - inf
        sum[r] = 0.0f;
    }
    const int64_t end = pos0 + tokens; // keys [0, end) are visible to some row
    for (int64_t pos = first_key(s, pos0), n; pos < end; pos += n) {
        const char *kp = key_group(s, pos, end, kv_head, dim, &n);
        const char *vp = kp + s->block * token_stride * esize;
        prefetch_group(s, pos + n, end, kv_head, dim);
        for (int64_t t = 0; t < KEYS; t++)
            for (int c = 0; c < nv; c++) {
                const int64_t at = (t * token_stride + c * KEYS) * esize;
                st(k + t * dim + c * KEYS, t < n ? load16(kp + at, s->dtype) : splat(0.0f));
                st(v + t * dim + c * KEYS, t < n ? load16(vp + at, s->dtype) : splat(0.0f));
            }
        for (int64_t r = 0; r < rows; r++) {
            // Row r sees keys up to its own position, within its window: lanes [from, visible).
            int64_t from;
            const int64_t visible = visible_lanes(s, pos0 + r / group, pos, n, &from);
            if (visible <= 0) continue;
            const float *qr = q + r * dim;
            vf dots[KEYS];
            for (int t = 0; t < KEYS; t++) {
                vf d = ld(qr) * ld(k + t * dim);
                for (int c = 1; c < nv; c++) d += ld(qr + c * KEYS) * ld(k + t * dim + c * KEYS);
                dots[t] = d;
            }
            vf scores = hsum16(dots);
            if (s->softcap) scores = soft_cap(scores, s->softcap);
            float rescale, p[KEYS];
            st(p, online_softmax(scores, from, visible, &max[r], &sum[r], &rescale));
            float *ar = acc + r * dim;
            for (int c = 0; c < nv; c++) {
                vf a = ld(ar + c * KEYS) * rescale;
                for (int64_t t = 0; t < visible; t++) a += p[t] * ld(v + t * dim + c * KEYS);
                st(ar + c * KEYS, a);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = row_head(s, first, r, kv_head);
        const float inv = 1.0f / sum[r];
        for (int64_t d = 0; d < dim; d++) {
            const float o = acc[r * dim + d] * inv;
            if (s->dtype == BF16)
                ((uint16_t *)s->out)[head * dim + d] = to_bf16(o);
            else
                ((float *)s->out)[head * dim + d] = o;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 caches on CPUs with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and accumulates in
// fp32, at twice the rate of fp32 FMAs and without converting K and V. Scores: each key
// group's K is transposed to 32-bit pairs (lane t of kt[i] = dims 2i, 2i + 1 of key t), so a
// row's 16 scores are dim / 2 dot-pair steps with its query pairs broadcast. Values: keys
// 2u, 2u + 1 are interleaved per dim (vpair[u]), so a row accumulates p[2u] v[2u] + p[2u + 1]
// v[2u + 1] with the probabilities rounded to bf16 (as flash attention does). The
// interleave leaves the accumulator's dims permuted (pair_dim).
#include <immintrin.h>
#define HAVE_DPBF16 1

// 16 x 16 32-bit elements: r[j] lane t <- r[t] lane j.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

// The dim held by lane l of accumulator vector c: unpacklo/hi_epi16 of two rows' 32 dims
// [32 (c / 2), + 32) interleave 4 dims per 128-bit lane, lo first.
static inline int64_t pair_dim(int64_t c, int64_t l) {
    return (c / 2) * 32 + (l / 4) * 8 + (c % 2) * 4 + l % 4;
}

static inline __m512 dot_pairs(__m512 acc, __m512i pairs, uint32_t broadcast) {
    return _mm512_dpbf16_ps(acc, (__m512bh)pairs, (__m512bh)_mm512_set1_epi32((int)broadcast));
}

// As attend_tile, for a bf16 cache; nw = head_dim / 32.
static inline __attribute__((always_inline)) void
attend_tile_bf16(const Step *s, int64_t first, int64_t tokens, int64_t pos0, int64_t kv_head,
                 const int nw) {
    const int64_t group = s->heads / s->kv_heads, rows = tokens * group, dim = nw * 32;
    const int64_t token_stride = s->kv_heads * dim, nv = 2 * nw;
    uint32_t q[MAX_ROWS][MAX_HEAD_DIM / 2]; // each row's query as bf16 pairs
    __m512 acc[MAX_ROWS][MAX_HEAD_DIM / KEYS];
    __m512i kt[MAX_HEAD_DIM / 2], vpair[KEYS / 2][MAX_HEAD_DIM / KEYS];
    float max[MAX_ROWS], sum[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = row_head(s, first, r, kv_head);
        memcpy(q[r], (const uint16_t *)s->query + head * dim, dim * 2);
        max[r] = -1e30f;
        sum[r] = 0.0f;
        for (int64_t c = 0; c < nv; c++) acc[r][c] = _mm512_setzero_ps();
    }
    const int64_t end = pos0 + tokens;
    for (int64_t pos = first_key(s, pos0), n; pos < end; pos += n) {
        const uint16_t *kp = (const uint16_t *)key_group(s, pos, end, kv_head, dim, &n);
        const uint16_t *vp = kp + s->block * token_stride;
        prefetch_group(s, pos + n, end, kv_head, dim);
        for (int j = 0; j < nw; j++) {
            __m512i block[KEYS];
            for (int64_t t = 0; t < KEYS; t++)
                block[t] = t < n ? _mm512_loadu_si512(kp + t * token_stride + 32 * j)
                                 : _mm512_setzero_si512();
            transpose16(block);
            for (int i = 0; i < KEYS; i++) kt[KEYS * j + i] = block[i];
        }
        for (int64_t u = 0; u < KEYS / 2; u++)
            for (int j = 0; j < nw; j++) {
                const int64_t t = 2 * u;
                const __m512i a = t < n ? _mm512_loadu_si512(vp + t * token_stride + 32 * j)
                                        : _mm512_setzero_si512();
                const __m512i b = t + 1 < n
                                      ? _mm512_loadu_si512(vp + (t + 1) * token_stride + 32 * j)
                                      : _mm512_setzero_si512();
                vpair[u][2 * j] = _mm512_unpacklo_epi16(a, b);
                vpair[u][2 * j + 1] = _mm512_unpackhi_epi16(a, b);
            }
        for (int64_t r = 0; r < rows; r++) {
            int64_t from;
            const int64_t visible = visible_lanes(s, pos0 + r / group, pos, n, &from);
            if (visible <= 0) continue;
            __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                              _mm512_setzero_ps()};
            for (int64_t i = 0; i < dim / 2; i += 4)
                for (int j = 0; j < 4; j++) part[j] = dot_pairs(part[j], kt[i + j], q[r][i + j]);
            vf scores = (vf)((part[0] + part[1]) + (part[2] + part[3])) * s->scale;
            if (s->softcap) scores = soft_cap(scores, s->softcap);
            float rescale;
            const vf p = online_softmax(scores, from, visible, &max[r], &sum[r], &rescale);
            uint32_t pairs[KEYS / 2]; // p as bf16 pairs (p[2u], p[2u + 1])
            const __m256bh p16 = _mm512_cvtneps_pbh((__m512)p);
            memcpy(pairs, &p16, sizeof pairs);
            for (int64_t c = 0; c < nv; c++) {
                __m512 a = acc[r][c] * rescale;
                for (int64_t u = 0; 2 * u < visible; u++) a = dot_pairs(a, vpair[u][c], pairs[u]);
                acc[r][c] = a;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = row_head(s, first, r, kv_head);
        const float inv = 1.0f / sum[r];
        for (int64_t c = 0; c < nv; c++)
            for (int l = 0; l < KEYS; l++)
                ((uint16_t *)s->out)[head * dim + pair_dim(c, l)] = to_bf16(acc[r][c][l] * inv);
    }
}
#endif

// query and out: (num_tokens, heads, dim); request i's query tokens are rows
// [query_start_loc[i], query_start_loc[i + 1]) at the last positions before seq_lens[i], its
// blocks block_tables[i] (table_stride ids per row). `window` > 0: a row at position p sees
// only keys (p - window, p], and table entries wholly before its window are never read (a
// sliding-window layer's freed blocks); `softcap` > 0: scores are soft-capped (Gemma 2). Rows
// of `out` outside every request are left alone.
// Returns 0, -1 for shapes beyond the limits, -2 when out of memory.
int paged_attention(const void *query, const void *kv_cache, void *out, int dtype,
                    const int32_t *query_start_loc, const int32_t *seq_lens,
                    const int32_t *block_tables, int64_t table_stride, int64_t num_requests,
                    int64_t heads, int64_t kv_heads, int64_t dim, int64_t block, float scale,
                    int64_t window, float softcap, int num_threads) {
    if (dim > MAX_HEAD_DIM || dim % KEYS || heads % kv_heads || heads / kv_heads > MAX_GROUP ||
        (block % KEYS && KEYS % block) || window < 0 || softcap < 0)
        return -1;
    const int64_t group = heads / kv_heads, tile = MAX_ROWS / group;
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < num_requests; i++)
        num_tiles += (query_start_loc[i + 1] - query_start_loc[i] + tile - 1) / tile;
    int64_t *tiles = malloc((num_tiles > 0 ? num_tiles : 1) * 2 * sizeof(int64_t));
    if (!tiles) return -2;
    // One entry per tile: its request and first query row. Dynamic scheduling balances the
    // items, whose cost grows with the request's context.
    for (int64_t i = 0, n = 0; i < num_requests; i++)
        for (int64_t t = query_start_loc[i]; t < query_start_loc[i + 1]; t += tile, n++) {
            tiles[2 * n] = i;
            tiles[2 * n + 1] = t;
        }
    const Step base = {query,    kv_cache, out,   0,      dtype,  heads,
                       kv_heads, block,    scale, window, softcap};
    // One item (a decode over one KV head: Gemma 3 1B's) runs on the caller's thread: a team
    // would only wait at its barrier for threads the OS may not have scheduled yet.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)             \
    if (num_tiles * kv_heads > 1)
    for (int64_t n = 0; n < num_tiles; n++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t i = tiles[2 * n], first = tiles[2 * n + 1];
            const int64_t last = query_start_loc[i + 1];
            const int64_t tokens = last - first < tile ? last - first : tile;
            const int64_t pos0 = seq_lens[i] - (last - first); // position of token `first`
            Step s = base;
            s.table = block_tables + i * table_stride;
#ifdef HAVE_DPBF16
            if (dtype == BF16 && dim % 32 == 0) {
                if (dim == 64)
                    attend_tile_bf16(&s, first, tokens, pos0, h, 2);
                else
                    attend_tile_bf16(&s, first, tokens, pos0, h, (int)(dim / 32));
                continue;
            }
#endif
            // A constant vector count lets the compiler keep rows in registers.
            if (dim == 64)
                attend_tile(&s, first, tokens, pos0, h, 4);
            else if (dim == 128)
                attend_tile(&s, first, tokens, pos0, h, 8);
            else
                attend_tile(&s, first, tokens, pos0, h, (int)(dim / KEYS));
        }
    free(tiles);
    return 0;
}
