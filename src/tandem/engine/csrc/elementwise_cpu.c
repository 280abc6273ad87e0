/*
 * Fused element-wise ops of the Llama block for the CPU, float32 (`_f32`) and bfloat16
 * (`_bf16`), rows in parallel. Each replaces a chain of 3-7 torch ops (and their
 * temporaries) by one pass over memory.
 *
 *   add_rms_norm: residual[t] += x[t] (skipped when x is NULL);
 *                 out[t] = weight * residual[t] / sqrt(mean(residual[t]^2) + eps)
 *                 x, residual, out: [T, H] contiguous; weight [H]
 *   silu_mul:     out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]
 *                 gate_up [T, 2I] contiguous, out [T, I] contiguous
 *   rope:         rotate-half RoPE in place on x[t, h, :] for h < num_heads, with
 *                 cos/sin tables [max_pos, D] (both halves equal) at positions[t];
 *                 x rows are `x_stride` floats apart, heads contiguous [num_heads, D]
 *
 * The bfloat16 variants take the same layouts with bfloat16 (uint16_t) x / residual / out /
 * gate_up / weight (strides in elements); RoPE's cos/sin tables stay float32. They compute in
 * float32 and round each stored value once to nearest even (bf16.h):
 *   add_rms_norm: residual[t] = bf16(residual[t] + x[t]); the sum of squares and the scaling
 *                 use that rounded residual: out[t] = bf16(weight * (r * inv))
 *   silu_mul:     out = bf16(silu(g) * u)
 *   rope:         x = bf16(rotated x)
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#pragma omp declare simd notinbranch
extern float expf(float);

/* add_rms_norm and rope are written once for both element types E: rows are widened by LD
 * and each stored value narrowed by ST (identities for float32). */
static inline float f32_same(float v) { return v; }

#define ADD_RMS_NORM(NAME, E, LD, ST)                                                      \
    void NAME(E *out, E *residual, const E *x, const E *weight, int64_t T, int64_t H,      \
              float eps, int64_t num_threads)                                              \
    {                                                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (T * H > 32768)") \
        for (int64_t t = 0; t < T; t++) {                                                  \
            E *restrict r = residual + t * H;                                              \
            E *restrict o = out + t * H;                                                   \
            float ss = 0.0f;                                                               \
            if (x != NULL) {                                                               \
                const E *restrict xi = x + t * H;                                          \
                _Pragma("omp simd reduction(+ : ss)")                                      \
                for (int64_t i = 0; i < H; i++) {                                          \
                    const E h = ST(LD(r[i]) + LD(xi[i]));                                  \
                    const float v = LD(h);                                                 \
                    r[i] = h;                                                              \
                    ss += v * v;                                                           \
                }                                                                          \
            } else {                                                                       \
                _Pragma("omp simd reduction(+ : ss)")                                      \
                for (int64_t i = 0; i < H; i++) {                                          \
                    const float v = LD(r[i]);                                              \
                    ss += v * v;                                                           \
                }                                                                          \
            }                                                                              \
            const float inv = 1.0f / sqrtf(ss / (float)H + eps);                           \
            _Pragma("omp simd")                                                            \
            for (int64_t i = 0; i < H; i++) o[i] = ST(LD(weight[i]) * (LD(r[i]) * inv));  \
        }                                                                                  \
    }

#define ROPE(NAME, E, LD, ST)                                                              \
    void NAME(E *x, const int64_t *positions, const float *cos_table,                     \
              const float *sin_table, int64_t T, int64_t num_heads, int64_t D,             \
              int64_t x_stride, int64_t num_threads)                                       \
    {                                                                                      \
        const int64_t half = D / 2;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (T * num_heads * D > 32768)") \
        for (int64_t t = 0; t < T; t++) {                                                  \
            const float *restrict c = cos_table + positions[t] * D;                        \
            const float *restrict s = sin_table + positions[t] * D;                        \
            for (int64_t h = 0; h < num_heads; h++) {                                      \
                E *restrict v = x + t * x_stride + h * D;                                  \
                _Pragma("omp simd")                                                        \
                for (int64_t i = 0; i < half; i++) {                                       \
                    const float a = LD(v[i]), b = LD(v[i + half]);                         \
                    v[i] = ST(a * c[i] - b * s[i]);                                        \
                    v[i + half] = ST(b * c[i + half] + a * s[i + half]);                   \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

ADD_RMS_NORM(tandem_add_rms_norm_f32, float, f32_same, f32_same)
ADD_RMS_NORM(tandem_add_rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16)
ROPE(tandem_rope_f32, float, f32_same, f32_same)
ROPE(tandem_rope_bf16, uint16_t, bf16_to_float, float_to_bf16)

void tandem_silu_mul_f32(float *out, const float *gate_up, int64_t T, int64_t I,
                         int64_t num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict g = gate_up + t * 2 * I;
        const float *restrict u = g + I;
        float *restrict o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---- bfloat16 -------------------------------------------------------------------------- */

/* floats of a row converted at a time through a stack buffer */
#define BF16_CHUNK 256

void tandem_silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t T, int64_t I,
                          int64_t num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I > 32768)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *restrict g = gate_up + t * 2 * I;
        const uint16_t *restrict u = g + I;
        uint16_t *restrict o = out + t * I;
        /* two passes per chunk: GCC vectorizes a loop with the vector expf, or one with
         * float_to_bf16's NaN select, not both in one */
        float buf[BF16_CHUNK];
        for (int64_t i0 = 0; i0 < I; i0 += BF16_CHUNK) {
            const int64_t n = I - i0 < BF16_CHUNK ? I - i0 : BF16_CHUNK;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                const float gi = bf16_to_float(g[i0 + i]);
                buf[i] = gi / (1.0f + expf(-gi)) * bf16_to_float(u[i0 + i]);
            }
            float_row_to_bf16(o + i0, buf, n);
        }
    }
}
