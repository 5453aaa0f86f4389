/* Matrix-vector products for CPU decoding: y[m, n] = x[m, k] @ w[n, k]^T (+ bias), m small.
 *
 * A decode step multiplies one row (a verification pass a few) by every weight matrix, so its
 * speed is how fast the weights stream from memory. The loops take the weight in blocks of JB
 * rows and the input in blocks of up to RB rows: each 32-element weight chunk is loaded once and
 * meets every input row of the block in registers (JB x RB independent accumulators, so the
 * dot-product instructions never wait on one another and extra input rows cost little more than
 * their arithmetic). AVX-512 BF16 dot products for bfloat16, FMAs for float32.
 *
 * Every output element is the same instruction sequence whatever m is (its own accumulator over
 * the chunks in order, then one fixed reduction tree), so a 1-token decode step and a (K+1)-token
 * verification pass compute bit-identical rows. A last partial block of weight rows repeats its
 * final row and stores only the real outputs, so it too runs that sequence.
 * Built by infer/models/cpu_kernels.py with the system C compiler (-O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define JB 4 /* weight rows per block: one reduction of four accumulators */
#define RB 4 /* input rows per pass over a weight block */
/* Weight rows to fetch ahead of the ones in use: the hardware prefetcher alone left a 1-row product
 * at ~60% of the memory bandwidth on the project's Xeon, and a 4-row one at a third of it. Two
 * blocks ahead measured best (1, 3, 4 and 8 were slower); a prefetch never faults, so the
 * addresses past the end of w are harmless. */
#define AHEAD (2 * JB)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch rounds */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The four sums of a, b, c, d's lanes, in that order; each is the same tree of additions. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* One weight block (JB rows at w[0..3]) against R input rows; sums[r][jj] = dot(x_r, w_jj).
 * R is a compile-time constant at every call, so the accumulators stay in registers. */
#define BLOCK_BF16(R)                                                                              \
    static inline void block_bf16_##R(const uint16_t *const *w, const uint16_t *x, int64_t k,      \
                                      float sums[RB][JB]) {                                        \
        __m512 acc[R][JB];                                                                         \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < JB; j++) acc[r][j] = _mm512_setzero_ps();                          \
        int64_t i = 0;                                                                             \
        for (; i + 32 <= k; i += 32) {                                                             \
            __m512bh wv[JB];                                                                       \
            for (int j = 0; j < JB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + i);           \
            for (int j = 0; j < JB; j++) _mm_prefetch((const char *)(w[j] + AHEAD * k + i), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                          \
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);                         \
                for (int j = 0; j < JB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);   \
            }                                                                                      \
        }                                                                                          \
        if (i < k) { /* the last k % 32 elements: masked loads, the other lanes zero */            \
            __mmask32 tail = (__mmask32)((1ull << (k - i)) - 1);                                   \
            __m512bh wv[JB];                                                                       \
            for (int j = 0; j < JB; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w[j] + i); \
            for (int r = 0; r < R; r++) {                                                          \
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * k + i);             \
                for (int j = 0; j < JB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);   \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++) _mm_storeu_ps(sums[r], sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])); \
    }
BLOCK_BF16(1)
BLOCK_BF16(2)
BLOCK_BF16(3)
BLOCK_BF16(4)

#define BLOCK_F32(R)                                                                               \
    static inline void block_f32_##R(const float *const *w, const float *x, int64_t k,             \
                                     float sums[RB][JB]) {                                         \
        __m512 acc[R][JB];                                                                         \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < JB; j++) acc[r][j] = _mm512_setzero_ps();                          \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= k; i += 16) {                                                             \
            __m512 wv[JB];                                                                         \
            for (int j = 0; j < JB; j++) wv[j] = _mm512_loadu_ps(w[j] + i);                        \
            for (int j = 0; j < JB; j++) _mm_prefetch((const char *)(w[j] + AHEAD * k + i), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                          \
                __m512 xv = _mm512_loadu_ps(x + r * k + i);                                        \
                for (int j = 0; j < JB; j++) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);    \
            }                                                                                      \
        }                                                                                          \
        if (i < k) {                                                                               \
            __mmask16 tail = (__mmask16)((1u << (k - i)) - 1);                                     \
            __m512 wv[JB];                                                                         \
            for (int j = 0; j < JB; j++) wv[j] = _mm512_maskz_loadu_ps(tail, w[j] + i);            \
            for (int r = 0; r < R; r++) {                                                          \
                __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * k + i);                            \
                for (int j = 0; j < JB; j++) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);    \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++) _mm_storeu_ps(sums[r], sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])); \
    }
BLOCK_F32(1)
BLOCK_F32(2)
BLOCK_F32(3)
BLOCK_F32(4)

