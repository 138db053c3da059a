/* Parametric fp32 GEMM, row-major C[M,N] = A[M,K] x B[K,N] (GotoBLAS/BLIS structure).
 *
 * Parameters (arrive as #defines): MR, NR (register tile; NR a multiple of the vector width),
 * MC, KC, NC (cache blocks; MC % MR == 0, NC % NR == 0), UNROLL (k-loop unroll of the micro-kernel)
 * LOOP_ORDER (nesting of the three macro loops: JPI or PJI; J = NC blocks of columns,
 * P = KC blocks of the shared dimension, I = MC blocks of rows), TILE_ORDER (COLS: consecutive tiles
 * share a B micro-panel, which stays in L1; ROWS: they share an A micro-panel) and PREFETCH_C
 * (prefetch a C tile before computing it).
 * A blocks and B panels are packed into 64-byte aligned buffers, zero-padded to whole register tiles,
 * so the micro-kernel never branches on edges; only the valid part of a tile is written back.
 * Built with -fopenmp, the packing and the micro-panel loop are shared among threads.
 */
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#if NR % VW != 0
#error "NR must be a multiple of the vector width"
#endif
#define NV (NR / VW)

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* EVOLVE-BLOCK-START */
/* Packs an mr x kc slice of A (leading dim lda) into one MR-row micro-panel dst[k][r], zero-padded. */
static void pack_a(int mr, int kc, const float *restrict a, int lda, float *restrict dst)
{
    for (int k = 0; k < kc; k++) {
        for (int r = 0; r < mr; r++) dst[k * MR + r] = a[(size_t)r * lda + k];
        for (int r = mr; r < MR; r++) dst[k * MR + r] = 0.0f;
    }
}

/* Packs a kc x nr slice of B (leading dim ldb) into one NR-column micro-panel dst[k][c], zero-padded. */
static void pack_b(int kc, int nr, const float *restrict b, int ldb, float *restrict dst)
{
    for (int k = 0; k < kc; k++) {
        memcpy(dst + k * NR, b + (size_t)k * ldb, (size_t)nr * sizeof(float));
        for (int c = nr; c < NR; c++) dst[k * NR + c] = 0.0f;
    }
}

/* C[0:mr, 0:nr] (+)= Ap x Bp over kc for one MR x NR tile held in registers; `first` overwrites C. */
static inline void micro_kernel(int kc, const float *restrict ap, const float *restrict bp,
                                float *restrict c, int ldc, int mr, int nr, int first)
{
    vf acc[MR][NV];
#if PREFETCH_C
    UNROLLED(MR) for (int r = 0; r < MR; r++)
        UNROLLED(4) for (int v = 0; v < NR; v += 16) __builtin_prefetch(c + (size_t)r * ldc + v, 1, 3);
#endif
    UNROLLED(MR) for (int r = 0; r < MR; r++)
        UNROLLED(NV) for (int v = 0; v < NV; v++) acc[r][v] = (vf){0};

    UNROLLED(UNROLL) for (int k = 0; k < kc; k++) {
        vf bv[NV];
        UNROLLED(NV) for (int v = 0; v < NV; v++) bv[v] = *(const vf *)(bp + k * NR + v * VW);
        UNROLLED(MR) for (int r = 0; r < MR; r++) {
            float a = ap[k * MR + r];
            UNROLLED(NV) for (int v = 0; v < NV; v++) acc[r][v] += bv[v] * a;
        }
    }

    if (mr == MR && nr == NR) {
        UNROLLED(MR) for (int r = 0; r < MR; r++)
            UNROLLED(NV) for (int v = 0; v < NV; v++) {
                vfu *dst = (vfu *)(c + (size_t)r * ldc + v * VW);
                *dst = first ? acc[r][v] : *dst + acc[r][v];
            }
    } else {
        float tile[MR][NR] __attribute__((aligned(64)));
        UNROLLED(MR) for (int r = 0; r < MR; r++)
            UNROLLED(NV) for (int v = 0; v < NV; v++) *(vf *)&tile[r][v * VW] = acc[r][v];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nr; j++)
                c[(size_t)r * ldc + j] = first ? tile[r][j] : c[(size_t)r * ldc + j] + tile[r][j];
    }
}
/* EVOLVE-BLOCK-END */

