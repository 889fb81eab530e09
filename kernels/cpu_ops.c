// The small operations between a quantized decoder layer's matrix products, fused for the CPU
// (built on first use by cpu_ops.py, like cpu_attention.c).
//
// Around torch's int4/int8 kernels, which take and give bf16, a layer's glue is three fused
// passes instead of ~40 torch calls:
//
//   add_rms_norm   residual += x (the previous projection's bf16 output), then the RMSNorm of
//                  the sum, rounded to bf16: the next projection's input
//   rope_qkv       the qkv projection's bf16 output -> the rotated query (fp32), the rotated
//                  key and the value written into their KV-cache rows (fp32); with a qkv
//                  bias (Qwen2) added and q/k RMSNorm per head (Qwen3) first, when given
//   silu_mul       silu(gate) * up of the gate/up projection's bf16 output, rounded to bf16
//
// The arithmetic is the model's fp32 arithmetic (HF Llama's order of operations): the values
// a projection sees differ from the torch path's only by fp32 rounding (a sum's order, exp's
// last bit). Rows run on OpenMP threads when a step has many; one row runs on the caller's.

#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define PARALLEL_ROWS 8 // fewer rows than this run on one thread: a fork costs more

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// residual (rows, dim) fp32 += x (bf16, or nothing when x is NULL) * x_scale (Granite's
// residual multiplier; 1: the same bits as none); out (rows, dim) bf16 =
// bf16(weight * (r * 1 / sqrt(mean(r^2) + eps))) of the updated residual r.
void add_rms_norm(const uint16_t *x, float *residual, const float *weight, uint16_t *out,
                  int64_t rows, int64_t dim, float eps, float x_scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        float *r = residual + t * dim;
        if (x)
            for (int64_t d = 0; d < dim; d++) r[d] += bf16_to_f32(x[t * dim + d]) * x_scale;
        float sum = 0.0f;
        for (int64_t d = 0; d < dim; d++) sum += r[d] * r[d];
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[t * dim + d] = f32_to_bf16(weight[d] * (r[d] * inv));
    }
}

// Rotate one head (neox style: the two halves of `dim` turn by the same angles) from bf16 into
// fp32: out[i] = x[i] cos[i] - x[i + half] sin[i], out[i + half] = x[i + half] cos[i] + x[i] sin[i].
static inline void rotate(const uint16_t *x, const float *cos, const float *sin, float *out,
                          int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        out[i] = a * cos[i] + -b * sin[i];
        out[i + half] = b * cos[i] + a * sin[i];
    }
}

// One head of the bias-or-norm path into `out` fp32: x (bf16) + bias (NULL: none), then with
// `norm` (NULL: none) HF's per-head RMSNorm in fp32, norm * (h * 1 / sqrt(mean(h^2) + eps)),
// then rotated in place (each pair i, i + half read before it is written; cos NULL: not
// rotated, a NoPE layer's).
static inline void head_f32(const uint16_t *x, const float *bias, const float *norm, float eps,
                            const float *cos, const float *sin, float *out, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < dim; d++) out[d] = bf16_to_f32(x[d]);
    if (bias)
        for (int64_t d = 0; d < dim; d++) out[d] += bias[d];
    if (norm) {
        float sum = 0.0f;
        for (int64_t d = 0; d < dim; d++) sum += out[d] * out[d];
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[d] = norm[d] * (out[d] * inv);
    }
    if (!cos) return;
    for (int64_t i = 0; i < half; i++) {
        const float a = out[i], b = out[i + half];
        out[i] = a * cos[i] + -b * sin[i];
        out[i + half] = b * cos[i] + a * sin[i];
    }
}

