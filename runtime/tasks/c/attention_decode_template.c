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
 * (floats per vector over d), KBLOCK (keys per block), QTILE (queries per tile), SCORES (DOT: each key's score
 * its own horizontal sum; KEYS: VEC keys' scores at once, their sums reduced together, each by the same tree of
 * pairs whatever its place among them), EXP (LIBM: expf score by score; POLY: a vectorised Cephes-style exp,
 * about 1 ulp) and VALUES (AXPY: each weighted value added into the output rows in memory, key by key; ROWS: a
 * row's output held in registers, a strip at a time, over the block's values: the same sums in the same order).
 * Built with -fopenmp, the tiles are shared among threads.
 */
#include <math.h>
#include <stdlib.h>

#define MAX_ROWS 16 /* query rows done together; a larger group of heads is done in parts */
#ifndef QTILE
#define QTILE 1 /* a point from before the parameter: one query per tile */
#endif
#if !SCORES_KEYS
#define SCORES_DOT 1 /* likewise: a horizontal sum per key */
#endif
#if !EXP_POLY
#define EXP_LIBM 1 /* likewise: expf score by score */
#endif
#if !VALUES_ROWS
#define VALUES_AXPY 1 /* likewise: each value added into the output row by row */
#endif

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VEC * 4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline vf vload(const float *p) { return *(const vfu *)p; }
#if KV_F16
#include <immintrin.h>
typedef _Float16 kv_t;
/* VEC halves to floats with F16C's vcvtph2ps, 8 at a time (AVX-512's 16 where there is room: a plain conversion
 * compiles to one scalar per half, and a vector assembled in memory stalls every load after it) */
