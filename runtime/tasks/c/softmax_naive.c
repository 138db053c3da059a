/* Naive row-wise softmax over the last axis: y[r,:] = exp(x[r,:] - max) / sum(exp(x[r,:] - max)). */
#include <math.h>

void kernel(int rows, int cols, const float *x, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        float max = -INFINITY;
        for (int c = 0; c < cols; c++) max = fmaxf(max, xr[c]);
        float sum = 0.0f;
        for (int c = 0; c < cols; c++) {
            yr[c] = expf(xr[c] - max);
            sum += yr[c];
        }
        for (int c = 0; c < cols; c++) yr[c] /= sum;
    }
    /* EVOLVE-BLOCK-END */
}
