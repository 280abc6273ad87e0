/*
 * Paged prefill attention for the CPU (AVX2 + FMA), float32 arithmetic: the query rows of
 * one or more prefill chunks attend causally to their sequence's keys, all read from the
 * block pool (the chunk's own K/V are written there before attention runs).
 *
 * Layouts (element strides):
 *   q        [T, H, D]        row t at q + t * q_stride; heads contiguous, D contiguous
 *   out      [T, H, D]        row t at out + t * out_stride
 *                             (q and out float32, or bfloat16 when io_bf16 = 1)
 *   k_cache  [NB, KVH, BS, D] contiguous, float32 (kv_fmt 0) or bfloat16 (kv_fmt 3);
 *                             v_cache likewise
 *   tables   [S, max_blocks]  int32 block ids of sequence s
 *   q_start  [S] int32        first row of sequence s in q / out
 *   q_lens   [S] int32        its query rows: positions seq_len - q_len .. seq_len - 1
 *   seq_lens [S] int32        context length after this chunk
 * Query position p sees key t when t <= p and (window <= 0 or t > p - window). Requires
 * D % 16 == 0, BS % 16 == 0, 1 <= H / KVH <= 64. Returns 0; -1 if scratch memory ran out;
 * -2 for an unsupported shape; -3 when built without AVX2 + FMA (callers then use torch).
 *
 * Flash-attention schedule: a work item is (sequence, KV head, tile of TQ query rows). Its
 * G = H / KVH query heads share every key read, so they are stacked into one M = G * TQ
 * row matrix. Keys go in blocks of KB: S = Q K^T in 16-key tiles with the GEMM's 6x16
 * register tile (tile_avx2.h) over transposed keys, an online softmax once per block (running
 * max and sum per row, exp inlined), and O = alpha O + P V with the same register tile
 * (each V row load serves six query rows). Key tiles past a work item's last position are
 * never touched: the causal half is skipped, where torch's CPU flash kernel scores and
 * masks it for chunks shorter than its ~1k-token query split. Each key tile is transposed
 * once per (sequence, KV head), in a first pass shared by all query tiles. bfloat16 keys
 * widen (exactly, bf16.h) in that transpose, bfloat16 values into a per-thread float
 * block of KB rows before P V, bfloat16 queries as they are scaled, and outputs round to
 * nearest even once, at the end.
 * Measured on the 2-core AVX2 dev VM (SmolLM2: 9 query / 3 KV heads, D 64): 1.6-2.5x
 * faster than the torch path from 64 to 2,048 tokens, and on a mixed batch of six chunks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_PREFILL_AVX2 1
#include "tile_avx2.h"
#define MR TILE_MR
#endif

#define KT 16  /* keys per score tile (two ymm) */
#define KB 128 /* keys per softmax block: the running max / sum update once per block */
#define TQ 16  /* query positions per work item */
#define MAX_GROUP 64
#if defined(TANDEM_PREFILL_AVX2) && KT != TILE_NR
#error "a key tile is one column panel of the shared register tile"
#endif

#ifdef TANDEM_PREFILL_AVX2
/* o[mr x D] = alpha[i] * o + p[mr x n] @ v[n x D] (p rows `ldp` apart, v[j] = key j's
 * value row): the 6x16 register tile again, D in 16-column panels, so each V load serves
 * six query rows. */
static inline __attribute__((always_inline)) void pv_tile(
        float *restrict o, int64_t D, const float *restrict alpha, const float *restrict p,
        int64_t ldp, const float *const *v, int64_t n, const int mr) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m256 c0[MR], c1[MR];
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_set1_ps(alpha[i]);
            c0[i] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D + d0), a);
            c1[i] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D + d0 + 8), a);
        }
        for (int64_t j = 0; j < n; j++) {
            const __m256 b0 = _mm256_loadu_ps(v[j] + d0);
            const __m256 b1 = _mm256_loadu_ps(v[j] + d0 + 8);
            for (int i = 0; i < mr; i++) {
                const __m256 pv = _mm256_broadcast_ss(p + i * ldp + j);
                c0[i] = _mm256_fmadd_ps(pv, b0, c0[i]);
                c1[i] = _mm256_fmadd_ps(pv, b1, c1[i]);
            }
        }
        for (int i = 0; i < mr; i++) {
            _mm256_storeu_ps(o + i * D + d0, c0[i]);
            _mm256_storeu_ps(o + i * D + d0 + 8, c1[i]);
        }
    }
}

