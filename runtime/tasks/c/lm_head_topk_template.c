/* Parametric q8 LM head with its top list, on AVX2 and FMA (runtime.tasks.lm_head_topk):
 *   per group g of 32 values of a row of x: s_g = max|x| / 127, q = clamp(rint(x / s_g), -127, 127) (0 where the
 *   group is all zero); logit[i][v] = sum_g (s_g * w_scale[v][g]) * dot_g, dot_g exact in int32; per row: the top
 *   largest logits in descending order with their ids, and lse = log(sum_v exp(logit)).
 *
 * The rows of x are quantised once per call. The vocabulary is cut in blocks of BLOCK head rows, shared out among
 * the threads in contiguous runs; each block's logits (MR rows of x at a time, RB head rows per tile) go to a
 * buffer, which then feeds each row's running top list (a sorted array, entered only past its last value) and its
 * log-sum-exp (a running maximum and a sum of exp(logit - maximum) in double, 8 exps at a time). The threads'
 * lists and sums are merged at the end. A logit's arithmetic is the same in any tile, so a row's result does not
 * depend on the rows beside it. Requires k % 32 == 0, 1 <= top <= vocab, AVX2 and FMA; with USE_VNNI defined
 * (runtime.tasks.lm_head_topk_vnni), the tile runs vpdpbusd over two groups at a time, on a head (and rows of x)
 * whose pairs of groups are interleaved by 4-byte chunks, and needs AVX512F, BW and VNNI.
 *
 * Parameters (arrive as #defines):
 *   MR      rows of x a tile runs (MR * RB fp32 accumulators).
 *   RB      head rows a tile runs.
 *   BLOCK   head rows a block's buffer holds.
 *   GU      unroll of the loop over groups.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline float max8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* exp of 8 values (Cephes' single-precision polynomial, about 1 ulp), flushed to 0 below -87 */
static inline __m256 exp8(__m256 x)
{
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}

/* One row of x (k floats, k % 32 == 0) to s8 values in q, one scale per group of 32 in s. */
static inline void quantize_row(int k, const float *x, int8_t *q, float *s)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < k / 32; g++) {
        const float *xg = x + 32 * g;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(xg + 8 * c);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
        }
        const float a = max8(amax), scale = a / 127.0f;
        const __m256 inv = _mm256_set1_ps(a > 0.0f ? 1.0f / scale : 0.0f);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        __m256i w[4];
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv)), lo), hi);
        const __m256i w16 = _mm256_packs_epi32(w[0], w[1]), x16 = _mm256_packs_epi32(w[2], w[3]);
        const __m256i b8 = _mm256_packs_epi16(w16, x16);
        _mm256_storeu_si256((__m256i *)(q + 32 * g),
                            _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        s[g] = scale;
    }
}

#ifdef USE_VNNI
/* A quantised row's pairs of groups with their 4-byte chunks interleaved, as the VNNI tile reads the head. */
static inline void interleave_pairs(int k, int8_t *q)
{
    for (int p = 0; p + 64 <= k; p += 64) {
        int8_t pair[64];
        for (int c = 0; c < 8; c++)
            for (int h = 0; h < 2; h++) memcpy(pair + 4 * (2 * c + h), q + p + 32 * h + 4 * c, 4);
        memcpy(q + p, pair, 64);
    }
}
#endif

/* A row's running top list and log-sum-exp. */
typedef struct {
    float *values;
    int32_t *ids;
    int count;
    float peak;
    double sum; /* of exp(logit - peak) */
} row_state;

static inline void enter(row_state *st, int top, float l, int32_t id)
{
    if (st->count == top && !(l > st->values[top - 1])) return;
    int p = st->count < top ? st->count++ : top - 1;
    while (p > 0 && st->values[p - 1] < l) {
        st->values[p] = st->values[p - 1];
        st->ids[p] = st->ids[p - 1];
        p--;
    }
    st->values[p] = l;
    st->ids[p] = id;
}

/* EVOLVE-BLOCK-START */
#ifdef USE_VNNI
/* Logits of R rows of x (q, row stride k; scales qs, row stride k / 32) by NB head rows (w, ws) into out (row stride
 * BLOCK), a pair of groups a 512-bit vector. x and the head come with each pair's 4-byte chunks interleaved (even
 * chunks of the first group, odd of the second: runtime.tasks.lm_head_topk_vnni.interleave_pairs), so vpdpbusd's
 * even int32 sums are the first group's and the odd ones the second's, and an 8-byte broadcast of the two groups'
 * adjacent scales puts each on its lanes. W is negated where q is, and vpdpbusd adds |q| (u8) times it. */
