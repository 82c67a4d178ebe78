/* A Llama decoder's layers over a few rows in one call: what fused.py's `LlamaLayers` does
 * between the products and the attention (RMSNorm, the rotary turn, the KV cache's writes,
 * SiLU and the gate, the residual additions), with the products and the attention left to
 * the row kernels themselves (rowamx.c's bf16 products on AMX tiles, or rowgemm.c's float32
 * ones, and rowattention.c), called through the pointers rowlayer.py hands over. A SmolLM2
 * step on a 2-core CPU spent about half its time on the ~1,000 torch calls around its 120
 * products; here they are a few microseconds of plain loops.
 *
 * The arithmetic is transformers' LlamaDecoderLayer's, operation for operation, each result
 * rounded to the activations' dtype where torch's would be (`rnd8`: bfloat16 to nearest
 * even, float32 as it is), with two differences in order only: RMSNorm's sum of squares
 * runs over eight FMA lanes added pairwise (torch's own reduction adds in another order)
 * and SiLU's exp is `exp8` (torch's is SLEEF's); each differs from torch's by about an ulp
 * before rounding. Every row is computed from its own values alone, so a verify's rows get
 * bit for bit what the same tokens get in one-row steps, as with the kernels it calls.
 *
 * Activations are float32 (F32) or bfloat16 (BF16) values; hidden, head and intermediate
 * sizes multiples of 16 (rowlayer.py checks). The loops run on one thread for a few rows
 * (the products and the attention use the threads) and split by rows from PARALLEL_ROWS
 * on; a row's arithmetic is the same on any thread. Needs AVX2, FMA and F16C
 * (rowkernels.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rowkernels.h"

#define PARALLEL_ROWS 8  /* from this many rows the loops between products take both threads */

typedef void (*amx_fn)(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y,
                       int M, int K, int N);
typedef void (*gemm_fn)(const float *x, const void *w, const float *b, float *y, int M,
                        int K, int N, int kind);
typedef int (*attend_fn)(const float *q, long qh, long qr, const void *k, long kh, long kj,
                         const void *v, long vh, long vj, const unsigned char *mask,
                         float *out, int Q, int H, int G, int K, int D, float scale,
                         int kind);

/* a product's prepared weight: rowamx.c's tiles (BF16 activations) or a rowgemm.c weight
   stored as `kind` (F32 activations) */
struct product {
    const void *w;
    const float *b;
    int kind, pad;
};

struct layer {
    struct product qkv, o, gate_up, down;  /* q, k, v joined; gate, up joined */
    const void *norm1, *norm2;  /* RMSNorm weights, as the activations; norm1 NULL: none */
};

struct stack {
    int layers, hidden, heads, kv_heads, dim, inter, kind;  /* kind: F32 or BF16 */
    int capacity, table;  /* the cache's slots; the rotary table's positions */
    float eps, scale;
    const void *cos, *sin;   /* (table, dim) as the activations; sin's first half negated */
    void *cache;             /* (layers, 2, kv_heads, capacity, dim) as the activations */
    const void *final_norm;  /* the decoder's last norm, or NULL */
    void *amx, *gemm, *attend;
    const struct layer *layer;
};

/* eight float32 values rounded to bfloat16 as torch rounds (to nearest even, a NaN to the
   quiet 0x7fc0), in the upper halves of 32-bit lanes */
#define INLINE static inline __attribute__((always_inline))

INLINE __m256i bf16_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                                nan));
}

/* v as the activations hold it: rounded to bfloat16 (and widened back), or as it is */
INLINE __m256 rnd8(__m256 v, int kind) {
    return kind == BF16 ? _mm256_castsi256_ps(bf16_bits(v)) : v;
}

