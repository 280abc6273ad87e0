/*
 * bfloat16 linear layer for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), float32
 * accumulation, each output rounded once to bfloat16 (nearest even).
 *
 * Weights are packed once (engine/model/cpu_linear.py `pack_bf16_panels`) into pair panels
 * [P = ceil(N / 32), Kh = ceil(K / 2), 32, 2]: panel p holds columns 32 p .. 32 p + 31, and
 * for each pair of inputs (2 q, 2 q + 1) the 32 columns' two weights side by side, zero-
 * padded past N and K. One pair row is two zmm of 16 (w[n][2q], w[n][2q+1]) pairs: exactly
 * the operand of AVX512-BF16's VDPBF16PS, which multiplies a broadcast input pair
 * (x[m][2q], x[m][2q+1]) into 16 float32 sums at once. Without AVX512-BF16 (plain AVX-512)
 * the pairs are widened (a 16-bit shift, a mask) for two float32 FMAs; without AVX-512 a
 * portable loop computes the same sums (for tests and odd machines, not for speed).
 *
 * The register tile is 8 rows x 32 columns (16 zmm accumulators): per pair row two weight
 * loads feed 16 dot products. Threads split the panels, so at decode sizes each thread
 * streams its share of the weights once per call and keeps a panel in L2 while every row
 * block of x passes over it.
 *
 *   x    [M, K] bfloat16, rows lda elements apart (lda >= K)
 *   wp   [P, Kh, 32, 2] bfloat16 (the packed weight)
 *   bias [N] bfloat16 or NULL
 *   y    [M, N] bfloat16, contiguous
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR 32 /* columns per panel */
#define MR 8  /* rows per register tile */

/* 2: AVX512-BF16 dot products; 1: AVX-512 with widened pairs; 0: the portable loop. */
int64_t tandem_linear_bf16_simd(void)
{
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
/* acc + a[2i] * b[2i] + a[2i+1] * b[2i+1] per float32 lane i (pairs of bfloat16). */
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i a, __m512i b)
{
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)),
                           _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
#endif
}

/* The input pair (x[2q], x[2q+1]) as one 32-bit lane (the low half is the even element). */
static inline __attribute__((always_inline)) int32_t pair_at(const uint16_t *x, int64_t q)
{
    int32_t v;
    memcpy(&v, x + 2 * q, sizeof v);
    return v;
}

/* 16 float32 sums -> bfloat16 (nearest even) into dst[0..n), n <= 16, plus bias. */
static inline __attribute__((always_inline)) void store_16(uint16_t *dst, __m512 acc,
                                                           const uint16_t *bias, int64_t n)
{
    float tmp[16];
    _mm512_storeu_ps(tmp, acc);
    for (int64_t j = 0; j < n; j++)
        dst[j] = float_to_bf16(tmp[j] + (bias ? bf16_to_float(bias[j]) : 0.0f));
}

/* y[mr x ncols] = x[mr x K] @ panel (+ bias); mr <= MR a constant after inlining. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, int64_t lda, int64_t K, const uint16_t *panel, uint16_t *y,
    int64_t ldy, const int mr, int64_t ncols, const uint16_t *bias)
{
    __m512 c0[MR], c1[MR];
    for (int i = 0; i < mr; i++) {
        c0[i] = _mm512_setzero_ps();
        c1[i] = _mm512_setzero_ps();
    }
    const int64_t full = K / 2;
#pragma GCC unroll 2
    for (int64_t q = 0; q < full; q++) {
        const __m512i b0 = _mm512_loadu_si512(panel + q * 2 * NR);
        const __m512i b1 = _mm512_loadu_si512(panel + q * 2 * NR + NR);
        for (int i = 0; i < mr; i++) {
            const __m512i a = _mm512_set1_epi32(pair_at(x + i * lda, q));
            c0[i] = dot_pairs(c0[i], a, b0);
            c1[i] = dot_pairs(c1[i], a, b1);
        }
    }
    if (K & 1) { /* the last input alone: its pair's second weight is the zero padding */
        const __m512i b0 = _mm512_loadu_si512(panel + full * 2 * NR);
        const __m512i b1 = _mm512_loadu_si512(panel + full * 2 * NR + NR);
        for (int i = 0; i < mr; i++) {
            const __m512i a = _mm512_set1_epi32((int32_t)x[i * lda + K - 1]);
            c0[i] = dot_pairs(c0[i], a, b0);
            c1[i] = dot_pairs(c1[i], a, b1);
        }
    }
    for (int i = 0; i < mr; i++) {
        store_16(y + i * ldy, c0[i], bias, ncols < 16 ? ncols : 16);
        if (ncols > 16) store_16(y + i * ldy + 16, c1[i], bias ? bias + 16 : NULL, ncols - 16);
    }
}

