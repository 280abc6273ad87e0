/* The 6x16 float32 register tile shared by the GEMMs (linear_cpu.c, quant_linear_cpu.c's
 * scratch path) and the prefill attention scores (prefill_attention_cpu.c), AVX2 + FMA: 12
 * ymm accumulators walk K, reading one 16-float line of a column panel [K x 16] and
 * broadcasting six rows of `a` per k; with AVX-512 the same product in a 12x16 zmm tile.
 * Callers use `rows_x16` / `TILE_ROWS_MR`: the widest tile of the build. Include after
 * <immintrin.h>, <stdint.h> and <string.h>, only under __AVX2__ and __FMA__.
 */
#ifndef TANDEM_TILE_AVX2_H
#define TANDEM_TILE_AVX2_H

#define TILE_NR 16            /* panel width (output columns), two ymm */
#define TILE_MR 6             /* rows per register tile */
#define TILE_PREFETCH_LINES 8 /* panel lines (k steps) prefetched ahead */

/* bias[ncols] zero-padded to 16 columns as two ymm (zeros when bias is NULL). */
static inline __attribute__((always_inline)) void tile_bias(const float *restrict bias,
                                                            int64_t ncols, __m256 *b0,
                                                            __m256 *b1) {
    float tmp[TILE_NR] = {0};
    if (bias) memcpy(tmp, bias, (size_t)ncols * sizeof(float));
    *b0 = _mm256_loadu_ps(tmp);
    *b1 = _mm256_loadu_ps(tmp + 8);
}

/* The first ncols (<= 16) of the row (r0, r1) stored at c. */
static inline __attribute__((always_inline)) void tile_store_row(float *restrict c, __m256 r0,
                                                                 __m256 r1, int64_t ncols) {
    if (ncols == TILE_NR) {
        _mm256_storeu_ps(c, r0);
        _mm256_storeu_ps(c + 8, r1);
        return;
    }
    float tmp[TILE_NR];
    _mm256_storeu_ps(tmp, r0);
    _mm256_storeu_ps(tmp + 8, r1);
    memcpy(c, tmp, (size_t)ncols * sizeof(float));
}

/* c[mr x ncols] = a[mr x K] @ panel[K x 16] (+ bias[ncols]); rows of a are K floats apart,
 * rows of c ldc; mr <= TILE_MR a constant after inlining. */
static inline __attribute__((always_inline)) void tile_6x16(
        const float *restrict a, int64_t K, const float *restrict panel, float *restrict c,
        int64_t ldc, const int mr, int64_t ncols, const float *restrict bias) {
    __m256 c0[TILE_MR], c1[TILE_MR];
    for (int i = 0; i < mr; i++) {
        c0[i] = _mm256_setzero_ps();
        c1[i] = _mm256_setzero_ps();
    }
    /* unrolled: the loop's own add/compare/branch otherwise crowd the front end, which
     * has to issue 8 loads and 12 FMAs per k (measured +3-7 % at 24-2,048 GEMM rows) */
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(panel + (k + TILE_PREFETCH_LINES) * TILE_NR, 0, 3);
        const __m256 b0 = _mm256_loadu_ps(panel + k * TILE_NR);
        const __m256 b1 = _mm256_loadu_ps(panel + k * TILE_NR + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 av = _mm256_broadcast_ss(a + i * K + k);
            c0[i] = _mm256_fmadd_ps(av, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(av, b1, c1[i]);
        }
    }
    /* the epilogue spelled out, not through tile_bias / tile_store_row: with them GCC
     * compiled this tile ~1.5x slower at 16-row decode steps (measured end to end) */
    float tmp[TILE_NR];
    __m256 bias0 = _mm256_setzero_ps(), bias1 = _mm256_setzero_ps();
    if (bias) {
        memset(tmp, 0, sizeof tmp);
        memcpy(tmp, bias, (size_t)ncols * sizeof(float));
        bias0 = _mm256_loadu_ps(tmp);
        bias1 = _mm256_loadu_ps(tmp + 8);
    }
    for (int i = 0; i < mr; i++) {
        const __m256 r0 = _mm256_add_ps(c0[i], bias0), r1 = _mm256_add_ps(c1[i], bias1);
        if (ncols == TILE_NR) {
            _mm256_storeu_ps(c + i * ldc, r0);
            _mm256_storeu_ps(c + i * ldc + 8, r1);
        } else {
            _mm256_storeu_ps(tmp, r0);
            _mm256_storeu_ps(tmp + 8, r1);
            memcpy(c + i * ldc, tmp, (size_t)ncols * sizeof(float));
        }
    }
}

