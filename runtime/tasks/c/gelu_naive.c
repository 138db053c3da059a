/* Naive fused bias + GELU: y[r,c] = g(x[r,c] + bias[c]), g(h) = h * (1 + erf(h / sqrt 2)) / 2 (libm erff). */
#include <math.h>

void kernel(int rows, int cols, const float *x, const float *bias, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float h = x[(long)r * cols + c] + bias[c];
            y[(long)r * cols + c] = 0.5f * h * (1.0f + erff(h * 0.70710678118654752f));
        }
    /* EVOLVE-BLOCK-END */
}
