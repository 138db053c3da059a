/* Parametric int8 linear layer with dynamic quantisation (runtime.tasks.linear_int8):
 *   q, s, z = per-row u8 quantisation of x (asymmetric), acc = q @ wq exactly in int32,
 *   y = (float)(acc - z * w_colsum) * (s * w_scale) + bias (each float operation rounded on its own).
 *
 * x is fp32 row-major; each row is quantised once per call, a panel of rows at a time, into a heap buffer:
 * lo = min(0, min x), hi = max(0, max x), s = (hi - lo) / 255 (1 if 0), inv = 1 / s, z = rint(-lo * inv),
 * q = clamp(rint(x * inv) + z, 0, 255), rint to nearest even (vcvtps2dq under the default MXCSR).
 * W comes quantised to s8 (one scale per column) and packed in quads, wq[((kk/4)*n + j)*4 + kk%4] = wq[kk, j]
 * (runtime.tasks.linear_int8.pack_int8), the operand layout of both vpdpbusd and AMX tdpbusd B tiles, with
 * w_colsum[j] = sum_kk wq[kk, j]. Requires k % 64 == 0, n % 16 == 0, m >= 1, AVX512_VNNI, and -ffp-contract=off
 * (a fused multiply-add would round differently from the reference).
 *
 * Parameters (arrive as #defines):
 *   ISA       VNNI: register-tiled vpdpbusd micro-kernel. AMX: tdpbusd on 16x16 int32 C tiles; when the process
 *             cannot get AMX (no permission, no hardware) it falls back to the VNNI path.
 *   MR, NR    VNNI register tile: MR rows by NR vectors of 16 columns (MR * NR int32 accumulators).
 *   KU        unroll of the VNNI loop over k quads.
 *   AMX_MT, AMX_NT  AMX block: AMX_MT x AMX_NT C tiles (16 rows x 16 columns each), at most 8 tiles in all.
 *   PANEL     rows of x quantised at a time (rounded up to whole row blocks); each block of columns sweeps them.
 * Built with -fopenmp (threads > 1), threads share the rows to quantise, then the blocks of columns.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)
#define AMX_ROWS (16 * AMX_MT)

typedef int32_t i32_alias __attribute__((may_alias));

/* One row of x (k floats, k % 16 == 0) to u8 in q, with its scale *s and zero point *z. */
static inline void quantize_row(int k, const float *x, uint8_t *q, float *s, int32_t *z)
{
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (int c = 0; c < k; c += 16) {
        const __m512 v = _mm512_loadu_ps(x + c);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    const float l = _mm512_reduce_min_ps(lo), h = _mm512_reduce_max_ps(hi);
    float scale = (h - l) / 255.0f;
    if (scale == 0.0f) scale = 1.0f;
    const float inv = 1.0f / scale;
    const int32_t zero_point = _mm_cvtss_si32(_mm_set_ss(-l * inv));
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i vz = _mm512_set1_epi32(zero_point), floor = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
    for (int c = 0; c < k; c += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), vinv));
        v = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(v, vz), floor), top);
        _mm_storeu_si128((__m128i *)(q + c), _mm512_cvtepi32_epi8(v));
    }
    *s = scale;
    *z = zero_point;
}

/* 16 outputs of one row: (float)(acc - z * w_colsum) * (s * w_scale) + bias, in that order. */
static inline __m512 dequantize(__m512i acc, __m512i z, __m512 s, const int32_t *cs, const float *ws, const float *b)
{
    const __m512i d = _mm512_sub_epi32(acc, _mm512_mullo_epi32(z, _mm512_loadu_si512(cs)));
    const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(ws));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), scale), _mm512_loadu_ps(b));
}

/* EVOLVE-BLOCK-START */
/* y[0:R, 0:16V] of R quantised rows (q, row stride k; scales qs, zero points qz); wq, ws, cs, bias and y point at
 * the block's first column. */
static inline __attribute__((always_inline)) void vnni_tile(const int R, const int V, int n, int k, const uint8_t *q,
                                                            const float *qs, const int32_t *qz, const int8_t *wq,
                                                            const float *ws, const int32_t *cs, const float *bias,
                                                            float *y)
{
    __m512i acc[MR][NR];
    UNROLLED(16) for (int r = 0; r < R; r++) UNROLLED(16) for (int v = 0; v < V; v++)
        acc[r][v] = _mm512_setzero_si512();
    UNROLLED(KU) for (int p = 0; p < k / 4; p++) {
        __m512i b[NR];
        UNROLLED(16) for (int v = 0; v < V; v++) b[v] = _mm512_loadu_si512(wq + ((long)p * n + 16 * v) * 4);
        UNROLLED(16) for (int r = 0; r < R; r++) {
            const __m512i a = _mm512_set1_epi32(*(const i32_alias *)(q + (long)r * k + 4 * p));
            UNROLLED(16) for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], a, b[v]);
        }
    }
    UNROLLED(16) for (int r = 0; r < R; r++) {
        const __m512i z = _mm512_set1_epi32(qz[r]);
        const __m512 s = _mm512_set1_ps(qs[r]);
        UNROLLED(16) for (int v = 0; v < V; v++)
            _mm512_storeu_ps(y + (long)r * n + 16 * v,
                             dequantize(acc[r][v], z, s, cs + 16 * v, ws + 16 * v, bias + 16 * v));
    }
}

