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
#include <stdlib.h>
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

/* What differs between the dtypes, so that every kernel below is written once: a vector of STEP
 * elements (loaded whole, or its first n elements with the other lanes zero), its dot product into
 * float32 lanes, and the scalar load, store and rounding of one element. float32's rounding to
 * its own dtype is the identity. */
#define STEP_bf16 32
#define STEP_f32 16
typedef uint16_t elem_bf16;
typedef float elem_f32;
typedef __m512bh vec_bf16;
typedef __m512 vec_f32;
static inline __m512bh load_vec_bf16(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512 load_vec_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512bh load_part_bf16(const uint16_t *p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}
static inline __m512 load_part_f32(const float *p, int64_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1ull << n) - 1), p);
}
static inline __m512 mac_bf16(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
static inline __m512 mac_f32(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline uint16_t store_bf16(float f) { return f32_to_bf16(f); }
static inline float store_f32(float f) { return f; }
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float round_f32(float f) { return f; }

/* One weight block (JB rows at w[0..3]) against R input rows; sums[r][jj] = dot(x_r, w_jj).
 * R is a compile-time constant at every call, so the accumulators stay in registers. */
#define DEFINE_BLOCK(S, R)                                                                         \
    static inline void block_##S##_##R(const elem_##S *const *w, const elem_##S *x, int64_t k,     \
                                       float sums[RB][JB]) {                                       \
        __m512 acc[R][JB];                                                                         \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < JB; j++) acc[r][j] = _mm512_setzero_ps();                          \
        int64_t i = 0;                                                                             \
        for (; i + STEP_##S <= k; i += STEP_##S) {                                                 \
            vec_##S wv[JB];                                                                        \
            for (int j = 0; j < JB; j++) wv[j] = load_vec_##S(w[j] + i);                           \
            for (int j = 0; j < JB; j++) _mm_prefetch((const char *)(w[j] + AHEAD * k + i), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                          \
                vec_##S xv = load_vec_##S(x + r * k + i);                                          \
                for (int j = 0; j < JB; j++) acc[r][j] = mac_##S(acc[r][j], wv[j], xv);            \
            }                                                                                      \
        }                                                                                          \
        if (i < k) { /* the last k % STEP elements: partial loads, the other lanes zero */         \
            vec_##S wv[JB];                                                                        \
            for (int j = 0; j < JB; j++) wv[j] = load_part_##S(w[j] + i, k - i);                   \
            for (int r = 0; r < R; r++) {                                                          \
                vec_##S xv = load_part_##S(x + r * k + i, k - i);                                  \
                for (int j = 0; j < JB; j++) acc[r][j] = mac_##S(acc[r][j], wv[j], xv);            \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++) _mm_storeu_ps(sums[r], sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])); \
    }

/* Row-major contiguous w [n, k], x [m, k], y [m, n]; bias [n] or NULL. */
#define DEFINE_GEMV(S)                                                                             \
    DEFINE_BLOCK(S, 1)                                                                             \
    DEFINE_BLOCK(S, 2)                                                                             \
    DEFINE_BLOCK(S, 3)                                                                             \
    DEFINE_BLOCK(S, 4)                                                                             \
    void gemv_##S(const elem_##S *w, const elem_##S *x, const elem_##S *bias, elem_##S *y,         \
                  int64_t m, int64_t n, int64_t k, int threads) {                                  \
        int64_t blocks = (n + JB - 1) / JB;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")         \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            int64_t j0 = b * JB, valid = n - j0 < JB ? n - j0 : JB;                                \
            const elem_##S *rows[JB];                                                              \
            for (int j = 0; j < JB; j++) rows[j] = w + (j0 + (j < valid ? j : valid - 1)) * k;     \
            float sums[RB][JB];                                                                    \
            for (int64_t r0 = 0; r0 < m; r0 += RB) {                                               \
                int64_t rn = m - r0 < RB ? m - r0 : RB;                                            \
                const elem_##S *xr = x + r0 * k;                                                   \
                switch (rn) {                                                                      \
                case 1: block_##S##_1(rows, xr, k, sums); break;                                   \
                case 2: block_##S##_2(rows, xr, k, sums); break;                                   \
                case 3: block_##S##_3(rows, xr, k, sums); break;                                   \
                default: block_##S##_4(rows, xr, k, sums); break;                                  \
                }                                                                                  \
                for (int64_t r = 0; r < rn; r++)                                                   \
                    for (int64_t j = 0; j < valid; j++)                                            \
                        y[(r0 + r) * n + j0 + j] =                                                 \
                            store_##S(sums[r][j] + (bias ? load_##S(bias, j0 + j) : 0.0f));        \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_GEMV(bf16)
DEFINE_GEMV(f32)

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

/* y = w * round(x * rsqrt(sum(x^2) / dim + eps)), per row of x [rows, dim] (RMSNorm). */
#define DEFINE_RMSNORM(S)                                                                          \
    void rmsnorm_##S(const elem_##S *x, const elem_##S *w, elem_##S *y, int64_t rows, int64_t dim, float eps) { \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const elem_##S *xr = x + r * dim;                                                      \
            float sum = 0.0f;                                                                      \
            for (int64_t i = 0; i < dim; i++) {                                                    \
                float v = load_##S(xr, i);                                                         \
                sum += v * v;                                                                      \
            }                                                                                      \
            float inv = 1.0f / sqrtf(sum / (float)dim + eps);                                      \
            for (int64_t i = 0; i < dim; i++)                                                      \
                y[r * dim + i] = store_##S(load_##S(w, i) * round_##S(load_##S(xr, i) * inv));     \
        }                                                                                          \
    }