static void rows(const uint16_t *x, int64_t lda, int64_t M, int64_t K, const uint16_t *panel,
                 uint16_t *y, int64_t ldy, int64_t ncols, const uint16_t *bias)
{
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
        tile(x + m * lda, lda, K, panel, y + m * ldy, ldy, MR, ncols, bias);
    const uint16_t *xm = x + m * lda;
    uint16_t *ym = y + m * ldy;
    switch (M - m) {
        case 7: tile(xm, lda, K, panel, ym, ldy, 7, ncols, bias); break;
        case 6: tile(xm, lda, K, panel, ym, ldy, 6, ncols, bias); break;
        case 5: tile(xm, lda, K, panel, ym, ldy, 5, ncols, bias); break;
        case 4: tile(xm, lda, K, panel, ym, ldy, 4, ncols, bias); break;
        case 3: tile(xm, lda, K, panel, ym, ldy, 3, ncols, bias); break;
        case 2: tile(xm, lda, K, panel, ym, ldy, 2, ncols, bias); break;
        case 1: tile(xm, lda, K, panel, ym, ldy, 1, ncols, bias); break;
        default: break;
    }
}
#else
/* The portable loop: the same sums in the same pair order, one output at a time. */
static void rows(const uint16_t *x, int64_t lda, int64_t M, int64_t K, const uint16_t *panel,
                 uint16_t *y, int64_t ldy, int64_t ncols, const uint16_t *bias)
{
    const int64_t kh = (K + 1) / 2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t q = 0; q < kh; q++) {
                const uint16_t *w = panel + (q * NR + j) * 2, *xq = x + m * lda + 2 * q;
                acc += bf16_to_float(xq[0]) * bf16_to_float(w[0]);
                if (2 * q + 1 < K) acc += bf16_to_float(xq[1]) * bf16_to_float(w[1]);
            }
            y[m * ldy + j] = float_to_bf16(acc + (bias ? bf16_to_float(bias[j]) : 0.0f));
        }
}
#endif

void tandem_linear_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                        uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t lda,
                        int64_t num_threads)
{
    const int64_t panels = (N + NR - 1) / NR, kh = (K + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
        rows(x, lda, M, K, wp + p * kh * 2 * NR, y + n0, N, ncols, bias ? bias + n0 : NULL);
    }
}

/*
 * Weight-only int8 linear layers of bfloat16 models: y[M, N] = x[M, K] @ W[N, K]^T
 * (+ bias), x, y and bias bfloat16, W kept as engine/quant's int8 code panels
 * (quant_linear_cpu.c's layout: codes [P16][K][16] int8, scales / mins [P16][K/g][16]
 * float16; mins may be NULL; w = code * scale + min, two float32 roundings, as
 * GroupedWeight.dequantize computes it). Each thread dequantizes two code panels at a
 * time (32 columns) into one bfloat16 pair panel in L2 (nearest even: the weight a
 * bfloat16 model of the dequantized checkpoint holds) and runs the pair-panel tile over
 * all M rows, so the weights stream from memory as int8 (a quarter of float32's bytes,
 * half of bfloat16's) and multiply at VDPBF16PS's rate. Returns 0, or -1 when scratch
 * memory ran out.
 */
/* The pair panel [kh][32][2] of code panels 2 pp and 2 pp + 1 (of p16). */
static void dequant_pair_panel(uint16_t *restrict out, const int8_t *codes,
                               const uint16_t *scales, const uint16_t *mins, int64_t pp,
                               int64_t p16, int64_t K, int64_t g)
{
    const int64_t G = K / g, kh = (K + 1) / 2;
#if defined(__AVX512BF16__)
    /* lane 2i <- w(k) of column i, lane 2i + 1 <- w(k + 1): cvtne2ps gives [w(k) | w(k+1)] */
    static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                      15, 31};
    const __m512i idx = _mm512_loadu_si512(order);
    for (int h = 0; h < 2; h++) {
        const int64_t p = 2 * pp + h;
        for (int64_t q = 0; q < kh; q++) {
            __m512 w[2];
            for (int r = 0; r < 2; r++) {
                const int64_t k = 2 * q + r;
                if (p >= p16 || k >= K) {
                    w[r] = _mm512_setzero_ps();
                    continue;
                }
                const int64_t at = (p * G + k / g) * 16;
                const __m128i c8 = _mm_loadu_si128((const __m128i *)(codes + (p * K + k) * 16));
                const __m256i s16 = _mm256_loadu_si256((const __m256i *)(scales + at));
                w[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c8)),
                                     _mm512_cvtph_ps(s16));
                if (mins) {
                    const __m256i m16 = _mm256_loadu_si256((const __m256i *)(mins + at));
                    w[r] = _mm512_add_ps(w[r], _mm512_cvtph_ps(m16));
                }
            }
            const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
            _mm512_storeu_si512(out + (q * NR + 16 * h) * 2, _mm512_permutexvar_epi16(idx, v));
        }
    }
#else
    for (int64_t q = 0; q < kh; q++)
        for (int64_t j = 0; j < NR; j++)
            for (int64_t r = 0; r < 2; r++) {
                const int64_t k = 2 * q + r, p = 2 * pp + j / 16, c = j % 16;
                float w = 0.0f;
                if (p < p16 && k < K) {
                    const int64_t at = (p * G + k / g) * 16 + c;
                    w = (float)codes[(p * K + k) * 16 + c] * half_bits_to_float(scales[at]);
                    if (mins) w = w + half_bits_to_float(mins[at]);
                }
                out[(q * NR + j) * 2 + r] = float_to_bf16(w);
            }
#endif
}

int tandem_quant_linear_i8_bf16(const uint16_t *x, const int8_t *codes, const uint16_t *scales,
                                const uint16_t *mins, const uint16_t *bias, uint16_t *y,
                                int64_t M, int64_t N, int64_t K, int64_t g,
                                int64_t num_threads)
{
    const int64_t p16 = (N + 15) / 16, pairs = (p16 + 1) / 2, kh = (K + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t *panel = malloc((size_t)(kh * 2 * NR) * sizeof(uint16_t));
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pp = 0; pp < pairs; pp++) {
            if (panel == NULL) continue;
            const int64_t n0 = pp * NR, ncols = N - n0 < NR ? N - n0 : NR;
            dequant_pair_panel(panel, codes, scales, mins, pp, p16, K, g);
            rows(x, K, M, K, panel, y + n0, N, ncols, bias ? bias + n0 : NULL);
        }
        free(panel);
    }
    return failed ? -1 : 0;
}
