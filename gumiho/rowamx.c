/* Row-invariant bfloat16 products for a few rows on a CPU with AMX tiles:
 * y[m, n] = bf16(x[m, :] . w[n, :] (+ b[n])), the sum in float32 (and, at the end of this
 * file, rowattention.c's attention over a bf16 cache: rowamx_scores, rowamx_values).
 *
 * One tile product (TDPBF16PS) multiplies 16 rows of x by 16 columns of w over 32 values
 * of k, each row alone, so a row's result depends only on its own values, the weight and
 * the order of the k blocks, which is fixed (0, 1, 2, ...): whatever rows come with it,
 * whatever tile it falls in, whatever the number of threads, a row gets bit for bit what
 * it gets alone. Padded values of k are zeros (adding a zero product leaves a float32 sum
 * as it was). The weight is laid out once by rowamx.py:
 * blocks of 16 outputs x 32 values of k, each a tile of 16 rows of 16 pairs (k = 2r, 2r + 1
 * of output c at r's row, c's pair), blocks ordered by output then k. The float32 sum is
 * rounded once to bfloat16 as torch rounds (to nearest even; a NaN stays a NaN).
 *
 * A row costs the same as sixteen, and a product of one row reads each weight byte once,
 * in order: as fast as memory allows. Needs AMX-TILE and AMX-BF16 and the kernel's
 * permission to use them (rowamx_init). Threads split the outputs; they are OpenMP's,
 * torch's own runtime where rowgemm.py finds it. */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rowkernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* ask Linux for the tile state (once per process; 0 on success) */
int rowamx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

struct config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0-1: sums, 2: `rows` rows of x (both of `rows` rows); 3-4: weights (16 rows) */
static void configure(int rows) {
    struct config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = t < 3 ? rows : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* sixteen float32 sums rounded to bfloat16 as torch rounds: to nearest even, a NaN to the
   quiet NaN 0x7fc0 */
static inline __m256i bf16x16(__m512 s) {
    __m512i u = _mm512_castps_si512(s);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* rows m0..m0+15 of the 16 outputs from n0, from the tile stored at `sums` */
static void emit(const float *sums, const float *b, uint16_t *y, int M, int N, int m0,
                 int n0) {
    int rows = M - m0 < 16 ? M - m0 : 16, cols = N - n0 < 16 ? N - n0 : 16;
    __mmask16 keep = (__mmask16)((1u << cols) - 1);
    __m512 bias = b ? _mm512_maskz_loadu_ps(keep, b + n0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 s = _mm512_load_ps(sums + r * 16);
        if (b) s = _mm512_add_ps(s, bias);
        _mm256_mask_storeu_epi16(y + (size_t)(m0 + r) * N + n0, keep, bf16x16(s));
    }
}

/* x (M, K) bf16, w laid out as above for N outputs, b (N) float32 or NULL, y (M, N) bf16.
   Tiles 0-1 hold the sums of two output blocks for one block of up to 16 rows, 2 the rows'
   x, 3-4 the output blocks' weights. Up to 16 rows are one block of exactly that many rows,
   read in place where K is whole blocks of 32; otherwise x is copied, k padded with zeros
   and, past 16 rows, the rows to whole blocks (a padding row's sums are its own and are
   dropped). (Two row blocks at once, sums in four tiles, read the weights half as often
   but ran 1.1-1.3x slower for 32 to 64 rows on an AMX Xeon.) */
void rowamx(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, int M, int K,
            int N) {
    int KB = (K + 31) / 32, NB = (N + 15) / 16, MB = (M + 15) / 16;
    int rows = M < 16 ? M : 16;
    size_t kp = (size_t)KB * 32;
    const uint16_t *xp = x;
    uint16_t *copy = NULL;
    if (kp != (size_t)K || M > 16) {
        size_t bytes = (size_t)(M > 16 ? MB * 16 : M) * kp * 2;  /* whole 64-byte lines */
        copy = aligned_alloc(64, bytes);
        if (!copy) return;
        memset(copy, 0, bytes);
        for (int m = 0; m < M; m++) memcpy(copy + m * kp, x + (size_t)m * K, (size_t)K * 2);
        xp = copy;
    }
    int pairs = (NB + 1) / 2;
    #pragma omp parallel
    {
        int p0, p1;
        share(pairs, 1, &p0, &p1);
        float sums[2][256] __attribute__((aligned(64)));
        if (p0 < p1) {
            configure(rows);
            for (int p = p0; p < p1; p++) {
                int n = 2 * p, two = n + 1 < NB;
                const uint16_t *w0 = w + (size_t)n * KB * 512, *w1 = w0 + (size_t)KB * 512;
                for (int mb = 0; mb < MB; mb++) {
                    const uint16_t *xm = xp + (size_t)mb * 16 * kp;
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int k = 0; k < KB; k++) {
                        _tile_loadd(2, xm + k * 32, kp * 2);
                        _tile_loadd(3, w0 + (size_t)k * 512, 64);
                        _tile_dpbf16ps(0, 2, 3);
                        if (two) {
                            _tile_loadd(4, w1 + (size_t)k * 512, 64);
                            _tile_dpbf16ps(1, 2, 4);
                        }
                    }
                    _tile_stored(0, sums[0], 64);
                    emit(sums[0], b, y, M, N, mb * 16, n * 16);
                    if (two) {
                        _tile_stored(1, sums[1], 64);
                        emit(sums[1], b, y, M, N, mb * 16, (n + 1) * 16);
                    }
                }
            }
            _tile_release();
        }
    }
    free(copy);
}

/* Attention scores on AMX tiles for rowattention.c (bf16 keys): for the keys at slots
   j0..j1-1 of one kv group (key j's D values at k + j * kj, D a multiple of 32) and n <= 16
   query columns qt, bf16, laid out as tile rows of pairs ((D / 2, n, 2): row r of block b
   holds values 32 b + 2 r, + 1 of each column), s[c * ss + j] = sum_d k[j][d] qt[c][d] in
   float32: each column's scores in slot order. A tile product computes each of its
   elements from that element's key and column alone, over the blocks of d in order, so a
   score is the same whatever else is computed with it: a row of a verify gets the scores
   it gets alone. Keys 16 at a time as one tile's rows, read in place (the last few as a
   tile of that many rows), their scores turned to columns on the way out. */
void rowamx_scores(const uint16_t *k, long kj, const uint16_t *qt, int n, int D, float *s,
                   long ss, int j0, int j1) {
    int KB = D / 32;
    float sums[16 * 16] __attribute__((aligned(64)));  /* (keys, columns) */
    __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                         5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(16));  /* key r's row: 16 r */
    for (int j = j0; j < j1; j += 16) {
        int rows = j1 - j < 16 ? j1 - j : 16;
        if (j == j0 || rows < 16) {  /* tiles 0: scores, 1: keys (rows of 32 values), 2: q */
            struct config c;
            memset(&c, 0, sizeof c);
            c.palette = 1;
            c.rows[0] = c.rows[1] = rows;
            c.rows[2] = 16;
            c.colsb[0] = c.colsb[2] = 4 * n;
            c.colsb[1] = 64;
            _tile_loadconfig(&c);
        }
        _tile_zero(0);
        for (int b = 0; b < KB; b++) {
            _tile_loadd(1, k + (size_t)j * kj + b * 32, kj * 2);
            _tile_loadd(2, qt + (size_t)b * 32 * n, 4 * n);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sums, 64);
        __mmask16 keep = (__mmask16)((1u << rows) - 1);
        for (int c = 0; c < n; c++)  /* column c's scores of these keys */
            _mm512_mask_storeu_ps(s + (size_t)c * ss + j, keep,
                                  _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep,
                                                           _mm512_add_epi32(across,
                                                               _mm512_set1_epi32(c)),
                                                           sums, 4));
    }
    _tile_release();
}

