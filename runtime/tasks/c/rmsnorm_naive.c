/* Naive RMSNorm over each row: y = x / sqrt(mean(x^2) + eps) * w (scalar, two passes). */
#include <math.h>

void kernel(int rows, int cols, float eps, const float *x, const float *w, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        float sq = 0.0f;
        for (int c = 0; c < cols; c++) sq += xr[c] * xr[c];
        const float inv = 1.0f / sqrtf(sq / cols + eps);
        for (int c = 0; c < cols; c++) yr[c] = xr[c] * inv * w[c];
    }
    /* EVOLVE-BLOCK-END */
}
