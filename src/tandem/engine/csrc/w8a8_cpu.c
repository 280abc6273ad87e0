/* W8A8 int8 linear layer on the CPU: y[M, N] = (xq[M, K] @ wq[N, K]^T) * xs[M] * ws[N] (+ b)
 * with int32 accumulation.
 *
 * Weights: int8 codes in [-127, 127] (never -128), per-output-channel float16 scales, in
 * the int8 panel layout shared with the weight-only kernel (quant_linear_cpu.c):
 *   wp     [P, K, 16] int8      panel p holds columns 16p..16p+15 for every k (zero-padded)
 *   ws     [P, 16]    float16   (the [P, 1, 16] scales of group size K)
 * Activations: quantized per row on the fly, symmetric: s = amax(|x|) / 127 (float32),
 * code = round_half_even(x / s) clamped to [-127, 127] (amax == 0: s = 0, codes 0).
 *
 * Each thread owns whole panels (OpenMP, static). A panel is first shuffled into k-quads
 * wq[ceil(K/4)][16][4] (column c's four consecutive k in one 32-bit lane, zero past K) in
 * a per-thread scratch, then every activation row block walks it:
 *   AVX-512 VNNI: one vpdpbusd per row and quad (16 columns in one zmm). dpbusd multiplies
 *     unsigned by signed bytes, so activations are stored as a + 128 and 128 * colsum(w)
 *     (computed while shuffling, with the same instruction) is subtracted at the end.
 *   AVX-VNNI: the same on two ymm.
 *   AVX2: vpmaddubsw(|a|, sign(w, a)) -- pair sums are at most 2 * 127 * 127 < 2^15, so it
 *     never saturates -- then vpmaddwd with ones into int32.
 *   scalar: plain int32 loops.
 * Every path computes the same int32 sums (exact integer arithmetic; requires K <= 65,536
 * so that even the offset VNNI sums stay below 2^31), so one exact test covers whichever
 * path the compiler enabled. Any K (the quads are zero-padded), any N.
 * Functions returning int give 0, or -1 when scratch memory ran out.
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF /* the epilogue rounds like torch: no fused multiply-add */
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define W8A8_PATH 3
#define W8A8_MR 8
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#define W8A8_PATH 2
#define W8A8_MR 6
#elif defined(__AVX2__)
#define W8A8_PATH 1
#define W8A8_MR 4
#else
#define W8A8_PATH 0
#define W8A8_MR 4
#endif
/* VNNI paths store activations as code + 128 (unsigned); -DW8A8_TEST_UNSIGNED makes the
 * scalar path do the same, so that bookkeeping is testable on any machine */
#if W8A8_PATH >= 2 || (W8A8_PATH == 0 && defined(W8A8_TEST_UNSIGNED))
#define W8A8_UNSIGNED 1
#else
#define W8A8_UNSIGNED 0
#endif
#define W8A8_OFFSET (W8A8_UNSIGNED ? 128 : 0) /* added to activation codes (mod 256) */
/* AVX2 reads |codes| from a second plane of the activation buffer (one op less per
 * row and quad than taking vpabsb of the broadcast) */
#define W8A8_PLANES (W8A8_PATH == 1 ? 2 : 1)
#define NR 16

/* 3 = AVX-512 VNNI, 2 = AVX-VNNI, 1 = AVX2, 0 = scalar. */
int64_t tandem_w8a8_simd(void) { return W8A8_PATH; }

/* Row x[K] -> codes q[K] (+ offset, mod 256), q[K..ldq) = offset; returns the scale. */
static float quantize_row(const float *restrict x, int8_t *restrict q, int64_t K, int64_t ldq,
                          int offset) {
    float amax = 0.0f;
    int64_t k = 0;
#ifdef __AVX2__
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8)
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), nosign));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#endif
    for (; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float scale = amax / 127.0f;
    const int8_t pad = (int8_t)(uint8_t)offset;
    if (!(scale > 0.0f)) {
        memset(q, pad, (size_t)ldq);
        return 0.0f;
    }
    k = 0;
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f),
                 hi = _mm256_set1_ps(127.0f);
    const __m128i voff = _mm_set1_epi8((char)pad);
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + k), vs);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32),
                                            _mm256_extracti128_si256(i32, 1));
        const __m128i i8 = _mm_xor_si128(_mm_packs_epi16(i16, i16), voff); /* +128: flip bit 7 */
        _mm_storel_epi64((__m128i *)(q + k), i8);
    }
