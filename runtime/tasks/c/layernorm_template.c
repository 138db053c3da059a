/* Parametric layer norm over the last axis, fp32: y = (x - mean) / sqrt(var + eps) * gamma + beta.
 *
 * Parameters (arrive as #defines): VEC (floats per vector), UNROLL (independent accumulators per row)
 * and PASSES (TWO: the mean, then the centred variance, exact; ONE: sum and sum of squares together,
 * one read fewer, var = E[x^2] - mean^2 in double). Built with -fopenmp, rows are shared among threads.
 */
#include <math.h>

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline vf splat(float s) { return (vf){0} + s; }
static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline float hsum(vf v) { float s = 0.0f; UNROLLED(VEC) for (int l = 0; l < VEC; l++) s += v[l]; return s; }

/* EVOLVE-BLOCK-START */
static inline void row(int cols, float eps, const float *x, const float *g, const float *b, float *y)
{
    const int step = VEC * UNROLL, main_end = cols / step * step, vec_end = cols / VEC * VEC;
    vf s[UNROLL];
    UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) s[u] = splat(0.0f);
#if PASSES_TWO
    for (int c = 0; c < main_end; c += step)
        UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) s[u] += vload(x + c + u * VEC);
    float sum = 0.0f;
    for (int u = 0; u < UNROLL; u++) sum += hsum(s[u]);
    for (int c = main_end; c < cols; c++) sum += x[c];
    const float mean = sum / cols;
    UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) s[u] = splat(0.0f);
    for (int c = 0; c < main_end; c += step)
        UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) {
            vf d = vload(x + c + u * VEC) - mean;
            s[u] += d * d;
        }
    float var = 0.0f;
    for (int u = 0; u < UNROLL; u++) var += hsum(s[u]);
    for (int c = main_end; c < cols; c++) var += (x[c] - mean) * (x[c] - mean);
    var /= cols;
#elif PASSES_ONE
    vf q[UNROLL];
    UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) q[u] = splat(0.0f);
    for (int c = 0; c < main_end; c += step)
        UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) {
            vf v = vload(x + c + u * VEC);
            s[u] += v;
            q[u] += v * v;
        }
    double sum = 0.0, sq = 0.0;
    for (int u = 0; u < UNROLL; u++) sum += hsum(s[u]), sq += hsum(q[u]);
    for (int c = main_end; c < cols; c++) sum += x[c], sq += (double)x[c] * x[c];
    const float mean = (float)(sum / cols);
    double dvar = sq / cols - (sum / cols) * (sum / cols);
    const float var = dvar > 0.0 ? (float)dvar : 0.0f;
#else
#error "unknown PASSES"
#endif
    const float inv = 1.0f / sqrtf(var + eps);
    for (int c = 0; c < vec_end; c += VEC)
        vstore(y + c, (vload(x + c) - mean) * inv * vload(g + c) + vload(b + c));
    for (int c = vec_end; c < cols; c++) y[c] = (x[c] - mean) * inv * g[c] + b[c];
}
/* EVOLVE-BLOCK-END */

void kernel(int rows, int cols, float eps, const float *x, const float *gamma, const float *beta, float *y)
{
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        row(cols, eps, x + (long)r * cols, gamma, beta, y + (long)r * cols);
}
