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
 * AVX2 and FMA. With rowamx.c's `rowamx_scores` and `rowamx_values` handed over
 * (rowattention_tiles: an AMX CPU), a bf16 cache's attention runs on AMX tiles: the scores
 * first, all rows and heads against all keys, each from its key and query alone; then each
 * row's softmax as above, its weights split in two bf16 parts and its visible values
 * weighed 32 keys a block in slot order, each row from its own weights and keys alone. */
#include <math.h>
#include <stdlib.h>
#include "rowkernels.h"

#define VALUE_BLOCK 64  /* keys whose values (16 KB at 64 float32 dims) one pass keeps in L1 */

/* `lanes` of two vectors at once, the same additions in the same pairs (the halves, then
   lanes 0 + 2 and 1 + 3, then those two): lanes(a) and lanes(b) in elements 0 and 1 */
static inline __m128 lanes2(__m256 a, __m256 b) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 y = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 z = _mm_add_ps(_mm_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm_hadd_ps(z, z);
}

/* The scores of HB heads' queries (a group's, which share keys) against NK keys at once
   (elements at[0..NK) of b), into p[h][i..i + NK): each key loaded once for all heads,
   NK * HB chains in flight. Every score is summed one way, whichever call computes it:
   eight FMA lanes over d in order, the lanes added pairwise, then the d % 8 tail
   (-ffp-contract=off keeps the tail's products unfused). */
static inline __attribute__((always_inline)) void dots(
        const float *const *qs, const void *b, const size_t *at, int D, int HB, int NK,
        float *const *p, int i, int kind) {
    __m256 c[4][3];  /* [key][head] */
    for (int j = 0; j < NK; j++)
        for (int h = 0; h < HB; h++) c[j][h] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 key[4];
        for (int j = 0; j < NK; j++) key[j] = load8(b, at[j] + d, kind);
        for (int h = 0; h < HB; h++) {
            __m256 u = _mm256_loadu_ps(qs[h] + d);
            for (int j = 0; j < NK; j++) c[j][h] = _mm256_fmadd_ps(u, key[j], c[j][h]);
        }
    }
    for (int h = 0; h < HB; h++) {
        int j = 0;
        if (d == D)  /* a head size of whole lanes (the usual): scores two at a time */
            for (; j + 2 <= NK; j += 2)
                _mm_storel_pi((__m64 *)(p[h] + i + j), lanes2(c[j][h], c[j + 1][h]));
        for (; j < NK; j++) {
            float s = lanes(c[j][h]);
            for (int t = d; t < D; t++) s += qs[h][t] * load1(b, at[j] + t, kind);
            p[h][i + j] = s;
        }
    }
}

/* The values weighted by HB heads' probabilities, keys i0..i1 - 1 of the row's visible
   ones, dims d0.. in chunks of 8 * C: each value row loaded once for all heads; every
   element accumulates p[i] * v[i] over i in order, carried between key blocks in o (exact
   float32 partial sums: `first`, start from zero; `last`, divide by the sum) */
static inline __attribute__((always_inline)) int weigh(
        const void *vg, long vj, const int *seen, int i0, int i1, float *const *p,
        const float *sums, float *const *o, int d0, int D, int HB, int C, int first,
        int last, int kind) {
    int d = d0;
    for (; d + 8 * C <= D; d += 8 * C) {
        __m256 acc[4][4];
        for (int h = 0; h < HB; h++)
            for (int c = 0; c < C; c++)
                acc[h][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o[h] + d + 8 * c);
        for (int i = i0; i < i1; i++) {
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
                _mm256_storeu_ps(o[h] + d + 8 * c,
                                 last ? _mm256_div_ps(acc[h][c], sum) : acc[h][c]);
        }
    }
    return d;
}

/* One head's n scores in place: scaled, then their weights exp(score - max), eight at a
   time by `exp8` (the last few padded with the max, exp(0) = 1, and left out of the sum);
   returns the weights' sum over eight lanes in slot order */
static inline float weights(float *ph, int n, float scale) {
    __m256 factor = _mm256_set1_ps(scale), most = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(ph + i), factor);
        _mm256_storeu_ps(ph + i, x);
        most = _mm256_max_ps(most, x);
    }
    float top = -INFINITY, eight[8];
    _mm256_storeu_ps(eight, most);
    for (int t = 0; t < 8; t++)
        if (eight[t] > top) top = eight[t];
    for (; i < n; i++) {
        ph[i] *= scale;
        if (ph[i] > top) top = ph[i];
    }
    __m256 total = _mm256_setzero_ps(), high = _mm256_set1_ps(top);
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(ph + i), high));
        _mm256_storeu_ps(ph + i, e);
        total = _mm256_add_ps(total, e);
    }
    if (i < n) {
        float part[8];
        int m = n - i;
        for (int t = 0; t < 8; t++) part[t] = t < m ? ph[i + t] : top;
        _mm256_storeu_ps(part, exp8(_mm256_sub_ps(_mm256_loadu_ps(part), high)));
        for (int t = 0; t < 8; t++) {
            if (t < m) ph[i + t] = part[t];
            else part[t] = 0.0f;
        }
        total = _mm256_add_ps(total, _mm256_loadu_ps(part));
    }
    return lanes(total);
}