static inline vf kvload(const kv_t *p)
{
#if VEC == 4
    return (vf)_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
#elif VEC == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif VEC == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    typedef float v8 __attribute__((vector_size(32)));
    const v8 lo = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const v8 hi = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
#else
typedef float kv_t;
static inline vf kvload(const kv_t *p) { return vload(p); }
#endif
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline float hsum(vf v) { float s = 0.0f; UNROLLED(VEC) for (int l = 0; l < VEC; l++) s += v[l]; return s; }
static inline vf splat(float s) { return (vf){0} + s; }

/* EVOLVE-BLOCK-START */
#if EXP_POLY
/* e^x for x <= 0: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-7 minimax polynomial, times 2^n. Inputs below
 * -86 are clamped there (e^-86 ~ 4e-38: a normal 2^n is needed, exact zero is not). Lane by lane: a score's exp
 * does not depend on the lanes beside it. */
static inline vf vexp(vf x)
{
    const vi below = x < -86.0f;
    x = (vf)(((vi)x & ~below) | ((vi)splat(-86.0f) & below));
    const vf shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vf t = x * 1.44269504088896341f + shifter;
    const vf n = t - shifter;
    const vi ni = (vi)t - (vi)shifter;
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

/* s[0, n) <- e^(s - m) in vectors, the tail's lanes padded (their results dropped); returns their sum */
static inline float exp_block(float *s, int n, float m)
{
    float add = 0.0f;
    for (int j = 0; j < n; j += VEC) {
        vf x = splat(-INFINITY);
        const int lanes = n - j < VEC ? n - j : VEC;
        for (int l = 0; l < lanes; l++) x[l] = s[j + l];
        const vf e = vexp(x - m);
        for (int l = 0; l < lanes; l++) add += s[j + l] = e[l];
    }
    return add;
}
#else
static inline float exp_block(float *s, int n, float m)
{
    float add = 0.0f;
    for (int j = 0; j < n; j++) add += s[j] = expf(s[j] - m);
    return add;
}
#endif

static inline float dot(const float *a, const kv_t *b, int d)
{
    const int vec_end = d / VEC * VEC;
    vf acc = {0};
    for (int c = 0; c < vec_end; c += VEC) acc += vload(a + c) * kvload(b + c);
    float s = hsum(acc);
    for (int c = vec_end; c < d; c++) s += a[c] * (float)b[c];
    return s;
}

#if SCORES_KEYS
/* Lane l <- the sum of a[l]'s lanes, for VEC vectors a[0..VEC): pairs of lanes, then pairs of pairs, and so on,
 * the same additions in the same order for every vector wherever it stands among them (a is overwritten). */
static inline vf hsums(vf *a)
{
    UNROLLED(8) for (int s = 1, n = VEC; s < VEC; s *= 2, n /= 2) {
        vi lo, hi;
        UNROLLED(VEC) for (int l = 0; l < VEC; l++) {
            const int left = (l / s) % 2 == 0; /* this lane sums lanes l, l + s of the left vector */
            lo[l] = left ? l : VEC + l - s;
            hi[l] = left ? l + s : VEC + l;
        }
        UNROLLED(VEC) for (int i = 0; i < n / 2; i++)
            a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi);
    }
    return a[0];
}

/* out[0, n) <- a . keys[j] for n keys ([n, d] rows): VEC keys at a time (the last group repeats its last key) */
static inline void scores(const float *a, const kv_t *keys, int n, int d, float scale, float *out)
{
    const int vec_end = d / VEC * VEC;
    for (int j = 0; j < n; j += VEC) {
        const int m = n - j < VEC ? n - j : VEC;
        const kv_t *kp[VEC];
        vf acc[VEC];
        UNROLLED(VEC) for (int i = 0; i < VEC; i++) {
            kp[i] = keys + (long)(j + (i < m ? i : m - 1)) * d;
            acc[i] = (vf){0};
        }
        for (int c = 0; c < vec_end; c += VEC) {
            const vf qc = vload(a + c);
            UNROLLED(VEC) for (int i = 0; i < VEC; i++) acc[i] += qc * kvload(kp[i] + c);
        }
        const vf sum = hsums(acc);
        if (m == VEC && vec_end == d) {
            vstore(out + j, sum * scale);
            continue;
        }
        for (int i = 0; i < m; i++) {
            float x = sum[i];
            for (int c = vec_end; c < d; c++) x += a[c] * (float)kp[i][c];
            out[j + i] = x * scale;
        }
    }
}
#endif

static inline void axpy(float *y, float a, const kv_t *x, int d)
{
    const int vec_end = d / VEC * VEC;
    for (int c = 0; c < vec_end; c += VEC) vstore(y + c, vload(y + c) + a * kvload(x + c));
    for (int c = vec_end; c < d; c++) y[c] += a * (float)x[c];
}

#if VALUES_ROWS
/* y += sum of p[j] * x[j] over n values ([n, d] rows), a strip of 4 vectors of y held in registers over all of them:
 * each element's sum in the order of j, as axpy's */
static inline void weighted_sum(float *y, const float *p, const kv_t *x, int n, int d)
{
    const int strip_end = d / (4 * VEC) * (4 * VEC), vec_end = d / VEC * VEC;
    for (int c = 0; c < strip_end; c += 4 * VEC) {
        vf y0 = vload(y + c), y1 = vload(y + c + VEC), y2 = vload(y + c + 2 * VEC), y3 = vload(y + c + 3 * VEC);
        for (int j = 0; j < n; j++) {
            const kv_t *xj = x + (long)j * d + c;
            y0 += p[j] * kvload(xj);
            y1 += p[j] * kvload(xj + VEC);
            y2 += p[j] * kvload(xj + 2 * VEC);
            y3 += p[j] * kvload(xj + 3 * VEC);
        }
        vstore(y + c, y0), vstore(y + c + VEC, y1), vstore(y + c + 2 * VEC, y2), vstore(y + c + 3 * VEC, y3);
    }
    for (int c = strip_end; c < vec_end; c += VEC) {
        vf yc = vload(y + c);
        for (int j = 0; j < n; j++) yc += p[j] * kvload(x + (long)j * d + c);
        vstore(y + c, yc);
    }
    for (int c = vec_end; c < d; c++)
        for (int j = 0; j < n; j++) y[c] += p[j] * (float)x[(long)j * d + c];
}
#endif

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
#if SCORES_KEYS
        for (int r = 0; r < rows; r++)
            if (n[r] > 0) scores(q[r], k[r] + (long)j0 * d, n[r], d, scale, s[r]);
#else
        for (int jj = 0; jj < most; jj++)
            for (int r = 0; r < rows; r++)
                if (jj < n[r]) s[r][jj] = dot(q[r], k[r] + (long)(j0 + jj) * d, d) * scale;
#endif
        for (int r = 0; r < rows; r++) {
            if (n[r] <= 0) continue;
            float m = max[r];
            for (int jj = 0; jj < n[r]; jj++) m = fmaxf(m, s[r][jj]);
            const float rescale = expf(max[r] - m); /* 0 on the first block: max[r] is -inf */
            sum[r] = sum[r] * rescale + exp_block(s[r], n[r], m);
            max[r] = m;
            if (rescale != 1.0f)
                for (int c = 0; c < d; c++) o[r][c] *= rescale;
        }
#if VALUES_ROWS
        for (int r = 0; r < rows; r++)
            if (n[r] > 0) weighted_sum(o[r], s[r], v[r] + (long)j0 * d, n[r], d);
#else
        for (int jj = 0; jj < most; jj++)
            for (int r = 0; r < rows; r++)
                if (jj < n[r]) axpy(o[r], s[r][jj], v[r] + (long)(j0 + jj) * d, d);
#endif
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
