/* Parametric bf16 linear layer: y[m,n] = bf16(x)[m,k] @ W[k,n] + bias[n], fp32 accumulation.
 *
 * x is fp32 row-major, rounded to bf16 (nearest even) here, once per block of rows, into a buffer;
 * W comes pre-packed as bf16 pairs, wp[((kk/2)*n + j)*2 + kk%2] = W[kk, j] (runtime.tasks.linear_bf16.pack_bf16),
 * the operand layout of both vdpbf16ps and AMX tdpbf16ps B tiles. Requires k % 32 == 0, n % 16 == 0, m >= 1,
 * and AVX512_BF16. The AVX512 path keeps MR rows of bf16 x on the stack (k up to ~64K), AMX a panel on the heap.
 *
 * Parameters (arrive as #defines):
 *   ISA       AVX512: register-tiled vdpbf16ps micro-kernel. AMX: tdpbf16ps on 16x16 fp32 C tiles; when the
 *             process cannot get AMX (no permission, no hardware) it falls back to the AVX512 path.
 *   MR, NR    AVX512 register tile: MR rows by NR vectors of 16 columns (MR * NR accumulators).
 *   KU        unroll of the AVX512 loop over k pairs.
 *   AMX_MT, AMX_NT  AMX block: AMX_MT x AMX_NT C tiles (16 rows x 16 columns each), at most 8 tiles in all.
 *   AMX_PANEL rows of x converted at a time (rounded up to whole blocks); each block of columns sweeps them.
 * Built with -fopenmp (threads > 1), threads share blocks of rows (AVX512) or of columns (AMX).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

typedef int32_t i32_alias __attribute__((may_alias));

/* rows x k floats (row stride ldx) to bf16, nearest even, into out (row stride k); k % 32 == 0. */
static inline void to_bf16(int rows, int k, const float *x, long ldx, uint16_t *out)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < k; c += 32) {
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * ldx + c + 16), _mm512_loadu_ps(x + r * ldx + c));
            _mm512_storeu_si512(out + (long)r * k + c, (__m512i)h);
        }
}

/* EVOLVE-BLOCK-START */
/* y[0:R, 0:16V] = xb[0:R, :] @ W[:, 0:16V] + bias; wp, bias and y point at the block's first column. */
static inline __attribute__((always_inline)) void avx_tile(const int R, const int V, int n, int k, const uint16_t *xb,
                                                           const uint16_t *wp, const float *bias, float *y)
{
    __m512 acc[MR][NR];
    UNROLLED(16) for (int r = 0; r < R; r++) UNROLLED(16) for (int v = 0; v < V; v++)
        acc[r][v] = _mm512_loadu_ps(bias + 16 * v);
    UNROLLED(KU) for (int p = 0; p < k / 2; p++) {
        __m512i b[NR];
        UNROLLED(16) for (int v = 0; v < V; v++) b[v] = _mm512_loadu_si512(wp + ((long)p * n + 16 * v) * 2);
        UNROLLED(16) for (int r = 0; r < R; r++) {
            __m512i a = _mm512_set1_epi32(*(const i32_alias *)(xb + (long)r * k + 2 * p));
            UNROLLED(16) for (int v = 0; v < V; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)b[v]);
        }
    }
    UNROLLED(16) for (int r = 0; r < R; r++) UNROLLED(16) for (int v = 0; v < V; v++)
        _mm512_storeu_ps(y + (long)r * n + 16 * v, acc[r][v]);
}

/* R rows (already bf16 in xb) across all n columns: NR vectors at a time, then single vectors. */
static inline __attribute__((always_inline)) void avx_rows(const int R, int n, int k, const uint16_t *xb,
                                                           const uint16_t *wp, const float *bias, float *y)
{
    int j = 0;
    for (; j + 16 * NR <= n; j += 16 * NR) avx_tile(R, NR, n, k, xb, wp + 2 * j, bias + j, y + j);
    for (; j < n; j += 16) avx_tile(R, 1, n, k, xb, wp + 2 * j, bias + j, y + j);
}

static void avx_gemm(int m, int n, int k, const float *x, const uint16_t *wp, const float *bias, float *y)
{
    int full = m / MR * MR;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < full; i += MR) {
        uint16_t xb[MR * k] __attribute__((aligned(64)));
        to_bf16(MR, k, x + (long)i * k, k, xb);
        avx_rows(MR, n, k, xb, wp, bias, y + (long)i * n);
    }
    int rest = m - full; /* < MR <= 16: one pass per set bit */
    if (rest) {
        uint16_t xb[rest * k] __attribute__((aligned(64)));
        to_bf16(rest, k, x + (long)full * k, k, xb);
        const uint16_t *xr = xb;
        float *yr = y + (long)full * n;
#define TAIL(T) if (rest & T) { avx_rows(T, n, k, xr, wp, bias, yr); xr += T * k; yr += (long)T * n; }
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
}

#if ISA_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS (16 * AMX_MT)