#endif
    for (; k < K; k++) {
        float v = nearbyintf(x[k] / scale);
        v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
        q[k] = (int8_t)(uint8_t)(((int)v + offset) & 0xff);
    }
    for (; k < ldq; k++) q[k] = pad;
    return scale;
}

static void quantize_rows(const float *x, int8_t *q, float *scales, int64_t M, int64_t K,
                          int64_t ldq, int offset, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 32768)
    for (int64_t i = 0; i < M; i++)
        scales[i] = quantize_row(x + i * K, q + i * ldq, K, ldq, offset);
}

/* x [M, K] float32 -> q [M, ldq] int8 (signed codes; zero past K), scales [M] float32. */
void tandem_w8a8_quantize_f32(const float *x, int8_t *q, float *scales, int64_t M, int64_t K,
                              int64_t ldq, int64_t num_threads) {
    quantize_rows(x, q, scales, M, K, ldq, 0, num_threads);
}

/* Panel [K, 16] -> k-quads wq [Kq, 16, 4] (zero past K); colsum[16] = sum_k w (VNNI). */
static void pack_quads(const int8_t *restrict panel, int64_t K, int8_t *restrict wq,
                       int32_t *restrict colsum) {
    const int64_t Kq = (K + 3) / 4;
    int64_t k = 0;
#ifdef __AVX2__
    for (; k + 4 <= K; k += 4) {
        const __m128i l0 = _mm_loadu_si128((const __m128i *)(panel + (k + 0) * NR));
        const __m128i l1 = _mm_loadu_si128((const __m128i *)(panel + (k + 1) * NR));
        const __m128i l2 = _mm_loadu_si128((const __m128i *)(panel + (k + 2) * NR));
        const __m128i l3 = _mm_loadu_si128((const __m128i *)(panel + (k + 3) * NR));
        const __m128i t0 = _mm_unpacklo_epi8(l0, l1), t1 = _mm_unpackhi_epi8(l0, l1);
        const __m128i t2 = _mm_unpacklo_epi8(l2, l3), t3 = _mm_unpackhi_epi8(l2, l3);
        int8_t *dst = wq + k * NR;
        _mm_store_si128((__m128i *)(dst + 0), _mm_unpacklo_epi16(t0, t2));  /* cols 0-3 */
        _mm_store_si128((__m128i *)(dst + 16), _mm_unpackhi_epi16(t0, t2)); /* cols 4-7 */
        _mm_store_si128((__m128i *)(dst + 32), _mm_unpacklo_epi16(t1, t3)); /* 8-11 */
        _mm_store_si128((__m128i *)(dst + 48), _mm_unpackhi_epi16(t1, t3)); /* 12-15 */
    }
#endif
    for (int64_t q = k / 4; q < Kq; q++)
        for (int c = 0; c < NR; c++)
            for (int j = 0; j < 4; j++) {
                const int64_t kk = 4 * q + j;
                wq[q * 64 + c * 4 + j] = kk < K ? panel[kk * NR + c] : 0;
            }
    if (!colsum) return;
#if W8A8_PATH == 3
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i s = _mm512_setzero_si512();
    for (int64_t q = 0; q < Kq; q++)
        s = _mm512_dpbusd_epi32(s, ones, _mm512_load_si512((const void *)(wq + q * 64)));
    _mm512_storeu_si512((void *)colsum, s);
#elif W8A8_PATH == 2
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int64_t q = 0; q < Kq; q++) {
        s0 = _mm256_dpbusd_avx_epi32(s0, ones, _mm256_load_si256((const __m256i *)(wq + q * 64)));
        s1 = _mm256_dpbusd_avx_epi32(s1, ones,
                                     _mm256_load_si256((const __m256i *)(wq + q * 64 + 32)));
    }
    _mm256_storeu_si256((__m256i *)colsum, s0);
    _mm256_storeu_si256((__m256i *)(colsum + 8), s1);
#else
    for (int c = 0; c < NR; c++) {
        int32_t s = 0;
        for (int64_t q = 0; q < Kq * 4; q++) s += wq[(q / 4) * 64 + c * 4 + q % 4];
        colsum[c] = s;
    }
#endif
}

