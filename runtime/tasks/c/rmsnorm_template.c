/* Parametric RMSNorm over the last axis, fp32: y = x / sqrt(mean(x^2) + eps) * w.
 *
 * Parameters (arrive as #defines): VEC (floats per vector) and UNROLL (independent sums of squares per row,
 * which break the add chain). Gemma's (1 + w) needs no variant: its GGUF file stores 1 + w. Built with
 * -fopenmp, rows are shared among threads.
 */
#include <math.h>

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline float hsum(vf v) { float s = 0.0f; UNROLLED(VEC) for (int l = 0; l < VEC; l++) s += v[l]; return s; }

/* EVOLVE-BLOCK-START */
static inline void row(int cols, float eps, const float *x, const float *w, float *y)
{
    const int step = VEC * UNROLL, main_end = cols / step * step, vec_end = cols / VEC * VEC;
    vf s[UNROLL];
    UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) s[u] = (vf){0};
    for (int c = 0; c < main_end; c += step)
        UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) {
            vf v = vload(x + c + u * VEC);
            s[u] += v * v;
        }
    float sq = 0.0f;
    for (int u = 0; u < UNROLL; u++) sq += hsum(s[u]);
    for (int c = main_end; c < cols; c++) sq += x[c] * x[c];
    const float inv = 1.0f / sqrtf(sq / cols + eps);
    for (int c = 0; c < vec_end; c += VEC) vstore(y + c, vload(x + c) * inv * vload(w + c));
    for (int c = vec_end; c < cols; c++) y[c] = x[c] * inv * w[c];
}
/* EVOLVE-BLOCK-END */

void kernel(int rows, int cols, float eps, const float *x, const float *w, float *y)
{
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) row(cols, eps, x + (long)r * cols, w, y + (long)r * cols);
}