INLINE void store8(void *p, size_t i, __m256 v, int kind) {
    if (kind == F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m256i r = _mm256_srli_epi32(bf16_bits(v), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* out = RMSNorm(x) * w for `rows` rows of n: x / sqrt(mean(x^2) + eps), rounded to the
   activations, then times the weight (transformers' LlamaRMSNorm) */
INLINE void norm(const void *x, const void *w, void *out, int rows, int n, float eps,
                 int kind) {
    #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        size_t row = (size_t)r * n;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            __m256 v = load8(x, row + i, kind);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float scale = 1.0f / sqrtf(lanes(acc) / (float)n + eps);
        __m256 s = _mm256_set1_ps(scale);
        for (int i = 0; i < n; i += 8) {
            __m256 v = rnd8(_mm256_mul_ps(load8(x, row + i, kind), s), kind);
            store8(out, row + i, _mm256_mul_ps(load8(w, i, kind), v), kind);
        }
    }
}

/* h += d for `rows` rows of n, each sum rounded to the activations */
INLINE void add(void *h, const void *d, int rows, int n, int kind) {
    #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        for (size_t i = (size_t)r * n; i < (size_t)(r + 1) * n; i += 8)
            store8(h, i, _mm256_add_ps(load8(h, i, kind), load8(d, i, kind)), kind);
}

/* out = SiLU(gate) * up per row of gu (gate, up side by side, n each): SiLU(g) =
   g / (1 + exp(-g)), rounded, then the product, rounded */
INLINE void gate(const void *gu, void *out, int rows, int n, int kind) {
    #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        size_t in = (size_t)r * 2 * n, at = (size_t)r * n;
        for (int i = 0; i < n; i += 8) {
            __m256 g = load8(gu, in + i, kind);
            /* exp(-g) for g >= -88 (below it, SiLU is -0.0 to float32's precision) */
            __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                          _mm256_set1_ps(88.0f)));
            __m256 s = rnd8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), kind);
            store8(out, at + i, _mm256_mul_ps(s, load8(gu, in + n + i, kind)), kind);
        }
    }
}

/* The rotary turn of one head's d values at `x` (as the activations), into `out` (float32
   or the activations, `okind`): x cos + (x2, x1) sin, sin's first half negated, each
   product and the sum rounded to the activations */
INLINE void turn(const void *x, size_t at, const void *cos, const void *sin,
                        size_t row, int d, void *out, size_t to, int kind, int okind) {
    int half = d / 2;
    for (int i = 0; i < half; i += 8) {
        __m256 a = load8(x, at + i, kind), b = load8(x, at + half + i, kind);
        __m256 lo = _mm256_add_ps(rnd8(_mm256_mul_ps(a, load8(cos, row + i, kind)), kind),
                                  rnd8(_mm256_mul_ps(b, load8(sin, row + i, kind)), kind));
        __m256 hi = _mm256_add_ps(
            rnd8(_mm256_mul_ps(b, load8(cos, row + half + i, kind)), kind),
            rnd8(_mm256_mul_ps(a, load8(sin, row + half + i, kind)), kind));
        store8(out, to + i, rnd8(lo, kind), okind);
        store8(out, to + half + i, rnd8(hi, kind), okind);
    }
}

INLINE void copy_row(const void *x, size_t at, void *out, size_t to, int d, int kind) {
    size_t size = kind == F32 ? 4 : 2;
    memcpy((char *)out + to * size, (const char *)x + at * size, (size_t)d * size);
}

INLINE void product(const struct stack *s, const struct product *p, const void *x, void *y,
                    int rows, int k, int n, int kind) {
    if (kind == BF16)
        ((amx_fn)s->amx)(x, p->w, p->b, y, rows, k, n);
    else
        ((gemm_fn)s->gemm)(x, p->w, p->b, y, rows, k, n, p->kind);
}

/* The layers on h (rows x hidden, as the activations, updated in place; with the final
   norm where the stack has one) for tokens at `positions`, their keys and values written
   to cache slots start.. start + rows - 1 (start read from `first`, the cache's position
   tensor: a recorded step reads it when it runs), each row attending over slots
   0..visible - 1 where mask (rows x visible, nonzero = seen) says. Returns 0; -1 where a
   row sees no key; -2 for a position past the rotary table or slots past the cache; -3 out
   of memory. */