/* RoPE: y[n, h] = x[n, h] * cos[n] + roll(x[n, h], dim / 2) * sin[n] (sin's first half negated by
 * the caller), for n over rows (tokens) and h over heads. x is strided (heads sliced out of the
 * fused projection): row stride sn, head stride sh, elements contiguous; y is contiguous. */
#define DEFINE_ROPE(S)                                                                             \
    void rope_##S(const elem_##S *x, int64_t sn, int64_t sh, const elem_##S *cos, const elem_##S *sin, \
                  elem_##S *y, int64_t rows, int64_t heads, int64_t dim) {                         \
        int64_t half = dim / 2;                                                                    \
        for (int64_t n = 0; n < rows; n++)                                                         \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                const elem_##S *xh = x + n * sn + h * sh, *c = cos + n * dim, *s = sin + n * dim;  \
                elem_##S *yh = y + (n * heads + h) * dim;                                          \
                for (int64_t i = 0; i < dim; i++) {                                                \
                    float rolled = load_##S(xh, i < half ? i + half : i - half);                   \
                    yh[i] = store_##S(round_##S(load_##S(xh, i) * load_##S(c, i))                  \
                                      + round_##S(rolled * load_##S(s, i)));                       \
                }                                                                                  \
            }                                                                                      \
    }

/* SwiGLU's activation: y = silu(gate) * up for gate_up [rows, 2 * inter] (gate first, then up).
 * The loops are vectorised (omp simd with glibc's vector expf where it links), 16 lanes at a time:
 * a scalar expf per element made this the costliest of the small operators (~2 ms of a SmolLM2
 * step). The last inter % 16 elements of every row take the scalar expf. */
