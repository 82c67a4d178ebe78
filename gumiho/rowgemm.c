/* Row-invariant float32 products for a few rows: y[m, n] = x[m, :] . w[n, :] (+ b[n]).
 *
 * Every output is summed the same way whatever the number of rows, the tile it falls in
 * and the number of threads: eight lanes accumulate k = lane, lane + 8, ... in order with
 * fused multiply-adds, the lanes are added pairwise in a fixed order, then the k % 8 tail
 * and the bias. So a row's result is bit for bit the one it gets alone. Each tile keeps
 * up to four weight rows in L1 while every input row passes over them, so a verify's
 * few rows cost little more than one row's (the weights are read from memory once).
 * Needs AVX2 and FMA; where there is AVX-512, the same sums run wider (rowgemm_wide,
 * below). Threads split the columns; they are OpenMP's, torch's own runtime where
 * rowgemm.py finds it (one pool, sized by torch.set_num_threads).
 *
 * The weight may be stored in 16 bits (float16 or bfloat16) and widened to float32 in
 * registers as it is read: where every value of a float32 weight is exactly a 16-bit one
 * (a drafter saved in float16, a target released in bfloat16), the products are bit for bit
 * the float32 ones and the weight costs half the memory traffic. */
#include <stdlib.h>

#include "rowkernels.h"

