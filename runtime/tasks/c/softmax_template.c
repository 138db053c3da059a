/* Parametric row-wise softmax over the last axis, fp32, numerically stable (the row max is subtracted).
 *
 * Parameters (arrive as #defines): VEC (floats per vector), UNROLL (independent vectors per row in flight),
 * ROWS_PER_BLOCK (rows processed interleaved, for more independent work), PASSES (THREE: max, then
 * exp and sum into y, then scale; ONLINE: running max and rescaled sum in one pass, then exp and scale)
 * and EXP (POLY: a vectorised Cephes-style exp, about 1 ulp; LIBM: expf lane by lane).
 * Built with -fopenmp, blocks of rows are shared among threads.
 */
#include <math.h>

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef int vi __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)
#define LANES(v) UNROLLED(VEC) for (int v = 0; v < VEC; v++)

static inline vf splat(float s) { return (vf){0} + s; }
static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline vf vmax(vf a, vf b) { vi gt = a > b; return (vf)(((vi)a & gt) | ((vi)b & ~gt)); }
static inline float hmax(vf v) { float m = v[0]; LANES(l) m = fmaxf(m, v[l]); return m; }
static inline float hsum(vf v) { float s = 0.0f; LANES(l) s += v[l]; return s; }

/* EVOLVE-BLOCK-START */
#if EXP_POLY
/* e^x for x <= 0: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-7 minimax polynomial, times 2^n.
 * Inputs below -86 are clamped there (e^-86 ~ 4e-38: exact zero is not needed, a normal 2^n is). */
static inline vf vexp(vf x)
{
    x = vmax(x, splat(-86.0f));
    const vf shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
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
#elif EXP_LIBM
static inline vf vexp(vf x)
{
    vf e;
    LANES(l) e[l] = expf(x[l]);
    return e;
}
#else
#error "unknown EXP"
#endif

/* Loads the tail x[c0, cols) into a vector padded with `pad`. */
static inline vf load_tail(const float *x, int c0, int cols, float pad)
{
    vf v = splat(pad);
    for (int c = c0; c < cols; c++) v[c - c0] = x[c];
    return v;
}

/* Softmax of NB rows (a compile-time constant after inlining) of length cols, interleaved. */
static inline __attribute__((always_inline)) void row_block(const int NB, int cols, const float *x, float *y)
{
    const int step = VEC * UNROLL, main_end = cols / step * step, vec_end = cols / VEC * VEC;
    float mx[ROWS_PER_BLOCK], inv[ROWS_PER_BLOCK];
#if PASSES_THREE
    vf m[ROWS_PER_BLOCK][UNROLL], s[ROWS_PER_BLOCK][UNROLL];
    for (int b = 0; b < NB; b++)
        UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) m[b][u] = splat(-INFINITY), s[b][u] = splat(0.0f);
    for (int c = 0; c < main_end; c += step)
        for (int b = 0; b < NB; b++)
            UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++)
                m[b][u] = vmax(m[b][u], vload(x + (long)b * cols + c + u * VEC));
    for (int b = 0; b < NB; b++) {
        const float *xb = x + (long)b * cols;
        for (int u = 1; u < UNROLL; u++) m[b][0] = vmax(m[b][0], m[b][u]);
        float mb = hmax(m[b][0]);
        for (int c = main_end; c < cols; c++) mb = fmaxf(mb, xb[c]);
        mx[b] = mb;
    }
    for (int c = 0; c < main_end; c += step)
        for (int b = 0; b < NB; b++)
            UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) {
                long o = (long)b * cols + c + u * VEC;
                vf e = vexp(vload(x + o) - mx[b]);
                vstore(y + o, e);
                s[b][u] += e;
            }
    for (int b = 0; b < NB; b++) {
        const float *xb = x + (long)b * cols;
        float *yb = y + (long)b * cols;
        for (int u = 1; u < UNROLL; u++) s[b][0] += s[b][u];
        for (int c = main_end; c < vec_end; c += VEC) {
            vf e = vexp(vload(xb + c) - mx[b]);
            vstore(yb + c, e);
            s[b][0] += e;
        }
        float sb = hsum(s[b][0]);
        if (vec_end < cols) {
            vf e = vexp(load_tail(xb, vec_end, cols, mx[b]) - mx[b]);
            for (int c = vec_end; c < cols; c++) yb[c] = e[c - vec_end], sb += e[c - vec_end];
        }
        inv[b] = 1.0f / sb;
    }
    for (int c = 0; c < vec_end; c += VEC)
        for (int b = 0; b < NB; b++) vstore(y + (long)b * cols + c, vload(y + (long)b * cols + c) * inv[b]);
    for (int b = 0; b < NB; b++)
        for (int c = vec_end; c < cols; c++) y[(long)b * cols + c] *= inv[b];
#elif PASSES_ONLINE
    vf m[ROWS_PER_BLOCK][UNROLL], s[ROWS_PER_BLOCK][UNROLL];
    for (int b = 0; b < NB; b++)
        UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) m[b][u] = splat(-INFINITY), s[b][u] = splat(0.0f);
    for (int c = 0; c < main_end; c += step)
        for (int b = 0; b < NB; b++)
            UNROLLED(UNROLL) for (int u = 0; u < UNROLL; u++) {
                vf v = vload(x + (long)b * cols + c + u * VEC), mn = vmax(m[b][u], v);
                s[b][u] = s[b][u] * vexp(m[b][u] - mn) + vexp(v - mn);
                m[b][u] = mn;
            }
    for (int b = 0; b < NB; b++) {
        const float *xb = x + (long)b * cols;
        float mb = -INFINITY, sb = 0.0f;
        for (int u = 0; u < UNROLL; u++) mb = fmaxf(mb, hmax(m[b][u]));
        for (int c = main_end; c < cols; c++) mb = fmaxf(mb, xb[c]);
        for (int u = 0; u < UNROLL; u++) sb += hsum(s[b][u] * vexp(m[b][u] - mb));
        for (int c = main_end; c < vec_end; c += VEC) sb += hsum(vexp(vload(xb + c) - mb));
        if (vec_end < cols) {
            vf e = vexp(load_tail(xb, vec_end, cols, mb) - mb);
            for (int c = vec_end; c < cols; c++) sb += e[c - vec_end];
        }
        mx[b] = mb, inv[b] = 1.0f / sb;
    }
    for (int c = 0; c < vec_end; c += VEC)
        for (int b = 0; b < NB; b++) {
            long o = (long)b * cols + c;
            vstore(y + o, vexp(vload(x + o) - mx[b]) * inv[b]);
        }
    for (int b = 0; b < NB; b++)
        if (vec_end < cols) {
            vf e = vexp(load_tail(x + (long)b * cols, vec_end, cols, mx[b]) - mx[b]) * inv[b];
            for (int c = vec_end; c < cols; c++) y[(long)b * cols + c] = e[c - vec_end];
        }
#else
#error "unknown PASSES"
#endif
}
/* EVOLVE-BLOCK-END */

void kernel(int rows, int cols, const float *x, float *y)
{
    if (rows <= 0 || cols <= 0)
        return;
    int full = rows / ROWS_PER_BLOCK * ROWS_PER_BLOCK;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < full; r += ROWS_PER_BLOCK)
        row_block(ROWS_PER_BLOCK, cols, x + (long)r * cols, y + (long)r * cols);
    for (int r = full; r < rows; r++)
        row_block(1, cols, x + (long)r * cols, y + (long)r * cols);
}
