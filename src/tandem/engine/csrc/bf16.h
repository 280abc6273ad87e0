/* bfloat16 <-> float32 (and float16 -> float32) for the CPU kernels. A bfloat16 is the high half of a float32, so
 * widening is exact (a 16-bit shift); narrowing rounds to nearest even, as torch's
 * `.to(torch.bfloat16)` does, and keeps NaN a (quiet) NaN. Rows convert with AVX-512 or
 * AVX2 where the library was built for them, else one element at a time. Include after
 * <stdint.h> and <string.h>.
 */
#ifndef TANDEM_BF16_H
#define TANDEM_BF16_H
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t h)
{
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* IEEE float16 bits -> float32, exact (subnormals included; NaN stays NaN): F16C's
 * conversion where built, else the bit manipulation. */
static inline float half_bits_to_float(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t bits;
    if (e == 0) {
        const float f = (float)m * 0x1p-24f; /* zero or subnormal: m * 2^-24, exact */
        memcpy(&bits, &f, sizeof bits);
    } else if (e == 31) {
        bits = 0x7F800000u | (m << 13);
    } else {
        bits = ((e + 112) << 23) | (m << 13);
    }
    bits |= sign;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* dst[0..n) = src[0..n) widened */
static inline __attribute__((always_inline)) void bf16_row_to_float(
    float *restrict dst, const uint16_t *restrict src, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(
                                      _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(
                                      _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

/* dst[0..n) = src[0..n) rounded to nearest even */
static inline void float_row_to_bf16(uint16_t *restrict dst, const float *restrict src,
                                     int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* dst[0..n) = scale * src[0..n), src float32 (bf16 == 0) or bfloat16 (bf16 == 1) */
static inline void load_scaled_row(float *restrict dst, const void *src, int bf16, float scale,
                                   int64_t n)
{
    if (bf16)
        bf16_row_to_float(dst, (const uint16_t *)src, n);
    else
        memcpy(dst, src, (size_t)n * sizeof(float));
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) dst[i] *= scale;
}

/* dst[0..n) = src[0..n), dst float32 (bf16 == 0) or bfloat16 (bf16 == 1) */
static inline void store_row(void *dst, const float *restrict src, int bf16, int64_t n)
{
    if (bf16)
        float_row_to_bf16((uint16_t *)dst, src, n);
    else
        memcpy(dst, src, (size_t)n * sizeof(float));
}
#endif