/* acc[mr][16] = a[mr rows, lda apart][4 Kq] (+ offset) @ quads; mr a constant after
 * inlining. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *restrict a, int64_t lda, int64_t plane, int64_t Kq,
        const int8_t *restrict wq, int32_t *restrict acc, const int mr) {
    (void)plane;
#if W8A8_PATH == 3
    __m512i c[W8A8_MR];
    for (int i = 0; i < mr; i++) c[i] = _mm512_setzero_si512();
    for (int64_t q = 0; q < Kq; q++) {
        const __m512i w = _mm512_load_si512((const void *)(wq + q * 64));
        for (int i = 0; i < mr; i++) {
            int32_t a4;
            memcpy(&a4, a + i * lda + 4 * q, 4);
            c[i] = _mm512_dpbusd_epi32(c[i], _mm512_set1_epi32(a4), w);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_si512((void *)(acc + i * NR), c[i]);
#elif W8A8_PATH == 2
    __m256i c0[W8A8_MR], c1[W8A8_MR];
    for (int i = 0; i < mr; i++) c0[i] = c1[i] = _mm256_setzero_si256();
    for (int64_t q = 0; q < Kq; q++) {
        const __m256i w0 = _mm256_load_si256((const __m256i *)(wq + q * 64));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(wq + q * 64 + 32));
        for (int i = 0; i < mr; i++) {
            int32_t a4;
            memcpy(&a4, a + i * lda + 4 * q, 4);
            const __m256i av = _mm256_set1_epi32(a4);
            c0[i] = _mm256_dpbusd_avx_epi32(c0[i], av, w0);
            c1[i] = _mm256_dpbusd_avx_epi32(c1[i], av, w1);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_si256((__m256i *)(acc + i * NR), c0[i]);
        _mm256_storeu_si256((__m256i *)(acc + i * NR + 8), c1[i]);
    }
#elif W8A8_PATH == 1
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c0[W8A8_MR], c1[W8A8_MR];
    for (int i = 0; i < mr; i++) c0[i] = c1[i] = _mm256_setzero_si256();
    for (int64_t q = 0; q < Kq; q++) {
        const __m256i w0 = _mm256_load_si256((const __m256i *)(wq + q * 64));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(wq + q * 64 + 32));
        for (int i = 0; i < mr; i++) {
            int32_t a4, u4;
            memcpy(&a4, a + i * lda + 4 * q, 4);
            memcpy(&u4, a + plane + i * lda + 4 * q, 4);
            const __m256i av = _mm256_set1_epi32(a4), ua = _mm256_set1_epi32(u4);
            const __m256i p0 = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(w0, av));
            const __m256i p1 = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(w1, av));
            c0[i] = _mm256_add_epi32(c0[i], _mm256_madd_epi16(p0, ones));
            c1[i] = _mm256_add_epi32(c1[i], _mm256_madd_epi16(p1, ones));
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_si256((__m256i *)(acc + i * NR), c0[i]);
        _mm256_storeu_si256((__m256i *)(acc + i * NR + 8), c1[i]);
    }
#else
    for (int i = 0; i < mr; i++) {
        int32_t *out = acc + i * NR;
        for (int c = 0; c < NR; c++) out[c] = 0;
        for (int64_t q = 0; q < Kq; q++)
            for (int c = 0; c < NR; c++)
                for (int j = 0; j < 4; j++)
                    out[c] += (W8A8_UNSIGNED ? (int32_t)(uint8_t)a[i * lda + 4 * q + j]
                                             : (int32_t)a[i * lda + 4 * q + j])
                              * wq[q * 64 + c * 4 + j];
    }
#endif
}

static void tile_any(const int8_t *a, int64_t lda, int64_t plane, int64_t Kq,
                     const int8_t *wq, int32_t *acc, int64_t mr) {
    switch (mr) {
#if W8A8_MR >= 8
        case 8: tile(a, lda, plane, Kq, wq, acc, 8); break;
        case 7: tile(a, lda, plane, Kq, wq, acc, 7); break;
#endif
#if W8A8_MR >= 6
        case 6: tile(a, lda, plane, Kq, wq, acc, 6); break;
        case 5: tile(a, lda, plane, Kq, wq, acc, 5); break;
#endif
        case 4: tile(a, lda, plane, Kq, wq, acc, 4); break;
        case 3: tile(a, lda, plane, Kq, wq, acc, 3); break;
        case 2: tile(a, lda, plane, Kq, wq, acc, 2); break;
        default: tile(a, lda, plane, Kq, wq, acc, 1); break;
    }
}

/* The GEMM over prepared activations a [M, lda] (codes + W8A8_OFFSET, lda = 4 ceil(K/4)).
 * Output: yi [M, N] int32 sums if yi, else yf [M, N] = sum * xs[row] * ws[col] (+ bias). */
