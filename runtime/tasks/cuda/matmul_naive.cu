/* Naive GEMM: every thread computes THREAD_M x THREAD_N outputs straight from global memory, with the
 * template's launch (grid of BLOCK_M x BLOCK_N tiles, TX * TY threads); no shared memory, no reuse. */
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(IN_F16)
typedef __half in_t;
__device__ __forceinline__ float to_float(in_t v) { return __half2float(v); }
#elif defined(IN_BF16)
typedef __nv_bfloat16 in_t;
__device__ __forceinline__ float to_float(in_t v) { return __bfloat162float(v); }
#else
typedef float in_t;
__device__ __forceinline__ float to_float(in_t v) { return v; }
#endif

#define TX (BLOCK_N / THREAD_N)
#define TY (BLOCK_M / THREAD_M)

/* EVOLVE-BLOCK-START */
extern "C" __global__ void kernel(int M, int N, int K, const in_t *A, const in_t *B, float *C)
{
    int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    for (int i = 0; i < THREAD_M; i++) {
        for (int j = 0; j < THREAD_N; j++) {
            int r = blockIdx.y * BLOCK_M + ty + i * TY, c = blockIdx.x * BLOCK_N + tx + j * TX;
            if (r >= M || c >= N) continue;
            float sum = 0.0f;
            for (int k = 0; k < K; k++) sum += to_float(A[(size_t)r * K + k]) * to_float(B[(size_t)k * N + c]);
            C[(size_t)r * N + c] = sum;
        }
    }
}
/* EVOLVE-BLOCK-END */
