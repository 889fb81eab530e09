// The top of a row of logits, for the sampler on the CPU (cpu_sampling.py builds and loads
// this; engine/worker/sampler.py calls it). A 150k-token vocabulary makes torch's argmax and
// topk cost 0.3-1 ms a row (they do not vectorize); these take one pass over the row.
//
// argmax_rows: the first index of each row's largest value, as torch.argmax (a NaN counts as
// the largest: the first NaN's index).
// top_k_rows: each row's k largest, ordered by value descending then index ascending (a
// stable sort's order), and how many of the row's values are >= the k-th (ties with the k-th
// beyond the k, which the caller keeps); -1 for a row holding a NaN (the caller's reference
// path decides it).
// softmax_draw_rows (AVX-512 builds): a row's softmax at temperature t summed, and the
// inverse-CDF draw of a uniform from it, without writing the probabilities.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16 // values a step of the scans (one AVX-512 register, two AVX2 ones)

// The largest value of x[0 .. n) ignoring NaNs (-inf when none), and whether a NaN occurs.
static float max_of(const float *x, int64_t n, int *has_nan) {
    float best = -__builtin_inff();
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(best);
    __mmask16 unordered = 0;
    for (; i + LANES <= n; i += LANES) {
        const __m512 v = _mm512_loadu_ps(x + i);
        m = _mm512_max_ps(v, m); // a NaN v keeps m
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    best = _mm512_reduce_max_ps(m);
    nan = unordered != 0;
#elif defined(__AVX2__)
    __m256 m0 = _mm256_set1_ps(best), m1 = m0, unordered = _mm256_setzero_ps();
    for (; i + LANES <= n; i += LANES) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        m0 = _mm256_max_ps(v0, m0); // a NaN v keeps m
        m1 = _mm256_max_ps(v1, m1);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < n; i++) {
        best = x[i] > best ? x[i] : best;
        nan |= x[i] != x[i];
    }
    *has_nan = nan;
    return best;
}

// The first index of x[0 .. n) holding v (n when none); v is not a NaN.
static int64_t find(const float *x, int64_t n, float v) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + LANES <= n; i += LANES) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(v), _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const int eq = _mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(v), _CMP_EQ_OQ));
        if (eq) return i + __builtin_ctz(eq);
    }
#endif
    for (; i < n; i++)
        if (x[i] == v) return i;
    return n;
}

// How many of x[0 .. n) are >= t; -1 when one is a NaN.
static int64_t count_at_least(const float *x, int64_t n, float t) {
    int64_t count = 0, i = 0;
    int nan = 0;
#if defined(__AVX512F__)
    __mmask16 unordered = 0;
    for (; i + LANES <= n; i += LANES) {
        const __m512 v = _mm512_loadu_ps(x + i);
        count += __builtin_popcount(_mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_GE_OQ));
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    nan = unordered != 0;
#elif defined(__AVX2__)
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        count += __builtin_popcount(
            _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(t), _CMP_GE_OQ)));
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < n; i++) {
        count += x[i] >= t;
        nan |= x[i] != x[i];
    }
    return nan ? -1 : count;
}

// Whether any of x[0 .. LANES) is > t.
static inline int any_above(const float *x, float t) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
    const __m256 b = _mm256_set1_ps(t);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), b, _CMP_GT_OQ),
                                           _mm256_cmp_ps(_mm256_loadu_ps(x + 8), b, _CMP_GT_OQ))) != 0;
#else
    int any = 0;
    for (int j = 0; j < LANES; j++) any |= x[j] > t;
    return any;
#endif
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * stride;
        int nan;
        const float best = max_of(p, n, &nan);
        int64_t at = 0;
        if (nan) {
            while (p[at] == p[at]) at++;
        } else {
            at = find(p, n, best); // there, unless every value is -inf: then index 0
            at = at == n ? 0 : at;
        }
        out[r] = at;
    }
}

// A min-heap of (value, index) whose root is the worst kept: the smallest value, the larger
// index among equal values.
typedef struct {
    float v;
    int64_t i;
} Entry;

static inline int worse(Entry a, Entry b) { return a.v < b.v || (a.v == b.v && a.i > b.i); }

static void sift_down(Entry *h, int64_t k, int64_t at) {
    for (;;) {
        int64_t c = 2 * at + 1;
        if (c >= k) return;
        if (c + 1 < k && worse(h[c + 1], h[c])) c++;
        if (!worse(h[c], h[at])) return;
        const Entry t = h[c];
        h[c] = h[at];
        h[at] = t;
        at = c;
    }
}

