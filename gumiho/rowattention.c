/* Row-invariant float32 attention: out[r, h] = softmax(q[h, r] . k[g, j] * scale over the
 * keys j that mask[r, j] lets row r see) . v[g, j], g = h / (heads per KV head).
 *
 * A row is computed from its own query and visible keys alone, in one fixed order: scores
 * as dot products over eight FMA lanes added pairwise, their maximum, exp(score - max) and
 * their running sum in slot order, the values weighted and accumulated in slot order (per
 * dimension), divided by the sum at the end. So a tree node's row, whose visible keys are the committed prefix and
 * its ancestors in slot (= depth) order, gets bit for bit what the same token gets as a
 * one-token decode step over the same keys: with row-invariant products (rowgemm.c) a
 * float32 verify gives exactly sequential decoding's hidden states. Threads take rows and
 * heads (OpenMP, torch's runtime where rowgemm.py finds it). Needs AVX2 and FMA. */
#include <math.h>
#include <stdlib.h>
#include "rowkernels.h"

static inline float dot(const float *a, const float *b, int D) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float s = lanes(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* q: element (h, r, d) at q[h * qh + r * qr + d]; k, v: (g, j, d) at [g * kh + j * kj + d]
   (and vh, vj); mask: (r, j) at mask[r * K + j], nonzero = visible; out: (r, h, d)
   contiguous. Returns 0, or -1 where a row sees no key or memory ran out. */
int rowattention(const float *q, long qh, long qr, const float *k, long kh, long kj,
                 const float *v, long vh, long vj, const unsigned char *mask, float *out,
                 int Q, int H, int G, int K, int D, float scale) {
    int failed = 0, per = H / G;
    #pragma omp parallel
    {
        float *p = malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
        int *seen = malloc(sizeof(int) * (size_t)(K > 0 ? K : 1));
        if (!p || !seen) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int task = 0; task < Q * H; task++) {
            if (!p || !seen) continue;
            int r = task / H, h = task % H, g = h / per;
            const float *qv = q + h * qh + r * qr;
            const unsigned char *m = mask + (size_t)r * K;
            int n = 0;
            float top = -INFINITY;
            for (int j = 0; j < K; j++)  /* the visible keys' scores, in slot order */
                if (m[j]) {
                    seen[n] = j;
                    p[n] = dot(qv, k + g * kh + j * kj, D) * scale;
                    if (p[n] > top) top = p[n];
                    n++;
                }
            if (n == 0) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            float sum = 0.0f;
            for (int i = 0; i < n; i++) {
                p[i] = expf(p[i] - top);
                sum += p[i];
            }
            float *o = out + ((size_t)r * H + h) * D;
            int d = 0;
            for (; d + 64 <= D; d += 64) {  /* 64 dims at a time in eight registers */
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0,
                       a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int i = 0; i < n; i++) {
                    const float *vv = v + g * vh + seen[i] * vj + d;
                    __m256 w = _mm256_set1_ps(p[i]);
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 24), a3);
                    a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 32), a4);
                    a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 40), a5);
                    a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 48), a6);
                    a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 56), a7);
                }
                __m256 inv = _mm256_set1_ps(sum);
                _mm256_storeu_ps(o + d, _mm256_div_ps(a0, inv));
                _mm256_storeu_ps(o + d + 8, _mm256_div_ps(a1, inv));
                _mm256_storeu_ps(o + d + 16, _mm256_div_ps(a2, inv));
                _mm256_storeu_ps(o + d + 24, _mm256_div_ps(a3, inv));
                _mm256_storeu_ps(o + d + 32, _mm256_div_ps(a4, inv));
                _mm256_storeu_ps(o + d + 40, _mm256_div_ps(a5, inv));
                _mm256_storeu_ps(o + d + 48, _mm256_div_ps(a6, inv));
                _mm256_storeu_ps(o + d + 56, _mm256_div_ps(a7, inv));
            }
            for (; d < D; d++) {  /* a head size not a multiple of 64 */
                float a = 0.0f;
                for (int i = 0; i < n; i++) a += p[i] * v[g * vh + seen[i] * vj + d];
                o[d] = a / sum;
            }
        }
        free(p);
        free(seen);
    }
    return failed ? -1 : 0;
}
