/* The CPU kernels of infer.kernels: matrix-vector products for decoding, the small operators
 * between them (RMSNorm, RoPE, SwiGLU's activation) and a whole decoder stack in one call.
 *
 * Products y[m, n] = x[m, k] @ w[n, k]^T (+ bias), m small: a decode step multiplies one row (a
 * verification pass a few) by every weight matrix, so its speed is how fast the weights stream from
 * memory. The loops take the weight in blocks of JB rows and the input in blocks of up to RB rows:
 * each weight chunk is loaded once and meets every input row of the block in registers (JB x RB
 * independent accumulators, so the dot-product instructions never wait on one another and extra
 * input rows cost little more than their arithmetic). AVX-512 BF16 dot products for bfloat16, FMAs
 * for float32.
 *
 * Every output element is the same instruction sequence whatever m is (its own accumulator over
 * the chunks in order, then one fixed reduction tree), so a 1-token decode step and a (K+1)-token
 * verification pass compute bit-identical rows. A last partial block of weight rows repeats its
 * final row and stores only the real outputs, so it too runs that sequence.
 *
 * One source, one library per instruction-set variant (infer/kernels/build.py compiles it with
 * explicit -m flags, never -march=native): the float32 kernels need AVX-512 F/BW/VL/DQ and FMA, or
 * AVX2 and FMA; the bfloat16 ones also AVX512_BF16, so they exist only where the compiler was told
 * the CPU has it (__AVX512BF16__). What differs between the ISAs is the float32 vector below (FVEC,
 * LANES floats); the type-generic code is cpu_kernels_impl.h, included once per type.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__FMA__)
#define INFER_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define INFER_AVX2 1
#else
#error "build cpu_kernels.c for AVX-512 (-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma) or AVX2 (-mavx2 -mfma)"
#endif
#include <stddef.h>
#include <stdio.h>
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "thread_pool.h"

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

/* The float32 vector of this ISA: LANES floats, loads and stores (fvec_load/fvec_store aligned),
 * a masked load of the first lanes (lanes(n)), a*b+c, and its lanes' sum, always the same tree. */
#ifdef INFER_AVX512
#define LANES 16
typedef __m512 FVEC;
typedef __mmask16 LMASK;
static inline FVEC fvec_zero(void) { return _mm512_setzero_ps(); }
static inline FVEC fvec_set1(float f) { return _mm512_set1_ps(f); }
static inline FVEC fvec_load(const float *p) { return _mm512_load_ps(p); }
static inline FVEC fvec_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void fvec_store(float *p, FVEC v) { _mm512_store_ps(p, v); }
static inline void fvec_storeu(float *p, FVEC v) { _mm512_storeu_ps(p, v); }
static inline FVEC fvec_fma(FVEC a, FVEC b, FVEC c) { return _mm512_fmadd_ps(a, b, c); }
static inline FVEC fvec_mul(FVEC a, FVEC b) { return _mm512_mul_ps(a, b); }
static inline float fvec_sum(FVEC v) { return _mm512_reduce_add_ps(v); }
static inline LMASK lanes(int64_t n) { return n >= 16 ? (LMASK)0xffff : (LMASK)((1u << n) - 1); }
static inline FVEC fvec_maskload(const float *p, LMASK m) { return _mm512_maskz_loadu_ps(m, p); }
static inline FVEC fvec_max(FVEC a, FVEC b) { return _mm512_max_ps(a, b); }
static inline float fvec_hmax(FVEC v) { return _mm512_reduce_max_ps(v); }
/* The lanes' sums of LANES vectors at once: lane t of the result is the sum of v[t]'s lanes. A
 * transpose tree (pairs, then quads, then 128-bit quarters), one fixed order of additions, at
 * about three instructions per vector where a reduction of each alone takes eight. */