/* c[M x ncols] = a[M x K] @ panel[K x 16] (+ bias): M rows in register tiles of six. */
static inline __attribute__((always_inline)) void rows_6x16(
        const float *a, int64_t M, int64_t K, const float *panel, float *c, int64_t ldc,
        int64_t ncols, const float *bias) {
    int64_t i = 0;
    for (; i + TILE_MR <= M; i += TILE_MR)
        tile_6x16(a + i * K, K, panel, c + i * ldc, ldc, TILE_MR, ncols, bias);
    switch (M - i) {
        case 5: tile_6x16(a + i * K, K, panel, c + i * ldc, ldc, 5, ncols, bias); break;
        case 4: tile_6x16(a + i * K, K, panel, c + i * ldc, ldc, 4, ncols, bias); break;
        case 3: tile_6x16(a + i * K, K, panel, c + i * ldc, ldc, 3, ncols, bias); break;
        case 2: tile_6x16(a + i * K, K, panel, c + i * ldc, ldc, 2, ncols, bias); break;
        case 1: tile_6x16(a + i * K, K, panel, c + i * ldc, ldc, 1, ncols, bias); break;
        default: break;
    }
}


#if defined(__AVX512F__)
/* AVX-512: the same product in a 12x16 tile, one zmm per row (12 accumulators; each panel
 * line load feeds 12 FMAs with broadcast operands), twice the columns per instruction of
 * the 6x16 ymm tile; the same epilogue (sum, then + bias). */
#define TILE512_MR 12

static inline __attribute__((always_inline)) void tile_12x16(
        const float *restrict a, int64_t K, const float *restrict panel, float *restrict c,
        int64_t ldc, const int mr, int64_t ncols, const float *restrict bias) {
    __m512 acc[TILE512_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(panel + (k + TILE_PREFETCH_LINES) * TILE_NR, 0, 3);
        const __m512 b = _mm512_loadu_ps(panel + k * TILE_NR);
        for (int i = 0; i < mr; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * K + k]), b, acc[i]);
    }
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++)
        _mm512_mask_storeu_ps(c + i * ldc, keep, _mm512_add_ps(acc[i], bv));
}

static inline __attribute__((always_inline)) void rows_12x16(
        const float *a, int64_t M, int64_t K, const float *panel, float *c, int64_t ldc,
        int64_t ncols, const float *bias) {
    int64_t i = 0;
    for (; i + TILE512_MR <= M; i += TILE512_MR)
        tile_12x16(a + i * K, K, panel, c + i * ldc, ldc, TILE512_MR, ncols, bias);
    const float *ai = a + i * K;
    float *ci = c + i * ldc;
    switch (M - i) {
        case 11: tile_12x16(ai, K, panel, ci, ldc, 11, ncols, bias); break;
        case 10: tile_12x16(ai, K, panel, ci, ldc, 10, ncols, bias); break;
        case 9: tile_12x16(ai, K, panel, ci, ldc, 9, ncols, bias); break;
        case 8: tile_12x16(ai, K, panel, ci, ldc, 8, ncols, bias); break;
        case 7: tile_12x16(ai, K, panel, ci, ldc, 7, ncols, bias); break;
        case 6: tile_12x16(ai, K, panel, ci, ldc, 6, ncols, bias); break;
        case 5: tile_12x16(ai, K, panel, ci, ldc, 5, ncols, bias); break;
        case 4: tile_12x16(ai, K, panel, ci, ldc, 4, ncols, bias); break;
        case 3: tile_12x16(ai, K, panel, ci, ldc, 3, ncols, bias); break;
        case 2: tile_12x16(ai, K, panel, ci, ldc, 2, ncols, bias); break;
        case 1: tile_12x16(ai, K, panel, ci, ldc, 1, ncols, bias); break;
        default: break;
    }
}
/* the widest tile this build has, and its rows */
#define rows_x16 rows_12x16
#define TILE_ROWS_MR TILE512_MR
#else
#define rows_x16 rows_6x16
#define TILE_ROWS_MR TILE_MR
#endif

#endif
