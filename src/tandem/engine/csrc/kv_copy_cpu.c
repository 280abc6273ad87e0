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
 *                 hashed, not copied (a receiver's block it already holds).
 *                 `update` is XXH3_64bits_update of the `xxhash` module's library (the
 *                 caller passes its address and a state it reset), so the digest is
 *                 xxhash's own. One thread: a transfer runs beside the engine's threads.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*tandem_hash_update_fn)(void *state, const void *data, size_t len);

#define PIECE ((int64_t)64 << 10)

int tandem_kv_copy_hash(const uint8_t *src, const int64_t *src_idx, uint8_t *dst,
                        const int64_t *dst_idx, int64_t n, int64_t bytes, void *state,
                        void *update)
{
    tandem_hash_update_fn up = (tandem_hash_update_fn)update;
    if (n < 0 || bytes <= 0) return -1;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = src + src_idx[i] * bytes;
        uint8_t *d = dst != NULL && dst_idx[i] >= 0 ? dst + dst_idx[i] * bytes : NULL;
        for (int64_t off = 0; off < bytes; off += PIECE) {
            const int64_t len = bytes - off < PIECE ? bytes - off : PIECE;
            if (up != NULL && up(state, s + off, (size_t)len) != 0) return -2;
            if (d != NULL) memcpy(d + off, s + off, (size_t)len);
        }
    }
    return 0;
}