// qkv (tokens, (heads + 2 kv_heads) * dim) bf16 -> query (tokens, heads, dim) fp32 rotated; the
// rotated key and the value of token t into the cache viewed as rows (.., kv_heads, dim) fp32:
// key at row key_rows[t], value at key_rows[t] + block_size. cos_sin (positions, dim): the
// cos of each angle, then its sin. `bias` ((heads + 2 kv_heads) * dim fp32, Qwen2's) is added
// to q, k and v; `q_norm` / `k_norm` ((dim,) fp32, Qwen3's; both or neither) normalise each
// query / key head before it turns. All three NULL (Llama): the bf16 values turn directly,
// the same bits as the fp32 path would give, with no pass over a copy. cos_sin NULL: q and k
// are not rotated (SmolLM3's NoPE layers).
void rope_qkv(const uint16_t *qkv, float *query, float *cache_rows, const int64_t *key_rows,
              const int64_t *positions, const float *cos_sin, int64_t tokens, int64_t heads,
              int64_t kv_heads, int64_t dim, int64_t block_size, const float *bias,
              const float *q_norm, const float *k_norm, float eps, int num_threads) {
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, row = kv_heads * dim;
    const int plain = !bias && !q_norm && !k_norm && cos_sin;
#pragma omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *src = qkv + t * width;
        const float *cos = cos_sin ? cos_sin + positions[t] * dim : NULL;
        const float *sin = cos ? cos + half : NULL;
        float *key = cache_rows + key_rows[t] * row, *value = key + block_size * row;
        const uint16_t *v = src + (heads + kv_heads) * dim;
        if (plain) {
            for (int64_t h = 0; h < heads; h++)
                rotate(src + h * dim, cos, sin, query + (t * heads + h) * dim, half);
            for (int64_t h = 0; h < kv_heads; h++)
                rotate(src + (heads + h) * dim, cos, sin, key + h * dim, half);
            for (int64_t d = 0; d < row; d++) value[d] = bf16_to_f32(v[d]);
            continue;
        }
        for (int64_t h = 0; h < heads; h++)
            head_f32(src + h * dim, bias ? bias + h * dim : NULL, q_norm, eps, cos, sin,
                     query + (t * heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; h++)
            head_f32(src + (heads + h) * dim, bias ? bias + (heads + h) * dim : NULL, k_norm, eps,
                     cos, sin, key + h * dim, dim);
        const float *v_bias = bias ? bias + (heads + kv_heads) * dim : NULL;
        for (int64_t d = 0; d < row; d++)
            value[d] = v_bias ? bf16_to_f32(v[d]) + v_bias[d] : bf16_to_f32(v[d]);
    }
}

// gate_up (rows, 2 * size) bf16, gate then up -> out (rows, size) bf16 = silu(gate) * up, with
// silu(g) = g * sigmoid(g) and sigmoid from exp(-|g|), which cannot overflow.
void silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t size,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *gate = gate_up + t * 2 * size, *up = gate + size;
        int64_t i = 0;
        for (; i + 16 <= size; i += 16) {
            vf g, u;
            for (int j = 0; j < 16; j++) {
                g[j] = bf16_to_f32(gate[i + j]);
                u[j] = bf16_to_f32(up[i + j]);
            }
            const vf e = exp_neg((vf)((vu)g | 0x80000000u)); // exp(-|g|)
            const vf sig = (vf)(((vi)(1.0f / (1.0f + e)) & (g >= 0)) |
                                ((vi)(e / (1.0f + e)) & ~(g >= 0)));
            const vf y = g * sig * u;
            for (int j = 0; j < 16; j++) out[t * size + i + j] = f32_to_bf16(y[j]);
        }
        for (; i < size; i++) {
            const float g = bf16_to_f32(gate[i]), u = bf16_to_f32(up[i]);
            const float e = exp_neg1(-__builtin_fabsf(g));
            const float sig = g >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
            out[t * size + i] = f32_to_bf16(g * sig * u);
        }
    }
}

// ---- A whole decoder in one call ----------------------------------------------------------
//
// decoder_forward runs every layer of a step as LlamaForCausalLM's forward_fused does, layer
// after layer, with the same operations in the same order (so the same bits): add_rms_norm,
// the qkv projection, rope_qkv (with the layer's qkv bias and q/k norms, if any), attention,
// the output projection of its bf16 rounding, add_rms_norm, gate_up, silu_mul, down. The products and attention are the other libraries'
// (ggml_quants.c's ggml_linear_packed, cpu_attention.c's paged_attention), called through
// pointers. From Python the same layer is ~10 calls of ~10 us each: a quarter of a decoded
// token's time on a small model (cpu_decoder.py has the figures).

#define MAX_PARTS 4

typedef int (*linear_fn)(const int64_t *args);
typedef int (*attention_fn)(const void *query, const void *kv_cache, void *out, int dtype,
                            const int32_t *query_start_loc, const int32_t *seq_lens,
                            const int32_t *block_tables, int64_t table_stride,
                            int64_t num_requests, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block, float scale, int64_t window, float softcap,
                            int num_threads);

// One block-format weight of a projection: its rows are the projection's outputs from the
// previous parts' total on (a fused qkv whose v is another type than q and k).
typedef struct {
    const void *weight;
    int64_t stride, qtype, rows, interleaved;
} Part;

