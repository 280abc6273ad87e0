/*
 * Copies of whole KV blocks between a paged cache and a contiguous buffer (or another
 * cache), fused with the XXH3-64 digest of the bytes copied, for KV page transfers.
 *
 *   kv_copy_hash: for i in 0..n-1, in order:
 *                   dst + dst_idx[i] * bytes  <-  src + src_idx[i] * bytes   (bytes each)
 *                 and, when `update` is not NULL, update(state, piece, len) over the source
 *                 bytes, in pieces of at most PIECE bytes, each hashed right before it is
 *                 copied (the copy then reads it from L1/L2): the digest of every block in
 *                 order, with one pass over memory. dst NULL, or dst_idx[i] < 0: block i is
 *                 hashed, not copied (a receiver's block it already holds). `stream` 1:
 *                 non-temporal stores for the destination's 64-byte-aligned lines (no
 *                 read-for-ownership of lines about to be overwritten whole, no eviction
 *                 of the source from the cache): for a KV cache being filled, or a buffer
 *                 larger than the last-level cache; 0: ordinary stores (a buffer the peer
 *                 reads next while it is still cached).
 *                 `update` is XXH3_64bits_update of the `xxhash` module's library (the
 *                 caller passes its address and a state it reset), so the digest is
 *                 xxhash's own. One thread: a transfer runs beside the engine's threads.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef int (*tandem_hash_update_fn)(void *state, const void *data, size_t len);

#define PIECE ((int64_t)64 << 10)

/* dst <- src, len bytes: non-temporal stores for the 64-byte-aligned body (AVX-512 or
   AVX2), memcpy for the unaligned head and the tail */
static void copy_stream(uint8_t *dst, const uint8_t *src, size_t len)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    size_t head = (size_t)(-(uintptr_t)dst) & 63;
    if (head > len) head = len;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    const size_t body = len & ~(size_t)255;
    for (size_t i = 0; i < body; i += 256) {
#if defined(__AVX512F__)
        for (size_t j = 0; j < 256; j += 64)
            _mm512_stream_si512((void *)(dst + i + j), _mm512_loadu_si512(src + i + j));
#else
        for (size_t j = 0; j < 256; j += 32)
            _mm256_stream_si256((__m256i *)(dst + i + j),
                                _mm256_loadu_si256((const __m256i *)(src + i + j)));
#endif
    }
    memcpy(dst + body, src + body, len - body);
#else
    memcpy(dst, src, len);
#endif
}

int tandem_kv_copy_hash(const uint8_t *src, const int64_t *src_idx, uint8_t *dst,
                        const int64_t *dst_idx, int64_t n, int64_t bytes, void *state,
                        void *update, int64_t stream)
{
    tandem_hash_update_fn up = (tandem_hash_update_fn)update;
    if (n < 0 || bytes <= 0) return -1;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = src + src_idx[i] * bytes;
        uint8_t *d = dst != NULL && dst_idx[i] >= 0 ? dst + dst_idx[i] * bytes : NULL;
        for (int64_t off = 0; off < bytes; off += PIECE) {
            const int64_t len = bytes - off < PIECE ? bytes - off : PIECE;
            if (up != NULL && up(state, s + off, (size_t)len) != 0) return -2;
            if (d == NULL) continue;
            if (stream) copy_stream(d + off, s + off, (size_t)len);
            else memcpy(d + off, s + off, (size_t)len);
        }
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    if (stream) _mm_sfence(); /* the stores are ordered before whatever the caller does next */
#endif
    return 0;
}
