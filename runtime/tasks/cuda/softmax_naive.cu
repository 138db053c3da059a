/* Naive softmax: lane 0 of each warp walks its row three times (max, sum, write); the other lanes
 * idle. It uses the template's WARP launch: WARPS_PER_BLOCK rows per block of 32 * WARPS_PER_BLOCK. */
#include <math.h>

/* EVOLVE-BLOCK-START */
extern "C" __global__ void kernel(int rows, int cols, const float *x, float *y)
{
    int row = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
    if (row >= rows || threadIdx.x % 32 != 0) return;
    const float *xr = x + (size_t)row * cols;
    float m = -INFINITY, s = 0.0f;
    for (int i = 0; i < cols; i++) m = fmaxf(m, xr[i]);
    for (int i = 0; i < cols; i++) s += expf(xr[i] - m);
    for (int i = 0; i < cols; i++) y[(size_t)row * cols + i] = expf(xr[i] - m) / s;
}
/* EVOLVE-BLOCK-END */
