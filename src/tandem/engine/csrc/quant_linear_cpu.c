/* Weight-only INT8 / INT4 linear layers on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
 * float32 activations, W kept compressed in 16-column panels (engine/quant's CPU layout):
 *
 *   int8: codes [P][K][16] int8 (signed), P = ceil(N/16), zero-padded columns
 *   int4: codes [P][K/2][16] uint8, byte [p][j][c] = k 2j (low nibble) | k 2j+1 (high nibble)
 *   scales, mins (mins may be NULL): [P][K/g][16] IEEE float16 bits
 *   w[n, k] = code * scale[n, k/g] + min[n, k/g]
 *
 * Two paths, both OpenMP over panels (static, so every thread streams a contiguous range):
 *  - few rows (decode): codes are widened to float in registers as they stream in, each
 *    group's partial dot products sum_k x_k q_k are kept apart (independent FMA chains for
 *    one or two rows) and folded once per group: y += s * partial + m * sum_k x_k (the
 *    per-group sums of x are computed once per call). Reading the weights is the cost here.
 *  - many rows (prefill): each panel is dequantized once per block of rows into a float
 *    [K][16] scratch (code * scale + min, two roundings: exactly GroupedWeight.dequantize)
 *    and multiplied by tile_avx2.h's 6x16 register tile, the float32 GEMM's own code, so
 *    this path computes bit for bit what tandem_linear_packed_f32 computes on the
 *    dequantized weight.
 * mode: 0 = pick by M (few rows: up to QL_FEW_ROWS_*), 1 = few-rows path, 2 = scratch.
 * Measured (bench/quant_micro.py, 2 threads on this shared 2-core AVX2 VM, best of 7, one
 * forward's 121 SmolLM2-135M linears, cold weights): 1 row f32 72 ms, int8 23, int4 16;
 * 16 rows 145 / 120 / 100 ms; 256 rows within +-10 % of f32.
 * The two paths round differently (the fold vs the dequantized weight), so a row's output
 * can differ in the last bits between a step of <= 16 rows and a larger one.
 * Without AVX2 + FMA + F16C: a scalar loop with the few-rows arithmetic (mode ignored).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#include "tile_avx2.h"
#endif

#define QL_NR 16              /* panel width */
/* auto mode: the register path up to this many rows (measured crossovers, one thread,
 * 3072 x 576: int8 ~16 rows, int4 ~10 rows, where its nibble unpacking per 4-row tile costs
 * more than one dequantized panel) */
#define QL_FEW_ROWS_I8 16
#define QL_FEW_ROWS_I4 8
#define QL_MC_BYTES (768 * 1024) /* activation rows per block of the scratch path (L2) */
#ifndef QL_PREFETCH
#define QL_PREFETCH 1024 /* bytes of panel prefetched ahead on the few-rows path */
#endif

/* per-group sums of x: xs[m * G + gi] = sum of x[m, gi*g .. gi*g + g) (sequential) */
static float *ql_group_sums(const float *x, int64_t M, int64_t K, int64_t g) {
    const int64_t G = K / g;
    float *xs = malloc((size_t)(M * G > 0 ? M * G : 1) * sizeof(float));
    if (!xs) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < G; gi++) {
            float s = 0.0f;
            for (int64_t k = gi * g; k < gi * g + g; k++) s += x[m * K + k];
            xs[m * G + gi] = s;
        }
    return xs;
}

#ifdef QL_AVX2