typedef struct {
    int64_t in_features, out_features, num_parts;
    Part parts[MAX_PARTS];
} Projection;

typedef struct {
    const float *input_norm, *post_norm; // (hidden,) fp32
    float *kv_cache;                     // (NB, 2, BS, kv_heads, head_dim) fp32
    Projection qkv, o, gate_up, down;
    // rope_qkv's: the qkv bias ((heads + 2 kv_heads) * head_dim) and the per-head q/k norms
    // ((head_dim,)), all fp32; NULL for a layer without them (Llama).
    const float *qkv_bias, *q_norm, *k_norm;
    const float *cos_sin; // rope_qkv's table (positions, head_dim); NULL: a NoPE layer
} Layer;

// The step's shapes, metadata and buffers. `residual` (T, hidden) fp32 holds the embeddings
// and is updated in place; `out` (T, hidden) bf16 receives the last layer's down projection
// (unsummed, as forward_fused returns it). On failure, `failed_layer` and `failed_op` (1 a
// projection, 2 attention) say where, and the callee's status is returned.
typedef struct {
    int64_t tokens, hidden, intermediate, heads, kv_heads, head_dim, block_size;
    float eps, scale, residual_scale; // residual_scale: add_rms_norm's x_scale (Granite's)
    int64_t num_threads;
    const int64_t *positions, *key_rows;
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    int64_t table_stride, num_requests;
    float *residual, *query, *attn;
    uint16_t *out, *normed, *qkv, *attn_bf16, *gate_up, *act;
    linear_fn linear;
    attention_fn attention;
    int64_t failed_layer, failed_op;
} Step;

// out (T, p->out_features) bf16 = x (T, p->in_features) bf16 @ W.T, part by part.
static int project(const Step *s, const Projection *p, const uint16_t *x, uint16_t *out) {
    int64_t col = 0;
    for (int64_t i = 0; i < p->num_parts; i++) {
        const Part *w = &p->parts[i];
        const int64_t args[13] = {(int64_t)(intptr_t)x, 1, s->tokens, p->in_features,
                                  (int64_t)(intptr_t)w->weight, w->stride, w->qtype, w->rows,
                                  (int64_t)(intptr_t)(out + col), p->out_features, 1,
                                  s->num_threads, w->interleaved};
        const int rc = s->linear(args);
        if (rc) return rc;
        col += w->rows;
    }
    return 0;
}

static void to_bf16(const float *x, uint16_t *out, int64_t rows, int64_t width,
                    int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t i = 0; i < width; i++) out[t * width + i] = f32_to_bf16(x[t * width + i]);
}

static int failed(Step *s, int64_t layer, int64_t op, int rc) {
    s->failed_layer = layer;
    s->failed_op = op;
    return rc;
}

int decoder_forward(Step *s, const Layer *layers, int64_t num_layers) {
    const int64_t rows = s->tokens, dim = s->hidden;
    const int nt = (int)s->num_threads;
    int rc;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *layer = &layers[l];
        add_rms_norm(l ? s->out : NULL, s->residual, layer->input_norm, s->normed, rows, dim,
                     s->eps, s->residual_scale, nt);
        if ((rc = project(s, &layer->qkv, s->normed, s->qkv))) return failed(s, l, 1, rc);
        rope_qkv(s->qkv, s->query, layer->kv_cache, s->key_rows, s->positions, layer->cos_sin,
                 rows, s->heads, s->kv_heads, s->head_dim, s->block_size, layer->qkv_bias,
                 layer->q_norm, layer->k_norm, s->eps, nt);
        rc = s->attention(s->query, layer->kv_cache, s->attn, 0, s->query_start_loc,
                          s->seq_lens, s->block_tables, s->table_stride, s->num_requests,
                          s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale, 0, 0.0f,
                          nt);
        if (rc) return failed(s, l, 2, rc);
        to_bf16(s->attn, s->attn_bf16, rows, s->heads * s->head_dim, nt);
        if ((rc = project(s, &layer->o, s->attn_bf16, s->out))) return failed(s, l, 1, rc);
        add_rms_norm(s->out, s->residual, layer->post_norm, s->normed, rows, dim, s->eps,
                     s->residual_scale, nt);
        if ((rc = project(s, &layer->gate_up, s->normed, s->gate_up))) return failed(s, l, 1, rc);
        silu_mul(s->gate_up, s->act, rows, s->intermediate, nt);
        if ((rc = project(s, &layer->down, s->act, s->out))) return failed(s, l, 1, rc);
    }
    return 0;
}