/* R input rows (from x) times C weight rows (from w), R and C constants after inlining */
static inline __attribute__((always_inline)) void block(
        const float *x, const void *w, const float *b, float *y,
        int K, int N, int R, int C, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v[4];
        for (int c = 0; c < C; c++) {
            v[c] = load8(w, (size_t)c * K + k, kind);
            /* the next tile's rows (the C after these) come into L2 while this one computes:
               a verify's rows then cost little more than one (past the end: a hint, no
               fault). Into L2 (T1), not L1 (T0): a SmolLM2 step's products 5-11% faster
               at 1 to 8 rows on a 2-core AVX-512 Xeon (scripts/rowgemm_ab.py) */
            _mm_prefetch((const char *)w + ((size_t)(c + C) * K + k) * size, _MM_HINT_T1);
        }
        for (int r = 0; r < R; r++) {
            __m256 u = _mm256_loadu_ps(x + (size_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(u, v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = lanes(acc[r][c]);
            for (int t = k; t < K; t++)
                s += x[(size_t)r * K + t] * load1(w, (size_t)c * K + t, kind);
            y[(size_t)r * N + c] = b ? s + b[c] : s;
        }
}

#define ROWS(R, C, T) case C: block(x, w, b, y, K, N, R, C, T); break;
#define COLS(R, T) case R: switch (C) { \
    ROWS(R, 1, T) ROWS(R, 2, T) ROWS(R, 3, T) ROWS(R, 4, T) } break;
#define STORED(T) case T: switch (R) { COLS(1, T) COLS(2, T) COLS(3, T) COLS(4, T) } break;

static void tile(const float *x, const void *w, const float *b, float *y,
                 int K, int N, int R, int C, int kind) {
    switch (kind) { STORED(F32) STORED(F16) STORED(BF16) }
}

/* rows 4 at a time over columns n0..n1, 4 weight rows at a time (3 for 3-4 rows:
   twelve accumulators fit AVX2's sixteen registers beside the loads) */
static void span(const float *x, const void *w, const float *b, float *y,
                 int M, int K, int N, int n0, int n1, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    int width = M >= 3 ? 3 : 4;
    for (int n = n0; n < n1; n += width) {
        int C = n1 - n < width ? n1 - n : width;
        for (int m = 0; m < M; m += 4) {
            int R = M - m < 4 ? M - m : 4;
            tile(x + (size_t)m * K, (const char *)w + (size_t)n * K * size, b ? b + n : NULL,
                 y + (size_t)m * N + n, K, N, R, C, kind);
        }
    }
}

/* Where the CPU has AVX-512 (rowgemm_wide), the same sums twice as wide. A 16-lane register
 * holds two rows' eight lanes for one weight column: the rows are interleaved in pairs
 * eight values at a time (once per call), each column's eight weights are read into both
 * halves, and one FMA advances both rows. Every lane accumulates exactly what the AVX2
 * block's lane does, in the same order, and each half is added by the same lanes(), so
 * the results are bit for bit block()'s: only the speed changes, not the output, and a
 * machine with AVX-512 computes what one without it does. Tiles of 4 pairs (8 rows) x 6
 * columns keep 24 accumulators, 4 pairs and a column in AVX-512's 32 registers. */
#define WIDE __attribute__((target("avx512f")))
#define PAIRS 4
#define WIDTH 6

static int wide = 0;

/* eight weights from element i, widened, the same eight in both halves */
static inline __attribute__((always_inline)) WIDE __m512 load8x2(const void *w, size_t i,
                                                                   int kind) {
    if (kind == F32)
        return _mm512_castpd_ps(_mm512_broadcast_f64x4(
            _mm256_loadu_pd((const double *)((const float *)w + i))));
    __m512d v = _mm512_castps_pd(_mm512_castps256_ps512(load8(w, i, kind)));
    return _mm512_castpd_ps(_mm512_insertf64x4(v, _mm512_castpd512_pd256(v), 1));
}

static inline __attribute__((always_inline)) WIDE float upper(__m512 v) {
    return lanes(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* P pairs of rows from row m (interleaved in xp: pair p's k-chunk j at (p * K8 + j) * 16)
   times C weight rows */
static inline __attribute__((always_inline)) WIDE void pair_block(
        const float *xp, const float *x, const void *w, const float *b, float *y,
        int M, int m, int K, int N, int P, int C, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    int K8 = K / 8;
    __m512 acc[PAIRS][WIDTH];
    for (int p = 0; p < P; p++)
        for (int c = 0; c < C; c++) acc[p][c] = _mm512_setzero_ps();
    for (int j = 0; j < K8; j++) {
        __m512 u[PAIRS];
        for (int p = 0; p < P; p++) u[p] = _mm512_load_ps(xp + ((size_t)p * K8 + j) * 16);
        for (int c = 0; c < C; c++) {
            __m512 v = load8x2(w, (size_t)c * K + 8 * j, kind);
            _mm_prefetch((const char *)w + ((size_t)(c + C) * K + 8 * j) * size, _MM_HINT_T1);
            for (int p = 0; p < P; p++) acc[p][c] = _mm512_fmadd_ps(u[p], v, acc[p][c]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int h = 0; h < 2; h++) {
            int r = m + 2 * p + h;
            if (r >= M) break;
            for (int c = 0; c < C; c++) {
                float s = h ? upper(acc[p][c]) : lanes(_mm512_castps512_ps256(acc[p][c]));
                for (int t = 8 * K8; t < K; t++)
                    s += x[(size_t)r * K + t] * load1(w, (size_t)c * K + t, kind);
                y[(size_t)r * N + c] = b ? s + b[c] : s;
            }
        }
}

#define PAIRED(P, C, T) case C: pair_block(xp, x, w, b, y, M, m, K, N, P, C, T); break;
#define PCOLS(P, T) case P: switch (C) { PAIRED(P, 1, T) PAIRED(P, 2, T) PAIRED(P, 3, T) \
    PAIRED(P, 4, T) PAIRED(P, 5, T) PAIRED(P, 6, T) } break;
#define PSTORED(T) case T: switch (P) { PCOLS(1, T) PCOLS(2, T) PCOLS(3, T) PCOLS(4, T) } break;

static WIDE void pair_tile(const float *xp, const float *x, const void *w, const float *b,
                           float *y, int M, int m, int K, int N, int P, int C, int kind) {
    switch (kind) { PSTORED(F32) PSTORED(F16) PSTORED(BF16) }
}

static WIDE void pair_span(const float *xp, const float *x, const void *w, const float *b,
                           float *y, int M, int K, int N, int n0, int n1, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    int pairs = (M + 1) / 2, K8 = K / 8;
    for (int n = n0; n < n1; n += WIDTH) {
        int C = n1 - n < WIDTH ? n1 - n : WIDTH;
        for (int p = 0; p < pairs; p += PAIRS) {
            int P = pairs - p < PAIRS ? pairs - p : PAIRS;
            pair_tile(xp + (size_t)p * K8 * 16, x, (const char *)w + (size_t)n * K * size,
                      b ? b + n : NULL, y + n, M, 2 * p, K, N, P, C, kind);
        }
    }
}

/* 1 where AVX-512 is there and turned on, 0 where rowgemm runs the AVX2 blocks only
   (rowgemm.py turns it on where the CPU has it, unless GUMIHO_ROWGEMM512=0) */
int rowgemm_wide(int on) {
    __builtin_cpu_init();
    wide = on && __builtin_cpu_supports("avx512f");
    return wide;
}

static WIDE int rowgemm_pairs(const float *x, const void *w, const float *b, float *y, int M,
                              int K, int N, int kind) {
    int pairs = (M + 1) / 2, K8 = K / 8;
    float *xp = aligned_alloc(64, (size_t)pairs * K8 * 16 * sizeof(float) + 64);
    if (xp == NULL) return 0;
    #pragma omp parallel
    {
        #pragma omp for
        for (int p = 0; p < pairs; p++)
            for (int j = 0; j < K8; j++)
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 8; l++)
                        xp[((size_t)p * K8 + j) * 16 + 8 * h + l] = 2 * p + h < M ?
                            x[(size_t)(2 * p + h) * K + 8 * j + l] : 0.0f;
        int n0, n1;
        share(N, 12, &n0, &n1);  /* whole tiles of 6 columns per thread */
        if (n0 < n1) pair_span(xp, x, w, b, y, M, K, N, n0, n1, kind);
    }
    free(xp);
    return 1;
}

void rowgemm(const float *x, const void *w, const float *b, float *y, int M, int K, int N,
             int kind) {
    /* one or two rows are bound by the weights' reading, not by the FMAs */
    if (wide && M >= 3 && K >= 8 && rowgemm_pairs(x, w, b, y, M, K, N, kind)) return;
    #pragma omp parallel
    {
        int n0, n1;
        share(N, 12, &n0, &n1);  /* whole tiles of 3 or 4 columns per thread */
        if (n0 < n1) span(x, w, b, y, M, K, N, n0, n1, kind);
    }
}

/* The index of each row's largest value, as torch.argmax(x, -1) gives it: the first NaN
 * where a row has one, else the first index of its maximum (-0.0 and 0.0 equal). x (M, N)
 * float32, float16 or bfloat16 (`kind`), contiguous; out (M) int64. torch's own CPU argmax
 * reduces ~3 ns a value (0.13-0.26 ms over a 49,152-token vocabulary, every decode step);
 * this reads each value twice in eight lanes: the maximum, then its first position. */
static long argmax_row(const void *x, long N, int kind) {
    __m256 top = _mm256_set1_ps(-__builtin_inff()), nan = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= N; i += 8) {
        __m256 v = load8(x, (size_t)i, kind);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float m = -__builtin_inff();
    int found_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < N; i++) {
        float v = load1(x, (size_t)i, kind);
        if (v != v) found_nan = 1;
        else if (v > m) m = v;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) if (lanes[l] > m) m = lanes[l];
    if (found_nan) {
        for (long j = 0; j < N; j++) {
            float v = load1(x, (size_t)j, kind);
            if (v != v) return j;
        }
    }
    __m256 want = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= N; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, (size_t)i, kind), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < N; i++)
        if (load1(x, (size_t)i, kind) == m) return i;
    return 0;  /* N == 0 (torch refuses an empty argmax before it gets here) */
}

void rowargmax(const void *x, int64_t *out, long M, long N, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    #pragma omp parallel for if (M > 1)  /* a verify's rows split over the threads */
    for (long r = 0; r < M; r++) out[r] = argmax_row((const char *)x + (size_t)r * N * size, N, kind);
}
