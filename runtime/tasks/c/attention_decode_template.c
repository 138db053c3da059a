/* Parametric decode attention with grouped-query heads: one new query token per sequence over its cache, fp32
 * arithmetic over a cache of kv_t (float, or _Float16 where KV_F16 is defined: converted on load by F16C).
 *
 * Sequence b's cache holds keys at k + k_off[b] and values at v + v_off[b], each [kv_heads, capacity[b], d];
 * its first length[b] positions are filled. The query heads that share a KV head are done together, so each
 * key and value is loaded once for the group. One pass over the keys (online softmax): a block of KBLOCK
 * scores per query head, the running max and sum rescaled once per block. Parameters (arrive as #defines):
 * VEC (floats per vector over d) and KBLOCK (keys per block). Built with -fopenmp, the (sequence, KV head)
 * pairs are shared among threads.
 */
#include <math.h>

#define MAX_GROUP 8 /* query heads done together; a larger group is done in parts */

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline vf vload(const float *p) { return *(const vfu *)p; }
#if KV_F16
#include <immintrin.h>
typedef _Float16 kv_t;
/* VEC halves to floats, 8 at a time with F16C's vcvtph2ps (a plain conversion compiles to one scalar per half) */
static inline vf kvload(const kv_t *p)
{
    vf out;
#if VEC == 4
    const __m128 a = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
    __builtin_memcpy(&out, &a, sizeof a);
#else
    for (int i = 0; i < VEC; i += 8) {
        const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i)));
        __builtin_memcpy((float *)&out + i, &a, sizeof a);
    }
#endif
    return out;
}
#else
typedef float kv_t;
static inline vf kvload(const kv_t *p) { return vload(p); }
#endif
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline float hsum(vf v) { float s = 0.0f; UNROLLED(VEC) for (int l = 0; l < VEC; l++) s += v[l]; return s; }

/* EVOLVE-BLOCK-START */
static inline float dot(const float *a, const kv_t *b, int d)
{
    const int vec_end = d / VEC * VEC;
    vf acc = {0};
    for (int c = 0; c < vec_end; c += VEC) acc += vload(a + c) * kvload(b + c);
    float s = hsum(acc);
    for (int c = vec_end; c < d; c++) s += a[c] * (float)b[c];
    return s;
}

static inline void axpy(float *y, float a, const kv_t *x, int d)
{
    const int vec_end = d / VEC * VEC;
    for (int c = 0; c < vec_end; c += VEC) vstore(y + c, vload(y + c) + a * kvload(x + c));
    for (int c = vec_end; c < d; c++) y[c] += a * (float)x[c];
}

/* g query heads (q: [g, d]) over one KV head's len keys and values ([len, d] rows); o: [g, d] */
static void group_heads(int g, int d, int len, float scale, const float *q, const kv_t *k, const kv_t *v,
                        float *o)
{
    float max[MAX_GROUP], sum[MAX_GROUP], s[MAX_GROUP][KBLOCK];
    for (int i = 0; i < g; i++) {
        max[i] = -INFINITY;
        sum[i] = 0.0f;
        for (int c = 0; c < d; c++) o[(long)i * d + c] = 0.0f;
    }
    for (int j0 = 0; j0 < len; j0 += KBLOCK) {
        const int n = len - j0 < KBLOCK ? len - j0 : KBLOCK;
        for (int jj = 0; jj < n; jj++) {
            const kv_t *kj = k + (long)(j0 + jj) * d;
            for (int i = 0; i < g; i++) s[i][jj] = dot(q + (long)i * d, kj, d) * scale;
        }
        for (int i = 0; i < g; i++) {
            float m = max[i];
            for (int jj = 0; jj < n; jj++) m = fmaxf(m, s[i][jj]);
            const float rescale = expf(max[i] - m); /* 0 on the first block: max[i] is -inf */
            float add = 0.0f;
            for (int jj = 0; jj < n; jj++) add += s[i][jj] = expf(s[i][jj] - m);
            sum[i] = sum[i] * rescale + add;
            max[i] = m;
            if (rescale != 1.0f)
                for (int c = 0; c < d; c++) o[(long)i * d + c] *= rescale;
        }
        for (int jj = 0; jj < n; jj++) {
            const kv_t *vj = v + (long)(j0 + jj) * d;
            for (int i = 0; i < g; i++) axpy(o + (long)i * d, s[i][jj], vj, d);
        }
    }
    for (int i = 0; i < g; i++) {
        const float inv = 1.0f / sum[i];
        for (int c = 0; c < d; c++) o[(long)i * d + c] *= inv;
    }
}
/* EVOLVE-BLOCK-END */

void kernel(int batch, int heads, int kv_heads, int d, const float *q, const kv_t *k, const kv_t *v,
            const long *k_off, const long *v_off, const int *length, const int *capacity, float *out)
{
    const int group = heads / kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < kv_heads; h++) {
            const long at = (long)h * capacity[b] * d;
            for (int i0 = 0; i0 < group; i0 += MAX_GROUP) {
                const int g = group - i0 < MAX_GROUP ? group - i0 : MAX_GROUP;
                const long row = ((long)b * heads + (long)h * group + i0) * d;
                group_heads(g, d, length[b], scale, q + row, k + k_off[b] + at, v + v_off[b] + at, out + row);
            }
        }
}