static int ql_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline __attribute__((always_inline)) __m256 ql_h8(const uint16_t *h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* widen 16 int8 codes (one panel line) to two float vectors */
static inline __attribute__((always_inline)) void ql_i8_line(const uint8_t *q, __m256 *b0,
                                                             __m256 *b1) {
    *b0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    *b1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
}

/* one int4 panel line (k = 2j, 2j + 1 for 16 columns) as widened integer vectors */
static inline __attribute__((always_inline)) void ql_i4_line(const uint8_t *q, __m256i *w0,
                                                             __m256i *w1) {
    *w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    *w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
}

/* One panel, mr <= 4 rows (a constant after inlining), few-rows path; BITS 8 or 4.
 * CH independent accumulator chains per row and half-line (8 FMA chains in all at 1-2
 * rows, covering the FMA latency); the running totals stay in registers up to 2 rows and
 * in a small stack array beyond (touched once per group), so the inner loop never spills. */
static inline __attribute__((always_inline)) void ql_few(
        const int BITS, const float *restrict x, int64_t K, int64_t g,
        const uint8_t *restrict panel, const uint16_t *restrict ps,
        const uint16_t *restrict pm, const float *restrict xs, float *restrict y,
        int64_t ldy, const int mr, int64_t ncols, const float *restrict bias) {
    const int64_t G = K / g;
    const int CH = mr == 1 ? 4 : mr == 2 ? 2 : 1;
    const int in_regs = mr <= 2;
    __m256 t0[2], t1[2];
    float tmem[4][QL_NR];
    for (int i = 0; i < 2; i++) t0[i] = t1[i] = _mm256_setzero_ps();
    if (!in_regs) memset(tmem, 0, sizeof tmem);
    const __m256i nib = _mm256_set1_epi32(0x0F);
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 a0[4][4], a1[4][4]; /* [chain][row] */
        for (int c = 0; c < CH; c++)
            for (int i = 0; i < mr; i++) a0[c][i] = a1[c][i] = _mm256_setzero_ps();
        const int64_t k0 = gi * g, k1 = k0 + g;
        if (BITS == 8) {
            int64_t k = k0;
            for (; k + CH <= k1; k += CH) {
                __builtin_prefetch(panel + k * QL_NR + QL_PREFETCH, 0, 3);
                for (int c = 0; c < CH; c++) {
                    __m256 b0, b1;
                    ql_i8_line(panel + (k + c) * QL_NR, &b0, &b1);
                    for (int i = 0; i < mr; i++) {
                        const __m256 av = _mm256_broadcast_ss(x + i * K + k + c);
                        a0[c][i] = _mm256_fmadd_ps(av, b0, a0[c][i]);
                        a1[c][i] = _mm256_fmadd_ps(av, b1, a1[c][i]);
                    }
                }
            }
            for (; k < k1; k++) {
                __m256 b0, b1;
                ql_i8_line(panel + k * QL_NR, &b0, &b1);
                for (int i = 0; i < mr; i++) {
                    const __m256 av = _mm256_broadcast_ss(x + i * K + k);
                    a0[0][i] = _mm256_fmadd_ps(av, b0, a0[0][i]);
                    a1[0][i] = _mm256_fmadd_ps(av, b1, a1[0][i]);
                }
            }
        } else {
            /* line j: k = 2j (low nibbles) and 2j + 1 (high); g is even. With CH >= 2 the
             * two k go to different chains, with CH = 4 two lines at a time. */
            const int per = CH >= 2 ? CH / 2 : 1; /* lines per step */
            int64_t j = k0 / 2;
            const int64_t j1 = k1 / 2;
            for (; j + per <= j1; j += per) {
                __builtin_prefetch(panel + j * QL_NR + QL_PREFETCH, 0, 3);
                for (int u = 0; u < per; u++) {
                    __m256i w0, w1;
                    ql_i4_line(panel + (j + u) * QL_NR, &w0, &w1);
                    const __m256 lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(w0, nib));
                    const __m256 lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(w1, nib));
                    const __m256 hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
                    const __m256 hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
                    const int ce = CH >= 2 ? 2 * u : 0, co = CH >= 2 ? 2 * u + 1 : 0;
                    for (int i = 0; i < mr; i++) {
                        const float *xr = x + i * K + 2 * (j + u);
                        const __m256 ae = _mm256_broadcast_ss(xr);
                        const __m256 ao = _mm256_broadcast_ss(xr + 1);
                        a0[ce][i] = _mm256_fmadd_ps(ae, lo0, a0[ce][i]);
                        a1[ce][i] = _mm256_fmadd_ps(ae, lo1, a1[ce][i]);
                        a0[co][i] = _mm256_fmadd_ps(ao, hi0, a0[co][i]);
                        a1[co][i] = _mm256_fmadd_ps(ao, hi1, a1[co][i]);
                    }
                }
            }
            for (; j < j1; j++) { /* only with CH = 4 and an odd number of lines */
                __m256i w0, w1;
                ql_i4_line(panel + j * QL_NR, &w0, &w1);
                const __m256 lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(w0, nib));
                const __m256 lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(w1, nib));
                const __m256 hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
                const __m256 hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
                for (int i = 0; i < mr; i++) {
                    const __m256 ae = _mm256_broadcast_ss(x + i * K + 2 * j);
                    const __m256 ao = _mm256_broadcast_ss(x + i * K + 2 * j + 1);
                    a0[0][i] = _mm256_fmadd_ps(ae, lo0, a0[0][i]);
                    a1[0][i] = _mm256_fmadd_ps(ae, lo1, a1[0][i]);
                    a0[0][i] = _mm256_fmadd_ps(ao, hi0, a0[0][i]);
                    a1[0][i] = _mm256_fmadd_ps(ao, hi1, a1[0][i]);
                }
            }
        }
        /* fold: total += scale * partial (+ min * sum of x over the group) */
        const __m256 s0 = ql_h8(ps + gi * QL_NR), s1 = ql_h8(ps + gi * QL_NR + 8);
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        if (pm) {
            m0 = ql_h8(pm + gi * QL_NR);
            m1 = ql_h8(pm + gi * QL_NR + 8);
        }
        for (int i = 0; i < mr; i++) {
            __m256 p0 = a0[0][i], p1 = a1[0][i];
            for (int c = 1; c < CH; c++) {
                p0 = _mm256_add_ps(p0, a0[c][i]);
                p1 = _mm256_add_ps(p1, a1[c][i]);
            }
            __m256 r0 = in_regs ? t0[i & 1] : _mm256_loadu_ps(tmem[i]);
            __m256 r1 = in_regs ? t1[i & 1] : _mm256_loadu_ps(tmem[i] + 8);
            r0 = _mm256_fmadd_ps(p0, s0, r0);
            r1 = _mm256_fmadd_ps(p1, s1, r1);
            if (pm) {
                const __m256 sv = _mm256_broadcast_ss(xs + i * G + gi);
                r0 = _mm256_fmadd_ps(m0, sv, r0);
                r1 = _mm256_fmadd_ps(m1, sv, r1);
            }
            if (in_regs) {
                t0[i & 1] = r0;
                t1[i & 1] = r1;
            } else {
                _mm256_storeu_ps(tmem[i], r0);
                _mm256_storeu_ps(tmem[i] + 8, r1);
            }
        }
    }
    __m256 bias0, bias1;
    tile_bias(bias, ncols, &bias0, &bias1);
    for (int i = 0; i < mr; i++) {
        const __m256 v0 = in_regs ? t0[i & 1] : _mm256_loadu_ps(tmem[i]);
        const __m256 v1 = in_regs ? t1[i & 1] : _mm256_loadu_ps(tmem[i] + 8);
        tile_store_row(y + i * ldy, _mm256_add_ps(v0, bias0), _mm256_add_ps(v1, bias1), ncols);
    }
}

