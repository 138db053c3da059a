/* Parametric row-wise softmax, fp32, y = exp(x - max) / sum(exp(x - max)) over each row of x[rows, cols].
 *
 * Parameters (arrive as #defines): VARIANT (WARP: one warp per row, WARPS_PER_BLOCK rows per block;
 * BLOCK: one block of 32 * WARPS_PER_BLOCK threads per row, reduced through shared memory), VEC
 * (floats per load: aligned vector loads when cols % VEC == 0, scalar otherwise), UNROLL (loads in
 * flight per thread), ONLINE (one pass for max and sum with a running rescale, instead of two passes)
 * and EXP (EXPF: accurate expf; FAST: the __expf intrinsic).
 * Launch: 32 * WARPS_PER_BLOCK threads; grid ceil(rows / WARPS_PER_BLOCK) (WARP) or rows (BLOCK).
 */
#include <math.h>

#define BLOCK_THREADS (32 * WARPS_PER_BLOCK)
#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(unroll n) /* expands n first: #pragma unroll takes no macro */

/* EVOLVE-BLOCK-START */
__device__ __forceinline__ float ex(float v)
{
#if EXP_FAST
    return __expf(v);
#else
    return expf(v);
#endif
}

__device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#if VARIANT_WARP
#define GROUP 32
__device__ __forceinline__ float group_max(float v) { return warp_max(v); }
__device__ __forceinline__ float group_sum(float v) { return warp_sum(v); }
#else
#define GROUP BLOCK_THREADS
__device__ __forceinline__ float block_reduce(float v, bool is_max)
{
    __shared__ float partial[32];
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads(); /* partial[] may still be read by the previous reduction */
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < WARPS_PER_BLOCK ? partial[threadIdx.x % 32] : (is_max ? -INFINITY : 0.0f);
    return is_max ? warp_max(v) : warp_sum(v);
}
__device__ __forceinline__ float group_max(float v) { return block_reduce(v, true); }
__device__ __forceinline__ float group_sum(float v) { return block_reduce(v, false); }
#endif

/* VEC consecutive floats from p[i..]; slots past cols are left as they are (valid[j] = 0). */
__device__ __forceinline__ void load(const float *__restrict__ p, int i, int cols, bool aligned,
                                     float (&v)[VEC], bool (&valid)[VEC])
{
    if (aligned && i + VEC <= cols) {
#if VEC == 4
        float4 t = *reinterpret_cast<const float4 *>(p + i);
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
#elif VEC == 2
        float2 t = *reinterpret_cast<const float2 *>(p + i);
        v[0] = t.x; v[1] = t.y;
#else
        v[0] = p[i];
#endif
#pragma unroll
        for (int j = 0; j < VEC; j++) valid[j] = true;
    } else {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            valid[j] = i + j < cols;
            if (valid[j]) v[j] = p[i + j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
kernel(int rows, int cols, const float *__restrict__ x, float *__restrict__ y)
{
#if VARIANT_WARP
    const int row = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return; /* whole warps leave together, so the shuffles stay full */
#else
    const int row = blockIdx.x, lane = threadIdx.x;
#endif
    const float *xr = x + (size_t)row * cols;
    float *yr = y + (size_t)row * cols;
    const bool aligned = cols % VEC == 0; /* every row then starts on a VEC boundary */
    float m = -INFINITY, s = 0.0f, v[VEC];
    bool valid[VEC];

UNROLLED(UNROLL)
    for (int i = lane * VEC; i < cols; i += GROUP * VEC) {
        load(xr, i, cols, aligned, v, valid);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            if (!valid[j]) continue;
#if ONLINE
            float mn = fmaxf(m, v[j]);
            s = s * ex(m - mn) + ex(v[j] - mn);
            m = mn;
#else
            m = fmaxf(m, v[j]);
#endif
        }
    }
    const float row_max = group_max(m);
#if ONLINE
    s = m == -INFINITY ? 0.0f : s * ex(m - row_max);
#else
UNROLLED(UNROLL)
    for (int i = lane * VEC; i < cols; i += GROUP * VEC) {
        load(xr, i, cols, aligned, v, valid);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            if (valid[j]) s += ex(v[j] - row_max);
    }
#endif
    const float inv = 1.0f / group_sum(s);

UNROLLED(UNROLL)
    for (int i = lane * VEC; i < cols; i += GROUP * VEC) {
        load(xr, i, cols, aligned, v, valid);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            if (valid[j]) yr[i + j] = ex(v[j] - row_max) * inv;
    }
}
/* EVOLVE-BLOCK-END */
