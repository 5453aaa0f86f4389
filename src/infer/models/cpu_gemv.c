/* Matrix-vector products for CPU decoding: y[m, n] = x[m, k] @ w[n, k]^T (+ bias), m small.
 *
 * A decode step multiplies one row (a verification pass a few) by every weight matrix, so its
 * speed is how fast the weights stream from memory. These loops read each weight row once, with
 * AVX-512 (BF16 dot-product instructions for bfloat16), and keep it in L1 while every input row
 * uses it. Every output element is one dot product in one fixed order, whatever m is: a 1-token
 * decode step and a (K+1)-token verification pass compute bit-identical rows.
 * Built by infer/models/cpu_gemv.py with the system C compiler (-O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float dot_bf16(const uint16_t *w, const uint16_t *x, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {  /* two accumulators: two dot-product chains in flight */
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(x + i + 32));
    }
    for (; i + 32 <= k; i += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    if (i < k) {  /* the last k % 32 elements: masked loads, the rest of the lanes zero */
        __mmask32 tail = (__mmask32)((1ull << (k - i)) - 1);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + i),
                              (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static inline float dot_f32(const float *w, const float *x, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    }
    for (; i + 16 <= k; i += 16)
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    if (i < k) {
        __mmask16 tail = (__mmask16)((1u << (k - i)) - 1);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + i), _mm512_maskz_loadu_ps(tail, x + i), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch rounds */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row-major contiguous w [n, k], x [m, k], y [m, n]; bias [n] or NULL. */
void gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
               int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *row = w + j * k;
        float b = bias ? bf16_to_f32(bias[j]) : 0.0f;
        for (int64_t r = 0; r < m; r++) y[r * n + j] = f32_to_bf16(dot_bf16(row, x + r * k, k) + b);
    }
}

void gemv_f32(const float *w, const float *x, const float *bias, float *y,
              int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        const float *row = w + j * k;
        float b = bias ? bias[j] : 0.0f;
        for (int64_t r = 0; r < m; r++) y[r * n + j] = dot_f32(row, x + r * k, k) + b;
    }
}