/* HB heads' outputs o from their scores p (HB rows, one per head, of the row's n visible
   keys' q . k, unscaled): softmax weights, then the values weighed, each head divided by
   its weights' sum */
static inline __attribute__((always_inline)) void attend_values(
        float *const *o, const void *vg, long vj, const int *seen, int n, float *const *p,
        int D, float scale, int HB, int kind) {
    float sums[4];
    for (int h = 0; h < HB; h++) sums[h] = weights(p[h], n, scale);
    /* 32 dims at a time for up to two heads, 24 for three: their accumulators in registers
       (the order each element sums in is the same for any width); the keys in blocks whose
       values stay in L1 while every block of dims passes over them, so a long context's
       values are read from memory once, not once a block of dims */
    int d = 0;
    for (int i0 = 0; i0 < n; i0 += VALUE_BLOCK) {
        int i1 = n - i0 < VALUE_BLOCK ? n : i0 + VALUE_BLOCK, first = i0 == 0, last = i1 == n;
        d = HB == 3 ? weigh(vg, vj, seen, i0, i1, p, sums, o, 0, D, HB, 3, first, last, kind)
                    : weigh(vg, vj, seen, i0, i1, p, sums, o, 0, D, HB, 4, first, last, kind);
        d = weigh(vg, vj, seen, i0, i1, p, sums, o, d, D, HB, 2, first, last, kind);
        d = weigh(vg, vj, seen, i0, i1, p, sums, o, d, D, HB, 1, first, last, kind);
    }
    for (; d < D; d++)  /* a head size not a multiple of 8 */
        for (int h = 0; h < HB; h++) {
            float a = 0.0f;
            for (int i = 0; i < n; i++) a += p[h][i] * load1(vg, (size_t)seen[i] * vj + d, kind);
            o[h][d] = a / sums[h];
        }
}

/* HB heads of kv group g (qs: their queries, o: their outputs) over one row's visible keys
   (seen[0..n)); p: HB rows of K scratch floats */
static inline __attribute__((always_inline)) void heads(
        const float *const *qs, float *const *o, const void *kg, long kj, const void *vg,
        long vj, const int *seen, int n, float *const *p, int D, float scale, int HB,
        int kind) {
    /* keys four at a time for up to two heads, three for three (the accumulators and keys
       fit AVX2's sixteen registers); the last few one at a time */
    const int NK = HB == 3 ? 3 : 4;
    int i = 0;
    for (; i + NK <= n; i += NK) {
        size_t at[4];
        for (int j = 0; j < NK; j++) at[j] = (size_t)seen[i + j] * kj;
        dots(qs, kg, at, D, HB, NK, p, i, kind);
    }
    for (; i < n; i++) {
        size_t at = (size_t)seen[i] * kj;
        dots(qs, kg, &at, D, HB, 1, p, i, kind);
    }
    attend_values(o, vg, vj, seen, n, p, D, scale, HB, kind);
}

/* x rounded to bfloat16 as torch rounds (to nearest even; x finite), its 16 bits */
static inline uint16_t bf16_of(float x) {
    union { float f; uint32_t u; } v = { x };
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* rowamx.c's `rowamx_scores` and `rowamx_values` where the process has them (rowamx.py
   hands them over once, before any bf16 attention runs: rowgemm.py), else NULL: a bf16
   cache's scores and values on AMX tiles. */
typedef void (*scores_fn)(const uint16_t *k, long kj, const uint16_t *qt, int n, int D,
                          float *s, long ss, int j0, int j1);
typedef void (*values_fn)(const uint16_t *v, long vj, const int *seen, int n,
                          const uint16_t *p, int np, int HB, int D, float *acc);
static scores_fn amx_scores = NULL;
static values_fn amx_values = NULL;

int rowattention_tiles(void *scores, void *values) {
    amx_scores = (scores_fn)scores;
    amx_values = (values_fn)values;
    return amx_scores != NULL;
}

/* `heads` with the scores computed already (`scored`: each head's scores of every key, in
   slot order, rowamx.c's on AMX tiles): the row's visible ones gathered, their softmax
   weights, then the values weighed on the tiles too, each weight as the sum of two bf16
   values (its bf16 rounding and the rounding of the rest: 16 bits of its 24, where torch's
   bf16 attention keeps 8) weighed apart and their sums added (into `pb`, 2 HB rows of n
   rounded up to 32, and `acc`, 2 HB x D floats), each head divided by its weights' float32
   sum. */
