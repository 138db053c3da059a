/* Naive layer norm over each row: y = (x - mean) / sqrt(var + eps) * gamma + beta (two passes, scalar). */
#include <math.h>

void kernel(int rows, int cols, float eps, const float *x, const float *gamma, const float *beta, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        float sum = 0.0f;
        for (int c = 0; c < cols; c++) sum += xr[c];
        float mean = sum / cols, var = 0.0f;
        for (int c = 0; c < cols; c++) var += (xr[c] - mean) * (xr[c] - mean);
        float inv = 1.0f / sqrtf(var / cols + eps);
        for (int c = 0; c < cols; c++) yr[c] = (xr[c] - mean) * inv * gamma[c] + beta[c];
    }
    /* EVOLVE-BLOCK-END */
}
