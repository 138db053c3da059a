/* Parametric tiled GEMM, row-major C[M,N] (fp32) = A[M,K] x B[K,N], inputs fp32, fp16 or bf16
 * (IN_F16 / IN_BF16 from the task's flags), accumulation in fp32.
 *
 * Parameters (arrive as #defines): BLOCK_M x BLOCK_N is a block's tile of C, BLOCK_K the depth of one
 * shared-memory stage; each thread computes THREAD_M x THREAD_N outputs, strided by the thread grid so
 * shared-memory reads are broadcasts (A) or consecutive (B) and stores coalesce. VEC elements are read
 * per global load (aligned vector loads when K, resp. N, is a multiple of VEC; scalar otherwise).
 * DOUBLE_BUFFER loads the next stage into registers while the current one is computed (two stages of
 * shared memory, one barrier per stage). SMEM_PAD pads shared rows against bank conflicts.
 * Launch: grid (ceil(N / BLOCK_N), ceil(M / BLOCK_M)), THREADS threads, dynamic shared memory
 * STAGES * BLOCK_K * (BLOCK_M + BLOCK_N + 2 * SMEM_PAD) * 4 bytes.
 */
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
#define THREADS (TX * TY)
#define STAGES (DOUBLE_BUFFER ? 2 : 1)
#define LDA (BLOCK_M + SMEM_PAD) /* As is stored transposed: As[k][m] */
#define LDB (BLOCK_N + SMEM_PAD)
#define A_TILE (BLOCK_K * LDA)
#define B_TILE (BLOCK_K * LDB)
#define A_LOADS (BLOCK_M * BLOCK_K / (THREADS * VEC))
#define B_LOADS (BLOCK_K * BLOCK_N / (THREADS * VEC))

#if (BLOCK_M * BLOCK_K) % (THREADS * VEC) != 0 || (BLOCK_K * BLOCK_N) % (THREADS * VEC) != 0
#error "a tile must split evenly into VEC-wide loads over the block's threads"
#endif
#if BLOCK_K % VEC != 0 || BLOCK_N % VEC != 0
#error "BLOCK_K and BLOCK_N must be multiples of VEC"
#endif

struct __align__(sizeof(in_t) * VEC) vec_t { in_t v[VEC]; };

/* EVOLVE-BLOCK-START */
/* Global -> registers: this thread's share of the A tile at (row0, k0), zero outside the matrix. */
__device__ __forceinline__ void load_a(const in_t *__restrict__ A, int M, int K, int row0, int k0,
                                       float (&ra)[A_LOADS][VEC])
{
#pragma unroll
    for (int i = 0; i < A_LOADS; i++) {
        int idx = (threadIdx.x + i * THREADS) * VEC;
        int r = row0 + idx / BLOCK_K, c = k0 + idx % BLOCK_K;
        if (r < M && c + VEC <= K && K % VEC == 0) {
            vec_t v = *reinterpret_cast<const vec_t *>(A + (size_t)r * K + c);
#pragma unroll
            for (int j = 0; j < VEC; j++) ra[i][j] = to_float(v.v[j]);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; j++) ra[i][j] = (r < M && c + j < K) ? to_float(A[(size_t)r * K + c + j]) : 0.0f;
        }
    }
}

/* Global -> registers: this thread's share of the B tile at (k0, col0). */
__device__ __forceinline__ void load_b(const in_t *__restrict__ B, int N, int K, int k0, int col0,
                                       float (&rb)[B_LOADS][VEC])
{
#pragma unroll
    for (int i = 0; i < B_LOADS; i++) {
        int idx = (threadIdx.x + i * THREADS) * VEC;
        int r = k0 + idx / BLOCK_N, c = col0 + idx % BLOCK_N;
        if (r < K && c + VEC <= N && N % VEC == 0) {
            vec_t v = *reinterpret_cast<const vec_t *>(B + (size_t)r * N + c);
#pragma unroll
            for (int j = 0; j < VEC; j++) rb[i][j] = to_float(v.v[j]);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; j++) rb[i][j] = (r < K && c + j < N) ? to_float(B[(size_t)r * N + c + j]) : 0.0f;
        }
    }
}

