/*
 * Fused element-wise ops of the Llama block for the CPU, float32, rows in parallel.
 * Each replaces a chain of 3-7 torch ops (and their temporaries) by one pass over memory.
 *
 *   add_rms_norm: residual[t] += x[t] (skipped when x is NULL);
 *                 out[t] = weight * residual[t] / sqrt(mean(residual[t]^2) + eps)
 *                 x, residual, out: [T, H] contiguous; weight [H]
 *   silu_mul:     out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]
 *                 gate_up [T, 2I] contiguous, out [T, I] contiguous
 *   rope:         rotate-half RoPE in place on x[t, h, :] for h < num_heads, with
 *                 cos/sin tables [max_pos, D] (both halves equal) at positions[t];
 *                 x rows are `x_stride` floats apart, heads contiguous [num_heads, D]
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#pragma omp declare simd notinbranch
extern float expf(float);

void tandem_add_rms_norm_f32(float *out, float *residual, const float *x, const float *weight,
                             int64_t T, int64_t H, float eps, int64_t num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H > 32768)
    for (int64_t t = 0; t < T; t++) {
        float *restrict r = residual + t * H;
        float *restrict o = out + t * H;
        float ss = 0.0f;
        if (x != NULL) {
            const float *restrict xi = x + t * H;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) {
                const float v = r[i] + xi[i];
                r[i] = v;
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) ss += r[i] * r[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = weight[i] * (r[i] * inv);
    }
}

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

void tandem_rope_f32(float *x, const int64_t *positions, const float *cos_table,
                     const float *sin_table, int64_t T, int64_t num_heads, int64_t D,
                     int64_t x_stride, int64_t num_threads)
{
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * num_heads * D > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cos_table + positions[t] * D;
        const float *restrict s = sin_table + positions[t] * D;
        for (int64_t h = 0; h < num_heads; h++) {
            float *restrict v = x + t * x_stride + h * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
