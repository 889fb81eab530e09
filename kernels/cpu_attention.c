// Paged decode attention for the CPU (built on first use by cpu_attention.py).
//
// One query token per request attends to its whole context, read in place from the block-paged
// KV cache: cache (num_blocks, 2, block_size, num_kv_heads, head_dim), index 0 = K, 1 = V.
// Work items are (request, KV head) pairs, spread over OpenMP threads (the libgomp torch has
// loaded, so torch's thread settings apply). Each item loads its query heads once, walks the
// request's blocks, converts each block's K and V rows to fp32 once for all the query heads that
// share that KV head (GQA), and keeps an online softmax: a running max, a running sum and an fp32
// accumulator per head, rescaled when the max grows. Output rows are written in the cache dtype.
// Cascade: a row may start past a shared prefix that was attended elsewhere, from that
// prefix's output and log-sum-exp (see decode_one).

#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16 // query heads per KV head
#define MAX_BLOCK 128

enum { F32 = 0, BF16 = 1 };

// exp(x) for x <= 0 (softmax arguments), vectorisable: 2^n * 2^f with n = round(x * log2 e),
// |f| <= 1/2, and 2^f from its degree-6 minimax polynomial (relative error < 2e-7).
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_roundf(t);
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, 4);
    return p;
}

// n rows of `dim` values, `stride` elements apart, to contiguous fp32.
static inline void load_rows(const void *src, int dtype, int64_t n, int64_t dim, int64_t stride,
                             float *dst) {
    if (dtype == BF16) {
        const uint16_t *p = src;
        for (int64_t r = 0; r < n; r++)
            for (int64_t d = 0; d < dim; d++) {
                const uint32_t bits = (uint32_t)p[r * stride + d] << 16;
                memcpy(dst + r * dim + d, &bits, 4);
            }
    } else {
        const float *p = src;
        for (int64_t r = 0; r < n; r++) memcpy(dst + r * dim, p + r * stride, dim * 4);
    }
}

// fp32 to bf16, rounding to nearest even (NaN stays NaN).
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

// One block of n tokens for `group` query heads: scores, online-softmax update, V accumulation.
static inline void attend_block(const float *restrict q, const float *restrict k,
                                const float *restrict v, int64_t n, int64_t group, int64_t dim,
                                float *restrict max, float *restrict sum, float *restrict acc) {
    float scores[MAX_GROUP * MAX_BLOCK];
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; d++) dot += q[g * dim + d] * k[t * dim + d];
            scores[g * MAX_BLOCK + t] = dot;
        }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * MAX_BLOCK;
        float new_max = max[g];
        for (int64_t t = 0; t < n; t++) new_max = s[t] > new_max ? s[t] : new_max;
        const float rescale = exp_neg(max[g] - new_max);
        max[g] = new_max;
        float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t t = 0; t < n; t++) {
            s[t] = exp_neg(s[t] - new_max);
            block_sum += s[t];
        }
        sum[g] = sum[g] * rescale + block_sum;
        float *a = acc + g * dim;
        for (int64_t d = 0; d < dim; d++) a[d] *= rescale;
        for (int64_t t = 0; t < n; t++) {
            const float p = s[t];
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) a[d] += p * v[t * dim + d];
        }
    }
}

// One (query token, KV head): attends positions [start, seq_len). With start > 0, positions
// before it were attended elsewhere (a shared prefix): `init_out` holds their softmax-weighted
// values and `init_lse` their log-sum-exp per head, which is exactly the online-softmax state
// (max = lse, sum = 1, acc = out) after them.
static void decode_one(const char *query, const char *cache, int dtype, int64_t token,
                       int64_t start, int64_t seq_len, const int32_t *table, const float *init_out,
                       const float *init_lse, int64_t kv_head, int64_t heads, int64_t kv_heads,
                       int64_t dim, int64_t block, float scale, char *out) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * dim;
    const int64_t esize = dtype == BF16 ? 2 : 4;
    float q[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM];
    float max[MAX_GROUP], sum[MAX_GROUP];
    float k[MAX_BLOCK * MAX_HEAD_DIM], v[MAX_BLOCK * MAX_HEAD_DIM];
    const int64_t first = (token * heads + kv_head * group) * dim; // first query/out element
    load_rows(query + first * esize, dtype, group, dim, dim, q);
    for (int64_t i = 0; i < group * dim; i++) {
        q[i] *= scale;
        acc[i] = 0.0f;
    }
    for (int64_t g = 0; g < group; g++) {
        max[g] = -1e30f; // finite, so the first rescale is exp(-huge) = 0, never inf - inf
        sum[g] = 0.0f;
    }
    if (start > 0) {
        for (int64_t g = 0; g < group; g++) {
            max[g] = init_lse[kv_head * group + g];
            sum[g] = 1.0f;
        }
        for (int64_t i = 0; i < group * dim; i++) acc[i] = init_out[kv_head * group * dim + i];
    }
    for (int64_t pos = start; pos < seq_len; pos += block) {
        const int64_t n = seq_len - pos < block ? seq_len - pos : block;
        const int64_t k_first = (int64_t)table[pos / block] * 2 * block * token_stride;
        const char *k_rows = cache + (k_first + kv_head * dim) * esize;
        load_rows(k_rows, dtype, n, dim, token_stride, k);
        load_rows(k_rows + block * token_stride * esize, dtype, n, dim, token_stride, v);
        attend_block(q, k, v, n, group, dim, max, sum, acc);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) {
            const float o = acc[g * dim + d] / sum[g];
            if (dtype == BF16)
                ((uint16_t *)out)[first + g * dim + d] = to_bf16(o);
            else
                ((float *)out)[first + g * dim + d] = o;
        }
}

// query and out: (num_tokens, heads, dim); token_index, seq_lens: (num_decodes,);
// block_tables: (num_decodes, table_stride). starts (or NULL: all 0) holds each decode's first
// position, a multiple of block; decodes with start > 0 read their shared-prefix state from
// init_out (num_decodes, heads, dim) and init_lse (num_decodes, heads), both fp32.
// Returns 0, or -1 for shapes beyond the limits.
int paged_decode(const void *query, const void *kv_cache, void *out, int dtype,
                 const int64_t *token_index, const int32_t *seq_lens, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *starts, const float *init_out,
                 const float *init_lse, int64_t num_decodes, int64_t heads, int64_t kv_heads,
                 int64_t dim, int64_t block, float scale, int num_threads) {
    if (dim > MAX_HEAD_DIM || block > MAX_BLOCK || heads % kv_heads || heads / kv_heads > MAX_GROUP)
        return -1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_decodes; i++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int32_t *table = block_tables + i * table_stride;
            const int64_t start = starts ? starts[i] : 0;
            const float *o = init_out ? init_out + i * heads * dim : 0;
            const float *lse = init_lse ? init_lse + i * heads : 0;
            // A constant head_dim lets the compiler unroll the inner loops for the usual size.
            if (dim == 64)
                decode_one(query, kv_cache, dtype, token_index[i], start, seq_lens[i], table, o,
                           lse, h, heads, kv_heads, 64, block, scale, out);
            else
                decode_one(query, kv_cache, dtype, token_index[i], start, seq_lens[i], table, o,
                           lse, h, heads, kv_heads, dim, block, scale, out);
        }
    return 0;
}
