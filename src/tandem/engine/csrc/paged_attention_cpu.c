/*
 * Paged decode attention for the CPU: one query token per sequence, K/V read straight
 * from the block pool (no gathered copy), float32 arithmetic whatever the storage.
 *
 * Layouts (element strides):
 *   q        [B, H, D]        row b starts at q + b * q_stride; heads contiguous
 *   out      [B, H, D]        row b starts at out + b * out_stride
 *                             (q and out float32, or bfloat16 when io_bf16 = 1)
 *   k_cache  [NB, KVH, BS, D] contiguous (one block = one page of KVH * BS * D), float32
 *                             (kv_fmt 0) or bfloat16 (kv_fmt 3); quantized formats below
 *   v_cache  likewise
 *   tables   [B, max_blocks]  int32 block ids
 *   seq_lens [B]              int32 context length including the new token
 * Query head h reads KV head h / (H / KVH) (grouped-query attention). With window > 0
 * only the last `window` positions are attended (Mistral-style sliding window).
 * Requires 1 <= H / KVH <= 64. Returns 0, -1 if scratch memory ran out, -2 for an
 * unsupported group or format.
 *
 * Work item = (sequence, KV head): its G = H / KVH query heads share every K/V row
 * read. Three passes over the context: scores (and their max), exp and sum, then the
 * probability-weighted sum of V. Same math as softmax(q k^T * scale) v in float32; exp
 * comes from glibc's vector math library (libmvec, at most 4 ulp). bfloat16 rows widen
 * exactly (bf16.h) into a D-float buffer shared by the G heads; bfloat16 outputs round to
 * nearest even once, at the end.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#pragma omp declare simd notinbranch
extern float expf(float);

#define MAX_GROUP 64

/* Row t's address in a cache (K or V), and a prefetch of the same row one block ahead:
 * a block's rows for one KV head are one 4 KiB run, and hardware prefetchers stop at
 * page boundaries, so without this every block starts with a cache-miss stall. */
static inline __attribute__((always_inline)) const float *row_and_prefetch(
    const float *cache, const int32_t *table, int64_t t, int64_t len, int64_t kvh,
    int64_t block_size, int64_t page, int64_t D)
{
    const int64_t in_block = (kvh * block_size + t % block_size) * D;
    if (t + block_size < len) {
        const char *next = (const char *)(cache + (int64_t)table[t / block_size + 1] * page
                                          + in_block);
        for (int64_t c = 0; c < D * (int64_t)sizeof(float); c += 64)
            __builtin_prefetch(next + c);
    }
    return cache + (int64_t)table[t / block_size] * page + in_block;
}

int tandem_paged_attention_abi(void) { return 7; }  /* ABI of the whole library */

/* One (sequence, KV head) item; D is a compile-time constant in the specialised copies. */
/* Each of the G score rows `scores[g * n ...]` (row maxima `mx`) -> its softmax, in place;
 * the G output rows `oh[g * D ...]` zeroed for the PV accumulation. */
static void softmax_and_clear(float *restrict scores, const float *restrict mx, int64_t G,
                              int64_t n, float *restrict oh, int64_t D)
{
    for (int64_t g = 0; g < G; g++) {
        float *restrict s = scores + g * n;
        const float m = mx[g];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            const float e = expf(s[i] - m);
            s[i] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) s[i] *= inv;
        memset(oh + g * D, 0, (size_t)D * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void attend(
    float *restrict oh, const float *restrict qh, const float *restrict k_cache,
    const float *restrict v_cache, const int32_t *restrict table, int64_t first,
    int64_t len, int64_t G, const int64_t D, int64_t kvh, int64_t block_size, int64_t page,
    float scale, float *restrict scores)
{
    const int64_t n = len - first;
    float mx[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;

    for (int64_t t = first; t < len; t++) {
        const float *restrict kr =
            row_and_prefetch(k_cache, table, t, len, kvh, block_size, page, D);
        for (int64_t g = 0; g < G; g++) {
            const float *restrict qg = qh + g * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qg[d] * kr[d];
            acc *= scale;
            scores[g * n + (t - first)] = acc;
            mx[g] = acc > mx[g] ? acc : mx[g];
        }
    }
    softmax_and_clear(scores, mx, G, n, oh, D);
    for (int64_t t = first; t < len; t++) {
        const float *restrict vr =
            row_and_prefetch(v_cache, table, t, len, kvh, block_size, page, D);
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * n + (t - first)];
            float *restrict og = oh + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) og[d] += p * vr[d];
        }
    }
}