#if defined(__AVX512F__)
/* AVX-512: P V in 12 rows x 16 columns per register tile (one zmm per row; each value-row
 * load feeds 12 FMAs with broadcast operands), as the scores use tile_avx2.h's 12x16. */
#define MR512 TILE512_MR

/* o[mr x D] = alpha[i] * o + p[mr x n] @ v[n x D], 16 columns of D per pass. */
static inline __attribute__((always_inline)) void pv_tile_512(
        float *restrict o, int64_t D, const float *restrict alpha, const float *restrict p,
        int64_t ldp, const float *const *v, int64_t n, const int mr) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 c[MR512];
        for (int i = 0; i < mr; i++)
            c[i] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d0), _mm512_set1_ps(alpha[i]));
        for (int64_t j = 0; j < n; j++) {
            const __m512 b = _mm512_loadu_ps(v[j] + d0);
            for (int i = 0; i < mr; i++)
                c[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * ldp + j]), b, c[i]);
        }
        for (int i = 0; i < mr; i++) _mm512_storeu_ps(o + i * D + d0, c[i]);
    }
}

static void pv(float *o, int64_t M, int64_t D, const float *alpha, const float *p,
               int64_t ldp, const float *const *v, int64_t n) {
    int64_t i = 0;
    for (; i + MR512 <= M; i += MR512)
        pv_tile_512(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, MR512);
    float *oi = o + i * D;
    const float *ai = alpha + i, *pi = p + i * ldp;
    switch (M - i) {
        case 11: pv_tile_512(oi, D, ai, pi, ldp, v, n, 11); break;
        case 10: pv_tile_512(oi, D, ai, pi, ldp, v, n, 10); break;
        case 9: pv_tile_512(oi, D, ai, pi, ldp, v, n, 9); break;
        case 8: pv_tile_512(oi, D, ai, pi, ldp, v, n, 8); break;
        case 7: pv_tile_512(oi, D, ai, pi, ldp, v, n, 7); break;
        case 6: pv_tile_512(oi, D, ai, pi, ldp, v, n, 6); break;
        case 5: pv_tile_512(oi, D, ai, pi, ldp, v, n, 5); break;
        case 4: pv_tile_512(oi, D, ai, pi, ldp, v, n, 4); break;
        case 3: pv_tile_512(oi, D, ai, pi, ldp, v, n, 3); break;
        case 2: pv_tile_512(oi, D, ai, pi, ldp, v, n, 2); break;
        case 1: pv_tile_512(oi, D, ai, pi, ldp, v, n, 1); break;
        default: break;
    }
}
#else
static void pv(float *o, int64_t M, int64_t D, const float *alpha, const float *p,
               int64_t ldp, const float *const *v, int64_t n) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR) pv_tile(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, MR);
    switch (M - i) {
        case 5: pv_tile(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, 5); break;
        case 4: pv_tile(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, 4); break;
        case 3: pv_tile(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, 3); break;
        case 2: pv_tile(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, 2); break;
        case 1: pv_tile(o + i * D, D, alpha + i, p + i * ldp, ldp, v, n, 1); break;
        default: break;
    }
}
#endif

/* exp(x) for x <= 0 (inputs below -87 give ~1e-38, not 0): Cody-Waite range reduction
 * x = n ln2 + r, a degree-5 minimax polynomial for e^r (the Cephes coefficients), and 2^n
 * built in the exponent bits. About 1 ulp; inlined, unlike libmvec's expf. */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* Row t of KV head h: its element offset in a paged cache (page: elements per block). */
static inline int64_t cache_row(const int32_t *table, int64_t t, int64_t h, int64_t bs,
                                int64_t page, int64_t D) {
    return (int64_t)table[t / bs] * page + (h * bs + t % bs) * D;
}

typedef struct {
    int32_t seq, head, tile;
} item_t;
#endif

int tandem_paged_attention_prefill(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *tables, const int32_t *q_start, const int32_t *q_lens,
    const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t q_stride,
    int64_t out_stride, int64_t window, int64_t kv_fmt, int64_t io_bf16, float scale,
    int64_t num_threads)
{
#ifndef TANDEM_PREFILL_AVX2
    (void)out; (void)q; (void)k_cache; (void)v_cache; (void)tables; (void)q_start;
    (void)q_lens; (void)seq_lens; (void)num_seqs; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)block_size; (void)max_blocks; (void)q_stride; (void)out_stride;
    (void)window; (void)kv_fmt; (void)io_bf16; (void)scale; (void)num_threads;
    return -3;
