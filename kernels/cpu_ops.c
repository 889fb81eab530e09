// The small operations between a quantized decoder layer's matrix products, fused for the CPU
// (built on first use by cpu_ops.py, like cpu_attention.c).
//
// Around torch's int4/int8 kernels, which take and give bf16, a layer's glue is three fused
// passes instead of ~40 torch calls:
//
//   add_rms_norm   residual += x (the previous projection's bf16 output; first normalised by
//                  its own RMSNorm where the family norms a branch's output: Gemma's and OLMo
//                  2's post-norms), then the RMSNorm of the sum, rounded to bf16: the next
//                  projection's input (no norm: the sum itself, OLMo 2's)
//   rope_qkv       the qkv projection's bf16 output -> the rotated query (fp32), the rotated
//                  key and the value written into their KV-cache rows (fp32); with a qkv
//                  bias (Qwen2) added and q/k RMSNorm (per head: Qwen3, Gemma 3; over all
//                  heads: OLMo 2) first, when given
//   silu_mul       silu(gate) * up of the gate/up projection's bf16 output, rounded to bf16
//   gelu_tanh_mul  the same with tanh-approximated GELU (Gemma's GeGLU)
//
// A norm weight here is the factor the normalised value is multiplied by: Gemma's `1 + w`
// is passed as that sum (computed in fp32, as HF does).
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
// residual multiplier; 1: the same bits as none), with `x_norm` (NULL: none) the RMSNorm of
// that scaled x added instead, x_norm * (h * 1 / sqrt(mean(h^2) + eps)); out (rows, dim)
// bf16 = bf16(weight * (r * 1 / sqrt(mean(r^2) + eps))) of the updated residual r, or bf16(r)
// when weight is NULL.
void add_rms_norm(const uint16_t *x, const float *x_norm, float *residual, const float *weight,
                  uint16_t *out, int64_t rows, int64_t dim, float eps, float x_scale,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        float *r = residual + t * dim;
        if (x && x_norm) {
            float sum = 0.0f;
            for (int64_t d = 0; d < dim; d++) {
                const float h = bf16_to_f32(x[t * dim + d]) * x_scale;
                sum += h * h;
            }
            const float inv = 1.0f / __builtin_sqrtf(sum / (float)dim + eps);
            for (int64_t d = 0; d < dim; d++)
                r[d] += x_norm[d] * ((bf16_to_f32(x[t * dim + d]) * x_scale) * inv);
        } else if (x) {
            for (int64_t d = 0; d < dim; d++) r[d] += bf16_to_f32(x[t * dim + d]) * x_scale;
        }
        if (!weight) {
            for (int64_t d = 0; d < dim; d++) out[t * dim + d] = f32_to_bf16(r[d]);
            continue;
        }
        float sum = 0.0f;
        for (int64_t d = 0; d < dim; d++) sum += r[d] * r[d];
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[t * dim + d] = f32_to_bf16(weight[d] * (r[d] * inv));
    }
}

// Rotate one head (neox style: the two halves of its first 2 half dims turn by the same angles)
// from bf16 into fp32: out[i] = x[i] cos[i] - x[i + half] sin[i], out[i + half] = x[i + half]
// cos[i] + x[i] sin[i]; dims 2 half .. dim pass through (partial rotary: Phi-4-mini's 96 of 128).
static inline void rotate(const uint16_t *x, const float *cos, const float *sin, float *out,
                          int64_t half, int64_t dim) {
    for (int64_t i = 0; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        out[i] = a * cos[i] + -b * sin[i];
        out[i + half] = b * cos[i] + a * sin[i];
    }
    for (int64_t d = 2 * half; d < dim; d++) out[d] = bf16_to_f32(x[d]);
}

// RMSNorm of `out` (dim,) fp32 in place, HF's arithmetic in fp32:
// norm * (h * 1 / sqrt(mean(h^2) + eps)).
static inline void norm_f32(float *out, const float *norm, float eps, int64_t dim) {
    float sum = 0.0f;
    for (int64_t d = 0; d < dim; d++) sum += out[d] * out[d];
    const float inv = 1.0f / __builtin_sqrtf(sum / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) out[d] = norm[d] * (out[d] * inv);
}