/* Columns [0, 16V) (pointers at the block's first column) of the panel's rows: MR at a time, then the rest
 * (< MR <= 16) in one pass per set bit. */
static inline __attribute__((always_inline)) void vnni_cols(const int V, int rows, int n, int k, const uint8_t *q,
                                                            const float *qs, const int32_t *qz, const int8_t *wq,
                                                            const float *ws, const int32_t *cs, const float *bias,
                                                            float *y)
{
    int r = 0;
    for (; r + MR <= rows; r += MR)
        vnni_tile(MR, V, n, k, q + (long)r * k, qs + r, qz + r, wq, ws, cs, bias, y + (long)r * n);
    const int rest = rows - r;
#define TAIL(T)                                                                                      \
    if (rest & T) {                                                                                  \
        vnni_tile(T, V, n, k, q + (long)r * k, qs + r, qz + r, wq, ws, cs, bias, y + (long)r * n); \
        r += T;                                                                                      \
    }
#if MR > 8
    TAIL(8)
#endif
#if MR > 4
    TAIL(4)
#endif
#if MR > 2
    TAIL(2)
#endif
    TAIL(1)
#undef TAIL
}

#if ISA_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Tile numbers (they must be literals): C tiles Cij, A tiles Ai (16 rows x 64 u8 of q), B tiles Bj
 * (16 k quads x 16 columns). Shapes: 1x1, 1x2, 1x3, 2x1, 2x2. */
#define C00 0
#define C01 1
#define C02 2
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7
#define B2 5

#if AMX_MT > 2 || AMX_NT > 3 || (AMX_MT == 2 && AMX_NT > 2)
#error "AMX block must be 1x1, 1x2, 1x3, 2x1 or 2x2 tiles"
#endif

/* Asks Linux once per process for the AMX tile state; 1 when granted, 0 otherwise (never retried).
 * Defining LINEAR_INT8_NO_AMX plays a refusal (the tests check the fallback with it). */