/* All MR x NR tiles of one packed (mc x kc) A block times one packed (kc x nc) B panel. */
static void macro_kernel(int mc, int nc, int kc, const float *ap, const float *bp, float *c, int ldc, int first)
{
    int np = (nc + NR - 1) / NR, mp = (mc + MR - 1) / MR;
#if TILE_ORDER_ROWS
#pragma omp for schedule(static)
    for (int ip = 0; ip < mp; ip++)
        for (int jp = 0; jp < np; jp++)
#elif TILE_ORDER_COLS
#pragma omp for schedule(static)
    for (int jp = 0; jp < np; jp++)
        for (int ip = 0; ip < mp; ip++)
#else
#error "unknown TILE_ORDER"
#endif
            micro_kernel(kc, ap + (size_t)ip * MR * kc, bp + (size_t)jp * NR * kc, c + (size_t)ip * MR * ldc + jp * NR,
                         ldc, min_int(MR, mc - ip * MR), min_int(NR, nc - jp * NR), first);
}

#if LOOP_ORDER_JPI
#define LOOP_1 for (int jc = 0; jc < N; jc += NC)
#define LOOP_2 for (int pc = 0; pc < K; pc += KC)
#define LOOP_3 for (int ic = 0; ic < M; ic += MC)
#elif LOOP_ORDER_PJI
#define LOOP_1 for (int pc = 0; pc < K; pc += KC)
#define LOOP_2 for (int jc = 0; jc < N; jc += NC)
#define LOOP_3 for (int ic = 0; ic < M; ic += MC)
#else
#error "unknown LOOP_ORDER"
#endif

void kernel(int M, int N, int K, const float *A, const float *B, float *C)
{
    if (M <= 0 || N <= 0)
        return;
    if (K <= 0) {
        for (int i = 0; i < M; i++) memset(C + (size_t)i * N, 0, (size_t)N * sizeof(float));
        return;
    }
    int mcap = min_int(MC, (M + MR - 1) / MR * MR), ncap = min_int(NC, (N + NR - 1) / NR * NR);
    int kcap = min_int(KC, K);
    size_t abytes = ((size_t)mcap * kcap * sizeof(float) + 63) / 64 * 64;
    size_t bbytes = ((size_t)ncap * kcap * sizeof(float) + 63) / 64 * 64;
    float *ap = aligned_alloc(64, abytes), *bp = aligned_alloc(64, bbytes);
    if (ap && bp) {
#pragma omp parallel
        {
            int packed_a_i = -1, packed_a_p = -1, packed_b_j = -1, packed_b_p = -1;
            LOOP_1 LOOP_2 LOOP_3 {
                int mc = min_int(MC, M - ic), nc = min_int(NC, N - jc), kc = min_int(KC, K - pc);
                if (packed_b_j != jc || packed_b_p != pc) {
#pragma omp for schedule(static)
                    for (int j = 0; j < nc; j += NR)
                        pack_b(kc, min_int(NR, nc - j), B + (size_t)pc * N + jc + j, N, bp + (size_t)j * kc);
                    packed_b_j = jc, packed_b_p = pc;
                }
                if (packed_a_i != ic || packed_a_p != pc) {
#pragma omp for schedule(static)
                    for (int i = 0; i < mc; i += MR)
                        pack_a(min_int(MR, mc - i), kc, A + (size_t)(ic + i) * K + pc, K, ap + (size_t)i * kc);
                    packed_a_i = ic, packed_a_p = pc;
                }
                macro_kernel(mc, nc, kc, ap, bp, C + (size_t)ic * N + jc, N, pc == 0);
            }
        }
    }
    free(ap);
    free(bp);
}
