/* Float32 linear layer on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), with W packed
 * once at load time into column panels: wp[ceil(N/16)][K][16] (panel p holds output columns
 * 16p..16p+15 for every k, zero-padded past N).
 *
 * One layout serves every batch size. A 6x16 register tile (12 ymm accumulators, AVX2 +
 * FMA; 12x16 in zmm with AVX-512, tile_avx2.h) walks K reading one 64-byte panel line per
 * k and broadcasting 6 (12) activations; each thread owns whole panels (OpenMP, static), so every weight byte is read once per block of
 * MC activation rows (MC sized so that block stays in L2), and the panel itself streams
 * from DRAM with a software prefetch a few lines ahead.
 * Measured on this 2-core AVX2 VM (bench/linear_micro.py, one forward of SmolLM2's linears):
 * 1.4-2x faster than oneDNN's pre-packed matmul at 1-48 rows, about equal at 256-2,048
 * (~146 GFLOPS, ~77 % of the FMA peak; a GotoBLAS-style K-blocked variant with packed
 * activations was tried and was no faster here).
 *
 * Without AVX2 + FMA the library reports tandem_linear_simd() == 0 and callers use oneDNN.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_LINEAR_AVX2 1
#include "tile_avx2.h"
#endif

#define NR 16                 /* panel width (output columns): TILE_NR of tile_avx2.h */
#define MR TILE_ROWS_MR        /* activation rows per register tile (6 AVX2, 12 AVX-512) */
#define MC_BYTES (768 * 1024) /* activation block kept in L2 across a thread's panels */

int64_t tandem_linear_simd(void) {
#ifdef TANDEM_LINEAR_AVX2
    return 1;
#else
    return 0;
#endif
}

void tandem_linear_packed_f32(const float *x, const float *wp, const float *bias, float *y,
                              int64_t M, int64_t N, int64_t K, int64_t num_threads) {
#ifdef TANDEM_LINEAR_AVX2
    const int64_t panels = (N + NR - 1) / NR;
    int64_t mc = (MC_BYTES / (K * (int64_t)sizeof(float))) / MR * MR;
    if (mc < MR) mc = MR;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t mb = M - m0 < mc ? M - m0 : mc;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = wp + p * K * NR;
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            const float *b = bias ? bias + n0 : NULL;
            rows_x16(x + m0 * K, mb, K, panel, y + m0 * N + n0, N, ncols, b);
        }
    }
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
#endif
}