static void scored_heads(const float *const *scored, float *const *o, const void *vg,
                         long vj, const int *seen, int n, float *const *p, int D,
                         float scale, int HB, uint16_t *pb, float *acc) {
    for (int h = 0; h < HB; h++)
        for (int i = 0; i < n; i++) p[h][i] = scored[h][seen[i]];
    float sums[4];
    for (int h = 0; h < HB; h++) sums[h] = weights(p[h], n, scale);
    int np = (n + 31) / 32 * 32;
    for (int h = 0; h < HB; h++) {
        uint16_t *high = pb + (size_t)h * np, *low = pb + (size_t)(HB + h) * np;
        for (int i = 0; i < n; i++) {
            high[i] = bf16_of(p[h][i]);
            union { uint32_t u; float f; } top = { (uint32_t)high[i] << 16 };
            low[i] = bf16_of(p[h][i] - top.f);  /* the rest, exact: the bits below bf16's */
        }
        for (int i = n; i < np; i++) high[i] = low[i] = 0;
    }
    amx_values((const uint16_t *)vg, vj, seen, n, pb, np, 2 * HB, D, acc);
    for (int h = 0; h < HB; h++)
        for (int d = 0; d < D; d++)
            o[h][d] = (acc[(size_t)h * D + d] + acc[(size_t)(HB + h) * D + d]) / sums[h];
}

#define KEYS_PER_TASK 128  /* a scoring task's keys (8 tiles) */
#define MAX_TILED_DIM 256  /* the largest head size scored on tiles */

/* The scores of every query column of every kv group against keys 0..K-1 on AMX tiles,
   into s (G, per * Q, K), column h * Q + r for head h of the group and row r; the queries
   rounded to bf16 (exact for a bf16 model's, which hold bf16 values). Inside the caller's
   parallel region: the tasks are shared, and end in a barrier. */
static void score_all(const float *q, long qh, long qr, const void *k, long kh, long kj,
                      float *s, int Q, int H, int G, int K, int D, uint16_t *qt) {
    int per = H / G, columns = per * Q, passes = (columns + 15) / 16;
    int chunks = (K + KEYS_PER_TASK - 1) / KEYS_PER_TASK;
    int tasks = G * passes * chunks;
    int packed = -1;  /* the (group, pass) whose queries `qt` holds (once per thread) */
    #pragma omp for schedule(static)
    for (int task = 0; task < tasks; task++) {
        int g = task / (passes * chunks), pass = task / chunks % passes, chunk = task % chunks;
        int c0 = pass * 16, n = columns - c0 < 16 ? columns - c0 : 16;
        for (int c = 0; c < n && packed != task / chunks; c++) {
            /* column c0 + c: head (c0 + c) / Q, row (c0 + c) % Q */
            int head = g * per + (c0 + c) / Q, row = (c0 + c) % Q;
            const float *x = q + (size_t)head * qh + (size_t)row * qr;
            for (int d = 0; d < D; d++)
                qt[(size_t)(d / 32) * 32 * n + (size_t)(d % 32 / 2) * 2 * n + 2 * c + d % 2] =
                    bf16_of(x[d]);
        }
        packed = task / chunks;
        int j0 = chunk * KEYS_PER_TASK, j1 = j0 + KEYS_PER_TASK < K ? j0 + KEYS_PER_TASK : K;
        amx_scores((const uint16_t *)k + (size_t)g * kh, kj, qt, n, D,
                   s + ((size_t)g * columns + c0) * K, K, j0, j1);
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
    /* bf16 keys with AMX tiles here: every score first, on the tiles (score_all) */
    int tiled = kind == BF16 && amx_scores && amx_values && D % 32 == 0 &&
                D <= MAX_TILED_DIM && K > 0;
    float *scored = tiled ? malloc(sizeof(float) * (size_t)G * K * per * Q) : NULL;
    if (tiled && !scored) return -1;  /* (never the other path: its scores round otherwise) */
    #pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(K > 0 ? K : 1) * (size_t)block);
        int *seen = malloc(sizeof(int) * (size_t)(K > 0 ? K : 1));
        uint16_t qt[MAX_TILED_DIM * 16];  /* a scoring task's queries, as tile rows */
        float acc[6 * MAX_TILED_DIM] __attribute__((aligned(64)));  /* a row's heads' sums */
        uint16_t *pb = scored ? malloc(sizeof(uint16_t) * 6 * ((size_t)K + 32)) : NULL;
        if (!scratch || !seen || (scored && !pb)) {
            #pragma omp atomic write
            failed = 1;
        }
        if (scored)  /* every thread: its tasks end in a barrier */
            score_all(q, qh, qr, k, kh, kj, scored, Q, H, G, K, D, qt);
        int listed = -1, n = 0;  /* the row whose visible keys `seen` holds, and how many */
        #pragma omp for schedule(static)
        for (int task = 0; task < Q * G * blocks; task++) {
            if (!scratch || !seen || (scored && !pb)) continue;
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
            if (scored) {  /* bf16 (the barrier after score_all: every score is there) */
                const float *sc[3];  /* each head's scores (its column: head, then row) */
                for (int h = 0; h < HB; h++)
                    sc[h] = scored + ((size_t)g * per * Q + (size_t)(first + h) * Q + r) * K;
                scored_heads(sc, o, vg, vj, seen, n, p, D, scale, HB, pb, acc);
                continue;
            }
            switch (kind * 4 + HB) {  /* each a copy of `heads` for its constants */
                HEADS(F32) HEADS(F16) HEADS(BF16)
            }
        }
        free(scratch);
        free(seen);
        free(pb);
    }
    free(scored);
    return failed ? -1 : 0;
}