static int better_first(const void *a, const void *b) {
    const Entry x = *(const Entry *)a, y = *(const Entry *)b;
    return worse(y, x) ? -1 : worse(x, y) ? 1 : 0;
}

// Returns 0, or -2 when memory runs out. k <= n.
int top_k_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t k, float *vals,
               int64_t *ids, int64_t *num_ge) {
    Entry *h = malloc((size_t)k * sizeof(Entry));
    if (!h) return -2;
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * stride;
        for (int64_t i = 0; i < k; i++) h[i] = (Entry){p[i], i};
        for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(h, k, i);
        int64_t i = k;
        // Later indices only enter with a strictly larger value than the root's; a whole
        // step of LANES is skipped when none of its values is.
        for (; i < n; i++) {
            if (i % LANES == 0 && i + LANES <= n && !any_above(p + i, h[0].v)) {
                i += LANES - 1;
                continue;
            }
            if (p[i] > h[0].v) {
                h[0] = (Entry){p[i], i};
                sift_down(h, k, 0);
            }
        }
        const int64_t ge = count_at_least(p, n, h[0].v);
        qsort(h, (size_t)k, sizeof(Entry), better_first);
        for (int64_t j = 0; j < k; j++) {
            vals[r * k + j] = h[j].v;
            ids[r * k + j] = h[j].i;
        }
        num_ge[r] = ge;
    }
    free(h);
    return 0;
}

#if defined(__AVX512F__)
// exp(x) for 16 floats, within ~2 ulp of expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// Taylor series to r^6 (error < 6e-8 relative), times 2^n (vscalefps: subnormal results
// too). x below -104 (and -inf) gives 0.
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); // ln2's high part
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);     // and its rest
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// The weights exp(x / t - m) of x[0 .. LANES).
static inline __m512 weights16(const float *x, float t, float m) {
    return exp16(_mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(x), _mm512_set1_ps(t)),
                               _mm512_set1_ps(m)));
}
#endif

// Whether this build has softmax_draw_rows.
int cpu_sampling_has_softmax(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// Per row (temperature t[r] > 0): m = max(x) / t, the weights w_i = exp(x_i / t - m) (the
// numerators of softmax(x / t)), totals[r] = their sum, added LANES at a time in order. With
// `u` (one uniform in [0, 1) a row), out[r] = the first i whose running sum of weights
// exceeds u * total (the last i with w_i > 0 when rounding leaves none): the inverse CDF of
// the row in index order. A row holding a NaN gets out[r] = -1. n must be a multiple of
// LANES. Returns 0, -1 for an n that is not (or a build without it), -2 out of memory.
int softmax_draw_rows(const float *x, int64_t rows, int64_t n, int64_t stride, const float *t,
                      const float *u, float *totals, int64_t *out) {
#if defined(__AVX512F__)
    if (n % LANES) return -1;
    const int64_t blocks = n / LANES;
    float *block_sum = malloc((size_t)blocks * sizeof(float));
    if (!block_sum) return -2;
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * stride;
        int nan;
        const float m = max_of(p, n, &nan) / t[r];
        if (nan) {
            totals[r] = NAN;
            if (u) out[r] = -1;
            continue;
        }
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            block_sum[b] = _mm512_reduce_add_ps(weights16(p + LANES * b, t[r], m));
            total += block_sum[b];
        }
        totals[r] = total;
        if (!u) continue;
        const float target = u[r] * total;
        float running = 0.0f;
        int64_t b = 0, last = -1; // `last`: the last block with weight before the crossing
        for (; b < blocks && !(running + block_sum[b] > target); b++) {
            running += block_sum[b];
            if (block_sum[b] > 0.0f) last = b;
        }
        int64_t at = -1;
        float w[LANES];
        if (b < blocks) { // the crossing is in block b (up to rounding of its sum)
            _mm512_storeu_ps(w, weights16(p + LANES * b, t[r], m));
            for (int j = 0; j < LANES && at < 0; j++) {
                running += w[j];
                if (w[j] > 0.0f && running > target) at = LANES * b + j;
            }
            if (at < 0 && block_sum[b] > 0.0f) last = b;
        }
        if (at < 0 && last >= 0) { // rounded past the total: the last token with weight
            _mm512_storeu_ps(w, weights16(p + LANES * last, t[r], m));
            for (int j = LANES - 1; j >= 0 && at < 0; j--)
                if (w[j] > 0.0f) at = LANES * last + j;
        }
        out[r] = at < 0 ? 0 : at;
    }
    free(block_sum);
    return 0;
#else
    (void)x, (void)rows, (void)n, (void)stride, (void)t, (void)u, (void)totals, (void)out;
    return -1;
#endif
}
