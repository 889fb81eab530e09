// Vectors of 16 floats and exp for x <= 0, shared by the kernels package's C sources
// (cpu_attention.c, cpu_ops.c). GCC/Clang vector extensions: one source serves AVX-512, AVX2
// and narrower targets. The build (cpu_build.py) hashes this header with each source.

#ifndef AGENTRT_CPU_VEC_H
#define AGENTRT_CPU_VEC_H

#include <stdint.h>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

static inline vf splat(float x) { return (vf){0} + x; }

// exp(x) for x <= 0 (softmax arguments): 2^n * 2^f with n = round(x * log2 e), |f| <= 1/2, and
// 2^f from its degree-6 minimax polynomial (relative error < 2e-7).
static inline vf exp_neg(vf x) {
    const vf floor = splat(-87.0f);
    x = (vf)(((vi)x & (x >= floor)) | ((vi)floor & ~(x >= floor)));
    const vf t = x * 1.44269504088896341f;
    const vf n = (t + 12582912.0f) - 12582912.0f; // round to nearest (|t| < 2^22)
    const vf f = t - n;
    vf p = splat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

static inline float exp_neg1(float x) { return exp_neg(splat(x))[0]; }

#endif