// One head of the bias-or-norm path into `out` fp32: x (bf16) + bias (NULL: none), then with
// `norm` (NULL: none) HF's per-head RMSNorm (norm_f32), then its first 2 half dims rotated in
// place (each pair i, i + half read before it is written; cos NULL: not rotated, a NoPE
// layer's). `load` 0: `out` holds the head already (loaded, biased and normalised over all
// heads).
static inline void head_f32(const uint16_t *x, const float *bias, const float *norm, float eps,
                            const float *cos, const float *sin, float *out, int64_t dim,
                            int64_t half, int load) {
    if (load) {
        for (int64_t d = 0; d < dim; d++) out[d] = bf16_to_f32(x[d]);
        if (bias)
            for (int64_t d = 0; d < dim; d++) out[d] += bias[d];
        if (norm) norm_f32(out, norm, eps, dim);
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
// key at row key_rows[t], value at key_rows[t] + block_size. cos_sin (positions, rot_dim): the
// cos of each angle, then its sin; the first rot_dim dims of each head turn (rot_dim < dim:
// partial rotary, the rest as they are). `bias` ((heads + 2 kv_heads) * dim fp32, Qwen2's) is added
// to q, k and v; `q_norm` / `k_norm` ((dim,) fp32, Qwen3's; both or neither) normalise each
// query / key head before it turns. All three NULL (Llama): the bf16 values turn directly,
// the same bits as the fp32 path would give, with no pass over a copy. cos_sin NULL: q and k
// are not rotated (SmolLM3's NoPE layers). `norm_all_heads`: q_norm / k_norm are
// ((heads * dim,) / (kv_heads * dim,)) and normalise the whole query / key of a token at once
// (OLMo 2's), not each head.
void rope_qkv(const uint16_t *qkv, float *query, float *cache_rows, const int64_t *key_rows,
              const int64_t *positions, const float *cos_sin, int64_t tokens, int64_t heads,
              int64_t kv_heads, int64_t dim, int64_t rot_dim, int64_t block_size,
              const float *bias, const float *q_norm, const float *k_norm, int norm_all_heads,
              float eps, int num_threads) {
    const int64_t half = rot_dim / 2, width = (heads + 2 * kv_heads) * dim, row = kv_heads * dim;
    const int plain = !bias && !q_norm && !k_norm && cos_sin;
#pragma omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *src = qkv + t * width;
        const float *cos = cos_sin ? cos_sin + positions[t] * rot_dim : NULL;
        const float *sin = cos ? cos + half : NULL;
        float *key = cache_rows + key_rows[t] * row, *value = key + block_size * row;
        const uint16_t *v = src + (heads + kv_heads) * dim;
        if (plain) {
            for (int64_t h = 0; h < heads; h++)
                rotate(src + h * dim, cos, sin, query + (t * heads + h) * dim, half, dim);
            for (int64_t h = 0; h < kv_heads; h++)
                rotate(src + (heads + h) * dim, cos, sin, key + h * dim, half, dim);
            for (int64_t d = 0; d < row; d++) value[d] = bf16_to_f32(v[d]);
            continue;
        }
        float *q = query + t * heads * dim;
        if (norm_all_heads && q_norm) { // load and bias every head, then one norm over them
            for (int64_t d = 0; d < heads * dim; d++)
                q[d] = bf16_to_f32(src[d]) + (bias ? bias[d] : 0.0f);
            for (int64_t d = 0; d < row; d++)
                key[d] = bf16_to_f32(src[heads * dim + d]) + (bias ? bias[heads * dim + d] : 0.0f);
            norm_f32(q, q_norm, eps, heads * dim);
            norm_f32(key, k_norm, eps, row);
        }
        const int load = !(norm_all_heads && q_norm);
        const float *qn = load ? q_norm : NULL, *kn = load ? k_norm : NULL;
        for (int64_t h = 0; h < heads; h++)
            head_f32(src + h * dim, bias ? bias + h * dim : NULL, qn, eps, cos, sin, q + h * dim,
                     dim, half, load);
        for (int64_t h = 0; h < kv_heads; h++)
            head_f32(src + (heads + h) * dim, bias ? bias + (heads + h) * dim : NULL, kn, eps,
                     cos, sin, key + h * dim, dim, half, load);
        const float *v_bias = bias ? bias + (heads + kv_heads) * dim : NULL;
        for (int64_t d = 0; d < row; d++)
            value[d] = v_bias ? bf16_to_f32(v[d]) + v_bias[d] : bf16_to_f32(v[d]);
    }
}

// The gated MLP's activations of 16 gates: silu(g) = g * sigmoid(g), and Gemma's
// gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), which is
// g * sigmoid(2 y) (1 + tanh(y) = 2 sigmoid(2 y)): no 1 + tanh cancelling for negative g.
// sigmoid(z) from exp(-|z|), which cannot overflow.
#define ACT_SILU 0
#define ACT_GELU_TANH 1

static inline vf act16(vf g, int act) {
    vf z = g;
    if (act == ACT_GELU_TANH) z = 1.5957691216057308f * (g + 0.044715f * (g * g * g)); // 2y
    const vf e = exp_neg((vf)((vu)z | 0x80000000u)); // exp(-|z|)
    const vf sig =
        (vf)(((vi)(1.0f / (1.0f + e)) & (z >= 0)) | ((vi)(e / (1.0f + e)) & ~(z >= 0)));
    return g * sig;
}

// gate_up (rows, 2 * size) bf16, gate then up -> out (rows, size) bf16 = act(gate) * up.
static void gated_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t size,
                      int act, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *gate = gate_up + t * 2 * size, *up = gate + size;
        for (int64_t i = 0; i < size; i += 16) {
            const int64_t n = size - i < 16 ? size - i : 16;
            vf g = {0}, u = {0};
            for (int j = 0; j < n; j++) {
                g[j] = bf16_to_f32(gate[i + j]);
                u[j] = bf16_to_f32(up[i + j]);
            }
            const vf y = act16(g, act) * u;
            for (int j = 0; j < n; j++) out[t * size + i + j] = f32_to_bf16(y[j]);
        }
    }
}

void silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t size,
              int num_threads) {
    gated_mul(gate_up, out, rows, size, ACT_SILU, num_threads);
}

void gelu_tanh_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t size,
                   int num_threads) {
    gated_mul(gate_up, out, rows, size, ACT_GELU_TANH, num_threads);
}

// ---- A whole decoder in one call ----------------------------------------------------------
//
// decoder_forward runs every layer of a step as LlamaForCausalLM's forward_fused does, layer
// after layer, with the same operations in the same order (so the same bits): add_rms_norm
// (with the previous layer's MLP output norm, if any), the qkv projection, rope_qkv (with the
// layer's qkv bias, q/k norms and rope table, if any), attention (the layer's window and
// soft-cap, over its KV cache group's block table), the output projection of its bf16
// rounding, add_rms_norm (with the attention output norm, if any), gate_up, silu_mul or
// gelu_tanh_mul, down; or, for a sparse MoE layer, its whole MLP in one call (what the
// layer-by-layer path calls for it). The products, attention and the MoE MLP are the other
// libraries' (ggml_quants.c's ggml_linear_packed, cpu_attention.c's paged_attention,
// ggml_experts.c's moe_forward), called through pointers. From Python the same layer is ~10
// calls of ~10 us each: a quarter of a decoded token's time on a small model (cpu_decoder.py
// has the figures).

#define MAX_PARTS 4
// moe_forward's arguments: 14, then 6 per gate_up part (at most 2) and 6 for down
#define MOE_ARGS (14 + 6 * 3)

typedef int (*linear_fn)(const int64_t *args);
typedef int (*moe_fn)(const int64_t *args);
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
    // (hidden,) fp32: the norms before attention and the MLP (NULL: none, OLMo 2's layer
    // reads the residual itself) and after each on its output (NULL: none, Llama's)
    const float *input_norm, *post_norm, *attn_output_norm, *mlp_output_norm;
    float *kv_cache; // (NB, 2, BS, kv_heads, head_dim) fp32
    Projection qkv, o, gate_up, down;
    // rope_qkv's: the qkv bias ((heads + 2 kv_heads) * head_dim) and the q/k norms (per head
    // (head_dim,), or over all heads with norm_all_heads), all fp32; NULL for a layer without
    // them (Llama).
    const float *qkv_bias, *q_norm, *k_norm;
    const float *cos_sin; // rope_qkv's table (positions, rot_dim); NULL: a NoPE layer
    int64_t norm_all_heads, window, group; // window 0: none; group: the KV cache group's
    float softcap;                         // of the attention scores; 0: none
    // A sparse MoE MLP (NULL: the dense gate_up and down): moe_forward and the layer's
    // arguments to it, whose x, T, out and num_threads (0, 1, 10, 12) each call fills in.
    moe_fn moe;
    const int64_t *moe_args;
} Layer;

