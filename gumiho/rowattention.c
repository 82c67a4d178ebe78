/* Row-invariant float32 attention: out[r, h] = softmax(q[h, r] . k[g, j] * scale over the
 * keys j that mask[r, j] lets row r see) . v[g, j], g = h / (heads per KV head). The keys
 * and values may be stored in 16 bits (a bfloat16 or float16 cache), widened to float32 as
 * they are read: the same arithmetic as on their float32 values.
 *
 * A row is computed from its own query and visible keys alone, in one fixed order: scores
 * as dot products over eight FMA lanes added pairwise, their maximum, exp(score - max)
 * (`exp8`, eight at a time, each value on its own) summed over eight lanes in slot order,
 * the values weighted and accumulated in slot order (per dimension), divided by the sum at
 * the end. So a tree node's row, whose visible keys are
 * the committed prefix and its ancestors in slot (= depth) order, gets bit for bit what
 * the same token gets as a one-token decode step over the same keys: with row-invariant
 * products (rowgemm.c) a float32 verify gives exactly sequential decoding's hidden states.
 * Threads take rows and heads (OpenMP, torch's runtime where rowgemm.py finds it). Needs
 * AVX2 and FMA. */
#include <math.h>
#include <stdlib.h>
#include "rowkernels.h"

/* The score of query a against key b: eight FMA lanes over d in order, the lanes added
   pairwise, then the d % 8 tail. Every score is summed this way, whichever of the
   functions below computes it (-ffp-contract=off keeps the tail's products unfused). */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b,
                                                       size_t at, int D, int kind) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, at + d, kind), acc);
    float s = lanes(acc);
    for (; d < D; d++) s += a[d] * load1(b, at + d, kind);
    return s;
}

/* HB heads' queries (a group's, which share keys) against two keys at once (elements
   at0 and at1 of b): each key is loaded once for all of them, 2 * HB chains in flight;
   each score as `dot` sums it */
static inline __attribute__((always_inline)) void dots(
        const float *const *qs, const void *b, size_t at0, size_t at1, int D, int HB,
        float *const *p, int i, int kind) {
    __m256 c0[4], c1[4];
    for (int h = 0; h < HB; h++) c0[h] = c1[h] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 k0 = load8(b, at0 + d, kind), k1 = load8(b, at1 + d, kind);
        for (int h = 0; h < HB; h++) {
            __m256 u = _mm256_loadu_ps(qs[h] + d);
            c0[h] = _mm256_fmadd_ps(u, k0, c0[h]);
            c1[h] = _mm256_fmadd_ps(u, k1, c1[h]);
        }
    }
    for (int h = 0; h < HB; h++) {
        float s0 = lanes(c0[h]), s1 = lanes(c1[h]);
        for (int t = d; t < D; t++) {
            s0 += qs[h][t] * load1(b, at0 + t, kind);
            s1 += qs[h][t] * load1(b, at1 + t, kind);
        }
        p[h][i] = s0, p[h][i + 1] = s1;
    }
}

/* The values weighted by HB heads' probabilities, dims d0.. in chunks of 8 * C: each value
   row loaded once for all heads; every element accumulates p[i] * v[i] over i in order */
static inline __attribute__((always_inline)) int weigh(
        const void *vg, long vj, const int *seen, int n, float *const *p, const float *sums,
        float *const *o, int d0, int D, int HB, int C, int kind) {
    int d = d0;
    for (; d + 8 * C <= D; d += 8 * C) {
        __m256 acc[4][4];
        for (int h = 0; h < HB; h++)
            for (int c = 0; c < C; c++) acc[h][c] = _mm256_setzero_ps();
        for (int i = 0; i < n; i++) {
            size_t at = (size_t)seen[i] * vj + d;
            __m256 x[4];
            for (int c = 0; c < C; c++) x[c] = load8(vg, at + 8 * c, kind);
            for (int h = 0; h < HB; h++) {
                __m256 w = _mm256_set1_ps(p[h][i]);
                for (int c = 0; c < C; c++) acc[h][c] = _mm256_fmadd_ps(w, x[c], acc[h][c]);
            }
        }
        for (int h = 0; h < HB; h++) {
            __m256 sum = _mm256_set1_ps(sums[h]);
            for (int c = 0; c < C; c++)
                _mm256_storeu_ps(o[h] + d + 8 * c, _mm256_div_ps(acc[h][c], sum));
        }
    }
    return d;
}

/* exp of eight values (<= 0 here: score - max), each computed on its own, so a value gets
   the same bits wherever it sits: x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by a degree-7
   polynomial (Cephes' expf coefficients, ~1 ulp), times 2^n. Below -87.3 (exp < 1.2e-38,
   against a top score's 1) it returns exp(-87.3). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                               _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* q: element (h, r, d) at q[h * qh + r * qr + d]; k, v: (g, j, d) at [g * kh + j * kj + d]
   (and vh, vj); mask: (r, j) at mask[r * K + j], nonzero = visible; out: (r, h, d)
   contiguous. Returns 0, or -1 where a row sees no key or memory ran out. */
/* HB heads of kv group g (qs: their queries, o: their outputs) over one row's visible keys
   (seen[0..n)); p: HB rows of K scratch floats */