/* Tile numbers (they must be literals): C tiles Cij, A tiles Ai (16 rows x 32 bf16 of x), B tiles Bj
 * (16 k pairs x 16 columns). Shapes: 1x1, 1x2, 1x3, 2x1, 2x2. */
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
 * Defining LINEAR_BF16_NO_AMX plays a refusal (the tests check the fallback with it). */
static int amx_ready(void)
{
#ifdef LINEAR_BF16_NO_AMX
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

/* C tiles = bias rows (a stride-0 load); after the k loop, stored to y (ldy floats), or to a scratch
 * block when the rows run past m. */
#define LOAD_BIAS(C, j) _tile_loadd(C, bias + (j), 0)
#define STORE_C(C, i, j) _tile_stored(C, out + (long)(i) * ldo + (j), ldo * 4)

/* y[i0 : i0 + AMX_ROWS, j0 : j0 + 16 * NT] for NT = AMX_NT (wide) or 1 (column tail). */
static inline __attribute__((always_inline)) void amx_block(const int wide, int n, int k, const uint16_t *xb,
                                                            const uint16_t *wp, const float *bias, float *out,
                                                            long ldo)
{
    const long lda = 2L * k, ldb = 4L * n;
    LOAD_BIAS(C00, 0);
#if AMX_MT == 2
    LOAD_BIAS(C10, 0);
#endif
    if (wide) {
#if AMX_NT >= 2
        LOAD_BIAS(C01, 16);
#if AMX_MT == 2
        LOAD_BIAS(C11, 16);
#endif
#endif
#if AMX_NT >= 3
        LOAD_BIAS(C02, 32);
#endif
    }
    for (int kk = 0; kk < k; kk += 32) {
        const uint16_t *b = wp + (long)kk * n;
        _tile_loadd(A0, xb + kk, lda);
#if AMX_MT == 2
        _tile_loadd(A1, xb + 16L * k + kk, lda);
#endif
        _tile_loadd(B0, b, ldb);
        _tile_dpbf16ps(C00, A0, B0);
#if AMX_MT == 2
        _tile_dpbf16ps(C10, A1, B0);
#endif
        if (wide) {
#if AMX_NT >= 2
            _tile_loadd(B1, b + 32, ldb);
            _tile_dpbf16ps(C01, A0, B1);
#if AMX_MT == 2
            _tile_dpbf16ps(C11, A1, B1);
#endif
#endif
#if AMX_NT >= 3
            _tile_loadd(B2, b + 64, ldb);
            _tile_dpbf16ps(C02, A0, B2);
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
}

/* Panels of AMX_PANEL rows: x converted once per panel (padded with zero rows to whole blocks) into a heap
 * buffer, then each block of columns runs down the panel, so its W columns stay in cache across row blocks.
 * Blocks are AMX_NT tiles wide, then single tiles for the columns left. 0 when the buffer cannot be had. */
static int amx_gemm(int m, int n, int k, const float *x, const uint16_t *wp, const float *bias, float *y)
{
    const int panel = (AMX_PANEL + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int wide_blocks = n / (16 * AMX_NT), blocks = wide_blocks + (n - wide_blocks * 16 * AMX_NT) / 16;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * panel * k);
    if (!xb) return 0;
    for (int i0 = 0; i0 < m; i0 += panel) {
        const int prows = m - i0 < panel ? m - i0 : panel;
        const int padded = (prows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int r = 0; r < padded; r++) {
                if (r < prows) to_bf16(1, k, x + (long)(i0 + r) * k, k, xb + (long)r * k);
                else memset(xb + (long)r * k, 0, sizeof(uint16_t) * k);
            }
            amx_config();
            float scratch[AMX_ROWS * 16 * AMX_NT] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int b = 0; b < blocks; b++) {
                const int wide = b < wide_blocks, cols = wide ? 16 * AMX_NT : 16;
                const int j = wide ? b * cols : wide_blocks * 16 * AMX_NT + (b - wide_blocks) * 16;
                for (int r = 0; r < padded; r += AMX_ROWS) {
                    float *yr = y + (long)(i0 + r) * n + j;
                    if (r + AMX_ROWS <= prows) {
                        amx_block(wide, n, k, xb + (long)r * k, wp + 2 * j, bias + j, yr, n);
                    } else { /* rows past m: through the scratch block */
                        amx_block(wide, n, k, xb + (long)r * k, wp + 2 * j, bias + j, scratch, cols);
                        for (int q = 0; q < prows - r; q++) memcpy(yr + (long)q * n, scratch + q * cols, 4 * cols);
                    }
                }
            }
            _tile_release();
        }
    }
    free(xb);
    return 1;
}
#endif
/* EVOLVE-BLOCK-END */

void kernel(int m, int n, int k, const float *x, const uint16_t *wp, const float *bias, float *y)
{
#if ISA_AMX
    if (amx_ready() && amx_gemm(m, n, k, x, wp, bias, y)) return;
#endif
    avx_gemm(m, n, k, x, wp, bias, y);
}
