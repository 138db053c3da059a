/* Naive fp32 GEMM, row-major C[M,N] = A[M,K] x B[K,N]: the i-j-k triple loop. */
void kernel(int M, int N, int K, const float *A, const float *B, float *C)
{
    /* EVOLVE-BLOCK-START */
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float sum = 0.0f;
            for (int k = 0; k < K; k++) sum += A[(long)i * K + k] * B[(long)k * N + j];
            C[(long)i * N + j] = sum;
        }
    /* EVOLVE-BLOCK-END */
}
