/* Parametric fused bias + GELU, fp32: y[r,c] = g(x[r,c] + bias[c]), g(h) = h * (1 + erf(h / sqrt 2)) / 2.
 *
 * Parameters (arrive as #defines): VEC (floats per vector), UNROLL (vectors per step) and ERF (POLY:
 * Abramowitz & Stegun 7.1.26 with a vectorised exp, absolute error under 2e-7; LIBM: erff lane by lane).
 * Built with -fopenmp, rows are shared among threads.
 */
#include <math.h>

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef int vi __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline vf splat(float s) { return (vf){0} + s; }
static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline vf vmax(vf a, vf b) { vi gt = a > b; return (vf)(((vi)a & gt) | ((vi)b & ~gt)); }
static inline vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }

/* EVOLVE-BLOCK-START */
#if ERF_POLY
/* e^x for x <= 0 (Cephes-style, as in the softmax template); inputs below -86 are clamped there. */
static inline vf vexp(vf x)
{
    x = vmax(x, splat(-86.0f));
    const vf shifter = splat(12582912.0f);
    vf t = x * 1.44269504088896341f + shifter;
    vf n = t - shifter;
    vi ni = (vi)t - (vi)shifter;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    return (vf)((vi)p + (ni << 23));
}

static inline vf gelu(vf h)
{
    vf z = vabs(h) * 0.70710678118654752f;
    vf t = 1.0f / (1.0f + 0.3275911f * z);
    vf p = splat(1.061405429f);
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    vf q = p * t * vexp(-(z * z)) * 0.5f; /* (1 - erf(|h| / sqrt 2)) / 2 */
    vi pos = h >= 0.0f;
    return h * (vf)(((vi)(1.0f - q) & pos) | ((vi)q & ~pos));
}
#elif ERF_LIBM
static inline vf gelu(vf h)
{
    vf y;
    for (int l = 0; l < VEC; l++) y[l] = 0.5f * h[l] * (1.0f + erff(h[l] * 0.70710678118654752f));
    return y;
}
#else
#error "unknown ERF"
#endif
/* EVOLVE-BLOCK-END */

void kernel(int rows, int cols, const float *x, const float *bias, float *y)
{
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        int c = 0;
        for (; c + VEC * UNROLL <= cols; c += VEC * UNROLL)
            UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++)
                vstore(yr + c + u * VEC, gelu(vload(xr + c + u * VEC) + vload(bias + c + u * VEC)));
        for (; c + VEC <= cols; c += VEC)
            vstore(yr + c, gelu(vload(xr + c) + vload(bias + c)));
        if (c < cols) {
            vf h = splat(0.0f);
            for (int k = c; k < cols; k++) h[k - c] = xr[k] + bias[k];
            vf g = gelu(h);
            for (int k = c; k < cols; k++) yr[k] = g[k - c];
        }
    }
}