static int amx_ready(void)
{
#ifdef LINEAR_INT8_NO_AMX
    return 0;
#endif
    static volatile int state; /* 0 unknown, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state > 0;
}

static void amx_config(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#define STORE_C(C, i, j) _tile_stored(C, &c[i][j], sizeof c[0])

/* y[0 : rows, 0 : 16 NT] for NT = AMX_NT (wide) or 1 (column tail), from AMX_ROWS quantised rows (those past
 * rows are padding): int32 sums in C tiles, stored to a block on the stack, dequantised from there. */
static inline __attribute__((always_inline)) void amx_block(const int wide, int rows, int n, int k, const uint8_t *q,
                                                            const float *qs, const int32_t *qz, const int8_t *wq,
                                                            const float *ws, const int32_t *cs, const float *bias,
                                                            float *y)
{
    int32_t c[AMX_ROWS][16 * AMX_NT] __attribute__((aligned(64)));
    const long lda = k, ldb = 4L * n;
    _tile_zero(C00);
#if AMX_MT == 2
    _tile_zero(C10);
#endif
    if (wide) {
#if AMX_NT >= 2
        _tile_zero(C01);
#if AMX_MT == 2
        _tile_zero(C11);
#endif
#endif
#if AMX_NT >= 3
        _tile_zero(C02);
#endif
    }
    for (int kk = 0; kk < k; kk += 64) {
        const int8_t *b = wq + (long)kk * n; /* quad row kk / 4 */
        _tile_loadd(A0, q + kk, lda);
#if AMX_MT == 2
        _tile_loadd(A1, q + 16L * k + kk, lda);
#endif
        _tile_loadd(B0, b, ldb);
        _tile_dpbusd(C00, A0, B0);
#if AMX_MT == 2
        _tile_dpbusd(C10, A1, B0);
#endif
        if (wide) {
#if AMX_NT >= 2
            _tile_loadd(B1, b + 64, ldb);
            _tile_dpbusd(C01, A0, B1);
#if AMX_MT == 2
            _tile_dpbusd(C11, A1, B1);
#endif
#endif
#if AMX_NT >= 3
            _tile_loadd(B2, b + 128, ldb);
            _tile_dpbusd(C02, A0, B2);
#endif
        }
    }
    STORE_C(C00, 0, 0);
#if AMX_MT == 2
    STORE_C(C10, 16, 0);
#endif
    if (wide) {
#if AMX_NT >= 2
        STORE_C(C01, 0, 16);
#if AMX_MT == 2
        STORE_C(C11, 16, 16);
#endif
#endif
#if AMX_NT >= 3
        STORE_C(C02, 0, 32);
#endif
    }
    const int vectors = wide ? AMX_NT : 1;
    for (int r = 0; r < rows; r++) {
        const __m512i z = _mm512_set1_epi32(qz[r]);
        const __m512 s = _mm512_set1_ps(qs[r]);
        for (int v = 0; v < vectors; v++)
            _mm512_storeu_ps(y + (long)r * n + 16 * v, dequantize(_mm512_load_si512(&c[r][16 * v]), z, s,
                                                                  cs + 16 * v, ws + 16 * v, bias + 16 * v));
    }
}

/* Columns [0, 16 NT) of the panel's rows (padded with zero rows to whole AMX_ROWS blocks). */
static inline __attribute__((always_inline)) void amx_cols(const int wide, int rows, int n, int k, const uint8_t *q,
                                                           const float *qs, const int32_t *qz, const int8_t *wq,
                                                           const float *ws, const int32_t *cs, const float *bias,
                                                           float *y)
{
    for (int r = 0; r < rows; r += AMX_ROWS)
        amx_block(wide, rows - r < AMX_ROWS ? rows - r : AMX_ROWS, n, k, q + (long)r * k, qs + r, qz + r, wq, ws,
                  cs, bias, y + (long)r * n);
}
#endif

/* Panels of PANEL rows (rounded up to whole row blocks: MR rows, or AMX_ROWS padded with zero rows): each row
 * quantised once into the buffer q (PANEL x k u8, then the scales and zero points), then each block of columns
 * runs down the panel, so its W columns stay in cache across row blocks. Blocks are NR (VNNI) or AMX_NT (AMX)
 * vectors wide, then single vectors for the columns left. */
static void gemm(const int amx, int m, int n, int k, const float *x, const int8_t *wq, const float *ws,
                 const int32_t *cs, const float *bias, float *y, uint8_t *q, int panel)
{
    float *qs = (float *)(q + (long)panel * k);
    int32_t *qz = (int32_t *)(qs + panel);
    const int wide_cols = 16 * (amx ? AMX_NT : NR);
    const int wide_blocks = n / wide_cols, blocks = wide_blocks + (n - wide_blocks * wide_cols) / 16;
    for (int i0 = 0; i0 < m; i0 += panel) {
        const int rows = m - i0 < panel ? m - i0 : panel;
        const int padded = amx ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
        float *yp = y + (long)i0 * n;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int r = 0; r < padded; r++) {
                if (r < rows) quantize_row(k, x + (long)(i0 + r) * k, q + (long)r * k, qs + r, qz + r);
                else memset(q + (long)r * k, 0, k);
            }
#if ISA_AMX
            if (amx) amx_config();
#endif
#pragma omp for schedule(static)
            for (int b = 0; b < blocks; b++) {
                const int wide = b < wide_blocks;
                const int j = wide ? b * wide_cols : wide_blocks * wide_cols + (b - wide_blocks) * 16;
                const int8_t *wj = wq + 4L * j;
#if ISA_AMX
                if (amx) {
                    if (wide) amx_cols(1, rows, n, k, q, qs, qz, wj, ws + j, cs + j, bias + j, yp + j);
                    else amx_cols(0, rows, n, k, q, qs, qz, wj, ws + j, cs + j, bias + j, yp + j);
                    continue;
                }
#endif
                if (wide) vnni_cols(NR, rows, n, k, q, qs, qz, wj, ws + j, cs + j, bias + j, yp + j);
                else vnni_cols(1, rows, n, k, q, qs, qz, wj, ws + j, cs + j, bias + j, yp + j);
            }
#if ISA_AMX
            if (amx) _tile_release();
#endif
        }
    }
}
/* EVOLVE-BLOCK-END */

void kernel(int m, int n, int k, const float *x, const int8_t *wq, const float *w_scale, const int32_t *w_colsum, const float *bias, float *y)
{
    int amx = 0;
#if ISA_AMX
    amx = amx_ready();
#endif
    const int step = amx ? AMX_ROWS : MR;
    int panel = (PANEL + step - 1) / step * step;
    uint8_t *q = aligned_alloc(64, ((size_t)panel * k + 8 * (size_t)panel + 63) / 64 * 64);
    if (!q) { /* no heap: one row block at a time, from a stack buffer */
        panel = step;
        q = __builtin_alloca((size_t)panel * k + 8 * (size_t)panel + 64);
        q = (uint8_t *)(((uintptr_t)q + 63) & ~(uintptr_t)63);
        gemm(amx, m, n, k, x, wq, w_scale, w_colsum, bias, y, q, panel);
        return;
    }
    gemm(amx, m, n, k, x, wq, w_scale, w_colsum, bias, y, q, panel);
    free(q);
}