INLINE int layers(const struct stack *s, void *h, int rows, const int64_t *positions,
                  int64_t start, int visible, const unsigned char *mask, int kind) {
    int H = s->hidden, D = s->dim, NQ = s->heads, G = s->kv_heads, I = s->inter;
    int width = (NQ + 2 * G) * D;
    size_t size = kind == F32 ? 4 : 2;
    if (start < 0 || start + rows > s->capacity || visible > s->capacity) return -2;
    for (int r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= s->table) return -2;
    char *x = malloc((size_t)rows * H * size), *qkv = malloc((size_t)rows * width * size),
         *o = malloc((size_t)rows * H * size), *gu = malloc((size_t)rows * 2 * I * size),
         *m = malloc((size_t)rows * I * size);
    /* the attention's rows: float32, and rounded to bf16 for the o product (BF16 only) */
    float *q = malloc(sizeof(float) * rows * NQ * D), *att = malloc(sizeof(float) * rows * NQ * D);
    char *heads = kind == BF16 ? malloc((size_t)rows * NQ * D * 2) : NULL;
    int status = x && qkv && o && gu && m && q && att && (heads || kind != BF16) ? 0 : -3;
    size_t plane = (size_t)G * s->capacity * D;  /* one layer's keys (or values) */
    for (int l = 0; l < s->layers && status == 0; l++) {
        const struct layer *L = &s->layer[l];
        char *keys = (char *)s->cache + (size_t)l * 2 * plane * size;
        char *values = keys + plane * size;
        if (L->norm1)
            norm(h, L->norm1, x, rows, H, s->eps, kind);
        else  /* no input norm (a drafter's first layer) */
            memcpy(x, h, (size_t)rows * H * size);
        product(s, &L->qkv, x, qkv, rows, H, width, kind);
        #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
        for (int r = 0; r < rows; r++) {
            size_t row = (size_t)positions[r] * D, in = (size_t)r * width;
            for (int j = 0; j < NQ; j++)  /* queries: float32 for the attention */
                turn(qkv, in + (size_t)j * D, s->cos, s->sin, row, D, q,
                     ((size_t)r * NQ + j) * D, kind, F32);
            for (int g = 0; g < G; g++) {
                size_t slot = ((size_t)g * s->capacity + (size_t)start + r) * D;
                turn(qkv, in + (size_t)(NQ + g) * D, s->cos, s->sin, row, D, keys, slot,
                     kind, kind);
                copy_row(qkv, in + (size_t)(NQ + G + g) * D, values, slot, D, kind);
            }
        }
        if (((attend_fn)s->attend)(q, D, (long)NQ * D, keys, (long)s->capacity * D, D, values,
                                   (long)s->capacity * D, D, mask, att, rows, NQ, G, visible,
                                   D, s->scale, kind)) {
            status = -1;
            break;
        }
        const void *attended = att;
        if (kind == BF16) {  /* the attention's float32 rows rounded once, as torch does */
            for (size_t i = 0; i < (size_t)rows * NQ * D; i += 8)
                store8(heads, i, _mm256_loadu_ps(att + i), BF16);
            attended = heads;
        }
        product(s, &L->o, attended, o, rows, NQ * D, H, kind);
        add(h, o, rows, H, kind);
        norm(h, L->norm2, x, rows, H, s->eps, kind);
        product(s, &L->gate_up, x, gu, rows, H, 2 * I, kind);
        gate(gu, m, rows, I, kind);
        product(s, &L->down, m, o, rows, I, H, kind);
        add(h, o, rows, H, kind);
    }
    if (status == 0 && s->final_norm) {
        norm(h, s->final_norm, x, rows, H, s->eps, kind);
        memcpy(h, x, (size_t)rows * H * size);
    }
    free(x), free(qkv), free(o), free(gu), free(m), free(heads), free(q), free(att);
    return status;
}

int rowlayer(const struct stack *s, void *h, int rows, const int64_t *positions,
             const int64_t *first, int visible, const unsigned char *mask) {
    /* one copy of the loops per dtype, its branches on the dtype folded away */
    if (s->kind == BF16) return layers(s, h, rows, positions, *first, visible, mask, BF16);
    return layers(s, h, rows, positions, *first, visible, mask, F32);
}
