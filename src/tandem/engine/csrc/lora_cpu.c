/*
 * Batched multi-LoRA for the CPU, float32: each token's rows get its own adapter's update,
 * in one call per fused linear (the torch plans cost ~2 ops per sub-target each).
 *
 *   for t with s = slots[t] >= 0, for sub-target j < nsub:
 *     xa[t, j*R : (j+1)*R] = A[s, j*R : (j+1)*R, :] @ x[t]            (shrink)
 *     y[t, off[j] : off[j] + n[j]] += xa[t, j*R : (j+1)*R] @ Bt_j[s]   (expand)
 *
 *   x  [T, in], rows x_stride floats apart; y [T, *], rows y_stride apart (updated in place)
 *   slots [T] int64 (-1: the base model, no update)
 *   a  [S, nsub * R, in] contiguous; bt[j] [S, R, n[j]] contiguous (B transposed, the scale
 *   folded in); xa [T, nsub * R] scratch
 * Shrink: 4 rows of A per work item share each load of x. Expand: rank-1 updates of a
 * contiguous output block (vectorised along the output, no horizontal sums). Both run in
 * parallel over (token, block), so a lone decode token still uses every thread. Zero-padded
 * ranks add exactly 0, as in the torch plans.
 */
#include <stddef.h>
#include <stdint.h>

#define LORA_ROWS 4     /* rows of A per shrink work item */
#define LORA_COLS 256   /* output columns per expand work item */

static void shrink_rows(const float *restrict ar, const float *restrict xt, int64_t in,
                        int64_t rows, float *restrict out)
{
    if (rows == LORA_ROWS) {
        const float *restrict a0 = ar, *restrict a1 = ar + in, *restrict a2 = ar + 2 * in,
                    *restrict a3 = ar + 3 * in;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t i = 0; i < in; i++) {
            const float v = xt[i];
            s0 += a0[i] * v;
            s1 += a1[i] * v;
            s2 += a2[i] * v;
            s3 += a3[i] * v;
        }
        out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < in; i++) s += ar[r * in + i] * xt[i];
        out[r] = s;
    }
}

void tandem_lora_f32(const float *x, float *y, float *xa, const int64_t *slots,
                     const float *a, const float *const *bt, const int64_t *n,
                     const int64_t *off, int64_t T, int64_t in, int64_t x_stride,
                     int64_t y_stride, int64_t R, int64_t nsub, int64_t num_threads)
{
    const int64_t nr = nsub * R;
    const int64_t row_blocks = (nr + LORA_ROWS - 1) / LORA_ROWS;
    int64_t col_blocks[8] = {0}, total_cols = 0, total_blocks = 0;
    for (int64_t j = 0; j < nsub; j++) {
        col_blocks[j] = (n[j] + LORA_COLS - 1) / LORA_COLS;
        total_cols += n[j];
        total_blocks += col_blocks[j];
    }
    const int64_t work = T * (nr * in + total_cols * R);
#pragma omp parallel num_threads(num_threads) if (work > 65536)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * row_blocks; item++) {
            const int64_t t = item / row_blocks, r0 = (item % row_blocks) * LORA_ROWS;
            const int64_t s = slots[t];
            if (s < 0) continue;
            const int64_t rows = nr - r0 < LORA_ROWS ? nr - r0 : LORA_ROWS;
            shrink_rows(a + (s * nr + r0) * in, x + t * x_stride, in, rows,
                        xa + t * nr + r0);
        }
        /* implicit barrier: every xa row is complete */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * total_blocks; item++) {
            const int64_t t = item / total_blocks;
            const int64_t s = slots[t];
            if (s < 0) continue;
            int64_t blk = item % total_blocks, j = 0;
            while (blk >= col_blocks[j]) blk -= col_blocks[j++];
            const int64_t nj = n[j], c0 = blk * LORA_COLS;
            const int64_t cols = nj - c0 < LORA_COLS ? nj - c0 : LORA_COLS;
            const float *restrict v = xa + t * nr + j * R;
            const float *restrict bs = bt[j] + s * R * nj + c0;
            float *restrict yt = y + t * y_stride + off[j] + c0;
            for (int64_t k = 0; k < R; k++) {
                const float vk = v[k];
                if (vk == 0.0f) continue;
                const float *restrict bk = bs + k * nj;
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) yt[c] += vk * bk[c];
            }
        }
    }
}
