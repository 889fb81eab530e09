// The small operations between a quantized decoder layer's matrix products, fused for the CPU
// (built on first use by cpu_ops.py, like cpu_attention.c).
//
// Around torch's int4/int8 kernels, which take and give bf16, a layer's glue is three fused
// passes instead of ~40 torch calls:
//
//   add_rms_norm   residual += x (the previous projection's bf16 output), then the RMSNorm of
//                  the sum, rounded to bf16: the next projection's input
//   rope_qkv       the qkv projection's bf16 output -> the rotated query (fp32), the rotated
//                  key and the value written into their KV-cache rows (fp32)
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

// residual (rows, dim) fp32 += x (bf16, or nothing when x is NULL); out (rows, dim) bf16 =
// bf16(weight * (r * 1 / sqrt(mean(r^2) + eps))) of the updated residual r.
void add_rms_norm(const uint16_t *x, float *residual, const float *weight, uint16_t *out,
                  int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        float *r = residual + t * dim;
        if (x)
            for (int64_t d = 0; d < dim; d++) r[d] += bf16_to_f32(x[t * dim + d]);
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

// qkv (tokens, (heads + 2 kv_heads) * dim) bf16 -> query (tokens, heads, dim) fp32 rotated; the
// rotated key and the value of token t into the cache viewed as rows (.., kv_heads, dim) fp32:
// key at row key_rows[t], value at key_rows[t] + block_size. cos_sin (positions, dim): the
// cos of each angle, then its sin.
void rope_qkv(const uint16_t *qkv, float *query, float *cache_rows, const int64_t *key_rows,
              const int64_t *positions, const float *cos_sin, int64_t tokens, int64_t heads,
              int64_t kv_heads, int64_t dim, int64_t block_size, int num_threads) {
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, row = kv_heads * dim;
#pragma omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *src = qkv + t * width;
        const float *cos = cos_sin + positions[t] * dim, *sin = cos + half;
        for (int64_t h = 0; h < heads; h++)
            rotate(src + h * dim, cos, sin, query + (t * heads + h) * dim, half);
        float *key = cache_rows + key_rows[t] * row, *value = key + block_size * row;
        for (int64_t h = 0; h < kv_heads; h++)
            rotate(src + (heads + h) * dim, cos, sin, key + h * dim, half);
        for (int64_t d = 0; d < row; d++) value[d] = bf16_to_f32(src[(heads + kv_heads) * dim + d]);
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