#define ATTEND_D(DIM)                                                                    \
    static void attend_d##DIM(float *oh, const float *qh, const float *k_cache,           \
                              const float *v_cache, const int32_t *table, int64_t first,  \
                              int64_t len, int64_t G, int64_t kvh, int64_t block_size,    \
                              int64_t page, float scale, float *scores)                   \
    {                                                                                     \
        attend(oh, qh, k_cache, v_cache, table, first, len, G, DIM, kvh, block_size,      \
               page, scale, scores);                                                      \
    }
ATTEND_D(64)
ATTEND_D(128)

/*
 * Rows stored in another format are converted to float32 as they are read. Quantized
 * caches (engine/kv_cache/quant.py): k_cache / v_cache are uint8 [NB, KVH, BS * (D + 2)];
 * each (block, KV head) page holds its BS rows' D codes (fmt 1: int8, fmt 2: fp8 e4m3fn),
 * row o at byte o * D, then their float16 scales s (little-endian), row o's at byte
 * BS * D + 2 * o; x = code * s. bfloat16 caches (fmt 3) are [NB, KVH, BS, D] with no
 * scales. Rows are read as they are stored (D + 2 bytes or 2 D instead of 4 D; with
 * D % 16 == 0 and BS % 8 == 0 every code row is 16-byte aligned): each row is converted
 * to float once into a D-float buffer shared by the G query heads, and a quantized row's
 * scale is folded in per row: score = (scale * s_k) * dot(q, codes), acc += (p * s_v) *
 * codes. fp8 codes convert exactly with the bit trick bits = (b & 0x7F) << 20 |
 * (b & 0x80) << 24, times 2^120 (subnormal codes land on float32 subnormals, exact
 * without flush-to-zero).
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* a little-endian float16 at p -> float32 */
static inline float half_to_float(const uint8_t *p)
{
    return half_bits_to_float((uint16_t)(p[0] | (p[1] << 8)));
}

static inline float fp8_to_float(uint8_t b)
{
    const uint32_t bits = ((uint32_t)(b & 0x7F) << 20) | ((uint32_t)(b & 0x80) << 24);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

/* dst[0..D) = the codes of one row as floats (fmt 1 int8, 2 fp8, 3 bfloat16) */
static inline __attribute__((always_inline)) void codes_to_float(
    float *restrict dst, const uint8_t *restrict src, const int64_t D, const int fmt)
{
    if (fmt == 3) {
        bf16_row_to_float(dst, (const uint16_t *)src, D);
        return;
    }
    int64_t d = 0;
#if defined(__AVX2__)
    if (fmt == 1) {
        for (; d + 8 <= D; d += 8) {
            const __m128i b = _mm_loadl_epi64((const __m128i *)(src + d));
            _mm256_storeu_ps(dst + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
        }
    } else {
        const __m256i mag = _mm256_set1_epi32(0x7F), sgn = _mm256_set1_epi32(0x80);
        const __m256 pow120 = _mm256_set1_ps(0x1p120f);
        for (; d + 8 <= D; d += 8) {
            const __m256i x =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)));
            const __m256i bits =
                _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, mag), 20),
                                _mm256_slli_epi32(_mm256_and_si256(x, sgn), 24));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_castsi256_ps(bits), pow120));
        }
    }