/* every row of one panel in tiles of up to 4 */
static inline __attribute__((always_inline)) void ql_few_rows(
        const int BITS, const float *x, int64_t M, int64_t K, int64_t g, const uint8_t *panel,
        const uint16_t *ps, const uint16_t *pm, const float *xs, float *y, int64_t ldy,
        int64_t ncols, const float *bias) {
    const int64_t G = K / g;
    int64_t i = 0;
    for (; i + 4 <= M; i += 4)
        ql_few(BITS, x + i * K, K, g, panel, ps, pm, xs ? xs + i * G : NULL, y + i * ldy, ldy,
               4, ncols, bias);
    const float *xr = x + i * K, *xsr = xs ? xs + i * G : NULL;
    float *yr = y + i * ldy;
    switch (M - i) {
        case 3: ql_few(BITS, xr, K, g, panel, ps, pm, xsr, yr, ldy, 3, ncols, bias); break;
        case 2: ql_few(BITS, xr, K, g, panel, ps, pm, xsr, yr, ldy, 2, ncols, bias); break;
        case 1: ql_few(BITS, xr, K, g, panel, ps, pm, xsr, yr, ldy, 1, ncols, bias); break;
        default: break;
    }
}

/* panel -> float scratch [K][16]: code * scale + min (separate multiply and add; ISO C
 * mode, -std=c99, keeps GCC from contracting them into an FMA) */
