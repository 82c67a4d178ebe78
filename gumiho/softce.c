/* The training losses' soft cross-entropy on a CPU, a row at a time (softce.py):
 *
 *     loss[m] = -sum_v p[v] log_softmax(z[m])[v] = (sum_v p) (max + log sum_v e) - sum_v p z
 *     grad[m] = e (sum_v p) / (sum_v e) - p,      e = exp(z[m] - max),
 *
 * p being row index[m] of the distributions (row m without an index). A row's logits (16-
 * or 32-bit), its distribution and its exps (float32 scratch) stay in the core's cache
 * over the three passes: the max with sum p and sum p z, then the exps and their sum, then
 * the gradient, rounded once to the logits' storage. Each row is summed on its own, so a
 * row's loss and gradient do not depend on the rows beside it or on the thread count.
 * Threads split the rows; they are OpenMP's (torch's own runtime, one pool). AVX2 and FMA.
 * The exp is rowkernels.h's exp8 (~1 ulp; exp(-87.3) below -87.3, where torch's is 0). */
#include <math.h>
#include <stdlib.h>

#include "rowkernels.h"

/* eight float32 values stored at element i as `kind`, rounded to nearest (ties to even) */
static inline __attribute__((always_inline)) void store8(void *g, size_t i, int kind,
                                                         __m256 v) {
    if (kind == F32) {
        _mm256_storeu_ps((float *)g + i, v);
        return;
    }
    __m128i h;
    if (kind == F16) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(
            odd, _mm256_set1_epi32(0x7FFF))), 16);
        h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)g + i), h);
}

static inline void store1(void *g, size_t i, int kind, float v) {
    if (kind == F32) {
        ((float *)g)[i] = v;
    } else if (kind == F16) {
        ((uint16_t *)g)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        union { float f; uint32_t u; } b = { v };
        ((uint16_t *)g)[i] = (uint16_t)((b.u + 0x7FFF + ((b.u >> 16) & 1)) >> 16);
    }
}

static inline float most(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* row `at` (its first element) of z: its loss; its gradient into g at the same place when
   g is given, e (V floats) holding its exps meanwhile */
static float row(const void *z, size_t at, int kind, const float *p, void *g, float *e,
                 int V) {
    __m256 top8 = _mm256_set1_ps(-INFINITY), mass8 = _mm256_setzero_ps(),
           dot8 = _mm256_setzero_ps();
    int v = 0;
    for (; v + 8 <= V; v += 8) {
        __m256 x = load8(z, at + v, kind), q = _mm256_loadu_ps(p + v);
        top8 = _mm256_max_ps(x, top8);
        mass8 = _mm256_add_ps(mass8, q);
        dot8 = _mm256_fmadd_ps(q, x, dot8);
    }
    float top = most(top8), mass = lanes(mass8), dot = lanes(dot8);
    for (int t = v; t < V; t++) {
        float x = load1(z, at + t, kind);
        top = x > top ? x : top;
        mass += p[t];
        dot += p[t] * x;
    }
    __m256 shift = _mm256_set1_ps(top), sum8 = _mm256_setzero_ps();
    for (v = 0; v + 8 <= V; v += 8) {
        __m256 x = exp8(_mm256_sub_ps(load8(z, at + v, kind), shift));
        sum8 = _mm256_add_ps(sum8, x);
        if (g) _mm256_storeu_ps(e + v, x);
    }
    float norm = lanes(sum8);
    for (int t = v; t < V; t++) {
        float x = expf(load1(z, at + t, kind) - top);
        norm += x;
        if (g) e[t] = x;
    }
    if (g) {
        __m256 a = _mm256_set1_ps(mass / norm);
        for (v = 0; v + 8 <= V; v += 8)
            store8(g, at + v, kind, _mm256_fmsub_ps(_mm256_loadu_ps(e + v), a,
                                                    _mm256_loadu_ps(p + v)));
        for (int t = v; t < V; t++) store1(g, at + t, kind, e[t] * (mass / norm) - p[t]);
    }
    return mass * (top + logf(norm)) - dot;
}

/* loss[m] for rows m < M of z (M x V, stored as `kind`), with distribution rows p[index[m]]
   (p[m] for no index); grad (M x V, as z) when given. Returns 0, or 1 where a thread's
   scratch could not be allocated (nothing is then complete). */
int softce(const void *z, int kind, const float *p, const int64_t *index, void *grad,
           float *loss, int M, int V) {
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel reduction(|| : failed)
#endif
    {
        int lo, hi;
        share(M, 1, &lo, &hi);
        float *e = grad && hi > lo ? malloc(sizeof(float) * (size_t)V) : NULL;
        if (grad && hi > lo && !e) {
            failed = 1;
        } else {
            for (int m = lo; m < hi; m++) {
                const float *q = p + (size_t)(index ? index[m] : m) * V;
                loss[m] = row(z, (size_t)m * V, kind, q, grad, e, V);
            }
        }
        free(e);
    }
    return failed;
}
