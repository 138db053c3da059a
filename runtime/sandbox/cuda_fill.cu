// Fresh inputs on the device: element i of a fill with seed s is a normal(mean, std) value drawn from a
// hash of (s, i), stored as fp32, fp16 or bf16 (the top half of the fp32 bits, rounded to nearest even).
// Built to PTX with the candidate host (runtime/sandbox/cuda_host.py); the worker loads the same PTX, so both sides
// fill identical inputs from a seed the candidate learns only when its inputs are already there.
#include <cuda_fp16.h>

__device__ static unsigned int mix(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

extern "C" __global__ void evoforge_fill(void *out, unsigned long long n, unsigned int kind, unsigned int seed,
                                         float mean, float std) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned int h = mix(seed ^ mix((unsigned int)i ^ mix((unsigned int)(i >> 32) + 0x9e3779b9u)));
        float u1 = ((h >> 8) + 1) * (1.0f / 16777217.0f), u2 = (mix(h) >> 8) * (1.0f / 16777216.0f);
        float v = mean + std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        if (kind == 0) {
            ((float *)out)[i] = v;
        } else if (kind == 1) {
            ((__half *)out)[i] = __float2half_rn(v);
        } else {
            unsigned int b = __float_as_uint(v);
            ((unsigned short *)out)[i] = (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
        }
    }
}
