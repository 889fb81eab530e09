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
// Requests with at least 16 query rows (prefills, long chunks) take wide items instead
// (attend_wide): 32 rows in vector lanes, no horizontal sums, 1.37x the row-by-row items'
// speed on a 512-token Qwen3-0.6B prefill (CPU time, alternated).
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

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#endif

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

// Prefill tiles (a request with at least a vector of query rows): the rows go in vector
// lanes instead, 16 rows a vector, WIDE_ROWS rows an item. A group of KEYS keys is gathered
// (across blocks) into contiguous fp32 buffers once per item; then per vector of rows the 16
// scores are 16 vectors of rows (each key's K element broadcast times the rows' transposed
// queries, dim FMAs per key with no horizontal sum), the online softmax is lane-wise (max,
// exp and sum across the 16 score vectors), and P.V accumulates the transposed output,
// acc[d] += p[key] * V[key][d] broadcast. Every FMA does 16 useful products, and only the
// diagonal and window-edge groups need masks. The rows of K and V lie head_dim * kv_heads
// floats apart in the cache (4 KiB for 8 heads of 128), which would map all 16 keys of a
// group to one L1 set: the gather avoids that too.
#define WIDE_ROWS 32
#define WIDE_VECS (WIDE_ROWS / KEYS)

// sc[j] = sum over d of k[j][d] * qt[d], for the KEYS keys j (k: (key, dim) floats; qt and
// sc: vectors of rows). Compilers do not keep an array of 16-float vectors in registers on
// AVX2, nor fold the broadcasts into the FMAs on AVX-512, so both are written out.
static inline void wide_scores(const vf *qt, const float *k, int64_t dim, vf *sc) {
#ifdef __AVX512F__
    __m512 a[KEYS]; // 16 of the 32 zmm registers
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; j++) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const __m512 q = (__m512)qt[d];
#pragma GCC unroll 16
        for (int j = 0; j < KEYS; j++)
            a[j] = _mm512_fmadd_ps(_mm512_set1_ps(k[j * dim + d]), q, a[j]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; j++) sc[j] = (vf)a[j];
#elif defined(__AVX2__) && defined(__FMA__)
    for (int j0 = 0; j0 < KEYS; j0 += 4) { // 4 keys x 2 halves: 8 of the 16 ymm registers
        __m256 a[4][2];
        for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const float *q = (const float *)&qt[d];
            const __m256 lo = _mm256_loadu_ps(q), hi = _mm256_loadu_ps(q + 8);
            for (int j = 0; j < 4; j++) {
                const __m256 x = _mm256_broadcast_ss(k + (j0 + j) * dim + d);
                a[j][0] = _mm256_fmadd_ps(x, lo, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(x, hi, a[j][1]);
            }
        }
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_ps((float *)&sc[j0 + j], a[j][0]);
            _mm256_storeu_ps((float *)&sc[j0 + j] + 8, a[j][1]);
        }
    }
#else
    for (int j = 0; j < KEYS; j++) {
        vf a = splat(0.0f);
        for (int64_t d = 0; d < dim; d++) a += splat(k[j * dim + d]) * qt[d];
        sc[j] = a;
    }
#endif
}

