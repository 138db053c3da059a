/* Naive bf16 linear layer: y[m,n] = bf16(x)[m,k] @ W[k,n] + bias[n], fp32 accumulation, one dot product at a time.
 * W arrives packed as bf16 pairs: W[kk, j] = wp[((kk/2)*n + j)*2 + kk%2]. bf16 -> fp32 is a 16-bit shift;
 * fp32 -> bf16 rounds to nearest even with integer arithmetic (NaN is not expected in x). */
#include <stdint.h>
#include <string.h>

static float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float round_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

void kernel(int m, int n, int k, const float *x, const uint16_t *wp, const float *bias, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int kk = 0; kk < k; kk++)
                acc += round_bf16(x[(long)i * k + kk]) * bf16_to_f32(wp[((long)(kk / 2) * n + j) * 2 + kk % 2]);
            y[(long)i * n + j] = acc + bias[j];
        }
    /* EVOLVE-BLOCK-END */
}
