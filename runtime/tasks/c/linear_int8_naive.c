/* Naive int8 linear layer with dynamic quantisation, one dot product at a time (runtime.tasks.linear_int8).
 * Each row of x is quantised to u8 once (per-row scale s and zero point z), W arrives quantised to s8 and packed
 * in quads: wq[kk, j] = wq[((kk/4)*n + j)*4 + kk%4], with w_scale[j] and w_colsum[j] = sum_kk wq[kk, j].
 * y = (float)(acc - z * w_colsum) * (s * w_scale) + bias, each float operation rounded on its own
 * (built with -ffp-contract=off); rintf rounds half to even under the default rounding mode. */
#include <math.h>
#include <stdint.h>

#ifndef W_AT /* W[kk, j] where the packing puts it (linear_int8_avx2's seed defines its panels' place) */
#define W_AT(kk, j) wq[((long)((kk) / 4) * n + (j)) * 4 + (kk) % 4]
#endif

void kernel(int m, int n, int k, const float *x, const int8_t *wq, const float *w_scale, const int32_t *w_colsum, const float *bias, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int i = 0; i < m; i++) {
        const float *xr = x + (long)i * k;
        float lo = 0.0f, hi = 0.0f;
        for (int kk = 0; kk < k; kk++) {
            lo = xr[kk] < lo ? xr[kk] : lo;
            hi = xr[kk] > hi ? xr[kk] : hi;
        }
        float s = (hi - lo) / 255.0f;
        if (s == 0.0f) s = 1.0f;
        const float inv = 1.0f / s;
        const int z = (int)rintf(-lo * inv);
        uint8_t q[k];
        for (int kk = 0; kk < k; kk++) {
            int v = (int)rintf(xr[kk] * inv) + z;
            q[kk] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
        }
        for (int j = 0; j < n; j++) {
            int32_t acc = 0;
            for (int kk = 0; kk < k; kk++) acc += (int32_t)q[kk] * W_AT(kk, j);
            y[(long)i * n + j] = (float)(acc - z * w_colsum[j]) * (s * w_scale[j]) + bias[j];
        }
    }
    /* EVOLVE-BLOCK-END */
}
