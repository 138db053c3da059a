/* Parametric int8 linear layer with dynamic quantisation on AVX2 (runtime.tasks.linear_int8_avx2):
 *   q, s, z = per-row u8 quantisation of x (asymmetric), acc = q @ W exactly in int32,
 *   y = (float)(acc - z * w_colsum) * (s * w_scale) + bias (each float operation rounded on its own).
 *
 * x is fp32 row-major; each row is quantised once per call, a panel of rows at a time, into a heap buffer of
 * int16 (u8 values widened): lo = min(0, min x), hi = max(0, max x), s = (hi - lo) / 255 (1 if 0),
 * inv = 1 / s, z = rint(-lo * inv), q = clamp(rint(x * inv) + z, 0, 255), rint to nearest even (vcvtps2dq under
 * the default MXCSR). W comes quantised to s8 (one scale per column) and packed in panels of 8 columns, each
 * panel's k rows contiguous in quads: W[kk, j] = wp[(((j/8)*(k/4) + kk/4)*8 + j%8)*4 + kk%4]
 * (runtime.tasks.linear_int8_avx2.pack_int8_panels), with w_colsum[j] = sum_kk W[kk, j]. One step of k quads
 * reads the next 32 bytes of a panel, which widen to int16 (vpmovsxbw) in two vectors of 4 columns; vpmaddwd by
 * a broadcast quad of q gives each column two exact int32 pair sums (vpmaddubsw's int16 pairs would saturate on
 * 8-bit weights), and a final vphaddd adds them. Requires k % 32 == 0, n % 8 == 0, m >= 1, AVX2, and
 * -ffp-contract=off (a fused multiply-add would round differently from the reference).
 *
 * Parameters (arrive as #defines):
 *   MR, NR    register tile: MR rows by NR blocks of 8 columns (2 * MR * NR int32 accumulators).
 *   KU        unroll of the loop over k quads.
 *   PANEL     rows of x quantised at a time (rounded up to whole MR row blocks); each block of columns sweeps them.
 * Built with -fopenmp (threads > 1), threads share the rows to quantise, then the blocks of columns.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

typedef long long i64_alias __attribute__((may_alias));

static inline float min8(__m256 v)
{
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float max8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* One row of x (k floats, k % 8 == 0) to u8 values widened to int16 in q, with its scale *s and zero point *z. */
static inline void quantize_row(int k, const float *x, int16_t *q, float *s, int32_t *z)
{
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int c = 0; c < k; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
    }
    const float l = min8(lo), h = max8(hi);
    float scale = (h - l) / 255.0f;
    if (scale == 0.0f) scale = 1.0f;
    const float inv = 1.0f / scale;
    const int32_t zero_point = _mm_cvtss_si32(_mm_set_ss(-l * inv));
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i vz = _mm256_set1_epi32(zero_point), floor = _mm256_setzero_si256(), top = _mm256_set1_epi32(255);
    for (int c = 0; c < k; c += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), vinv));
        v = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(v, vz), floor), top);
        _mm_storeu_si128((__m128i *)(q + c), _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    }
    *s = scale;
    *z = zero_point;
}

/* 8 outputs of one row: (float)(acc - z * w_colsum) * (s * w_scale) + bias, in that order. */
static inline __m256 dequantize(__m256i acc, __m256i z, __m256 s, const int32_t *cs, const float *ws, const float *b)
{
    const __m256i d = _mm256_sub_epi32(acc, _mm256_mullo_epi32(z, _mm256_loadu_si256((const __m256i *)cs)));
    const __m256 scale = _mm256_mul_ps(s, _mm256_loadu_ps(ws));
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), scale), _mm256_loadu_ps(b));
}

/* EVOLVE-BLOCK-START */
/* y[0:R, 0:8V] of R quantised rows (q, row stride k; scales qs, zero points qz); wp points at the block's first
 * panel, ws, cs, bias and y at its first column. Accumulator [r][v][h] holds columns 8v + 4h .. 8v + 4h + 3, two
 * pair sums each. */
