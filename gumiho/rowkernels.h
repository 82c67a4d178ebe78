/* What rowgemm.c and rowattention.c share: the one order in which eight FMA lanes are
 * added (pairwise), part of what makes every result independent of what is computed with
 * it, and the loads that widen 16-bit operands (weights, cached keys and values) to
 * float32 exactly as they are read. */
#ifndef GUMIHO_ROWKERNELS_H
#define GUMIHO_ROWKERNELS_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, F16 = 1, BF16 = 2 };  /* an operand's storage (rowgemm.py: KINDS) */

/* eight values from element i, widened to float32 (exactly: every 16-bit value is one) */
static inline __attribute__((always_inline)) __m256 load8(const void *w, size_t i, int kind) {
    if (kind == F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (kind == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) float load1(const void *w, size_t i, int kind) {
    if (kind == F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    if (kind == F16) return _cvtsh_ss(h);
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

/* this thread's share [lo, hi) of n items, in whole units of `unit` (1 thread without
   OpenMP) */
static inline void share(int n, int unit, int *lo, int *hi) {
#ifdef _OPENMP
    int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    int t = 0, T = 1;
#endif
    int per = (n + T - 1) / T;
    per = (per + unit - 1) / unit * unit;
    *lo = t * per;
    *hi = *lo + per < n ? *lo + per : n;
}

static inline float lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