static inline __m512 pair_scales(const float *s)
{
    double both;
    memcpy(&both, s, sizeof both);
    return _mm512_castpd_ps(_mm512_set1_pd(both));
}

static inline __attribute__((always_inline)) void tile(const int R, const int NB, int k, const int8_t *q,
                                                       const float *qs, const int8_t *w, const float *ws, float *out)
{
    const int G = k / 32;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[MR][RB];
    UNROLLED(4) for (int i = 0; i < R; i++) UNROLLED(8) for (int r = 0; r < NB; r++) acc[i][r] = _mm512_setzero_ps();
    UNROLLED(GU) for (int g = 0; g < G; g += 2) {
        const int pair = g + 1 < G; /* else one group left, in its own order: the lower half, scaled by its scale */
        const __mmask64 bytes = pair ? ~0ULL : 0xffffffffULL;
        __m512i magnitude[MR];
        __mmask64 negative[MR];
        __m512 xs[MR];
        UNROLLED(4) for (int i = 0; i < R; i++) {
            const __m512i a = _mm512_maskz_loadu_epi8(bytes, q + (long)i * k + 32 * g);
            magnitude[i] = _mm512_abs_epi8(a);
            negative[i] = _mm512_movepi8_mask(a);
            xs[i] = pair ? pair_scales(qs + (long)i * G + g) : _mm512_set1_ps(qs[(long)i * G + g]);
        }
        UNROLLED(8) for (int r = 0; r < NB; r++) {
            const __m512i wv = _mm512_maskz_loadu_epi8(bytes, w + (long)r * k + 32 * g);
            const __m512 wscale = pair ? pair_scales(ws + (long)r * G + g) : _mm512_set1_ps(ws[(long)r * G + g]);
            UNROLLED(4) for (int i = 0; i < R; i++) {
                const __m512i signed_w = _mm512_mask_sub_epi8(wv, negative[i], zero, wv);
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, magnitude[i], signed_w));
                acc[i][r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(xs[i], wscale), acc[i][r]);
            }
        }
    }
    UNROLLED(4) for (int i = 0; i < R; i++) UNROLLED(8) for (int r = 0; r < NB; r++) out[(long)i * BLOCK + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#else
/* Logits of R rows of x (q, row stride k; scales qs, row stride k / 32) by NB head rows (w, ws) into out (row stride
 * BLOCK). */
static inline __attribute__((always_inline)) void tile(const int R, const int NB, int k, const int8_t *q,
                                                       const float *qs, const int8_t *w, const float *ws, float *out)
{
    const int G = k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR][RB];
    UNROLLED(4) for (int i = 0; i < R; i++) UNROLLED(8) for (int r = 0; r < NB; r++) acc[i][r] = _mm256_setzero_ps();
    UNROLLED(GU) for (int g = 0; g < G; g++) {
        __m256i a[MR], magnitude[MR];
        UNROLLED(4) for (int i = 0; i < R; i++) {
            a[i] = _mm256_loadu_si256((const __m256i *)(q + (long)i * k + 32 * g));
            magnitude[i] = _mm256_sign_epi8(a[i], a[i]);
        }
        UNROLLED(8) for (int r = 0; r < NB; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (long)r * k + 32 * g));
            const float wscale = ws[(long)r * G + g];
            UNROLLED(4) for (int i = 0; i < R; i++) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitude[i], _mm256_sign_epi8(wv, a[i]));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                acc[i][r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(qs[(long)i * G + g] * wscale), acc[i][r]);
            }
        }
    }
    UNROLLED(4) for (int i = 0; i < R; i++) UNROLLED(8) for (int r = 0; r < NB; r++) out[(long)i * BLOCK + r] = sum8(acc[i][r]);
}

#endif

/* R rows' logits of n head rows from row v0 (rows: x's row tiles, then the head's; tails in passes of fewer). */
static inline __attribute__((always_inline)) void block_rows(const int R, int n, int k, const int8_t *q,
                                                             const float *qs, const int8_t *w, const float *ws,
                                                             float *out)
{
    const int G = k / 32;
    int r = 0;
    for (; r + RB <= n; r += RB) tile(R, RB, k, q, qs, w + (long)r * k, ws + (long)r * G, out + r);
    for (; r < n; r++) tile(R, 1, k, q, qs, w + (long)r * k, ws + (long)r * G, out + r);
}
/* EVOLVE-BLOCK-END */