// The step's shapes, metadata and buffers. `residual` (T, hidden) fp32 holds the embeddings
// and is updated in place; `out` (T, hidden) bf16 receives the last layer's down projection
// (unsummed and without its output norm, as forward_fused returns it). Each KV cache group
// g has its own key rows and block table (key_rows[g], block_tables[g] of table_strides[g]
// columns). On failure, `failed_layer` and `failed_op` (1 a projection, 2 attention, 3 the
// MoE MLP) say where, and the callee's status is returned.
typedef struct {
    int64_t tokens, hidden, intermediate, heads, kv_heads, head_dim, block_size;
    int64_t rot_dim; // rope_qkv's: the dims of each head that turn (head_dim, or fewer)
    float eps, scale, residual_scale; // residual_scale: add_rms_norm's x_scale (Granite's)
    int64_t num_threads, act;         // act: ACT_SILU or ACT_GELU_TANH
    const int64_t *positions;
    const int64_t *const *key_rows;
    const int32_t *query_start_loc, *seq_lens;
    const int32_t *const *block_tables;
    const int64_t *table_strides;
    int64_t num_requests;
    float *residual, *query, *attn;
    uint16_t *out, *normed, *qkv, *attn_bf16, *gate_up, *act_out;
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

// out (T, hidden) bf16 = the layer's MoE MLP of normed (T, hidden) bf16 (moe_forward).
static int moe_mlp(const Step *s, const Layer *layer) {
    int64_t args[MOE_ARGS];
    const int64_t n = 14 + 6 * (layer->moe_args[13] + 1);
    if (layer->moe_args[13] < 1 || n > MOE_ARGS) return -1;
    memcpy(args, layer->moe_args, n * sizeof(int64_t));
    args[0] = (int64_t)(intptr_t)s->normed;
    args[1] = s->tokens;
    args[10] = (int64_t)(intptr_t)s->out;
    args[12] = s->num_threads;
    return layer->moe(args);
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
        const int64_t g = layer->group;
        add_rms_norm(l ? s->out : NULL, l ? layers[l - 1].mlp_output_norm : NULL, s->residual,
                     layer->input_norm, s->normed, rows, dim, s->eps, s->residual_scale, nt);
        if ((rc = project(s, &layer->qkv, s->normed, s->qkv))) return failed(s, l, 1, rc);
        rope_qkv(s->qkv, s->query, layer->kv_cache, s->key_rows[g], s->positions,
                 layer->cos_sin, rows, s->heads, s->kv_heads, s->head_dim, s->rot_dim,
                 s->block_size, layer->qkv_bias, layer->q_norm, layer->k_norm,
                 (int)layer->norm_all_heads, s->eps, nt);
        rc = s->attention(s->query, layer->kv_cache, s->attn, 0, s->query_start_loc,
                          s->seq_lens, s->block_tables[g], s->table_strides[g], s->num_requests,
                          s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale,
                          layer->window, layer->softcap, nt);
        if (rc) return failed(s, l, 2, rc);
        to_bf16(s->attn, s->attn_bf16, rows, s->heads * s->head_dim, nt);
        if ((rc = project(s, &layer->o, s->attn_bf16, s->out))) return failed(s, l, 1, rc);
        add_rms_norm(s->out, layer->attn_output_norm, s->residual, layer->post_norm, s->normed,
                     rows, dim, s->eps, s->residual_scale, nt);
        if (layer->moe) {
            if ((rc = moe_mlp(s, layer))) return failed(s, l, 3, rc);
            continue;
        }
        if ((rc = project(s, &layer->gate_up, s->normed, s->gate_up))) return failed(s, l, 1, rc);
        gated_mul(s->gate_up, s->act_out, rows, s->intermediate, (int)s->act, nt);
        if ((rc = project(s, &layer->down, s->act_out, s->out))) return failed(s, l, 1, rc);
    }
    return 0;
}