static inline __attribute__((always_inline)) void heads(
        const float *const *qs, float *const *o, const void *kg, long kj, const void *vg,
        long vj, const int *seen, int n, float *const *p, int D, float scale, int HB,
        int kind) {
    int i = 0;
    for (; i + 2 <= n; i += 2)
        dots(qs, kg, (size_t)seen[i] * kj, (size_t)seen[i + 1] * kj, D, HB, p, i, kind);
    for (; i < n; i++)
        for (int h = 0; h < HB; h++) p[h][i] = dot(qs[h], kg, (size_t)seen[i] * kj, D, kind);
    float sums[4];
    for (int h = 0; h < HB; h++) {
        float *ph = p[h], top = -INFINITY;
        for (i = 0; i < n; i++) {
            ph[i] *= scale;
            if (ph[i] > top) top = ph[i];
        }
        /* eight at a time; the last few padded with the top (exp(0) = 1) and left out of
           the sum, so every key's weight is exp8's and the lanes sum in slot order */
        __m256 total = _mm256_setzero_ps(), high = _mm256_set1_ps(top);
        for (i = 0; i < n; i += 8) {
            float part[8];
            int m = n - i < 8 ? n - i : 8;
            for (int t = 0; t < 8; t++) part[t] = t < m ? ph[i + t] : top;
            _mm256_storeu_ps(part, exp8(_mm256_sub_ps(_mm256_loadu_ps(part), high)));
            for (int t = 0; t < 8; t++) {
                if (t < m) ph[i + t] = part[t];
                else part[t] = 0.0f;
            }
            total = _mm256_add_ps(total, _mm256_loadu_ps(part));
        }
        sums[h] = lanes(total);
    }
    /* 32 dims at a time for one head, 16 for more (their accumulators fit the registers) */
    int d = HB == 1 ? weigh(vg, vj, seen, n, p, sums, o, 0, D, HB, 4, kind)
                    : weigh(vg, vj, seen, n, p, sums, o, 0, D, HB, 2, kind);
    d = weigh(vg, vj, seen, n, p, sums, o, d, D, HB, 1, kind);
    for (; d < D; d++)  /* a head size not a multiple of 8 */
        for (int h = 0; h < HB; h++) {
            float a = 0.0f;
            for (i = 0; i < n; i++) a += p[h][i] * load1(vg, (size_t)seen[i] * vj + d, kind);
            o[h][d] = a / sums[h];
        }
}

#define HEAD(T, B) case T * 4 + B: \
    heads(qs, o, kg, kj, vg, vj, seen, n, p, D, scale, B, T); break;
#define HEADS(T) HEAD(T, 1) HEAD(T, 2) HEAD(T, 3)

/* q: element (h, r, d) at q[h * qh + r * qr + d]; k, v: (g, j, d) at [g * kh + j * kj + d]
   (and vh, vj); mask: (r, j) at mask[r * K + j], nonzero = visible; out: (r, h, d)
   contiguous; k and v stored as `kind` (F32, F16 or BF16), q float32. Returns 0, or -1
   where a row sees no key or memory ran out. A task is a row and up to three heads of one
   kv group (one head each for a single row, so both threads have work); a head's
   arithmetic is the same in any block. */
int rowattention(const float *q, long qh, long qr, const void *k, long kh, long kj,
                 const void *v, long vh, long vj, const unsigned char *mask, float *out,
                 int Q, int H, int G, int K, int D, float scale, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    int failed = 0, per = H / G, block = Q > 1 ? 3 : 1;
    int blocks = (per + block - 1) / block;  /* per kv group */
    #pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(K > 0 ? K : 1) * (size_t)block);
        int *seen = malloc(sizeof(int) * (size_t)(K > 0 ? K : 1));
        if (!scratch || !seen) {
            #pragma omp atomic write
            failed = 1;
        }
        int listed = -1, n = 0;  /* the row whose visible keys `seen` holds, and how many */
        #pragma omp for schedule(static)
        for (int task = 0; task < Q * G * blocks; task++) {
            if (!scratch || !seen) continue;
            int r = task / (G * blocks), g = task / blocks % G;
            int first = task % blocks * block;  /* within the group */
            int h0 = g * per + first, HB = per - first < block ? per - first : block;
            if (r != listed) {  /* the visible keys, in slot order (once per row and thread) */
                const unsigned char *m = mask + (size_t)r * K;
                n = 0;
                for (int j = 0; j < K; j++)
                    if (m[j]) seen[n++] = j;
                listed = r;
            }
            if (n == 0) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const float *qs[3];
            float *o[3], *p[3];
            for (int h = 0; h < HB; h++) {
                qs[h] = q + (h0 + h) * qh + r * qr;
                o[h] = out + ((size_t)r * H + h0 + h) * D;
                p[h] = scratch + (size_t)h * K;
            }
            const void *kg = (const char *)k + (size_t)g * kh * size,
                       *vg = (const char *)v + (size_t)g * vh * size;
            switch (kind * 4 + HB) {  /* each a copy of `heads` for its constants */
                HEADS(F32) HEADS(F16) HEADS(BF16)
            }
        }
        free(scratch);
        free(seen);
    }
    return failed ? -1 : 0;
}
