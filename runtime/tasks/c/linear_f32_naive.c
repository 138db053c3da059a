/* Naive fp32 linear layer, one dot product at a time (runtime.tasks.linear_f32): y = x @ W + bias with W packed
 * in panels of 8 columns, W[kk, j] = wp[((j/8)*k + kk)*8 + j%8]. */
void kernel(int m, int n, int k, const float *x, const float *wp, const float *bias, float *y)
{
    /* EVOLVE-BLOCK-START */
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int kk = 0; kk < k; kk++) acc += x[(long)i * k + kk] * wp[((long)(j / 8) * k + kk) * 8 + j % 8];
            y[(long)i * n + j] = acc + bias[j];
        }
    /* EVOLVE-BLOCK-END */
}