// acc[d] = acc[d] * rescale + sum over keys j of p[j] * v[j][d] (v: (key, dim) floats; acc,
// p and rescale: vectors of rows).
static inline void wide_accumulate(vf *acc, const vf *p, const float *v, int64_t dim,
                                   vf rescale) {
#ifdef __AVX512F__
    for (int64_t d0 = 0; d0 < dim; d0 += 8) { // 8 dims + 16 weights: 24 zmm registers
        __m512 a[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm512_mul_ps((__m512)acc[d0 + i], (__m512)rescale);
#pragma GCC unroll 16
        for (int j = 0; j < KEYS; j++)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                a[i] = _mm512_fmadd_ps((__m512)p[j], _mm512_set1_ps(v[j * dim + d0 + i]), a[i]);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[d0 + i] = (vf)a[i];
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const float *r = (const float *)&rescale;
    const __m256 r_lo = _mm256_loadu_ps(r), r_hi = _mm256_loadu_ps(r + 8);
    for (int64_t d0 = 0; d0 < dim; d0 += 4) { // 4 dims x 2 halves: 8 ymm registers
        __m256 a[4][2];
        for (int i = 0; i < 4; i++) {
            const float *x = (const float *)&acc[d0 + i];
            a[i][0] = _mm256_mul_ps(_mm256_loadu_ps(x), r_lo);
            a[i][1] = _mm256_mul_ps(_mm256_loadu_ps(x + 8), r_hi);
        }
        for (int j = 0; j < KEYS; j++) {
            const float *pj = (const float *)&p[j];
            const __m256 lo = _mm256_loadu_ps(pj), hi = _mm256_loadu_ps(pj + 8);
            for (int i = 0; i < 4; i++) {
                const __m256 x = _mm256_broadcast_ss(v + j * dim + d0 + i);
                a[i][0] = _mm256_fmadd_ps(lo, x, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(hi, x, a[i][1]);
            }
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps((float *)&acc[d0 + i], a[i][0]);
            _mm256_storeu_ps((float *)&acc[d0 + i] + 8, a[i][1]);
        }
    }
#else
    for (int64_t d = 0; d < dim; d++) {
        vf a = acc[d] * rescale;
        for (int j = 0; j < KEYS; j++) a += p[j] * splat(v[j * dim + d]);
        acc[d] = a;
    }
#endif
}

// The K (or V, one block further) row of position `pos` for `kv_head`.
static inline const char *key_row(const Step *s, int64_t pos, int64_t kv_head, int64_t dim) {
    const int64_t esize = s->dtype == BF16 ? 2 : 4;
    const int64_t row = (int64_t)s->table[pos / s->block] * 2 * s->block + pos % s->block;
    return s->cache + (row * s->kv_heads * dim + kv_head * dim) * esize;
}

// One wide item: query tokens [first, first + tokens) at positions [pos0, + tokens), the
// query heads of `kv_head`; rows = tokens * group <= WIDE_ROWS, row r (token r / group, head
// r % group) in lane r % 16 of vector r / 16. Lanes past the rows hold zero queries at the
// last row's position and are never written. nv = head_dim / 16.
static inline __attribute__((always_inline)) void
attend_wide(const Step *s, int64_t first, int64_t tokens, int64_t pos0, int64_t kv_head,
            const int nv) {
    const int64_t group = s->heads / s->kv_heads, rows = tokens * group, dim = nv * KEYS;
    const int64_t esize = s->dtype == BF16 ? 2 : 4, vecs = (rows + KEYS - 1) / KEYS;
    vf qt[WIDE_VECS][MAX_HEAD_DIM], acc[WIDE_VECS][MAX_HEAD_DIM]; // (vector, dim): rows
    float k[KEYS * MAX_HEAD_DIM], v[KEYS * MAX_HEAD_DIM];         // (key, dim)
    vf max[WIDE_VECS], sum[WIDE_VECS];
    vi row_pos[WIDE_VECS];
    int64_t lo[WIDE_VECS], hi[WIDE_VECS]; // each vector's first and last row position
    for (int64_t c = 0; c < vecs; c++) {
        for (int64_t d = 0; d < dim; d++) qt[c][d] = acc[c][d] = splat(0.0f);
        for (int l = 0; l < KEYS; l++) {
            const int64_t r = c * KEYS + l < rows ? c * KEYS + l : rows - 1;
            row_pos[c][l] = (int32_t)(pos0 + r / group);
        }
        max[c] = splat(-1e30f); // finite: the first rescale is exp(-huge) = 0, never inf - inf
        sum[c] = splat(0.0f);
        lo[c] = row_pos[c][0];
        hi[c] = row_pos[c][KEYS - 1];
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = row_head(s, first, r, kv_head);
        for (int c = 0; c < nv; c++) {
            float x[KEYS];
            st(x, load16(s->query + (head * dim + c * KEYS) * esize, s->dtype) * s->scale);
            for (int i = 0; i < KEYS; i++) qt[r / KEYS][c * KEYS + i][r % KEYS] = x[i];
        }
    }
    const int64_t end = pos0 + tokens;
    for (int64_t pos = first_key(s, pos0), n; pos < end; pos += n) {
        n = end - pos < KEYS ? end - pos : KEYS;
        for (int64_t t = 0; t < KEYS; t++) {
            if (t < n) {
                const char *kp = key_row(s, pos + t, kv_head, dim);
                const char *vp = kp + s->block * s->kv_heads * dim * esize;
                for (int c = 0; c < nv; c++) {
                    st(k + t * dim + c * KEYS, load16(kp + c * KEYS * esize, s->dtype));
                    st(v + t * dim + c * KEYS, load16(vp + c * KEYS * esize, s->dtype));
                }
            } else {
                for (int c = 0; c < nv; c++) {
                    st(k + t * dim + c * KEYS, splat(0.0f));
                    st(v + t * dim + c * KEYS, splat(0.0f));
                }
            }
        }
        for (int64_t t = n; t < 2 * KEYS && pos + t < end; t++) {
            const char *kp = key_row(s, pos + t, kv_head, dim);
            const char *vp = kp + s->block * s->kv_heads * dim * esize;
            for (int64_t b = 0; b < dim * esize; b += 64) {
                __builtin_prefetch(kp + b);
                __builtin_prefetch(vp + b);
            }
        }
        for (int64_t c = 0; c < vecs; c++) {
            // Skip the vectors that see none of these keys: all after their last row, or all
            // before their first row's window.
            if (pos > hi[c] || (s->window && pos + n - 1 <= lo[c] - s->window)) continue;
            vf sc[KEYS];
            wide_scores(qt[c], k, dim, sc);
            if (s->softcap)
                for (int j = 0; j < KEYS; j++) sc[j] = soft_cap(sc[j], s->softcap);
            // Masks where some row of the vector does not see some key: past its position, or
            // before its window, or past the last key.
            const int masked = pos + KEYS - 1 > lo[c] || (s->window && pos <= hi[c] - s->window);
            vi seen[KEYS];
            if (masked)
                for (int j = 0; j < KEYS; j++) {
                    const vi key = (vi){0} + (int32_t)(pos + j);
                    seen[j] = key <= row_pos[c];
                    if (s->window) seen[j] &= key > row_pos[c] - (int32_t)s->window;
                    sc[j] = (vf)(((vi)sc[j] & seen[j]) | ((vi)splat(-1e30f) & ~seen[j]));
                }
            vf block_max = sc[0];
            for (int j = 1; j < KEYS; j++) block_max = vmax(block_max, sc[j]);
            const vf new_max = vmax(max[c], block_max);
            const vf rescale = exp_neg(max[c] - new_max);
            max[c] = new_max;
            vf p[KEYS], total = splat(0.0f);
            for (int j = 0; j < KEYS; j++) {
                p[j] = exp_neg(sc[j] - new_max);
                if (masked) p[j] = (vf)((vi)p[j] & seen[j]);
                total += p[j];
            }
            sum[c] = sum[c] * rescale + total;
            wide_accumulate(acc[c], p, v, dim, rescale);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = row_head(s, first, r, kv_head);
        const float inv = 1.0f / sum[r / KEYS][r % KEYS];
        for (int64_t d = 0; d < dim; d++) {
            const float o = acc[r / KEYS][d][r % KEYS] * inv;
            if (s->dtype == BF16)
                ((uint16_t *)s->out)[head * dim + d] = to_bf16(o);
            else
                ((float *)s->out)[head * dim + d] = o;
        }
    }
}

#ifdef HAVE_DPBF16
// bf16 caches on CPUs with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and accumulates in
// fp32, at twice the rate of fp32 FMAs and without converting K and V. Scores: each key
// group's K is transposed to 32-bit pairs (lane t of kt[i] = dims 2i, 2i + 1 of key t), so a
// row's 16 scores are dim / 2 dot-pair steps with its query pairs broadcast. Values: keys
// 2u, 2u + 1 are interleaved per dim (vpair[u]), so a row accumulates p[2u] v[2u] + p[2u + 1]
// v[2u + 1] with the probabilities rounded to bf16 (as flash attention does). The
// interleave leaves the accumulator's dims permuted (pair_dim).
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
    // Requests with a vector of query rows or more take wide items (attend_wide), the others
    // (decodes, short chunks) items of MAX_ROWS rows that walk the keys per row.
    const int64_t group = heads / kv_heads;
    const int64_t tile = MAX_ROWS / group, wide_tile = WIDE_ROWS / group;
#ifdef HAVE_DPBF16
    const int wide_dtype = dtype != BF16 || dim % 32; // else attend_tile_bf16 serves them all
#else
    const int wide_dtype = 1;
#endif
#define IS_WIDE(i) (wide_dtype && (query_start_loc[(i) + 1] - query_start_loc[i]) * group >= KEYS)
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < num_requests; i++) {
        const int64_t size = IS_WIDE(i) ? wide_tile : tile;
        num_tiles += (query_start_loc[i + 1] - query_start_loc[i] + size - 1) / size;
    }
    int64_t *tiles = malloc((num_tiles > 0 ? num_tiles : 1) * 3 * sizeof(int64_t));
    if (!tiles) return -2;
    // One entry per tile: its request, first query row and size. Dynamic scheduling balances
    // the items, whose cost grows with the request's context; a request's tiles are listed
    // last first, so the costliest items start first.
    for (int64_t i = 0, n = 0; i < num_requests; i++) {
        const int64_t size = IS_WIDE(i) ? wide_tile : tile;
        const int64_t count = (query_start_loc[i + 1] - query_start_loc[i] + size - 1) / size;
        for (int64_t t = count - 1; t >= 0; t--, n++) {
            tiles[3 * n] = i;
            tiles[3 * n + 1] = query_start_loc[i] + t * size;
            tiles[3 * n + 2] = IS_WIDE(i) ? size : 0;
        }
    }
#undef IS_WIDE
    const Step base = {query,    kv_cache, out,   0,      dtype,  heads,
                       kv_heads, block,    scale, window, softcap};
    // One item (a decode over one KV head: Gemma 3 1B's) runs on the caller's thread: a team
    // would only wait at its barrier for threads the OS may not have scheduled yet. Items
    // run KV head by KV head, so the threads share that head's keys in cache.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)             \
    if (num_tiles * kv_heads > 1)
    for (int64_t h = 0; h < kv_heads; h++)
        for (int64_t n = 0; n < num_tiles; n++) {
            const int64_t i = tiles[3 * n], first = tiles[3 * n + 1], wide = tiles[3 * n + 2];
            const int64_t last = query_start_loc[i + 1], size = wide ? wide : tile;
            const int64_t tokens = last - first < size ? last - first : size;
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
            if (wide && dim == 64)
                attend_wide(&s, first, tokens, pos0, h, 4);
            else if (wide && dim == 128)
                attend_wide(&s, first, tokens, pos0, h, 8);
            else if (wide)
                attend_wide(&s, first, tokens, pos0, h, (int)(dim / KEYS));
            else if (dim == 64)
                attend_tile(&s, first, tokens, pos0, h, 4);
            else if (dim == 128)
                attend_tile(&s, first, tokens, pos0, h, 8);
            else
                attend_tile(&s, first, tokens, pos0, h, (int)(dim / KEYS));
        }
    free(tiles);
    return 0;
}