#else
    const int64_t G = num_heads / num_kv_heads, D = head_dim, KVH = num_kv_heads;
    const int64_t bs = block_size, page = KVH * bs * D;
    const int kv16 = kv_fmt == 3, io16 = io_bf16 == 1;
    const int64_t esz = io16 ? 2 : 4;
    if (G < 1 || G > MAX_GROUP || G * KVH != num_heads || D % 16 != 0 || bs % KT != 0
        || (kv_fmt != 0 && kv_fmt != 3) || (io_bf16 != 0 && io_bf16 != 1))
        return -2;
    /* transposed key tiles, per (sequence, KV head): [tiles][D][16] */
    int64_t *kt_off = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    int64_t n_items = 0, n_kt_items = 0;
    if (kt_off == NULL) return -1;
    kt_off[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t tiles = (seq_lens[s] + KT - 1) / KT;
        kt_off[s + 1] = kt_off[s] + tiles * KVH * D * KT;
        n_kt_items += tiles * KVH;
        n_items += (q_lens[s] + TQ - 1) / TQ * KVH;
    }
    float *kt_all = malloc((size_t)kt_off[num_seqs] * sizeof(float) + 64);
    item_t *items = malloc((size_t)(n_items + n_kt_items) * sizeof(item_t) + 1);
    if (kt_all == NULL || items == NULL) {
        free(kt_off); free(kt_all); free(items);
        return -1;
    }
    item_t *kt_items = items + n_items;
    /* query items in reverse so the longest (last tiles of each sequence) start first */
    int64_t n = 0, m = 0;
    for (int64_t s = num_seqs - 1; s >= 0; s--) {
        const int32_t qt = (q_lens[s] + TQ - 1) / TQ, kt = (seq_lens[s] + KT - 1) / KT;
        for (int32_t t = qt - 1; t >= 0; t--)
            for (int32_t h = 0; h < KVH; h++) items[n++] = (item_t){(int32_t)s, h, t};
        for (int32_t t = 0; t < kt; t++)
            for (int32_t h = 0; h < KVH; h++) kt_items[m++] = (item_t){(int32_t)s, h, t};
    }
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_kt_items; i++) {
            const item_t it = kt_items[i];
            const int64_t len = seq_lens[it.seq], t0 = (int64_t)it.tile * KT;
            const int32_t *table = tables + it.seq * max_blocks;
            float *dst = kt_all + kt_off[it.seq] + ((int64_t)it.tile * KVH + it.head) * D * KT;
            const int64_t valid = len - t0 < KT ? len - t0 : KT;
            for (int64_t j = 0; j < KT; j++) {
                if (j < valid) {
                    const int64_t at = cache_row(table, t0 + j, it.head, bs, page, D);
                    if (kv16) {
                        const uint16_t *src = (const uint16_t *)k_cache + at;
                        for (int64_t d = 0; d < D; d++) dst[d * KT + j] = bf16_to_float(src[d]);
                    } else {
                        const float *src = (const float *)k_cache + at;
                        for (int64_t d = 0; d < D; d++) dst[d * KT + j] = src[d];
                    }
                } else {
                    for (int64_t d = 0; d < D; d++) dst[d * KT + j] = 0.0f;
                }
            }
        }
        /* implicit barrier: every key tile is transposed */
        const int64_t M_max = G * TQ;
        float *qs = malloc((size_t)(M_max * D) * sizeof(float));
        float *o = malloc((size_t)(M_max * D) * sizeof(float));
        float *sc = malloc((size_t)(M_max * KB) * sizeof(float));
        float *alpha = malloc((size_t)M_max * sizeof(float));
        /* bfloat16 values of one key block, widened */
        float *vbuf = kv16 ? malloc((size_t)(KB * D) * sizeof(float)) : NULL;
        const float *vrow[KB];
        float *mx = malloc((size_t)M_max * sizeof(float));
        float *sum = malloc((size_t)M_max * sizeof(float));
        const int ok = qs && o && sc && mx && sum && alpha && (vbuf || !kv16);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_items; w++) {
            if (!ok) continue;
            const item_t it = items[w];
            const int64_t s = it.seq, h = it.head;
            const int64_t qlen = q_lens[s], len = seq_lens[s];
            const int64_t i0 = (int64_t)it.tile * TQ;
            const int64_t tq = qlen - i0 < TQ ? qlen - i0 : TQ;
            const int64_t M = G * tq, p0 = len - qlen + i0, p1 = p0 + tq - 1;
            const int32_t *table = tables + s * max_blocks;
            /* rows r = g * tq + i: query head h * G + g at position p0 + i, pre-scaled */
            for (int64_t g = 0; g < G; g++)
                for (int64_t i = 0; i < tq; i++)
                    load_scaled_row(qs + (g * tq + i) * D,
                                    (const char *)q + ((q_start[s] + i0 + i) * q_stride
                                                       + (h * G + g) * D) * esz,
                                    io16, scale, D);
            memset(o, 0, (size_t)(M * D) * sizeof(float));
            for (int64_t r = 0; r < M; r++) {
                mx[r] = -INFINITY;
                sum[r] = 0.0f;
            }
            const int64_t lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
            for (int64_t T0 = lo / KB * KB; T0 <= p1; T0 += KB) {
                /* keys T0 .. T0 + nk - 1 are seen by some row; scores in whole 16-key tiles */
                int64_t nk = p1 - T0 + 1;
                if (nk > KB) nk = KB;
                const int64_t ntiles = (nk + KT - 1) / KT, first = (lo > T0 ? lo - T0 : 0) / KT;
                for (int64_t u = first; u < ntiles; u++)
                    rows_x16(qs, M, D, kt_all + kt_off[s] + ((T0 / KT + u) * KVH + h) * D * KT,
                             sc + u * KT, KB, KT, NULL);
                for (int64_t j = first * KT; j < nk; j++) {
                    const int64_t at = cache_row(table, T0 + j, h, bs, page, D);
                    if (kv16) {
                        bf16_row_to_float(vbuf + j * D, (const uint16_t *)v_cache + at, D);
                        vrow[j] = vbuf + j * D;
                    } else {
                        vrow[j] = (const float *)v_cache + at;
                    }
                }
                const int64_t k0 = first * KT;
                for (int64_t r = 0; r < M; r++) {
                    /* row r's scores -> unnormalised probabilities in place, 0 where masked */
                    const int64_t p = p0 + r % tq;
                    float *srow = sc + r * KB;
                    const int64_t jhi = p - T0 + 1 < nk ? p - T0 + 1 : nk;
                    int64_t jlo = window > 0 ? p - window + 1 - T0 : 0;
                    if (jlo < k0) jlo = k0;
                    if (jhi <= jlo) {  /* no key of this block is visible to row r */
                        memset(srow + k0, 0, (size_t)(nk - k0) * sizeof(float));
                        alpha[r] = 1.0f;
                        continue;
                    }
                    __m256 mv = _mm256_set1_ps(mx[r]);
                    int64_t j = jlo;
                    for (; j + 8 <= jhi; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(srow + j));
                    float lanes[8], m_new = mx[r];
                    _mm256_storeu_ps(lanes, mv);
                    for (int l = 0; l < 8; l++) m_new = lanes[l] > m_new ? lanes[l] : m_new;
                    for (; j < jhi; j++) m_new = srow[j] > m_new ? srow[j] : m_new;
                    mv = _mm256_set1_ps(m_new);
                    __m256 acc = _mm256_setzero_ps();
                    for (j = jlo / 8 * 8; j < jhi; j += 8)
                        _mm256_storeu_ps(srow + j, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(srow + j), mv)));
                    for (j = k0; j < jlo; j++) srow[j] = 0.0f;
                    for (j = jhi; j < nk; j++) srow[j] = 0.0f;
                    for (j = jlo / 8 * 8; j + 8 <= jhi; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(srow + j));
                    _mm256_storeu_ps(lanes, acc);
                    float tot = 0.0f;
                    for (int l = 0; l < 8; l++) tot += lanes[l];
                    for (; j < jhi; j++) tot += srow[j];
                    alpha[r] = expf(mx[r] - m_new);  /* 0 on the first block */
                    sum[r] = sum[r] * alpha[r] + tot;
                    mx[r] = m_new;
                }
                pv(o, M, D, alpha, sc + k0, KB, vrow + k0, nk - k0);
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t i = 0; i < tq; i++) {
                    const int64_t r = g * tq + i;
                    const float inv = 1.0f / sum[r];
                    float *orow = o + r * D;
                    for (int64_t d = 0; d < D; d++) orow[d] *= inv;
                    store_row((char *)out + ((q_start[s] + i0 + i) * out_stride
                                             + (h * G + g) * D) * esz, orow, io16, D);
                }
        }
        free(qs); free(o); free(sc); free(mx); free(sum); free(alpha); free(vbuf);
    }
    free(kt_off); free(kt_all); free(items);
    return failed ? -1 : 0;
#endif
}