#endif
    for (; d < D; d++)
        dst[d] = fmt == 1 ? (float)(int8_t)src[d] : fp8_to_float(src[d]);
}

/* Row t's bytes in a converted cache (fmt as above; a quantized row's scale's two bytes
 * at *scale), and a prefetch of the same row (and scale) one block ahead (`page`: bytes
 * per block, all KV heads). */
static inline __attribute__((always_inline)) const uint8_t *qrow_and_prefetch(
    const uint8_t *cache, const int32_t *table, int64_t t, int64_t len, int64_t kvh,
    int64_t block_size, int64_t page, int64_t D, const int fmt, const uint8_t **scale)
{
    const int64_t o = t % block_size, row = fmt == 3 ? 2 * D : D;
    const int64_t head = kvh * block_size * (fmt == 3 ? 2 * D : D + 2);
    if (t + block_size < len) {
        const char *next = (const char *)(cache + (int64_t)table[t / block_size + 1] * page
                                          + head);
        for (int64_t c = 0; c < row; c += 64) __builtin_prefetch(next + o * row + c);
        if (fmt != 3) __builtin_prefetch(next + block_size * D + 2 * o);
    }
    const uint8_t *base = cache + (int64_t)table[t / block_size] * page + head;
    *scale = base + block_size * D + 2 * o;  /* unused for fmt 3 */
    return base + o * row;
}

/* One (sequence, KV head) item over converted rows; D and fmt constant in the copies. */
static inline __attribute__((always_inline)) void attend_q8(
    float *restrict oh, const float *restrict qh, const uint8_t *restrict k_cache,
    const uint8_t *restrict v_cache, const int32_t *restrict table, int64_t first,
    int64_t len, int64_t G, const int64_t D, const int fmt, int64_t kvh, int64_t block_size,
    int64_t page, float scale, float *restrict scores, float *restrict row)
{
    const int64_t n = len - first;
    const uint8_t *sp;
    float mx[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;

    for (int64_t t = first; t < len; t++) {
        const uint8_t *kr =
            qrow_and_prefetch(k_cache, table, t, len, kvh, block_size, page, D, fmt, &sp);
        const float sk = fmt == 3 ? scale : scale * half_to_float(sp);
        codes_to_float(row, kr, D, fmt);
        for (int64_t g = 0; g < G; g++) {
            const float *restrict qg = qh + g * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qg[d] * row[d];
            acc *= sk;
            scores[g * n + (t - first)] = acc;
            mx[g] = acc > mx[g] ? acc : mx[g];
        }
    }
    softmax_and_clear(scores, mx, G, n, oh, D);
    for (int64_t t = first; t < len; t++) {
        const uint8_t *vr =
            qrow_and_prefetch(v_cache, table, t, len, kvh, block_size, page, D, fmt, &sp);
        const float sv = fmt == 3 ? 1.0f : half_to_float(sp);
        codes_to_float(row, vr, D, fmt);
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * n + (t - first)] * sv;
            float *restrict og = oh + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) og[d] += p * row[d];
        }
    }
}

#define ATTEND_Q8(DIM, FMT, NAME)                                                         \
    static void NAME(float *oh, const float *qh, const uint8_t *k_cache,                  \
                     const uint8_t *v_cache, const int32_t *table, int64_t first,         \
                     int64_t len, int64_t G, int64_t kvh, int64_t block_size, int64_t page, \
                     float scale, float *scores, float *row)                              \
    {                                                                                     \
        attend_q8(oh, qh, k_cache, v_cache, table, first, len, G, DIM, FMT, kvh,          \
                  block_size, page, scale, scores, row);                                  \
    }
ATTEND_Q8(64, 1, attend_i8_d64)
ATTEND_Q8(64, 2, attend_f8_d64)
ATTEND_Q8(128, 1, attend_i8_d128)
ATTEND_Q8(128, 2, attend_f8_d128)
ATTEND_Q8(64, 3, attend_bf_d64)
ATTEND_Q8(128, 3, attend_bf_d128)

