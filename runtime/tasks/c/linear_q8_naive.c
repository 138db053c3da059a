/* Naive int8 linear layer in groups of 32 (runtime.tasks.linear_q8), one dot product at a time. Each group of 32
 * values of a row of x gets its own scale: s = max|x| / 127, q = clamp(rint(x / s), -127, 127) (q = 0 for a group
 * of zeros); W arrives quantised to s8 with a scale per group of 32 rows of each column, w_scale[g * n + j], and
 * packed in quads, wq[kk, j] = wq[((kk/4)*n + j)*4 + kk%4]. Each group's exact int32 sum is scaled by the product
 * of its two scales and added up in fp32: y = sum_g (s_g * w_scale_g) * (float)dot_g + bias. */
#include <math.h>
#include <stdint.h>

void kernel(int m, int n, int k, const float *x, const int8_t *wq, const float *w_scale, const float *bias, float *y)
{
    /* EVOLVE-BLOCK-START */
    const int groups = k / 32;
    for (int i = 0; i < m; i++) {
        const float *xr = x + (long)i * k;
        int8_t q[k];
        float s[groups];
        for (int g = 0; g < groups; g++) {
            float amax = 0.0f;
            for (int c = 32 * g; c < 32 * g + 32; c++) amax = fabsf(xr[c]) > amax ? fabsf(xr[c]) : amax;
            s[g] = amax / 127.0f;
            const float inv = amax > 0.0f ? 1.0f / s[g] : 0.0f;
            for (int c = 32 * g; c < 32 * g + 32; c++) {
                int v = (int)rintf(xr[c] * inv);
                q[c] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
            }
        }
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int c = 32 * g; c < 32 * g + 32; c++) dot += (int32_t)q[c] * wq[((long)(c / 4) * n + j) * 4 + c % 4];
                acc += (s[g] * w_scale[(long)g * n + j]) * (float)dot;
            }
            y[(long)i * n + j] = acc + bias[j];
        }
    }
    /* EVOLVE-BLOCK-END */
}