static int gemm(const int8_t *a, int64_t lda, const int8_t *wp, int64_t M, int64_t N,
                int64_t K, int32_t *yi, float *yf, const float *xs, const uint16_t *ws,
                const float *bias, int64_t num_threads) {
    const int64_t panels = (N + NR - 1) / NR, Kq = lda / 4, plane = M * lda;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *wq = NULL;
        if (posix_memalign((void **)&wq, 64, (size_t)(Kq * 64 > 0 ? Kq * 64 : 64))) {
            wq = NULL;
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!wq) continue;
            int32_t corr[NR] = {0}, acc[W8A8_MR * NR];
            float wscale[NR] = {0}, b[NR] = {0};
            const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
            pack_quads(wp + p * K * NR, K, wq, W8A8_UNSIGNED ? corr : NULL);
            for (int c = 0; c < NR; c++) corr[c] *= W8A8_OFFSET;
            for (int64_t c = 0; yf && c < ncols; c++) {
                wscale[c] = half_bits_to_float(ws[n0 + c]);
                b[c] = bias ? bias[n0 + c] : 0.0f;
            }
            for (int64_t i0 = 0; i0 < M; i0 += W8A8_MR) {
                const int64_t mr = M - i0 < W8A8_MR ? M - i0 : W8A8_MR;
                tile_any(a + i0 * lda, lda, plane, Kq, wq, acc, mr);
                for (int64_t i = 0; i < mr; i++) {
                    const int32_t *r = acc + i * NR;
                    if (yi) {
                        for (int64_t c = 0; c < ncols; c++)
                            yi[(i0 + i) * N + n0 + c] = r[c] - corr[c];
                    } else {
                        const float s = xs[i0 + i];
                        float *out = yf + (i0 + i) * N + n0;
                        for (int64_t c = 0; c < ncols; c++)
                            out[c] = (float)(r[c] - corr[c]) * s * wscale[c] + b[c];
                    }
                }
            }
        }
        free(wq);
    }
    return failed ? -1 : 0;
}

/* The |code| plane after the codes a[n] (AVX2 path). */
static void abs_plane(int8_t *a, int64_t n) {
    if (W8A8_PLANES < 2) return;
    for (int64_t i = 0; i < n; i++) a[n + i] = (int8_t)(a[i] < 0 ? -a[i] : a[i]);
}

/* yi [M, N] int32 = a [M, K] (int8 codes, rows K apart) @ panels wp [P, K, 16] -- exact. */
int tandem_w8a8_gemm_i32(const int8_t *a, const int8_t *wp, int32_t *yi, int64_t M, int64_t N,
                         int64_t K, int64_t num_threads) {
    const int64_t lda = (K + 3) / 4 * 4;
    int8_t *buf = malloc((size_t)(M * lda > 0 ? W8A8_PLANES * M * lda : 1));
    if (!buf) return -1;
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < lda; k++)
            buf[i * lda + k] = (int8_t)(uint8_t)(((k < K ? a[i * K + k] : 0) + W8A8_OFFSET) & 0xff);
    abs_plane(buf, M * lda);
    const int rc = gemm(buf, lda, wp, M, N, K, yi, NULL, NULL, NULL, NULL, num_threads);
    free(buf);
    return rc;
}

/* y [M, N] float32 = W8A8 linear of x [M, K] float32 with panels wp [P, K, 16] int8 and
 * scales ws [P, 16] float16; bias [N] float32 or NULL. */
int tandem_w8a8_linear_f32(const float *x, const int8_t *wp, const uint16_t *ws,
                           const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                           int64_t num_threads) {
    const int64_t lda = (K + 3) / 4 * 4;
    int8_t *buf = malloc((size_t)(M * lda > 0 ? W8A8_PLANES * M * lda : 1));
    float *xs = malloc((size_t)(M > 0 ? M : 1) * sizeof(float));
    int rc = -1;
    if (buf && xs) {
        quantize_rows(x, buf, xs, M, K, lda, W8A8_OFFSET, num_threads);
        abs_plane(buf, M * lda);
        rc = gemm(buf, lda, wp, M, N, K, NULL, y, xs, ws, bias, num_threads);
    }
    free(buf);
    free(xs);
    return rc;
}