/* One item over a converted cache (fmt 1-3): the specialised copy for (D, fmt) if any. */
static void attend_converted(float *oh, const float *qh, const uint8_t *k_cache,
                             const uint8_t *v_cache, const int32_t *table, int64_t first,
                             int64_t len, int64_t G, int64_t D, int fmt, int64_t kvh,
                             int64_t bs, int64_t page, float scale, float *scores, float *row)
{
#define ARGS oh, qh, k_cache, v_cache, table, first, len, G, kvh, bs, page, scale, scores, row
    if (D == 64 && fmt == 1) attend_i8_d64(ARGS);
    else if (D == 64 && fmt == 2) attend_f8_d64(ARGS);
    else if (D == 64 && fmt == 3) attend_bf_d64(ARGS);
    else if (D == 128 && fmt == 1) attend_i8_d128(ARGS);
    else if (D == 128 && fmt == 2) attend_f8_d128(ARGS);
    else if (D == 128 && fmt == 3) attend_bf_d128(ARGS);
    else
        attend_q8(oh, qh, k_cache, v_cache, table, first, len, G, D, fmt, kvh, bs, page,
                  scale, scores, row);
#undef ARGS
}

/*
 * The fast path for float32 and bfloat16 caches, D 64 or 128 and G <= 8 (compile-time
 * constants in each copy): the cache is walked block by block (no division per row, each
 * block's rows prefetched two blocks ahead: one ahead left large batches DRAM-bound at
 * ~28 GB/s on a 2-core EPYC, two ahead reached 35-55), the
 * G query rows stay in vector registers for the scores, and the G output rows accumulate
 * in registers over the values (AVX-512: up to 16 zmm each; AVX2 spills what does not
 * fit to L1). Same three passes and float32 arithmetic as `attend`.
 */
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VSUM _mm512_reduce_add_ps
static inline vf vload_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
static inline float VSUM(__m256 x)
{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline vf vload_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#ifdef VL
#define FAST_MAX_G 8
static inline __attribute__((always_inline)) vf vload_row(const void *row, int64_t d,
                                                          const int bf16)
{
    return bf16 ? vload_bf16((const uint16_t *)row + d) : VLOAD((const float *)row + d);
}

/* Block t0 / bs of one KV head in a cache walked block by block: its rows [*lo, *hi) that
 * [first, len) covers, at the returned bytes (`row` bytes apart), with the same head's rows
 * two blocks ahead prefetched. */
static inline __attribute__((always_inline)) const char *block_rows(
    const char *cache, const int32_t *table, int64_t t0, int64_t first, int64_t len,
    int64_t bs, int64_t page, int64_t kvh, int64_t row, int64_t *lo, int64_t *hi)
{
    const int64_t head = kvh * bs * row;
    if (t0 + 2 * bs < len) {
        const char *next = cache + (int64_t)table[t0 / bs + 2] * page + head;
        for (int64_t c = 0; c < bs * row; c += 64) __builtin_prefetch(next + c);
    }
    *lo = t0 < first ? first - t0 : 0;
    *hi = len - t0 < bs ? len - t0 : bs;
    return cache + (int64_t)table[t0 / bs] * page + head;
}

static inline __attribute__((always_inline)) void attend_fast(
    float *restrict oh, const float *restrict qh, const char *k_cache, const char *v_cache,
    const int32_t *restrict table, int64_t first, int64_t len, const int G, const int64_t D,
    const int bf16, int64_t kvh, int64_t bs, int64_t page, float scale,
    float *restrict scores)
{
    enum { MAXV = 128 / VL };
    const int64_t DV = D / VL, esz = bf16 ? 2 : 4, row = D * esz;
    const int64_t n = len - first;
    vf acc[FAST_MAX_G * MAXV];
    float mx[FAST_MAX_G];
    for (int g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        for (int64_t v = 0; v < DV; v++)
            acc[g * MAXV + v] = VMUL(VLOAD(qh + g * D + v * VL), VSET1(scale));
    }
    int64_t lo, hi;
    for (int64_t t0 = first / bs * bs; t0 < len; t0 += bs) { /* scores */
        const char *base = block_rows(k_cache, table, t0, first, len, bs, page, kvh, row, &lo,
                                      &hi);
        for (int64_t o = lo; o < hi; o++) {
            const char *kr = base + o * row;
            vf k[MAXV];
            for (int64_t v = 0; v < DV; v++) k[v] = vload_row(kr, v * VL, bf16);
            for (int g = 0; g < G; g++) {
                vf dot = VMUL(acc[g * MAXV], k[0]);
                for (int64_t v = 1; v < DV; v++) dot = VFMA(acc[g * MAXV + v], k[v], dot);
                const float sc = VSUM(dot);
                scores[g * n + (t0 + o - first)] = sc;
                mx[g] = sc > mx[g] ? sc : mx[g];
            }
        }
    }
    softmax_and_clear(scores, mx, G, n, oh, D);
    for (int g = 0; g < G; g++)
        for (int64_t v = 0; v < DV; v++) acc[g * MAXV + v] = VZERO();
    for (int64_t t0 = first / bs * bs; t0 < len; t0 += bs) { /* probabilities x values */
        const char *base = block_rows(v_cache, table, t0, first, len, bs, page, kvh, row, &lo,
                                      &hi);
        for (int64_t o = lo; o < hi; o++) {
            const char *vr = base + o * row;
            vf x[MAXV];
            for (int64_t v = 0; v < DV; v++) x[v] = vload_row(vr, v * VL, bf16);
            for (int g = 0; g < G; g++) {
                const vf p = VSET1(scores[g * n + (t0 + o - first)]);
                for (int64_t v = 0; v < DV; v++)
                    acc[g * MAXV + v] = VFMA(p, x[v], acc[g * MAXV + v]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int64_t v = 0; v < DV; v++) VSTORE(oh + g * D + v * VL, acc[g * MAXV + v]);
}

#define FAST(GG, DD, BF, NAME)                                                            \
    static void NAME(float *oh, const float *qh, const char *k, const char *v,              \
                     const int32_t *table, int64_t first, int64_t len, int64_t kvh,         \
                     int64_t bs, int64_t page, float scale, float *scores)                  \
    {                                                                                     \
        attend_fast(oh, qh, k, v, table, first, len, GG, DD, BF, kvh, bs, page, scale,    \
                    scores);                                                              \
    }
#define FAST_G(DD, BF, SUFFIX)                                                            \
    FAST(1, DD, BF, fast1_##SUFFIX) FAST(2, DD, BF, fast2_##SUFFIX)                         \
    FAST(3, DD, BF, fast3_##SUFFIX) FAST(4, DD, BF, fast4_##SUFFIX)                         \
    FAST(5, DD, BF, fast5_##SUFFIX) FAST(6, DD, BF, fast6_##SUFFIX)                         \
    FAST(7, DD, BF, fast7_##SUFFIX) FAST(8, DD, BF, fast8_##SUFFIX)                         \
    static void (*const fast_##SUFFIX[FAST_MAX_G])(                                        \
        float *, const float *, const char *, const char *, const int32_t *, int64_t,      \
        int64_t, int64_t, int64_t, int64_t, float, float *) = {                           \
        fast1_##SUFFIX, fast2_##SUFFIX, fast3_##SUFFIX, fast4_##SUFFIX,                    \
        fast5_##SUFFIX, fast6_##SUFFIX, fast7_##SUFFIX, fast8_##SUFFIX};
FAST_G(64, 0, f32_d64)
FAST_G(128, 0, f32_d128)
FAST_G(64, 1, bf_d64)
FAST_G(128, 1, bf_d128)

/* The fast copy for (G, D, format), or NULL. */
typedef void (*fast_fn)(float *, const float *, const char *, const char *, const int32_t *,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float, float *);
static fast_fn fast_attend(int64_t G, int64_t D, int64_t kv_fmt)
{
    if (G < 1 || G > FAST_MAX_G || (kv_fmt != 0 && kv_fmt != 3)) return NULL;
    if (D == 64) return (kv_fmt == 3 ? fast_bf_d64 : fast_f32_d64)[G - 1];
    if (D == 128) return (kv_fmt == 3 ? fast_bf_d128 : fast_f32_d128)[G - 1];
    return NULL;
}
#else
typedef void (*fast_fn)(float *, const float *, const char *, const char *, const int32_t *,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float, float *);
static fast_fn fast_attend(int64_t G, int64_t D, int64_t kv_fmt)
{
    (void)G; (void)D; (void)kv_fmt;
    return NULL;
}
#endif

int tandem_paged_attention_decode(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *tables, const int32_t *seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, int64_t q_stride, int64_t out_stride,
    int64_t window, int64_t kv_fmt, int64_t io_bf16, float scale, int64_t num_threads)
{
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    const int64_t esz = io_bf16 ? 2 : 4;  /* bytes per q / out element */
    /* bytes per block, all KV heads */
    const int64_t page = num_kv_heads * block_size
                         * (kv_fmt == 0 ? 4 * D : kv_fmt == 3 ? 2 * D : D + 2);
    int failed = 0;
    if (G < 1 || G > MAX_GROUP || kv_fmt < 0 || kv_fmt > 3 || io_bf16 < 0 || io_bf16 > 1)
        return -2;

    /* a thread takes a whole sequence (its KV heads in turn, so the rows of a block that
     * share cache lines and pages are read together) when there are enough of them */
    const int64_t chunk = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t b = item / num_kv_heads;
        const int64_t kvh = item % num_kv_heads;
        const int64_t len = seq_lens[b];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int32_t *table = tables + b * max_blocks;
        const char *qsrc = (const char *)q + (b * q_stride + kvh * G * D) * esz;
        char *odst = (char *)out + (b * out_stride + kvh * G * D) * esz;
        if (len <= first) {
            memset(odst, 0, (size_t)(G * D * esz));
            continue;
        }
        /* scores [G, n], a converted row [D], and (bfloat16 io) q and out [G, D] each */
        const int64_t n = len - first;
        float *scores = (float *)malloc((size_t)(G * n + D + (io_bf16 ? 2 * G * D : 0))
                                        * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *row = scores + G * n;
        const float *qh = (const float *)qsrc;
        float *oh = (float *)odst;
        if (io_bf16) {
            float *qf = row + D;
            bf16_row_to_float(qf, (const uint16_t *)qsrc, G * D);
            qh = qf;
            oh = qf + G * D;
        }
        const fast_fn fast = fast_attend(G, D, kv_fmt);
        if (fast != NULL)
            fast(oh, qh, k_cache, v_cache, table, first, len, kvh, block_size, page, scale,
                 scores);
        else if (kv_fmt == 0 && D == 64)
            attend_d64(oh, qh, k_cache, v_cache, table, first, len, G, kvh, block_size,
                       page / 4, scale, scores);
        else if (kv_fmt == 0 && D == 128)
            attend_d128(oh, qh, k_cache, v_cache, table, first, len, G, kvh, block_size,
                        page / 4, scale, scores);
        else if (kv_fmt == 0)
            attend(oh, qh, k_cache, v_cache, table, first, len, G, D, kvh, block_size,
                   page / 4, scale, scores);
        else
            attend_converted(oh, qh, k_cache, v_cache, table, first, len, G, D, (int)kv_fmt,
                             kvh, block_size, page, scale, scores, row);
        if (io_bf16) float_row_to_bf16((uint16_t *)odst, oh, G * D);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* float32 -> float16 bits, round to nearest even, for x in float16's normal range. */
static inline uint16_t float_to_half_normal(float x)
{
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(x, 0);  /* 0 = _MM_FROUND_TO_NEAREST_INT */
#else
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint32_t sign = (b >> 16) & 0x8000, a = b & 0x7FFFFFFF;
    return (uint16_t)(sign | (((a + 0xFFF + ((a >> 13) & 1)) >> 13) - (112 << 10)));
#endif
}

/* float32 y with |y| <= 448 -> fp8 e4m3fn bits, round to nearest even (as torch casts). */
static inline uint8_t float_to_fp8(float y)
{
    uint32_t b;
    memcpy(&b, &y, sizeof b);
    const uint32_t sign = (b >> 24) & 0x80, a = b & 0x7FFFFFFF;
    if (a >= 0x3C800000)  /* |y| >= 2^-6: round the mantissa to 3 bits, rebias 127 -> 7 */
        return (uint8_t)(sign | (((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)));
    float f;  /* subnormal: |y| + 2^14 rounds |y| to a multiple of 2^-9 */
    memcpy(&f, &a, sizeof f);
    f += 16384.0f;
    uint32_t m;
    memcpy(&m, &f, sizeof m);
    return (uint8_t)(sign | (m - 0x46800000u));
}

/*
 * Quantize rows into a quantized cache (engine/kv_cache/quant.py, the same bytes as its
 * torch reference): src row r (of T * KVH rows: token r / KVH, head r % KVH) is at
 * src + (r / KVH) * src_stride + (r % KVH) * D floats; it goes to cache row dst_rows[r],
 * i.e. offset o = dst_rows[r] % BS of page dst_rows[r] / BS of `cache` viewed as pages
 * [NB * KVH, BS * (D + 2)] uint8: codes at o * D, scale at BS * D + 2 * o. fmt 1 int8,
 * 2 fp8. Returns 0, or -2 for a bad fmt.
 */
int tandem_kv_quantize_write(
    uint8_t *cache, const float *src, const int64_t *dst_rows, int64_t num_tokens,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t src_stride,
    int64_t fmt, int64_t num_threads)
{
    const int64_t D = head_dim, P = block_size * (D + 2), n = num_tokens * num_kv_heads;
    if (fmt != 1 && fmt != 2) return -2;
    const float qmax = fmt == 1 ? 127.0f : 448.0f;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= 256)
    for (int64_t r = 0; r < n; r++) {
        const float *x = src + (r / num_kv_heads) * src_stride + (r % num_kv_heads) * D;
        const int64_t o = dst_rows[r] % block_size;
        uint8_t *page = cache + (dst_rows[r] / block_size) * P;
        uint8_t *dst = page + o * D, *sdst = page + block_size * D + 2 * o;
        float amax = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float a = fabsf(x[d]);
            amax = a > amax ? a : amax;
        }
        float s = amax / qmax;
        s = s < 0x1p-14f ? 0x1p-14f : (s > 65504.0f ? 65504.0f : s);
        const uint16_t h = float_to_half_normal(s);
        const float sr = half_to_float((const uint8_t[2]){(uint8_t)(h & 0xFF), (uint8_t)(h >> 8)});
        if (fmt == 1) {
            for (int64_t d = 0; d < D; d++) {
                float y = x[d] / sr;
                y = y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y);
                dst[d] = (uint8_t)(int8_t)nearbyintf(y);
            }
        } else {
            for (int64_t d = 0; d < D; d++) {
                float y = x[d] / sr;
                y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
                dst[d] = float_to_fp8(y);
            }
        }
        sdst[0] = (uint8_t)(h & 0xFF);
        sdst[1] = (uint8_t)(h >> 8);
    }
    return 0;
}
