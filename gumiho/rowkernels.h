/* What rowgemm.c and rowattention.c share: the one order in which eight FMA lanes are
 * added (pairwise), part of what makes every result independent of what is computed with
 * it. */
#ifndef GUMIHO_ROWKERNELS_H
#define GUMIHO_ROWKERNELS_H
#include <immintrin.h>
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
