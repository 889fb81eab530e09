// Paged varlen attention for the CPU (built on first use by cpu_attention.py).
//
// Every request of a step (a decode, a jump-forward chunk, a prefill chunk) attends causally to
// its context, read in place from the block-paged KV cache: cache (num_blocks, 2, block_size,
// num_kv_heads, head_dim), index 0 = K, 1 = V. A request's query tokens are split into tiles of
// up to MAX_ROWS / group tokens; work items are (tile, KV head) pairs, spread over OpenMP
// threads (the libgomp torch has loaded, so torch's thread settings apply). An item holds the
// tile's query rows (tokens x the query heads sharing the KV head) in fp32, walks the keys up
// to its last token in groups of 16, reads each group's K and V rows in place (an fp32
// cache) or converts them to fp32 once for all its rows, and keeps an online softmax per row:
// a running max, a running sum and an fp32 accumulator, rescaled when the max grows. Outputs
// are written in the cache dtype.
//
// Requests with at least 16 query rows (prefills, long chunks) take wide items instead
// (attend_wide): the rows in vector lanes, no horizontal sums, each row's sums rounded in the
// row items' order, so a prompt's rows have the bits of its decodes.
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

// a * b + c, rounded once where the target has FMA instructions (as compilers contract such
// expressions there), else rounded twice. Written out wherever a product meets a sum, so that
// the compiler's choice of which product to fuse cannot make the row items and the wide items
// round differently (see attend_wide).
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    typedef float v8 __attribute__((vector_size(32)));
#define LO(x) (__m256) __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
#define HI(x) (__m256) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)
    const v8 lo = (v8)_mm256_fmadd_ps(LO(a), LO(b), LO(c));
    const v8 hi = (v8)_mm256_fmadd_ps(HI(a), HI(b), HI(c));
#undef LO
#undef HI
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__FP_FAST_FMAF)
    vf r;
    for (int i = 0; i < 16; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#else
    return a * b + c;
#endif
}