static inline FVEC fvec_sums(const FVEC v[LANES]) {
    FVEC pair[8], quad[4], half[2];
    for (int t = 0; t < 8; t++) /* per 128-bit lane: v2t[0]+v2t[2], v2t+1[0]+v2t+1[2], v2t[1]+v2t[3], ... */
        pair[t] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * t], v[2 * t + 1]), _mm512_unpackhi_ps(v[2 * t], v[2 * t + 1]));
    for (int t = 0; t < 4; t++) /* per 128-bit lane: one partial sum of each of four vectors, in order */
        quad[t] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * t], pair[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(pair[2 * t], pair[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int t = 0; t < 2; t++) /* quarters 0+1 and 2+3 of two quads */
        half[t] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * t], quad[2 * t + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(quad[2 * t], quad[2 * t + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
/* The four sums of a, b, c, d's lanes, in that order; each is the same tree of additions. */
static inline __m128 sum4(FVEC a, FVEC b, FVEC c, FVEC d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#else /* AVX2 */
#define LANES 8
typedef __m256 FVEC;
typedef __m256i LMASK;
static inline FVEC fvec_zero(void) { return _mm256_setzero_ps(); }
static inline FVEC fvec_set1(float f) { return _mm256_set1_ps(f); }
static inline FVEC fvec_load(const float *p) { return _mm256_load_ps(p); }
static inline FVEC fvec_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void fvec_store(float *p, FVEC v) { _mm256_store_ps(p, v); }
static inline void fvec_storeu(float *p, FVEC v) { _mm256_storeu_ps(p, v); }
static inline FVEC fvec_fma(FVEC a, FVEC b, FVEC c) { return _mm256_fmadd_ps(a, b, c); }
static inline FVEC fvec_mul(FVEC a, FVEC b) { return _mm256_mul_ps(a, b); }
static inline float fvec_sum(FVEC v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
static inline LMASK lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline FVEC fvec_maskload(const float *p, LMASK m) { return _mm256_maskload_ps(p, m); }
static inline FVEC fvec_max(FVEC a, FVEC b) { return _mm256_max_ps(a, b); }
static inline float fvec_hmax(FVEC v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
/* The lanes' sums of LANES vectors at once (lane t: the sum of v[t]'s lanes), one fixed tree. */
static inline FVEC fvec_sums(const FVEC v[LANES]) {
    FVEC pair[4], quad[2];
    for (int t = 0; t < 4; t++)
        pair[t] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * t], v[2 * t + 1]), _mm256_unpackhi_ps(v[2 * t], v[2 * t + 1]));
    for (int t = 0; t < 2; t++)
        quad[t] = _mm256_add_ps(_mm256_shuffle_ps(pair[2 * t], pair[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm256_shuffle_ps(pair[2 * t], pair[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(quad[0], quad[1], 0x20), _mm256_permute2f128_ps(quad[0], quad[1], 0x31));
}
/* The four sums of a, b, c, d's lanes, in that order; each is the same tree of additions. */
static inline __m128 sum4(FVEC a, FVEC b, FVEC c, FVEC d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

/* What differs between the dtypes, so that every kernel below is written once: a vector of STEP
 * elements (loaded whole, or its first n elements with the other lanes zero), its dot product into
 * float32 lanes, and the scalar load, store and rounding of one element. float32's rounding to
 * its own dtype is the identity. */
#define STEP_f32 LANES
typedef float elem_f32;
typedef FVEC vec_f32;
static inline FVEC load_vec_f32(const float *p) { return fvec_loadu(p); }
static inline FVEC load_part_f32(const float *p, int64_t n) { return fvec_maskload(p, lanes(n)); }
static inline FVEC mac_f32(FVEC acc, FVEC w, FVEC x) { return fvec_fma(w, x, acc); }
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float store_f32(float f) { return f; }
static inline float round_f32(float f) { return f; }
static inline FVEC widen_f32(const float *p, LMASK m) { return fvec_maskload(p, m); }

#ifdef __AVX512BF16__
#define STEP_bf16 32
typedef uint16_t elem_bf16;
typedef __m512bh vec_bf16;
static inline __m512bh load_vec_bf16(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh load_part_bf16(const uint16_t *p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}
static inline __m512 mac_bf16(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline uint16_t store_bf16(float f) { return f32_to_bf16(f); }
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline FVEC widen_bf16(const uint16_t *p, LMASK m) { /* 16 bfloat16 to float32: a shift */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

/* The small operators between the matmuls of a decode step. Each is one call instead of the 3-9
 * tensor operators PyTorch runs for it (each of which costs microseconds of dispatch on a
 * 576-wide row), and each computes a row the same way whatever the number of rows. They round
 * where the reference (infer.models.layers) rounds: to the tensor's dtype after every operator.
 * The build disables FMA contraction so that a * b + c rounds twice, as the reference does. */

#ifndef INFER_NO_LIBMVEC
/* glibc's libmvec has a 16-lane expf; declaring it lets the omp simd loops below call it. */
#ifdef INFER_AVX512
#pragma omp declare simd notinbranch simdlen(16)
#else
#pragma omp declare simd notinbranch simdlen(8)
#endif
extern float expf(float);
#endif


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

/* Addresses of one layer's tensors, in this order, in the [layers, STACK_TENSORS] table
 * (Python mirrors it as infer.kernels.cpu.STACK_TENSORS; infer_kernels_layout lets it check). */
enum {
    T_LN1, T_QKV_W, T_QKV_B, T_Q_NORM, T_K_NORM, T_O_W, T_O_B, T_LN2, T_GATE_UP_W, T_GATE_UP_B, T_DOWN_W,
    T_DOWN_B, T_POST_ATTN_NORM, T_POST_FF_NORM, STACK_TENSORS
};
#define MAX_GROUP 16     /* query heads per KV head the attention takes */
#define MAX_HEAD_DIM 256 /* the attention keeps a key or value row in 16 registers of 16 floats */
/* A row's key list is taken in segments of ATTN_SEGMENT keys, by index in the list, each segment a
 * work item of its own: its scores, their softmax against the segment's peak, its total and its
 * weighted sum of values, merged afterwards in segment order. The boundaries depend on the row's list
 * alone, never on the pass or the thread count, so a token's result is still the same in every pass;
 * a row of at most ATTN_SEGMENT keys is one segment and its merge is exact (a factor of 1). Without
 * segments a pass had one item per KV head and row group: SmolLM2's 3 KV heads on two threads left
 * one thread idle for half of every attention, the longer the context the longer. */
#define ATTN_SEGMENT 128 /* keys */

typedef struct {
    int64_t rows, width, batch;           /* rows = batch * width query tokens */
    int64_t hidden, heads, kv_heads, head_dim, inter, layers;
    int64_t qk_norm;                      /* 1: RMSNorm on each query and key head before RoPE (Qwen3) */
    float eps, scale;
    const int64_t *tensors;               /* [layers, STACK_TENSORS] addresses (biases, q/k norms may be 0) */
    const int64_t *k_stores, *v_stores;   /* [layers] addresses of [storage rows, kv_heads, head_dim] */
    const int64_t *write_rows;            /* [rows] storage row of each token's new K/V; -1: padding */
    const int64_t *read_rows;             /* [batch, context] storage rows of the context, or NULL: */
    int64_t read_start;                   /* ... one sequence in rows read_start .. + context */
    int64_t context;
    const uint8_t *mask;                  /* [batch, width, context] 1 = visible, or NULL: all are */
    const void *cos, *sin;                /* [rows, head_dim], sin's first half negated */
    void *x;                              /* [rows, hidden]: the embeddings in, the stack's output out */
    int threads;
    /* Quantized projections (float32 stacks only; NULL: every projection is a float weight in the
     * tensor table). quant_index [layers, STACK_PROJECTIONS, 2] holds each projection's first part in
     * quant_parts and its part count; 0 parts: the float weight of the table. */
    const struct QuantPart *quant_parts;
    const int64_t *quant_index;
    /* The block's form (infer.models.block.BlockSpec), each 0 for Llama's. norm_offset = 1: every norm
     * (T_LN1, T_LN2, the q/k norms and the post norms) computes round(norm(x) * (1 + w)) in float32,
     * rounded once, instead of w * round(norm(x)). post_norms = 1: a norm on the attention's output
     * (T_POST_ATTN_NORM) and on the MLP's (T_POST_FF_NORM) before each residual add. activation: the
     * MLP's gate (ACT_SILU or ACT_GELU_TANH). local_layers [layers] (or NULL: none) marks the
     * sliding-window layers: they rotate with local_cos/local_sin and read and write through the
     * local view (their own storage rows and a mask that carries the window; read/write rows as the
     * main view's fields above). */
    int64_t norm_offset, post_norms, activation;
    const uint8_t *local_layers;
    const int64_t *local_write_rows, *local_read_rows;
    int64_t local_read_start;
    const uint8_t *local_mask;
    const void *local_cos, *local_sin;
    /* NULL, or [layers + 1] addresses of [rows, hidden] buffers (rows capture_stride apart; 0: none): x entering layer l is copied
     * to capture[l], the last layer's output to capture[layers] (an EAGLE-3 drafter's layer inputs,
     * taken in the same call: a copy, no arithmetic changes). */
    const int64_t *capture;
    /* NULL, or the LM head run in the same call (float32 stacks only): after the last layer (and its
     * capture) the final RMSNorm (weight final_norm, epsilon final_eps) in place over x, then head's
     * product of every row (bias head_bias or NULL) into logits [rows, head->rows], float32. The
     * same kernels as the norm and the head's own call, in the same order: the same bits. */
    const void *final_norm;
    float final_eps;
    const struct QuantPart *head;
    const float *head_bias;
    float *logits;
    /* 1 (one sequence, batch = 1, mask and local_mask NULL): query row t sees the context's keys
     * 0 .. context - width + t, a chain of new tokens after the cached ones, the keys a causal mask
     * gives it (the same list, so the same bits); 0: as mask says. */
    int64_t causal;
    /* Elements from one row's copy to the next in every capture buffer (0: hidden, rows back to
     * back): several layers' inputs can then land side by side in one [rows, n * hidden] buffer. */
    int64_t capture_stride;
} StackArgs;

/* One quantized matrix of a projection: infer.kernels.quant's C entry for its block type (all
 * share quant_linear's signature), its blocks, and the outputs it computes (columns offset ..
 * offset + rows of the projection's output; a fused q/k/v of two block types is two parts). */
typedef int (*QuantLinearFn)(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, const float *bias,
                             float *y, int threads);
typedef struct QuantPart {
    QuantLinearFn linear;
    const uint8_t *blocks;
    int64_t offset, rows, in_features;
} QuantPart;

/* The projections of a layer, in quant_index's order. */
enum { P_QKV, P_O, P_GATE_UP, P_DOWN, STACK_PROJECTIONS };

/* StackArgs.activation's values. */
enum { ACT_SILU, ACT_GELU_TANH, STACK_ACTIVATIONS };

#define KSFX f32
#include "cpu_kernels_impl.h"
#undef KSFX
#ifdef __AVX512BF16__
#define KSFX bf16
#include "cpu_kernels_impl.h"
#undef KSFX
#endif

/* The interface Python mirrors by hand (StackArgs' layout, the tensor table's order, the limits,
 * which dtypes this variant holds), as one line that infer.kernels.build compares with its own at
 * load: a mismatch refuses the library instead of passing misplaced pointers. */
const char *infer_kernels_layout(void) {
    static char text[3072];
#define FIELD(f) #f "=%zu "
#define AT(f) offsetof(StackArgs, f)
    snprintf(text, sizeof text,
             "size=%zu " FIELD(rows) FIELD(width) FIELD(batch) FIELD(hidden) FIELD(heads) FIELD(kv_heads)
             FIELD(head_dim) FIELD(inter) FIELD(layers) FIELD(qk_norm) FIELD(eps) FIELD(scale) FIELD(tensors)
             FIELD(k_stores) FIELD(v_stores) FIELD(write_rows) FIELD(read_rows) FIELD(read_start) FIELD(context)
             FIELD(mask) FIELD(cos) FIELD(sin) FIELD(x) FIELD(threads) FIELD(quant_parts) FIELD(quant_index)
             FIELD(norm_offset) FIELD(post_norms) FIELD(activation) FIELD(local_layers) FIELD(local_write_rows) FIELD(local_read_rows) FIELD(local_read_start)
             FIELD(local_mask) FIELD(local_cos) FIELD(local_sin) FIELD(capture) FIELD(final_norm) FIELD(final_eps)
             FIELD(head) FIELD(head_bias) FIELD(logits) FIELD(causal) FIELD(capture_stride)
             "part_size=%zu part_linear=%zu part_blocks=%zu part_offset=%zu part_rows=%zu part_in_features=%zu "
             "projections=qkv:%d,o:%d,gate_up:%d,down:%d/%d activations=silu:%d,gelu_tanh:%d/%d "
             "tensors=ln1:%d,qkv_w:%d,qkv_b:%d,q_norm:%d,k_norm:%d,o_w:%d,o_b:%d,ln2:%d,gate_up_w:%d,gate_up_b:%d,"
             "down_w:%d,down_b:%d,post_attn_norm:%d,post_ff_norm:%d/%d max_group=%d max_head_dim=%d attn_segment=%d dtypes=%s",
             sizeof(StackArgs), AT(rows), AT(width), AT(batch), AT(hidden), AT(heads), AT(kv_heads), AT(head_dim),
             AT(inter), AT(layers), AT(qk_norm), AT(eps), AT(scale), AT(tensors), AT(k_stores), AT(v_stores),
             AT(write_rows), AT(read_rows), AT(read_start), AT(context), AT(mask), AT(cos), AT(sin), AT(x),
             AT(threads), AT(quant_parts), AT(quant_index), AT(norm_offset), AT(post_norms), AT(activation), AT(local_layers), AT(local_write_rows),
             AT(local_read_rows), AT(local_read_start), AT(local_mask), AT(local_cos), AT(local_sin), AT(capture), AT(final_norm), AT(final_eps), AT(head), AT(head_bias),
             AT(logits), AT(causal), AT(capture_stride), sizeof(QuantPart), offsetof(QuantPart, linear),
             offsetof(QuantPart, blocks), offsetof(QuantPart, offset), offsetof(QuantPart, rows),
             offsetof(QuantPart, in_features), P_QKV, P_O, P_GATE_UP, P_DOWN, STACK_PROJECTIONS, ACT_SILU, ACT_GELU_TANH, STACK_ACTIVATIONS, T_LN1, T_QKV_W, T_QKV_B, T_Q_NORM, T_K_NORM, T_O_W, T_O_B, T_LN2, T_GATE_UP_W,
             T_GATE_UP_B, T_DOWN_W, T_DOWN_B, T_POST_ATTN_NORM, T_POST_FF_NORM, STACK_TENSORS, MAX_GROUP, MAX_HEAD_DIM, ATTN_SEGMENT,
#ifdef __AVX512BF16__
             "f32,bf16"
#else
             "f32"
#endif
    );
#undef FIELD
#undef AT
    return text;
}
