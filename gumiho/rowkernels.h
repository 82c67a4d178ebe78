/* What rowgemm.c, rowattention.c and rowlayer.c share: the one order in which eight FMA
 * lanes are added (pairwise), part of what makes every result independent of what is
 * computed with it, the loads that widen 16-bit operands (weights, cached keys and values)
 * to float32 exactly as they are read, and an exp of eight values each on its own. */
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

/* exp of eight values (<= 0 in rowattention.c: score - max; rowlayer.c's SiLU keeps them
   below 88), each computed on its own, so a value gets the same bits wherever it sits:
   x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by a degree-7 polynomial (Cephes' expf
   coefficients, ~1 ulp), times 2^n. Below -87.3 (exp < 1.2e-38, against a top score's 1)
   it returns exp(-87.3). */
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

#endif
