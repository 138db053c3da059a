/* Parametric attention over KV caches with grouped-query heads: each sequence's newest queries (one in a decode
 * step, a prompt's chunk in prefill) over its cache, fp32 arithmetic over a cache of kv_t (float, or _Float16
 * where KV_F16 is defined: converted on load by F16C).
 *
 * Sequence b's cache holds keys at k + k_off[b] and values at v + v_off[b], each [kv_heads, capacity[b], d];
 * its first length[b] positions are filled, the last count[b] of them the new queries' (rows of q and out,
 * sequence after sequence). The query at position p sees the keys 0..p (the last `window` of them where window
 * is not 0). Query rows that share a KV head are done together in tiles (QTILE queries of the group's heads),
 * so each key and value is loaded once for the tile. One pass over the keys (online softmax): a block of KBLOCK
 * scores per row, the running max and sum rescaled once per block. A row's arithmetic is the same in any tile:
 * a query's output does not depend on the chunk or the batch it came in. Parameters (arrive as #defines): VEC
 * (floats per vector over d), KBLOCK (keys per block) and QTILE (queries per tile). Built with -fopenmp, the
 * tiles are shared among threads.
 */
#include <math.h>
#include <stdlib.h>

#define MAX_ROWS 16 /* query rows done together; a larger group of heads is done in parts */
#ifndef QTILE
#define QTILE 1 /* a point from before the parameter: one query per tile */
#endif

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

/* rows query rows: row r's query q[r] over its len[r] keys k[r] and values v[r] ([len, d] rows); out o[r] */
static void tile_rows(int rows, int d, float scale, const float *const *q, const kv_t *const *k,
                      const kv_t *const *v, const int *len, float *const *o)
{
    float max[MAX_ROWS], sum[MAX_ROWS], s[MAX_ROWS][KBLOCK];
    int longest = 0;
    for (int r = 0; r < rows; r++) {
        max[r] = -INFINITY;
        sum[r] = 0.0f;
        for (int c = 0; c < d; c++) o[r][c] = 0.0f;
        longest = len[r] > longest ? len[r] : longest;
    }
    for (int j0 = 0; j0 < longest; j0 += KBLOCK) {
        int n[MAX_ROWS], most = 0;
        for (int r = 0; r < rows; r++) {
            n[r] = len[r] - j0 < KBLOCK ? len[r] - j0 : KBLOCK;
            most = n[r] > most ? n[r] : most;
        }
        for (int jj = 0; jj < most; jj++)
            for (int r = 0; r < rows; r++)
                if (jj < n[r]) s[r][jj] = dot(q[r], k[r] + (long)(j0 + jj) * d, d) * scale;
        for (int r = 0; r < rows; r++) {
            if (n[r] <= 0) continue;
            float m = max[r];
            for (int jj = 0; jj < n[r]; jj++) m = fmaxf(m, s[r][jj]);
            const float rescale = expf(max[r] - m); /* 0 on the first block: max[r] is -inf */
            float add = 0.0f;
            for (int jj = 0; jj < n[r]; jj++) add += s[r][jj] = expf(s[r][jj] - m);
            sum[r] = sum[r] * rescale + add;
            max[r] = m;
            if (rescale != 1.0f)
                for (int c = 0; c < d; c++) o[r][c] *= rescale;
        }
        for (int jj = 0; jj < most; jj++)
            for (int r = 0; r < rows; r++)
                if (jj < n[r]) axpy(o[r], s[r][jj], v[r] + (long)(j0 + jj) * d, d);
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / sum[r];
        for (int c = 0; c < d; c++) o[r][c] *= inv;
    }
}
/* EVOLVE-BLOCK-END */

void kernel(int batch, int heads, int kv_heads, int d, int window, const float *q, const kv_t *k, const kv_t *v,
            const long *k_off, const long *v_off, const int *length, const int *count, const int *capacity,
            float *out)
{
    const int group = heads / kv_heads;
    const int part = group < MAX_ROWS ? group : MAX_ROWS; /* query heads per tile */
    const int parts = (group + part - 1) / part;
    const int tq = QTILE * part <= MAX_ROWS ? QTILE : MAX_ROWS / part; /* queries per tile */
    const float scale = 1.0f / sqrtf((float)d);
    long *row0 = malloc(sizeof(long) * (2 * (size_t)batch + 1)), *item0 = row0 + batch;
    if (!row0) return;
    long rows = 0, items = 0;
    for (int b = 0; b < batch; b++) {
        row0[b] = rows;
        item0[b] = items;
        rows += count[b];
        items += (long)kv_heads * parts * ((count[b] + tq - 1) / tq);
    }
    item0[batch] = items;
#pragma omp parallel for schedule(dynamic)
    for (long it = 0; it < items; it++) {
        int b = 0;
        while (item0[b + 1] <= it) b++;
        const long local = it - item0[b];
        const int tiles = (count[b] + tq - 1) / tq;
        const int h = (int)(local / ((long)parts * tiles)), p = (int)(local / tiles % parts);
        const int t0 = (int)(local % tiles) * tq;
        const int nq = count[b] - t0 < tq ? count[b] - t0 : tq;
        const int i0 = p * part, g = group - i0 < part ? group - i0 : part;
        const long at = (long)h * capacity[b] * d;
        const float *qr[MAX_ROWS];
        const kv_t *kr[MAX_ROWS], *vr[MAX_ROWS];
        float *orow[MAX_ROWS];
        int len[MAX_ROWS], r = 0;
        for (int t = t0; t < t0 + nq; t++) {
            const int pos = length[b] - count[b] + t; /* the query's position */
            const int first = window && pos + 1 > window ? pos + 1 - window : 0;
            for (int i = 0; i < g; i++, r++) {
                const long row = ((row0[b] + t) * heads + (long)h * group + i0 + i) * d;
                qr[r] = q + row;
                orow[r] = out + row;
                kr[r] = k + k_off[b] + at + (long)first * d;
                vr[r] = v + v_off[b] + at + (long)first * d;
                len[r] = pos + 1 - first;
            }
        }
        tile_rows(r, d, scale, qr, kr, vr, len, orow);
    }
    free(row0);
}