static inline float sfma(float a, float b, float c) {
#ifdef __FP_FAST_FMAF
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

// A vector of x. (splat adds x to a zero vector, an add the compiler must keep for x = -0.)
static inline vf bcast(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

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

// The key group at `pos` (key_group) as fp32 K and V rows (key, dim), zero past its *n keys,
// with the next group's rows asked for (prefetch_group); returns n. nv = head_dim / 16.
static inline __attribute__((always_inline)) int64_t
load_group(const Step *s, int64_t pos, int64_t end, int64_t kv_head, int nv, float *k, float *v) {
    const int64_t dim = nv * KEYS, esize = s->dtype == BF16 ? 2 : 4;
    const int64_t token_stride = s->kv_heads * dim;
    int64_t n;
    const char *kp = key_group(s, pos, end, kv_head, dim, &n);
    const char *vp = kp + s->block * token_stride * esize;
    prefetch_group(s, pos + n, end, kv_head, dim);
    for (int64_t t = 0; t < KEYS; t++)
        for (int c = 0; c < nv; c++) {
            const int64_t at = (t * token_stride + c * KEYS) * esize;
            st(k + t * dim + c * KEYS, t < n ? load16(kp + at, s->dtype) : splat(0.0f));
            st(v + t * dim + c * KEYS, t < n ? load16(vp + at, s->dtype) : splat(0.0f));
        }
    return n;
}

// A row item's key group at `pos`: its K and V rows read where they lie in the cache when it
// is fp32 and the group has KEYS keys (*k and *v then point into the cache, rows *stride
// floats apart), else load_group's fp32 copies in kbuf and vbuf (rows dim apart). The same
// values either way: only the copy is saved (a decode's row item has 1-MAX_GROUP rows to
// share it). Returns n.
static inline __attribute__((always_inline)) int64_t
row_group(const Step *s, int64_t pos, int64_t end, int64_t kv_head, int nv, float *kbuf,
          float *vbuf, const float **k, const float **v, int64_t *stride) {
    const int64_t dim = nv * KEYS;
    if (s->dtype == F32) {
        int64_t n;
        const float *kp = (const float *)key_group(s, pos, end, kv_head, dim, &n);
        if (n == KEYS) {
            prefetch_group(s, pos + n, end, kv_head, dim);
            *k = kp, *v = kp + s->block * s->kv_heads * dim, *stride = s->kv_heads * dim;
            return n;
        }
    }
    *k = kbuf, *v = vbuf, *stride = dim;
    return load_group(s, pos, end, kv_head, nv, kbuf, vbuf);
}

// The query/out head of a work item's row r: token first + r / group, head
// kv_head * group + r % group.
static inline int64_t row_head(const Step *s, int64_t first, int64_t r, int64_t kv_head) {
    const int64_t group = s->heads / s->kv_heads;
    return (first + r / group) * s->heads + kv_head * group + r % group;
}

// The first key position that rows from `pos0` on may see: 0, or their window's start, down
// to a multiple of min(block, KEYS). So the key groups are [16m, 16m + 16) (or a block's
// keys) whatever a work item's first row, and every row's sums are rounded the same in any
// item; the keys added before the window (in the window start's block) are masked.
static inline int64_t first_key(const Step *s, int64_t pos0) {
    if (!s->window || pos0 < s->window) return 0;
    const int64_t start = pos0 - s->window + 1, align = s->block < KEYS ? s->block : KEYS;
    return start - start % align;
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

// Lane l of the result: the dot product of q and k over dims l, l + 16, ..., summed in order,
// the first two products in one rounding (nv = dim / 16).
static inline vf dot_lanes(const float *q, const float *k, int nv) {
    if (nv == 1) return ld(q) * ld(k);
    vf d = vfma(ld(q), ld(k), ld(q + KEYS) * ld(k + KEYS));
    for (int c = 2; c < nv; c++) d = vfma(ld(q + c * KEYS), ld(k + c * KEYS), d);
    return d;
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
    *sum = sfma(*sum, *rescale, hadd(p));
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
    const int64_t esize = s->dtype == BF16 ? 2 : 4;
    // fp32 buffers: the rows' scaled queries and accumulators, one key group's K and V.
    float q[MAX_ROWS * MAX_HEAD_DIM], acc[MAX_ROWS * MAX_HEAD_DIM];
    float kbuf[KEYS * MAX_HEAD_DIM], vbuf[KEYS * MAX_HEAD_DIM];
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
        const float *k, *v;
        int64_t ks; // the rows' stride in k and v
        n = row_group(s, pos, end, kv_head, nv, kbuf, vbuf, &k, &v, &ks);
        for (int64_t r = 0; r < rows; r++) {
            // Row r sees keys up to its own position, within its window: lanes [from, visible).
            int64_t from;
            const int64_t visible = visible_lanes(s, pos0 + r / group, pos, n, &from);
            if (visible <= 0) continue;
            const float *qr = q + r * dim;
            vf dots[KEYS];
            for (int t = 0; t < KEYS; t++) dots[t] = dot_lanes(qr, k + t * ks, nv);
            vf scores = hsum16(dots);
            if (s->softcap) scores = soft_cap(scores, s->softcap);
            float rescale, p[KEYS];
            st(p, online_softmax(scores, from, visible, &max[r], &sum[r], &rescale));
            float *ar = acc + r * dim;
            for (int c = 0; c < nv; c++) {
                vf a = vfma(ld(ar + c * KEYS), bcast(rescale), p[0] * ld(v + c * KEYS));
                for (int64_t t = 1; t < visible; t++)
                    a = vfma(bcast(p[t]), ld(v + t * ks + c * KEYS), a);
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

// Prefill items (a request with at least a vector of query rows): the rows go in vector lanes
// instead, 16 rows a vector, WIDE_ROWS rows an item. Per vector of rows, a key group's 16
// scores are 16 vectors of rows (each key's K element broadcast times the rows' transposed
// queries, no horizontal sum), the online softmax is lane-wise, and P.V accumulates the
// transposed output, acc[d] += p[key] * V[key][d] broadcast: every FMA does 16 useful
// products, and only the diagonal and window-edge groups need masks.
//
// Each row's output has the bits attend_tile gives it (so a prompt's rows equal those of its
// decodes, and the wide items change no model's output): the key groups are the same (they
// depend on the positions only, not on the item: see first_key), and every sum is rounded in
// attend_tile's order. A score sums lane l's products over dims l, l + 16, ... (dot_lanes'
// order) and adds the 16 lanes' sums as hsum16 does, ((l0 + l8) + (l4 + l12)) + ...; a
// vector lane that sees none of a group's keys (past its row, or before its window) takes
// the group as a no-op (rescale 1, weights 0) where attend_tile skips it.
#define WIDE_ROWS 32
#define WIDE_VECS (WIDE_ROWS / KEYS)

// a[j] = lane l's dot_lanes sum for key j (of 4: rows of k, dim floats apart) against the rows
// of qt ((dim,) vectors of rows): the query vectors loaded serve the 4 keys.
static inline void wide_lane(const vf *qt, const float *k, int64_t dim, int l, int nv, vf *a) {
    for (int j = 0; j < 4; j++)
        a[j] = vfma(qt[l], bcast(k[j * dim + l]), qt[KEYS + l] * bcast(k[j * dim + KEYS + l]));
    for (int c = 2; c < nv; c++)
        for (int j = 0; j < 4; j++)
            a[j] = vfma(qt[c * KEYS + l], bcast(k[j * dim + c * KEYS + l]), a[j]);
}

// z[j] = (lane m + lane m + 8) + (lane m + 4 + lane m + 12) for the 4 keys: hsum16's first two
// levels.
static inline void wide_quad(const vf *qt, const float *k, int64_t dim, int m, int nv, vf *z) {
    vf a[4], b[4], c[4];
    wide_lane(qt, k, dim, m, nv, a);
    wide_lane(qt, k, dim, m + 8, nv, b);
    for (int j = 0; j < 4; j++) a[j] += b[j];
    wide_lane(qt, k, dim, m + 4, nv, b);
    wide_lane(qt, k, dim, m + 12, nv, c);
    for (int j = 0; j < 4; j++) z[j] = a[j] + (b[j] + c[j]);
}

// sc[j] = the rows' scores against key j (k: (key, dim) floats), hsum16's sum of the dot_lanes
// sums, 4 keys at a time (their partial sums fit in registers with AVX-512).
static inline void wide_scores(const vf *qt, const float *k, int nv, vf *sc) {
    const int64_t dim = nv * KEYS;
    for (int j0 = 0; j0 < KEYS; j0 += 4) {
        vf w[4], z[4], y[4];
        wide_quad(qt, k + j0 * dim, dim, 0, nv, w);
        wide_quad(qt, k + j0 * dim, dim, 2, nv, z);
        for (int j = 0; j < 4; j++) w[j] += z[j];
        wide_quad(qt, k + j0 * dim, dim, 1, nv, z);
        wide_quad(qt, k + j0 * dim, dim, 3, nv, y);
        for (int j = 0; j < 4; j++) sc[j0 + j] = w[j] + (z[j] + y[j]);
    }
}

// acc[d] = acc[d] * rescale + the sum over keys j < n of p[j] * v[j][d] (v: (key, dim)
// floats; acc, p and rescale: vectors of rows), rounded as attend_tile does: the first key's
// product onto the rescaled accumulator in one FMA, then the others in key order.
static inline void wide_accumulate(vf *acc, const vf *p, const float *v, int64_t n, int nv,
                                   vf rescale) {
    const int64_t dim = nv * KEYS;
    for (int64_t d0 = 0; d0 < dim; d0 += 8) { // 8 dims + 16 weights in registers
        vf a[8];
        for (int i = 0; i < 8; i++) a[i] = vfma(acc[d0 + i], rescale, p[0] * bcast(v[d0 + i]));
        for (int64_t j = 1; j < n; j++)
            for (int i = 0; i < 8; i++) a[i] = vfma(p[j], bcast(v[j * dim + d0 + i]), a[i]);
        for (int i = 0; i < 8; i++) acc[d0 + i] = a[i];
    }
}

// The sum of x's 16 vectors in hsum16's (and hadd's) order.
static inline vf sum16(const vf *x) {
    vf y[8];
    for (int m = 0; m < 8; m++) y[m] = x[m] + x[m + 8];
    return ((y[0] + y[4]) + (y[2] + y[6])) + ((y[1] + y[5]) + (y[3] + y[7]));
}

// One wide item: as attend_tile, with rows = tokens * group <= WIDE_ROWS, row r in lane
// r % 16 of vector r / 16. Lanes past the rows hold zero queries at the last row's position
// and are never written. nv = head_dim / 16 >= 2.
static inline __attribute__((always_inline)) void
attend_wide(const Step *s, int64_t first, int64_t tokens, int64_t pos0, int64_t kv_head,
            const int nv) {
    const int64_t group = s->heads / s->kv_heads, rows = tokens * group, dim = nv * KEYS;
    const int64_t esize = s->dtype == BF16 ? 2 : 4;
    const int64_t vecs = (rows + KEYS - 1) / KEYS;
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
        n = load_group(s, pos, end, kv_head, nv, k, v);
        for (int64_t c = 0; c < vecs; c++) {
            // Skip the vectors that see none of these keys: all after their last row, or all
            // before their first row's window.
            if (pos > hi[c] || (s->window && pos + n - 1 <= lo[c] - s->window)) continue;
            vf sc[KEYS];
            wide_scores(qt[c], k, nv, sc);
            if (s->softcap)
                for (int j = 0; j < KEYS; j++) sc[j] = soft_cap(sc[j], s->softcap);
            // Masks where some row of the vector does not see some key: past the group (a
            // short one: a block's, or the last), past its position, or before its window.
            const int masked = n < KEYS || pos + KEYS - 1 > lo[c] ||
                               (s->window && pos <= hi[c] - s->window);
            vi seen[KEYS];
            if (masked)
                for (int j = 0; j < KEYS; j++) {
                    const vi key = (vi){0} + (int32_t)(pos + j);
                    seen[j] = (key <= row_pos[c]) & ((vi){0} - (j < n));
                    if (s->window) seen[j] &= key > row_pos[c] - (int32_t)s->window;
                    sc[j] = (vf)(((vi)sc[j] & seen[j]) | ((vi)splat(-1e30f) & ~seen[j]));
                }
            vf group_max = sc[0];
            for (int j = 1; j < KEYS; j++) group_max = vmax(group_max, sc[j]);
            const vf new_max = vmax(max[c], group_max);
            const vf rescale = exp_neg(max[c] - new_max); // 1 where the max did not grow
            max[c] = new_max;
            vf p[KEYS];
            for (int j = 0; j < KEYS; j++) {
                p[j] = exp_neg(sc[j] - new_max);
                if (masked) p[j] = (vf)((vi)p[j] & seen[j]);
            }
            sum[c] = vfma(sum[c], rescale, sum16(p));
            wide_accumulate(acc[c], p, v, n, nv, rescale);
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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 caches on CPUs with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and accumulates in
// fp32, at twice the rate of fp32 FMAs and without converting K and V. Scores: each key
// group's K is transposed to 32-bit pairs (lane t of kt[i] = dims 2i, 2i + 1 of key t), so a
// row's 16 scores are dim / 2 dot-pair steps with its query pairs broadcast. Values: keys
// 2u, 2u + 1 are interleaved per dim (vpair[u]), so a row accumulates p[2u] v[2u] + p[2u + 1]
// v[2u + 1] with the probabilities rounded to bf16 (as flash attention does). The
// interleave leaves the accumulator's dims permuted (pair_dim).
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
    // Requests with a vector of query rows or more take wide items (attend_wide), the others
    // (decodes, short chunks) items of MAX_ROWS rows that walk the keys per row.
    const int64_t group = heads / kv_heads;
    const int64_t tile = MAX_ROWS / group, wide_tile = WIDE_ROWS / group;
#ifdef HAVE_DPBF16
    const int wide_dtype = dtype != BF16 || dim % 32; // else attend_tile_bf16 serves them all
#else
    const int wide_dtype = 1;
#endif
    const int wide_ok = wide_dtype && dim >= 2 * KEYS; // dot_lanes' first FMA needs 2 vectors
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < num_requests; i++) {
        const int64_t len = query_start_loc[i + 1] - query_start_loc[i];
        const int64_t size = wide_ok && len * group >= KEYS ? wide_tile : tile;
        num_tiles += (len + size - 1) / size;
    }
    int64_t *tiles = malloc((num_tiles > 0 ? num_tiles : 1) * 3 * sizeof(int64_t));
    if (!tiles) return -2;
    // One entry per tile: its request, first query row and wide tile (0: row items). Dynamic
    // scheduling balances the items, whose cost grows with the request's context; a
    // request's tiles are listed last first, so the costliest items start first.
    for (int64_t i = 0, n = 0; i < num_requests; i++) {
        const int64_t len = query_start_loc[i + 1] - query_start_loc[i];
        const int64_t wide = wide_ok && len * group >= KEYS ? wide_tile : 0;
        const int64_t size = wide ? wide : tile, count = (len + size - 1) / size;
        for (int64_t t = count - 1; t >= 0; t--, n++) {
            tiles[3 * n] = i;
            tiles[3 * n + 1] = query_start_loc[i] + t * size;
            tiles[3 * n + 2] = wide;
        }
    }
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
            // A constant vector count lets the compiler keep rows in registers.
            if (wide && dim == 64)
                attend_wide(&s, first, tokens, pos0, h, 4);
            else if (wide && dim == 128)
                attend_wide(&s, first, tokens, pos0, h, 8);
            else if (wide)
                attend_wide(&s, first, tokens, pos0, h, (int)(dim / KEYS));
#ifdef HAVE_DPBF16
            else if (dtype == BF16 && dim % 32 == 0) {
                if (dim == 64)
                    attend_tile_bf16(&s, first, tokens, pos0, h, 2);
                else
                    attend_tile_bf16(&s, first, tokens, pos0, h, (int)(dim / 32));
            }
#endif
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