/* n logits of a row (ids v0..v0+n-1) into its state. */
static void consume(row_state *st, int top, const float *buf, int n, int v0)
{
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(buf + j));
    float peak = max8(vm);
    for (int t = j; t < n; t++) peak = buf[t] > peak ? buf[t] : peak;
    if (peak > st->peak) {
        st->sum = st->peak == -INFINITY ? 0.0 : st->sum * exp((double)st->peak - peak);
        st->peak = peak;
    }
    const __m256 shift = _mm256_set1_ps(st->peak);
    __m256 acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(buf + j), shift)));
    double sum = sum8(acc);
    for (int t = j; t < n; t++) sum += expf(buf[t] - st->peak);
    st->sum += sum;
    for (j = 0; j + 8 <= n; j += 8) {
        const float floor_ = st->count == top ? st->values[top - 1] : -INFINITY;
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(buf + j), _mm256_set1_ps(floor_), _CMP_GT_OQ));
        if (st->count < top) mask = 0xff;
        while (mask) {
            const int b = __builtin_ctz(mask);
            mask &= mask - 1;
            enter(st, top, buf[j + b], v0 + j + b);
        }
    }
    for (int t = j; t < n; t++) enter(st, top, buf[t], v0 + t);
}

void kernel(int m, int vocab, int k, int top, const float *x, const int8_t *wq, const float *w_scale, int32_t *ids,
            float *values, float *lse)
{
    const int G = k / 32;
    int most = 1;
#ifdef _OPENMP
    most = omp_get_max_threads();
#endif
    int8_t *q = malloc((size_t)m * k);
    float *qs = malloc(sizeof(float) * (size_t)m * G);
    row_state *states = malloc(sizeof(row_state) * (size_t)most * m);
    float *lists = malloc(sizeof(float) * (size_t)most * m * top);
    int32_t *list_ids = malloc(sizeof(int32_t) * (size_t)most * m * top);
    float *bufs = malloc(sizeof(float) * (size_t)most * MR * BLOCK);
    if (!q || !qs || !states || !lists || !list_ids || !bufs) abort();
    for (int i = 0; i < m; i++) {
        quantize_row(k, x + (long)i * k, q + (long)i * k, qs + (long)i * G);
#ifdef USE_VNNI
        interleave_pairs(k, q + (long)i * k);
#endif
    }
    const int blocks = (vocab + BLOCK - 1) / BLOCK;
    int team = 1;
#pragma omp parallel
    {
        int t = 0, threads = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        threads = omp_get_num_threads();
#pragma omp single
        team = threads;
#endif
        row_state *st = states + (long)t * m;
        float *buf = bufs + (long)t * MR * BLOCK;
        for (int i = 0; i < m; i++)
            st[i] = (row_state){lists + ((long)t * m + i) * top, list_ids + ((long)t * m + i) * top, 0, -INFINITY, 0.0};
        const int b0 = (int)((long)blocks * t / threads), b1 = (int)((long)blocks * (t + 1) / threads);
        for (int b = b0; b < b1; b++) {
            const int v0 = b * BLOCK, n = vocab - v0 < BLOCK ? vocab - v0 : BLOCK;
            const int8_t *w = wq + (long)v0 * k;
            const float *ws = w_scale + (long)v0 * G;
            int i0 = 0;
            for (; i0 + MR <= m; i0 += MR) {
                block_rows(MR, n, k, q + (long)i0 * k, qs + (long)i0 * G, w, ws, buf);
                for (int i = 0; i < MR; i++) consume(st + i0 + i, top, buf + (long)i * BLOCK, n, v0);
            }
            for (; i0 < m; i0++) {
                block_rows(1, n, k, q + (long)i0 * k, qs + (long)i0 * G, w, ws, buf);
                consume(st + i0, top, buf, n, v0);
            }
        }
    }
    for (int i = 0; i < m; i++) {
        row_state out = {values + (long)i * top, ids + (long)i * top, 0, -INFINITY, 0.0};
        for (int t = 0; t < team; t++) {
            const row_state *s = states + (long)t * m + i;
            if (s->peak > out.peak) out.peak = s->peak;
        }
        double sum = 0.0;
        for (int t = 0; t < team; t++) {
            const row_state *s = states + (long)t * m + i;
            if (s->peak != -INFINITY) sum += s->sum * exp((double)s->peak - out.peak);
            for (int j = 0; j < s->count; j++) enter(&out, top, s->values[j], s->ids[j]);
        }
        lse[i] = (float)(out.peak + log(sum));
    }
    free(q);
    free(qs);
    free(states);
    free(lists);
    free(list_ids);
    free(bufs);
}