static void ql_dequant_panel(const int BITS, const uint8_t *panel, const uint16_t *ps,
                             const uint16_t *pm, int64_t K, int64_t g, float *out) {
    const __m256i nib = _mm256_set1_epi32(0x0F);
    for (int64_t gi = 0; gi < K / g; gi++) {
        const __m256 s0 = ql_h8(ps + gi * QL_NR), s1 = ql_h8(ps + gi * QL_NR + 8);
        const __m256 m0 = pm ? ql_h8(pm + gi * QL_NR) : _mm256_setzero_ps();
        const __m256 m1 = pm ? ql_h8(pm + gi * QL_NR + 8) : _mm256_setzero_ps();
        if (BITS == 8) {
            for (int64_t k = gi * g; k < gi * g + g; k++) {
                __m256 b0, b1;
                ql_i8_line(panel + k * QL_NR, &b0, &b1);
                _mm256_storeu_ps(out + k * QL_NR, _mm256_add_ps(_mm256_mul_ps(b0, s0), m0));
                _mm256_storeu_ps(out + k * QL_NR + 8,
                                 _mm256_add_ps(_mm256_mul_ps(b1, s1), m1));
            }
        } else {
            for (int64_t j = gi * g / 2; j < (gi * g + g) / 2; j++) {
                __m256i w0, w1;
                ql_i4_line(panel + j * QL_NR, &w0, &w1);
                float *o = out + 2 * j * QL_NR;
                const __m256 lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(w0, nib));
                const __m256 lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(w1, nib));
                const __m256 hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
                const __m256 hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(lo0, s0), m0));
                _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(lo1, s1), m1));
                _mm256_storeu_ps(o + QL_NR, _mm256_add_ps(_mm256_mul_ps(hi0, s0), m0));
                _mm256_storeu_ps(o + QL_NR + 8, _mm256_add_ps(_mm256_mul_ps(hi1, s1), m1));
            }
        }
    }
}

static void ql_linear_avx2(const int BITS, const float *x, const uint8_t *codes,
                           const uint16_t *scales, const uint16_t *mins, const float *bias,
                           float *y, int64_t M, int64_t N, int64_t K, int64_t g,
                           int64_t mode, int64_t num_threads) {
    const int64_t panels = (N + QL_NR - 1) / QL_NR, G = K / g;
    const int64_t line = BITS == 8 ? K * QL_NR : K / 2 * QL_NR; /* code bytes per panel */
    if (mode == 1 || (mode == 0 && M <= (BITS == 8 ? QL_FEW_ROWS_I8 : QL_FEW_ROWS_I4))) {
        float *xs = mins ? ql_group_sums(x, M, K, g) : NULL;
        if (mins && !xs) return;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * QL_NR, ncols = N - n0 < QL_NR ? N - n0 : QL_NR;
            const uint16_t *pm = mins ? mins + p * G * QL_NR : NULL;
            if (BITS == 8)
                ql_few_rows(8, x, M, K, g, codes + p * line, scales + p * G * QL_NR, pm, xs,
                            y + n0, N, ncols, bias ? bias + n0 : NULL);
            else
                ql_few_rows(4, x, M, K, g, codes + p * line, scales + p * G * QL_NR, pm, xs,
                            y + n0, N, ncols, bias ? bias + n0 : NULL);
        }
        free(xs);
        return;
    }
    const int64_t nt = num_threads > 0 ? num_threads : 1;
    float *scratch = malloc((size_t)(nt * K * QL_NR) * sizeof(float));
    if (!scratch) return;
    int64_t mc = (QL_MC_BYTES / (K * (int64_t)sizeof(float))) / TILE_ROWS_MR * TILE_ROWS_MR;
    if (mc < TILE_ROWS_MR) mc = TILE_ROWS_MR;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t mb = M - m0 < mc ? M - m0 : mc;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < panels; p++) {
            float *w = scratch + (int64_t)ql_thread() * K * QL_NR;
            const int64_t n0 = p * QL_NR, ncols = N - n0 < QL_NR ? N - n0 : QL_NR;
            ql_dequant_panel(BITS, codes + p * line, scales + p * G * QL_NR,
                             mins ? mins + p * G * QL_NR : NULL, K, g, w);
            rows_x16(x + m0 * K, mb, K, w, y + m0 * N + n0, N, ncols,
                      bias ? bias + n0 : NULL);
        }
    }
    free(scratch);
}

