/* Skinny matmul for decode-sized batches: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
 *
 * With few rows (M <= ~16) a linear layer is bound by streaming its weight from memory;
 * oneDNN and MKL run it at a fraction of the bandwidth (measured 1.5-1.9x slower here at
 * M = 1..16, see bench/linear_micro.py). This kernel reads every weight element from DRAM
 * once: threads split N (OpenMP, static), each walks tiles of NB = 4 consecutive weight rows
 * (one contiguous 4*K run, software-prefetched two tiles ahead, since hardware prefetchers
 * stop at 4 KiB pages) and multiplies the tile with the activations in register blocks of
 * up to MB = 4 rows (16 ymm accumulators, AVX2 + FMA). Other CPUs get a plain-C loop.
 * Layout: row-major, contiguous float32; bias may be NULL.
 */
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_LINEAR_AVX2 1
#endif

#define NB 4
#define MB 4
#define PREFETCH_TILES 2

/* out[i * NB + j] = dot(x row m0 + i, w row n0 + j), i < mb, j < nb. */
static void tile_generic(const float *restrict x, const float *restrict w,
                         float *restrict out, int64_t m0, int64_t mb, int64_t n0,
                         int64_t nb, int64_t K) {
    for (int64_t i = 0; i < mb; i++)
        for (int64_t j = 0; j < nb; j++) {
            const float *xr = x + (m0 + i) * K, *wr = w + (n0 + j) * K;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += xr[k] * wr[k];
            out[i * NB + j] = s;
        }
}

#ifdef TANDEM_LINEAR_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* A full NB-row tile against `rows` (<= MB, a constant after inlining) activation rows. */
static inline __attribute__((always_inline)) void tile_avx2(
        const float *restrict x, const float *restrict w, float *restrict out, int64_t m0,
        const int rows, int64_t n0, int64_t N, int64_t K) {
    __m256 acc[MB][NB];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    const float *w0 = w + n0 * K;
    const float *pf = w0 + PREFETCH_TILES * NB * K;
    const int prefetch = n0 + (PREFETCH_TILES + 1) * NB <= N;
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        if (prefetch && (k & 15) == 0)  /* one 64-byte line per weight row every 16 floats */
            for (int j = 0; j < NB; j++) __builtin_prefetch(pf + j * K + k, 0, 0);
        __m256 wv[NB];
        for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w0 + j * K + k);
        for (int i = 0; i < rows; i++) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < NB; j++) {
            float s = hsum256(acc[i][j]);
            for (int64_t k = K8; k < K; k++) s += x[(m0 + i) * K + k] * w0[j * K + k];
            out[i * NB + j] = s;
        }
}
#endif

void tandem_linear_skinny_f32(const float *x, const float *w, const float *bias, float *y,
                              int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    const int64_t tiles = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NB, nb = N - n0 < NB ? N - n0 : NB;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
            float out[MB * NB];
#ifdef TANDEM_LINEAR_AVX2
            if (nb == NB) {
                switch (mb) {
                    case 4: tile_avx2(x, w, out, m0, 4, n0, N, K); break;
                    case 3: tile_avx2(x, w, out, m0, 3, n0, N, K); break;
                    case 2: tile_avx2(x, w, out, m0, 2, n0, N, K); break;
                    default: tile_avx2(x, w, out, m0, 1, n0, N, K); break;
                }
            } else {
                tile_generic(x, w, out, m0, mb, n0, nb, K);
            }
#else
            tile_generic(x, w, out, m0, mb, n0, nb, K);
#endif
            for (int64_t i = 0; i < mb; i++)
                for (int64_t j = 0; j < nb; j++)
                    y[(m0 + i) * N + n0 + j] = out[i * NB + j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}