/* Row-major contiguous w [n, k], x [m, k], y [m, n]; bias [n] or NULL. */
void gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
               int64_t m, int64_t n, int64_t k, int threads) {
    int64_t blocks = (n + JB - 1) / JB;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t j0 = b * JB, valid = n - j0 < JB ? n - j0 : JB;
        const uint16_t *rows[JB];
        for (int j = 0; j < JB; j++) rows[j] = w + (j0 + (j < valid ? j : valid - 1)) * k;
        float sums[RB][JB];
        for (int64_t r0 = 0; r0 < m; r0 += RB) {
            int64_t rn = m - r0 < RB ? m - r0 : RB;
            const uint16_t *xr = x + r0 * k;
            switch (rn) {
            case 1: block_bf16_1(rows, xr, k, sums); break;
            case 2: block_bf16_2(rows, xr, k, sums); break;
            case 3: block_bf16_3(rows, xr, k, sums); break;
            default: block_bf16_4(rows, xr, k, sums); break;
            }
            for (int64_t r = 0; r < rn; r++)
                for (int64_t j = 0; j < valid; j++)
                    y[(r0 + r) * n + j0 + j] = f32_to_bf16(sums[r][j] + (bias ? bf16_to_f32(bias[j0 + j]) : 0.0f));
        }
    }
}

void gemv_f32(const float *w, const float *x, const float *bias, float *y,
              int64_t m, int64_t n, int64_t k, int threads) {
    int64_t blocks = (n + JB - 1) / JB;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t j0 = b * JB, valid = n - j0 < JB ? n - j0 : JB;
        const float *rows[JB];
        for (int j = 0; j < JB; j++) rows[j] = w + (j0 + (j < valid ? j : valid - 1)) * k;
        float sums[RB][JB];
        for (int64_t r0 = 0; r0 < m; r0 += RB) {
            int64_t rn = m - r0 < RB ? m - r0 : RB;
            const float *xr = x + r0 * k;
            switch (rn) {
            case 1: block_f32_1(rows, xr, k, sums); break;
            case 2: block_f32_2(rows, xr, k, sums); break;
            case 3: block_f32_3(rows, xr, k, sums); break;
            default: block_f32_4(rows, xr, k, sums); break;
            }
            for (int64_t r = 0; r < rn; r++)
                for (int64_t j = 0; j < valid; j++)
                    y[(r0 + r) * n + j0 + j] = sums[r][j] + (bias ? bias[j0 + j] : 0.0f);
        }
    }
}

/* The small operators between the matmuls of a decode step. Each is one call instead of the 3-9
 * tensor operators PyTorch runs for it (each of which costs microseconds of dispatch on a
 * 576-wide row), and each computes a row the same way whatever the number of rows. They round
 * where the reference (infer.models.layers) rounds: to the tensor's dtype after every operator.
 * The build disables FMA contraction so that a * b + c rounds twice, as the reference does. */

#ifndef INFER_NO_LIBMVEC
/* glibc's libmvec has a 16-lane expf; declaring it lets the omp simd loops below call it. */
#pragma omp declare simd notinbranch simdlen(16)
extern float expf(float);
#endif

static inline float to_f32_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* y = w * bf16(x * rsqrt(sum(x^2) / dim + eps)), per row of x [rows, dim] (RMSNorm). */
void rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float v = to_f32_bf16(xr, i);
            sum += v * v;
        }
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            y[r * dim + i] = f32_to_bf16(to_f32_bf16(w, i) * round_bf16(to_f32_bf16(xr, i) * inv));
    }
}

void rmsnorm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = w[i] * (xr[i] * inv);
    }
}

/* RoPE: y[n, h] = x[n, h] * cos[n] + roll(x[n, h], dim / 2) * sin[n] (sin's first half negated by
 * the caller), for n over rows (tokens) and h over heads. x is strided (heads sliced out of the
 * fused projection): row stride sn, head stride sh, elements contiguous; y is contiguous. */
void rope_bf16(const uint16_t *x, int64_t sn, int64_t sh, const uint16_t *cos, const uint16_t *sin, uint16_t *y,
               int64_t rows, int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t n = 0; n < rows; n++)
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + n * sn + h * sh, *c = cos + n * dim, *s = sin + n * dim;
            uint16_t *yh = y + (n * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) {
                float rolled = to_f32_bf16(xh, i < half ? i + half : i - half);
                yh[i] = f32_to_bf16(round_bf16(to_f32_bf16(xh, i) * to_f32_bf16(c, i))
                                    + round_bf16(rolled * to_f32_bf16(s, i)));
            }
        }
}

void rope_f32(const float *x, int64_t sn, int64_t sh, const float *cos, const float *sin, float *y,
              int64_t rows, int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t n = 0; n < rows; n++)
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + n * sn + h * sh, *c = cos + n * dim, *s = sin + n * dim;
            float *yh = y + (n * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) yh[i] = xh[i] * c[i] + xh[i < half ? i + half : i - half] * s[i];
        }
}

/* SwiGLU's activation: y = silu(gate) * up for gate_up [rows, 2 * inter] (gate first, then up).
 * The loops are vectorised (omp simd with glibc's vector expf where it links), 16 lanes at a time:
 * a scalar expf per element made this the costliest of the small operators (~2 ms of a SmolLM2
 * step). The last inter % 16 elements of every row take the scalar expf. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            float v = to_f32_bf16(g, i);
            y[r * inter + i] = f32_to_bf16(round_bf16(v / (1.0f + expf(-v))) * to_f32_bf16(u, i));
        }
    }
}

void silu_mul_f32(const float *gate_up, float *y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) y[r * inter + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