#define DEFINE_SILU_MUL(S)                                                                         \
    void silu_mul_##S(const elem_##S *gate_up, elem_##S *y, int64_t rows, int64_t inter) {         \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const elem_##S *g = gate_up + r * 2 * inter, *u = g + inter;                           \
            _Pragma("omp simd")                                                                    \
            for (int64_t i = 0; i < inter; i++) {                                                  \
                float v = load_##S(g, i);                                                          \
                y[r * inter + i] = store_##S(round_##S(v / (1.0f + expf(-v))) * load_##S(u, i));   \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_RMSNORM(bf16)
DEFINE_RMSNORM(f32)
DEFINE_ROPE(bf16)
DEFINE_ROPE(f32)
DEFINE_SILU_MUL(bf16)
DEFINE_SILU_MUL(f32)

/* ---------------------------------------------------------------------------------------------
 * A whole decoder stack in one call, for passes of a few rows (decode steps, verifications,
 * draft steps). Between its matmuls a Llama layer is some thirty PyTorch operators and Python
 * lines on rows of a few hundred elements; on a 135M model that was a third of a decode step.
 * Here every layer is the kernels above in the order infer.models.layers runs them, plus the
 * attention over the cache, with no return to Python until the last layer.
 *
 * The attention computes each query row (a token of a sequence, one head) alone: the scores of
 * its visible keys in position order, their softmax in float32 and the weighted sum of the values
 * in that same order. A query's result therefore depends on which keys it sees and nothing else:
 * not the number of rows in the pass nor the masked keys beside it. With the row-wise kernels
 * above, a token's logits are bit-identical in a decode step and in any verification pass.
 */

/* Addresses of one layer's tensors, in this order, in the [layers, STACK_TENSORS] table. */
enum { T_LN1, T_QKV_W, T_QKV_B, T_O_W, T_O_B, T_LN2, T_GATE_UP_W, T_GATE_UP_B, T_DOWN_W, T_DOWN_B, STACK_TENSORS };

typedef struct {
    int64_t rows, width, batch;           /* rows = batch * width query tokens */
    int64_t hidden, heads, kv_heads, head_dim, inter, layers;
    float eps, scale;
    const int64_t *tensors;               /* [layers, STACK_TENSORS] addresses (biases may be 0) */
    const int64_t *k_stores, *v_stores;   /* [layers] addresses of [storage rows, kv_heads, head_dim] */
    const int64_t *write_rows;            /* [rows] storage row of each token's new K/V; -1: padding */
    const int64_t *read_rows;             /* [batch, context] storage rows of the context, or NULL: */
    int64_t read_start;                   /* ... one sequence in rows read_start .. + context */
    int64_t context;
    const uint8_t *mask;                  /* [batch, width, context] 1 = visible, or NULL: all are */
    const void *cos, *sin;                /* [rows, head_dim], sin's first half negated */
    void *x;                              /* [rows, hidden]: the embeddings in, the stack's output out */
    int threads;
} StackArgs;

/* Dot product of a float32 query with one stored key, and value accumulation, 16 lanes at a time. */
static inline __m512 widen_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 widen_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
#define MAX_GROUP 16 /* query heads per KV head the attention takes */
static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

#define DEFINE_STACK(S)                                                                            \
    static void attention_##S(const StackArgs *a, const elem_##S *qk, const elem_##S *ks,          \
                              const elem_##S *vs, elem_##S *out) {                                 \
        int64_t hd = a->head_dim, heads = a->heads, kvh = a->kv_heads, groups = heads / kvh;       \
        int64_t L = a->context, stride = (L + 15) / 16 * 16, chunks = (hd + 15) / 16;              \
        int64_t items = a->rows * kvh, width = groups * chunks * 16;                               \
        _Pragma("omp parallel num_threads(a->threads) if (a->threads > 1 && items > 1)")           \
        {                                                                                          \
            /* per head: its scores (rows 64-byte aligned, so the vectorised exp below splits every \
             * row alike), its query and its weighted sum, in float32 */                          \
            float *score = aligned_alloc(64, sizeof(float) * (size_t)(stride * groups));           \
            float *query = aligned_alloc(64, sizeof(float) * (size_t)width);                       \
            float *sum = aligned_alloc(64, sizeof(float) * (size_t)width);                         \
            int64_t *key = malloc(sizeof(int64_t) * (size_t)L);                                    \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t p = 0; p < items; p++) {                                                  \
                int64_t r = p / kvh, g = p % kvh, b = r / a->width, n = 0;                         \
                const uint8_t *visible = a->mask ? a->mask + r * L : NULL;                         \
                for (int64_t l = 0; l < L; l++)                                                    \
                    if (!visible || visible[l])                                                    \
                        key[n++] = a->read_rows ? a->read_rows[b * L + l] : a->read_start + l;     \
                float top[MAX_GROUP], total[MAX_GROUP];                                            \
                for (int64_t j = 0; j < groups; j++) {                                             \
                    const elem_##S *qh = qk + (r * (heads + kvh) + g * groups + j) * hd;           \
                    for (int64_t c = 0; c < chunks; c++)                                           \
                        _mm512_store_ps(query + (j * chunks + c) * 16, widen_##S(qh + 16 * c, lanes(hd - 16 * c))); \
                    top[j] = -INFINITY;                                                            \
                    total[j] = 0.0f;                                                               \
                }                                                                                  \
                /* each key (and value) row is read once for all the query heads that share it */  \
                for (int64_t i = 0; i < n; i++) {                                                  \
                    const elem_##S *kr = ks + (key[i] * kvh + g) * hd;                             \
                    __m512 kc[16];                                                                 \
                    for (int64_t c = 0; c < chunks; c++) kc[c] = widen_##S(kr + 16 * c, lanes(hd - 16 * c)); \
                    for (int64_t j = 0; j < groups; j++) {                                         \
                        __m512 acc = _mm512_setzero_ps();                                          \
                        for (int64_t c = 0; c < chunks; c++)                                       \
                            acc = _mm512_fmadd_ps(_mm512_load_ps(query + (j * chunks + c) * 16), kc[c], acc); \
                        float s = _mm512_reduce_add_ps(acc) * a->scale;                            \
                        score[j * stride + i] = s;                                                 \
                        top[j] = s > top[j] ? s : top[j];                                          \
                    }                                                                              \
                }                                                                                  \
                for (int64_t j = 0; j < groups; j++) {                                             \
                    float *row = score + j * stride, peak = top[j];                                \
                    _Pragma("omp simd")                                                            \
                    for (int64_t i = 0; i < n; i++) row[i] = expf(row[i] - peak);                  \
                }                                                                                  \
                for (int64_t e = 0; e < width; e += 16) _mm512_store_ps(sum + e, _mm512_setzero_ps()); \
                for (int64_t i = 0; i < n; i++) {                                                  \
                    const elem_##S *vr = vs + (key[i] * kvh + g) * hd;                             \
                    __m512 vc[16];                                                                 \
                    for (int64_t c = 0; c < chunks; c++) vc[c] = widen_##S(vr + 16 * c, lanes(hd - 16 * c)); \
                    for (int64_t j = 0; j < groups; j++) {                                         \
                        float weight = score[j * stride + i];                                      \
                        __m512 w = _mm512_set1_ps(weight);                                         \
                        total[j] += weight;                                                        \
                        for (int64_t c = 0; c < chunks; c++) {                                     \
                            float *acc = sum + (j * chunks + c) * 16;                              \
                            _mm512_store_ps(acc, _mm512_fmadd_ps(w, vc[c], _mm512_load_ps(acc)));  \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
                for (int64_t j = 0; j < groups; j++) {                                             \
                    float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f, lane[16];                \
                    elem_##S *o = out + (r * heads + g * groups + j) * hd;                         \
                    for (int64_t c = 0; c < chunks; c++) {                                         \
                        _mm512_storeu_ps(lane, _mm512_mul_ps(_mm512_load_ps(sum + (j * chunks + c) * 16), \
                                                             _mm512_set1_ps(inv)));                \
                        for (int64_t e = 0; e < 16 && 16 * c + e < hd; e++) o[16 * c + e] = store_##S(lane[e]); \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            free(score);                                                                           \
            free(query);                                                                           \
            free(sum);                                                                             \
            free(key);                                                                             \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static void add_into_##S(elem_##S *x, const elem_##S *y, int64_t n) { /* x += y, rounded */   \
        for (int64_t i = 0; i < n; i++) x[i] = store_##S(load_##S(x, i) + load_##S(y, i));         \
    }                                                                                              \
                                                                                                   \
    void decoder_stack_##S(const StackArgs *a) {                                                   \
        int64_t m = a->rows, d = a->hidden, hd = a->head_dim, H = a->heads, KV = a->kv_heads;      \
        int64_t qkv_n = (H + 2 * KV) * hd;                                                         \
        elem_##S *x = a->x;                                                                        \
        elem_##S *normed = malloc(sizeof(elem_##S) * (size_t)(m * d));                             \
        elem_##S *qkv = malloc(sizeof(elem_##S) * (size_t)(m * qkv_n));                           \
        elem_##S *qk = malloc(sizeof(elem_##S) * (size_t)(m * (H + KV) * hd));                     \
        elem_##S *attn = malloc(sizeof(elem_##S) * (size_t)(m * H * hd));                          \
        elem_##S *delta = malloc(sizeof(elem_##S) * (size_t)(m * d));                              \
        elem_##S *gate_up = malloc(sizeof(elem_##S) * (size_t)(m * 2 * a->inter));                 \
        elem_##S *act = malloc(sizeof(elem_##S) * (size_t)(m * a->inter));                         \
        for (int64_t layer = 0; layer < a->layers; layer++) {                                      \
            const int64_t *t = a->tensors + layer * STACK_TENSORS;                                 \
            elem_##S *ks = (elem_##S *)a->k_stores[layer], *vs = (elem_##S *)a->v_stores[layer];   \
            rmsnorm_##S(x, (const elem_##S *)t[T_LN1], normed, m, d, a->eps);                      \
            gemv_##S((const elem_##S *)t[T_QKV_W], normed, (const elem_##S *)t[T_QKV_B], qkv, m, qkv_n, d, a->threads); \
            rope_##S(qkv, qkv_n, hd, a->cos, a->sin, qk, m, H + KV, hd);                           \
            for (int64_t r = 0; r < m; r++) {                                                      \
                int64_t row = a->write_rows[r];                                                    \
                if (row < 0) continue;                                                             \
                memcpy(ks + row * KV * hd, qk + (r * (H + KV) + H) * hd, sizeof(elem_##S) * (size_t)(KV * hd)); \
                memcpy(vs + row * KV * hd, qkv + r * qkv_n + (H + KV) * hd, sizeof(elem_##S) * (size_t)(KV * hd)); \
            }                                                                                      \
            attention_##S(a, qk, ks, vs, attn);                                                    \
            gemv_##S((const elem_##S *)t[T_O_W], attn, (const elem_##S *)t[T_O_B], delta, m, d, H * hd, a->threads); \
            add_into_##S(x, delta, m * d);                                                         \
            rmsnorm_##S(x, (const elem_##S *)t[T_LN2], normed, m, d, a->eps);                      \
            gemv_##S((const elem_##S *)t[T_GATE_UP_W], normed, (const elem_##S *)t[T_GATE_UP_B], gate_up, m, \
                     2 * a->inter, d, a->threads);                                                 \
            silu_mul_##S(gate_up, act, m, a->inter);                                               \
            gemv_##S((const elem_##S *)t[T_DOWN_W], act, (const elem_##S *)t[T_DOWN_B], delta, m, d, a->inter, a->threads); \
            add_into_##S(x, delta, m * d);                                                         \
        }                                                                                          \
        free(normed); free(qkv); free(qk); free(attn); free(delta); free(gate_up); free(act);     \
    }

DEFINE_STACK(bf16)
DEFINE_STACK(f32)