#else /* scalar fallback */

static float ql_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void ql_linear_scalar(const int BITS, const float *x, const uint8_t *codes,
                             const uint16_t *scales, const uint16_t *mins, const float *bias,
                             float *y, int64_t M, int64_t N, int64_t K, int64_t g,
                             int64_t num_threads) {
    const int64_t G = K / g, line = BITS == 8 ? K * QL_NR : K / 2 * QL_NR;
    float *xs = mins ? ql_group_sums(x, M, K, g) : NULL;
    if (mins && !xs) return;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = n / QL_NR, c = n % QL_NR;
        const uint8_t *panel = codes + p * line;
        for (int64_t m = 0; m < M; m++) {
            float tot = 0.0f;
            for (int64_t gi = 0; gi < G; gi++) {
                float part = 0.0f;
                for (int64_t k = gi * g; k < gi * g + g; k++) {
                    int q;
                    if (BITS == 8) {
                        q = (int8_t)panel[k * QL_NR + c];
                    } else {
                        const uint8_t b = panel[(k / 2) * QL_NR + c];
                        q = k % 2 ? b >> 4 : b & 0x0F;
                    }
                    part += x[m * K + k] * (float)q;
                }
                tot += part * ql_half(scales[(p * G + gi) * QL_NR + c]);
                if (mins) tot += ql_half(mins[(p * G + gi) * QL_NR + c]) * xs[m * G + gi];
            }
            y[m * N + n] = tot + (bias ? bias[n] : 0.0f);
        }
    }
    free(xs);
}

#endif

static void ql_linear(const int BITS, const float *x, const void *codes, const uint16_t *scales,
                      const uint16_t *mins, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int64_t g, int64_t mode, int64_t num_threads) {
    if (M <= 0 || N <= 0) return;
#ifdef QL_AVX2
    ql_linear_avx2(BITS, x, codes, scales, mins, bias, y, M, N, K, g, mode, num_threads);
#else
    (void)mode;
    ql_linear_scalar(BITS, x, codes, scales, mins, bias, y, M, N, K, g, num_threads);
#endif
}

/* int8 codes [P][K][16]; see the top of the file. Returns nothing; y [M, N] float32. */
void tandem_quant_linear_i8(const float *x, const int8_t *codes, const uint16_t *scales,
                            const uint16_t *mins, const float *bias, float *y, int64_t M,
                            int64_t N, int64_t K, int64_t group_size, int64_t mode,
                            int64_t num_threads) {
    ql_linear(8, x, codes, scales, mins, bias, y, M, N, K, group_size, mode, num_threads);
}

/* int4 codes [P][K/2][16] (two per byte); group_size even. */
void tandem_quant_linear_i4(const float *x, const uint8_t *codes, const uint16_t *scales,
                            const uint16_t *mins, const float *bias, float *y, int64_t M,
                            int64_t N, int64_t K, int64_t group_size, int64_t mode,
                            int64_t num_threads) {
    ql_linear(4, x, codes, scales, mins, bias, y, M, N, K, group_size, mode, num_threads);
}

/* 1 when the AVX2 paths are compiled in (mode is honoured), 0 for the scalar fallback */
int64_t tandem_quant_linear_simd(void) {
#ifdef QL_AVX2
    return 1;
#else
    return 0;
#endif
}