static inline __attribute__((always_inline)) void tile(const int R, const int V, int n, int k, const int16_t *q,
                                                       const float *qs, const int32_t *qz, const int8_t *wp,
                                                       const float *ws, const int32_t *cs, const float *bias,
                                                       float *y)
{
    __m256i acc[MR][NR][2];
    UNROLLED(8) for (int r = 0; r < R; r++) UNROLLED(4) for (int v = 0; v < V; v++) {
        acc[r][v][0] = _mm256_setzero_si256();
        acc[r][v][1] = _mm256_setzero_si256();
    }
    UNROLLED(KU) for (int p = 0; p < k / 4; p++) {
        __m256i b[NR][2];
        UNROLLED(4) for (int v = 0; v < V; v++) {
            const int8_t *w = wp + ((long)v * k + 4 * p) * 8;
            b[v][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
            b[v][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
        }
        UNROLLED(8) for (int r = 0; r < R; r++) {
            const __m256i a = _mm256_set1_epi64x(*(const i64_alias *)(q + (long)r * k + 4 * p));
            UNROLLED(4) for (int v = 0; v < V; v++) {
                acc[r][v][0] = _mm256_add_epi32(acc[r][v][0], _mm256_madd_epi16(a, b[v][0]));
                acc[r][v][1] = _mm256_add_epi32(acc[r][v][1], _mm256_madd_epi16(a, b[v][1]));
            }
        }
    }
    UNROLLED(8) for (int r = 0; r < R; r++) {
        const __m256i z = _mm256_set1_epi32(qz[r]);
        const __m256 s = _mm256_set1_ps(qs[r]);
        UNROLLED(4) for (int v = 0; v < V; v++) {
            /* [c0 c1 c4 c5 | c2 c3 c6 c7] -> c0..c7 */
            const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][v][0], acc[r][v][1]), 0xD8);
            _mm256_storeu_ps(y + (long)r * n + 8 * v, dequantize(sums, z, s, cs + 8 * v, ws + 8 * v, bias + 8 * v));
        }
    }
}

/* Columns [0, 8V) (pointers at the block's first panel and column) of the panel's rows: MR at a time, then the
 * rest (< MR <= 8) in one pass per set bit. */
static inline __attribute__((always_inline)) void cols(const int V, int rows, int n, int k, const int16_t *q,
                                                       const float *qs, const int32_t *qz, const int8_t *wp,
                                                       const float *ws, const int32_t *cs, const float *bias,
                                                       float *y)
{
    int r = 0;
    for (; r + MR <= rows; r += MR)
        tile(MR, V, n, k, q + (long)r * k, qs + r, qz + r, wp, ws, cs, bias, y + (long)r * n);
    const int rest = rows - r;
#define TAIL(T)                                                                                 \
    if (rest & T) {                                                                             \
        tile(T, V, n, k, q + (long)r * k, qs + r, qz + r, wp, ws, cs, bias, y + (long)r * n); \
        r += T;                                                                                 \
    }
#if MR > 4
    TAIL(4)
#endif
#if MR > 2
    TAIL(2)
#endif
    TAIL(1)
#undef TAIL
}

/* Panels of PANEL rows: each row quantised once into the buffer q (PANEL x k int16, then the scales and zero
 * points), then each block of columns runs down the panel, so its W panels stay in cache across row blocks.
 * Blocks are NR vectors wide, then single vectors for the columns left. */
static void gemm(int m, int n, int k, const float *x, const int8_t *wp, const float *ws, const int32_t *cs,
                 const float *bias, float *y, int16_t *q, int panel)
{
    float *qs = (float *)(q + (long)panel * k);
    int32_t *qz = (int32_t *)(qs + panel);
    const int wide_cols = 8 * NR;
    const int wide_blocks = n / wide_cols, blocks = wide_blocks + (n - wide_blocks * wide_cols) / 8;
    for (int i0 = 0; i0 < m; i0 += panel) {
        const int rows = m - i0 < panel ? m - i0 : panel;
        float *yp = y + (long)i0 * n;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) quantize_row(k, x + (long)(i0 + r) * k, q + (long)r * k, qs + r, qz + r);
#pragma omp for schedule(static)
            for (int b = 0; b < blocks; b++) {
                const int wide = b < wide_blocks;
                const int j = wide ? b * wide_cols : wide_blocks * wide_cols + (b - wide_blocks) * 8;
                const int8_t *wj = wp + (long)j * k;
                if (wide) cols(NR, rows, n, k, q, qs, qz, wj, ws + j, cs + j, bias + j, yp + j);
                else cols(1, rows, n, k, q, qs, qz, wj, ws + j, cs + j, bias + j, yp + j);
            }
        }
    }
}
/* EVOLVE-BLOCK-END */

void kernel(int m, int n, int k, const float *x, const int8_t *wp, const float *w_scale, const int32_t *w_colsum, const float *bias, float *y)
{
    int panel = (PANEL + MR - 1) / MR * MR;
    int16_t *q = aligned_alloc(64, (2 * (size_t)panel * k + 8 * (size_t)panel + 63) / 64 * 64);
    if (!q) { /* no heap: one row block at a time, from a stack buffer */
        panel = MR;
        q = __builtin_alloca(2 * (size_t)panel * k + 8 * (size_t)panel + 64);
        q = (int16_t *)(((uintptr_t)q + 63) & ~(uintptr_t)63);
        gemm(m, n, k, x, wp, w_scale, w_colsum, bias, y, q, panel);
        return;
    }
    gemm(m, n, k, x, wp, w_scale, w_colsum, bias, y, q, panel);
    free(q);
}
