/* Row-invariant float32 products for a few rows: y[m, n] = x[m, :] . w[n, :] (+ b[n]).
 *
 * Every output is summed the same way whatever the number of rows, the tile it falls in
 * and the number of threads: eight lanes accumulate k = lane, lane + 8, ... in order with
 * fused multiply-adds, the lanes are added pairwise in a fixed order, then the k % 8 tail
 * and the bias. So a row's result is bit for bit the one it gets alone. Each tile keeps
 * up to four weight rows in L1 while every input row passes over them, so a verify's
 * few rows cost little more than one row's (the weights are read from memory once).
 * Needs AVX2 and FMA. Threads split the columns; they are OpenMP's, torch's own runtime
 * where rowgemm.py finds it (one pool, sized by torch.set_num_threads).
 *
 * The weight may be stored in 16 bits (float16 or bfloat16) and widened to float32 in
 * registers as it is read: where every value of a float32 weight is exactly a 16-bit one
 * (a drafter saved in float16, a target released in bfloat16), the products are bit for bit
 * the float32 ones and the weight costs half the memory traffic. */
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
            /* the next tile's rows (the C after these) come in while this one computes: a
               verify's rows then cost little more than one (past the end: a hint, no fault) */
            _mm_prefetch((const char *)w + ((size_t)(c + C) * K + k) * size, _MM_HINT_T0);
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

void rowgemm(const float *x, const void *w, const float *b, float *y, int M, int K, int N,
             int kind) {
    #pragma omp parallel
    {
        int n0, n1;
        share(N, 12, &n0, &n1);  /* whole tiles of 3 or 4 columns per thread */
        if (n0 < n1) span(x, w, b, y, M, K, N, n0, n1, kind);
    }
}
