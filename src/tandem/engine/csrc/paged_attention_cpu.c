/*
 * Paged decode attention for the CPU: one query token per sequence, K/V read straight
 * from the block pool (no gathered copy), float32.
 *
 * Layouts (element strides, all float32 unless noted):
 *   q        [B, H, D]        row b starts at q + b * q_stride; heads contiguous
 *   out      [B, H, D]        row b starts at out + b * out_stride
 *   k_cache  [NB, KVH, BS, D] contiguous (one block = one page of KVH * BS * D)
 *   v_cache  [NB, KVH, BS, D] contiguous
 *   tables   [B, max_blocks]  int32 block ids
 *   seq_lens [B]              int32 context length including the new token
 * Query head h reads KV head h / (H / KVH) (grouped-query attention). With window > 0
 * only the last `window` positions are attended (Mistral-style sliding window).
 * Requires 1 <= H / KVH <= 64. Returns 0, or -1 if scratch memory ran out.
 *
 * Work item = (sequence, KV head): its G = H / KVH query heads share every K/V row
 * read. Three passes over the context: scores (and their max), exp and sum, then the
 * probability-weighted sum of V. Same math as softmax(q k^T * scale) v in float32; exp
 * comes from glibc's vector math library (libmvec, at most 4 ulp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

int tandem_paged_attention_abi(void) { return 5; }  /* ABI of the whole library */

/* One (sequence, KV head) item; D is a compile-time constant in the specialised copies. */
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

int tandem_paged_attention_decode_f32(
    float *out, const float *q, const float *k_cache, const float *v_cache,
    const int32_t *tables, const int32_t *seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, int64_t q_stride, int64_t out_stride,
    int64_t window, float scale, int64_t num_threads)
{
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    const int64_t page = num_kv_heads * block_size * D;  /* floats per block */
    int failed = 0;
    if (G < 1 || G > MAX_GROUP) return -2;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t b = item / num_kv_heads;
        const int64_t kvh = item % num_kv_heads;
        const int64_t len = seq_lens[b];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int32_t *table = tables + b * max_blocks;
        const float *qh = q + b * q_stride + kvh * G * D;
        float *oh = out + b * out_stride + kvh * G * D;
        if (len <= first) {
            memset(oh, 0, (size_t)(G * D) * sizeof(float));
            continue;
        }
        float *scores = (float *)malloc((size_t)(G * (len - first)) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        if (D == 64)
            attend_d64(oh, qh, k_cache, v_cache, table, first, len, G, kvh, block_size,
                       page, scale, scores);
        else if (D == 128)
            attend_d128(oh, qh, k_cache, v_cache, table, first, len, G, kvh, block_size,
                        page, scale, scores);
        else
            attend(oh, qh, k_cache, v_cache, table, first, len, G, D, kvh, block_size, page,
                   scale, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