/* The values weighed on AMX tiles for rowattention.c (bf16 values): for HB <= 16 rows of
   weights of one kv group and one row of the attention (its heads', each in two parts),
   acc[h * D + d] = sum_i p[h * np + i] v[seen[i] * vj + d] over the row's n visible keys
   in slot order, the weights p bf16 (rows of np, n rounded up to 32,
   zeros past n), D a multiple of 16. Keys 32 at a time as a block of k: per 16 values of d
   a tile of 16 rows of pairs (keys 2r, 2r + 1 side by side, zeros past n), built from the
   gathered rows, against the weights' tile; the sums float32, over the blocks in order.
   A row's result depends only on its own weights and visible values, so a verify's row
   gets what its token gets alone. Up to 64 values of d a pass (four tiles of sums). */
void rowamx_values(const uint16_t *v, long vj, const int *seen, int n, const uint16_t *p,
                   int np, int HB, int D, float *acc) {
    static const short order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15,
                                    47};
    __m512i pairs = _mm512_loadu_si512(order);
    uint16_t pack[4][16 * 32] __attribute__((aligned(64)));  /* a block's tiles of values */
    struct config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) {  /* tiles 0-3: sums of 16 values of d each */
        c.rows[t] = HB;
        c.colsb[t] = 64;
    }
    c.rows[4] = HB, c.colsb[4] = 64;  /* the weights: HB rows of 32 keys */
    c.rows[5] = 16, c.colsb[5] = 64;  /* values: 16 rows of 16 pairs */
    _tile_loadconfig(&c);
    for (int d0 = 0; d0 < D; d0 += 64) {
        int chunks = D - d0 < 64 ? (D - d0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < np; b += 32) {
            for (int r = 0; r < 16; r++) {  /* keys b + 2r and b + 2r + 1, zeros past n */
                int i = b + 2 * r;
                const uint16_t *x = i < n ? v + (size_t)seen[i] * vj + d0 : NULL;
                const uint16_t *y = i + 1 < n ? v + (size_t)seen[i + 1] * vj + d0 : NULL;
                for (int t = 0; t < chunks; t++) {
                    __m256i a = x ? _mm256_loadu_si256((const __m256i *)(x + 16 * t))
                                  : _mm256_setzero_si256();
                    __m256i e = y ? _mm256_loadu_si256((const __m256i *)(y + 16 * t))
                                  : _mm256_setzero_si256();
                    _mm512_store_si512(pack[t] + r * 32,
                                       _mm512_permutex2var_epi16(_mm512_castsi256_si512(a),
                                                                 pairs,
                                                                 _mm512_castsi256_si512(e)));
                }
            }
            _tile_loadd(4, p + b, (size_t)np * 2);
            /* (tile numbers are immediates: one product per tile of sums) */
            _tile_loadd(5, pack[0], 64);
            _tile_dpbf16ps(0, 4, 5);
            if (chunks > 1) {
                _tile_loadd(5, pack[1], 64);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (chunks > 2) {
                _tile_loadd(5, pack[2], 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (chunks > 3) {
                _tile_loadd(5, pack[3], 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        float *out = acc + d0;
        _tile_stored(0, out, (size_t)D * 4);
        if (chunks > 1) _tile_stored(1, out + 16, (size_t)D * 4);
        if (chunks > 2) _tile_stored(2, out + 32, (size_t)D * 4);
        if (chunks > 3) _tile_stored(3, out + 48, (size_t)D * 4);
    }
    _tile_release();
}
