/* Row-invariant float32 attention: out[r, h] = softmax(q[h, r] . k[g, j] * scale over the
 * keys j that mask[r, j] lets row r see) . v[g, j], g = h / (heads per KV head).
 *
 * A row is computed from its own query and visible keys alone, in one fixed order: scores
 * as dot products over eight FMA lanes added pairwise, their maximum, exp(score - max) and
 * their running sum in slot order, the values weighted and accumulated in slot order (per
 * dimension), divided by the sum at the end. So a tree node's row, whose visible keys are
 * the committed prefix and its ancestors in slot (= depth) order, gets bit for bit what
 * the same token gets as a one-token decode step over the same keys: with row-invariant
 * products (rowgemm.c) a float32 verify gives exactly sequential decoding's hidden states.
 * Threads take rows and heads (OpenMP, torch's runtime where rowgemm.py finds it). Needs
 * AVX2 and FMA. */
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

/* `dot` for four keys at once: four accumulation chains in flight instead of one (a lone
   dot waits on each FMA's latency), every one summed exactly as `dot` sums it */
static inline void dot4(const float *a, const float *b0, const float *b1, const float *b2,
                        const float *b3, int D, float *out) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 u = _mm256_loadu_ps(a + d);
        c0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(b0 + d), c0);
        c1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(b1 + d), c1);
        c2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(b2 + d), c2);
        c3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(b3 + d), c3);
    }
    float s0 = lanes(c0), s1 = lanes(c1), s2 = lanes(c2), s3 = lanes(c3);
    for (; d < D; d++) {
        s0 += a[d] * b0[d];
        s1 += a[d] * b1[d];
        s2 += a[d] * b2[d];
        s3 += a[d] * b3[d];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
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
        int listed = -1, n = 0;  /* the row whose visible keys `seen` holds, and how many */
        #pragma omp for schedule(static)
        for (int task = 0; task < Q * H; task++) {
            if (!p || !seen) continue;
            int r = task / H, h = task % H, g = h / per;
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
            const float *qv = q + h * qh + r * qr, *kg = k + g * kh;
            int i = 0;
            for (; i + 4 <= n; i += 4)  /* four independent dots at a time, each as `dot` */
                dot4(qv, kg + seen[i] * kj, kg + seen[i + 1] * kj, kg + seen[i + 2] * kj,
                     kg + seen[i + 3] * kj, D, p + i);
            for (; i < n; i++) p[i] = dot(qv, kg + seen[i] * kj, D);
            float top = -INFINITY, sum = 0.0f;
            for (i = 0; i < n; i++) {
                p[i] *= scale;
                if (p[i] > top) top = p[i];
            }
            for (i = 0; i < n; i++) {
                p[i] = expf(p[i] - top);
                sum += p[i];
            }
            float *o = out + ((size_t)r * H + h) * D;
            int d = 0;
            for (; d + 64 <= D; d += 64) {  /* 64 dims at a time in eight registers */
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0,
                       a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (i = 0; i < n; i++) {
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
                for (i = 0; i < n; i++) a += p[i] * v[g * vh + seen[i] * vj + d];
                o[d] = a / sum;
            }
        }
        free(p);
        free(seen);
    }
    return failed ? -1 : 0;
}