/* Registers -> one shared-memory stage (A transposed, so the compute loop reads rows of both). */
__device__ __forceinline__ void store_stage(float *__restrict__ As, float *__restrict__ Bs,
                                            const float (&ra)[A_LOADS][VEC], const float (&rb)[B_LOADS][VEC])
{
#pragma unroll
    for (int i = 0; i < A_LOADS; i++) {
        int idx = (threadIdx.x + i * THREADS) * VEC;
#pragma unroll
        for (int j = 0; j < VEC; j++) As[(idx % BLOCK_K + j) * LDA + idx / BLOCK_K] = ra[i][j];
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; i++) {
        int idx = (threadIdx.x + i * THREADS) * VEC;
#pragma unroll
        for (int j = 0; j < VEC; j++) Bs[(idx / BLOCK_N) * LDB + idx % BLOCK_N + j] = rb[i][j];
    }
}

__device__ __forceinline__ void compute_stage(const float *__restrict__ As, const float *__restrict__ Bs,
                                              float (&acc)[THREAD_M][THREAD_N], int ty, int tx)
{
#pragma unroll
    for (int k = 0; k < BLOCK_K; k++) {
        float a[THREAD_M], b[THREAD_N];
#pragma unroll
        for (int i = 0; i < THREAD_M; i++) a[i] = As[k * LDA + ty + i * TY];
#pragma unroll
        for (int j = 0; j < THREAD_N; j++) b[j] = Bs[k * LDB + tx + j * TX];
#pragma unroll
        for (int i = 0; i < THREAD_M; i++)
#pragma unroll
            for (int j = 0; j < THREAD_N; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
kernel(int M, int N, int K, const in_t *__restrict__ A, const in_t *__restrict__ B, float *__restrict__ C)
{
    extern __shared__ float smem[];
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    const int row0 = blockIdx.y * BLOCK_M, col0 = blockIdx.x * BLOCK_N;
    float acc[THREAD_M][THREAD_N];
#pragma unroll
    for (int i = 0; i < THREAD_M; i++)
#pragma unroll
        for (int j = 0; j < THREAD_N; j++) acc[i][j] = 0.0f;

    float ra[A_LOADS][VEC], rb[B_LOADS][VEC];
    const int tiles = (K + BLOCK_K - 1) / BLOCK_K;
    load_a(A, M, K, row0, 0, ra);
    load_b(B, N, K, 0, col0, rb);
    store_stage(smem, smem + A_TILE, ra, rb);
    __syncthreads();
    for (int t = 0; t < tiles; t++) {
        const bool more = t + 1 < tiles;
#if DOUBLE_BUFFER
        float *cur = smem + (t & 1) * (A_TILE + B_TILE), *next = smem + ((t + 1) & 1) * (A_TILE + B_TILE);
        if (more) {  /* next stage's loads are in flight while this one is computed */
            load_a(A, M, K, row0, (t + 1) * BLOCK_K, ra);
            load_b(B, N, K, (t + 1) * BLOCK_K, col0, rb);
        }
        compute_stage(cur, cur + A_TILE, acc, ty, tx);
        if (more) store_stage(next, next + A_TILE, ra, rb);
        __syncthreads();
#else
        compute_stage(smem, smem + A_TILE, acc, ty, tx);
        __syncthreads();
        if (more) {
            load_a(A, M, K, row0, (t + 1) * BLOCK_K, ra);
            load_b(B, N, K, (t + 1) * BLOCK_K, col0, rb);
            store_stage(smem, smem + A_TILE, ra, rb);
            __syncthreads();
        }
#endif
    }
#pragma unroll
    for (int i = 0; i < THREAD_M; i++) {
        int r = row0 + ty + i * TY;
#pragma unroll
        for (int j = 0; j < THREAD_N; j++) {
            int c = col0 + tx + j * TX;
            if (r < M && c < N) C[(size_t)r * N + c] = acc[i][j];
        }
    }
}
/* EVOLVE-BLOCK-END */
