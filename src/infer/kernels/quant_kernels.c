/* Quantized matrix-vector products for GGUF block types (infer.kernels.quant).
 *
 * y[m, n] = x[m, k] @ W[n, k]^T with W in ggml's block layout exactly as a GGUF file stores it
 * (Q8_0, Q4_0, Q4_1, Q5_0: blocks of 32; Q4_K, Q5_K, Q6_K: super-blocks of 256), as ggml computes
 * it: each activation row is quantized to int8 per 32 elements (a float scale dx and, for the
 * types with a min, the block's sum sx = dx * sum(q)), and each 32-element chunk of a weight row
 * meets it in an integer dot product, times the chunk's float scales, summed in float.
 *
 * Exactness: output y[r, j] depends only on x[r] and W[j]. Its dot product is one sequence of
 * instructions (its own accumulators over the chunks in order, then one fixed reduction), the same
 * whether the call has 1 row or 16, and computed by one thread, whatever the thread count. So a
 * verification pass gives a decode step's rows bit for bit.
 *
 * Speed: a decode step streams the weights once, so the loop takes JB weight rows at a time and
 * every input row (in groups of RB, all in registers) meets each decoded chunk while it is in
 * registers and the rows' bytes while they are in L1: extra input rows cost arithmetic, not memory.
 *
 * One source, one library per ISA (build.py's QUANT_VARIANTS, explicit flags, never
 * -march=native). What differs per ISA is the handful of primitives below: unpacking 32 4/5/6-bit
 * values to int8 lanes, the int8 dot product (AVX2 maddubs with the sign trick, AVX-512 VNNI
 * vpdpbusd, ARM sdot, plain C) and the float accumulator. The per-type chunk decoders use only
 * those; quant_kernels_impl.h holds the kernels, included once per type.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX2__) && \
    defined(__FMA__) && defined(__F16C__)
#define QISA "avx512-vnni"
#define Q_X86 1
#define Q_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QISA "avx2"
#define Q_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define QISA "neon-dotprod"
#define Q_NEON 1
#else
#define QISA "portable"
#endif

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef Q_X86
#include <immintrin.h>
#endif
#ifdef Q_NEON
#include <arm_neon.h>
#endif

#define QK 32 /* elements per activation block and per weight chunk */
#define JB 2  /* weight rows decoded together (independent accumulators hide the FMA latency) */
#define RB 4  /* input rows per pass over a weight chunk */

/* ---------------------------------------------------------------------------------------------
 * Per-ISA primitives. WVEC: 32 int8 lanes; IACC: one chunk's dot product as int32 lanes; FACC:
 * float lanes accumulating one output.
 *   w_load32(p)           32 bytes
 *   w_nib16(p)            16 bytes' low nibbles, then their high nibbles (Q4_0/Q4_1/Q5_0)
 *   w_nib32(p, hi)        32 bytes' low (hi=0) or high nibbles (the K types)
 *   w_bits32(bits)        lane l = 16 where bit l of bits is set (Q5_0's fifth bits)
 *   w_high32(p, s, mask)  lane l = ((p[l] >> s) & mask) << 4 (Q5_K's, Q6_K's high bits)
 *   w_or, w_sub(w, c)     lane-wise or; subtract the constant c
 *   dot_u(w, x)           w's lanes unsigned (0..127) times x's signed ones
 *   dot_s(w, x)           both signed
 *   dot_s2(w, x, s0, s1)  both signed, the first 16 products times s0 and the last 16 times s1
 *   facc_fma(acc, v, s)   acc + float(v) * s, lane-wise;  facc_sum(acc): its lanes' sum, one tree
 */
#if defined(Q_X86)
typedef __m256i WVEC;
typedef __m256i IACC;
typedef __m256 FACC;
static inline float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline WVEC w_load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline WVEC w_nib16(const uint8_t *p) {
    __m128i q = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
}
static inline WVEC w_nib32(const uint8_t *p, int hi) {
    __m256i q = w_load32(p);
    if (hi) q = _mm256_srli_epi16(q, 4);
    return _mm256_and_si256(q, _mm256_set1_epi8(0x0f));
}
static inline WVEC w_bits32(uint32_t bits) {
    /* byte l of the result holds byte l/8 of bits (the shuffle works per 128-bit half) */
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                           0x0303030303030303));
    __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
static inline WVEC w_high32(const uint8_t *p, int shift, int mask) {
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(w_load32(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
    return _mm256_slli_epi16(q, 4); /* mask <= 3: nothing crosses into the next byte */
}
static inline WVEC w_or(WVEC a, WVEC b) { return _mm256_or_si256(a, b); }
static inline WVEC w_sub(WVEC a, int c) { return _mm256_sub_epi8(a, _mm256_set1_epi8((char)c)); }
static inline void w_store(int8_t *out, WVEC w) { _mm256_storeu_si256((__m256i *)out, w); }
static inline WVEC x_load(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
#ifdef Q_VNNI
static inline IACC dot_u(WVEC w, WVEC x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
static inline IACC dot_s(WVEC w, WVEC x) { /* |w| * (x with w's sign) = w * x; |-128| reads as 128 */
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
#else
/* maddubs' int16 pairs cannot saturate: |w| <= 128, |x| <= 127, 2 * 128 * 127 < 32768 */
static inline IACC dot_u(WVEC w, WVEC x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
static inline IACC dot_s(WVEC w, WVEC x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}
#endif
static inline IACC dot_s2(WVEC w, WVEC x, int s0, int s1) {
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_setr_m128i(_mm_set1_epi16((short)s0), _mm_set1_epi16((short)s1)));
}
static inline FACC facc_zero(void) { return _mm256_setzero_ps(); }
static inline FACC facc_fma(FACC acc, IACC v, float s) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc);
}
static inline float facc_sum(FACC v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

#elif defined(Q_NEON)
typedef int8x16x2_t WVEC;
typedef int32x4_t IACC;
typedef float32x4_t FACC;
static inline float fp16_to_f32(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
static inline WVEC w_load32(const uint8_t *p) { return (WVEC){{vld1q_s8((const int8_t *)p), vld1q_s8((const int8_t *)p + 16)}}; }
static inline WVEC w_nib16(const uint8_t *p) {
    uint8x16_t q = vld1q_u8(p);
    return (WVEC){{vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f))), vreinterpretq_s8_u8(vshrq_n_u8(q, 4))}};
}
static inline int8x16_t nib16(const uint8_t *p, int hi) {
    uint8x16_t q = vld1q_u8(p);
    return vreinterpretq_s8_u8(hi ? vshrq_n_u8(q, 4) : vandq_u8(q, vdupq_n_u8(0x0f)));
}
static inline WVEC w_nib32(const uint8_t *p, int hi) { return (WVEC){{nib16(p, hi), nib16(p + 16, hi)}}; }
static inline int8x16_t bits16(uint32_t bits) {
    uint8x8_t select = vcreate_u8(0x8040201008040201ull);
    uint8x16_t set = vcombine_u8(vtst_u8(vdup_n_u8((uint8_t)bits), select), vtst_u8(vdup_n_u8((uint8_t)(bits >> 8)), select));
    return vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(16)));
}
static inline WVEC w_bits32(uint32_t bits) { return (WVEC){{bits16(bits), bits16(bits >> 16)}}; }
static inline int8x16_t high16(const uint8_t *p, int shift, int mask) {
    uint8x16_t q = vandq_u8(vshlq_u8(vld1q_u8(p), vdupq_n_s8((int8_t)-shift)), vdupq_n_u8((uint8_t)mask));
    return vreinterpretq_s8_u8(vshlq_n_u8(q, 4));
}
static inline WVEC w_high32(const uint8_t *p, int shift, int mask) {
    return (WVEC){{high16(p, shift, mask), high16(p + 16, shift, mask)}};
}
static inline WVEC w_or(WVEC a, WVEC b) { return (WVEC){{vorrq_s8(a.val[0], b.val[0]), vorrq_s8(a.val[1], b.val[1])}}; }
static inline WVEC w_sub(WVEC a, int c) {
    int8x16_t v = vdupq_n_s8((int8_t)c);
    return (WVEC){{vsubq_s8(a.val[0], v), vsubq_s8(a.val[1], v)}};
}
static inline void w_store(int8_t *out, WVEC w) { vst1q_s8(out, w.val[0]); vst1q_s8(out + 16, w.val[1]); }
static inline WVEC x_load(const int8_t *p) { return (WVEC){{vld1q_s8(p), vld1q_s8(p + 16)}}; }
static inline IACC dot_s(WVEC w, WVEC x) {
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w.val[0], x.val[0]), w.val[1], x.val[1]);
}
static inline IACC dot_u(WVEC w, WVEC x) { return dot_s(w, x); } /* sdot: unsigned values <= 127 are signed too */
static inline IACC dot_s2(WVEC w, WVEC x, int s0, int s1) {
    int32x4_t lo = vdotq_s32(vdupq_n_s32(0), w.val[0], x.val[0]), hi = vdotq_s32(vdupq_n_s32(0), w.val[1], x.val[1]);
    return vmlaq_n_s32(vmulq_n_s32(lo, s0), hi, s1);
}
static inline FACC facc_zero(void) { return vdupq_n_f32(0.0f); }
static inline FACC facc_fma(FACC acc, IACC v, float s) { return vfmaq_f32(acc, vcvtq_f32_s32(v), vdupq_n_f32(s)); }
static inline float facc_sum(FACC v) { return vaddvq_f32(v); }

#else /* portable C */
typedef struct { int8_t v[QK]; } WVEC;
typedef int32_t IACC;
typedef float FACC;
static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float */
        float f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13)) : (sign | ((exponent + 112) << 23) | (mantissa << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline WVEC w_load32(const uint8_t *p) { WVEC w; memcpy(w.v, p, QK); return w; }
static inline WVEC w_nib16(const uint8_t *p) {
    WVEC w;
    for (int l = 0; l < 16; l++) { w.v[l] = (int8_t)(p[l] & 0x0f); w.v[l + 16] = (int8_t)(p[l] >> 4); }
    return w;
}
static inline WVEC w_nib32(const uint8_t *p, int hi) {
    WVEC w;
    for (int l = 0; l < QK; l++) w.v[l] = (int8_t)(hi ? p[l] >> 4 : p[l] & 0x0f);
    return w;
}
static inline WVEC w_bits32(uint32_t bits) {
    WVEC w;
    for (int l = 0; l < QK; l++) w.v[l] = (int8_t)(((bits >> l) & 1u) << 4);
    return w;
}
static inline WVEC w_high32(const uint8_t *p, int shift, int mask) {
    WVEC w;
    for (int l = 0; l < QK; l++) w.v[l] = (int8_t)(((p[l] >> shift) & mask) << 4);
    return w;
}
static inline WVEC w_or(WVEC a, WVEC b) { for (int l = 0; l < QK; l++) a.v[l] |= b.v[l]; return a; }
static inline WVEC w_sub(WVEC a, int c) { for (int l = 0; l < QK; l++) a.v[l] = (int8_t)(a.v[l] - c); return a; }
static inline void w_store(int8_t *out, WVEC w) { memcpy(out, w.v, QK); }
static inline WVEC x_load(const int8_t *p) { WVEC w; memcpy(w.v, p, QK); return w; }
static inline IACC dot_s(WVEC w, WVEC x) {
    int32_t sum = 0;
    for (int l = 0; l < QK; l++) sum += w.v[l] * x.v[l];
    return sum;
}
static inline IACC dot_u(WVEC w, WVEC x) { return dot_s(w, x); }
static inline IACC dot_s2(WVEC w, WVEC x, int s0, int s1) {
    int32_t lo = 0, hi = 0;
    for (int l = 0; l < 16; l++) { lo += w.v[l] * x.v[l]; hi += w.v[l + 16] * x.v[l + 16]; }
    return s0 * lo + s1 * hi;
}
static inline FACC facc_zero(void) { return 0.0f; }
static inline FACC facc_fma(FACC acc, IACC v, float s) { return acc + (float)v * s; }
static inline float facc_sum(FACC v) { return v; }
#endif

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t read_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ---------------------------------------------------------------------------------------------
 * The block types, in ggml's layouts (gguf-py's gguf/quants.py dequantizes each the same way).
 * prep_<t> reads a block's scales once; chunk_<t> gives the c-th 32 elements as int8 lanes w with
 * their float scale (value = scale * w, or scale * s0/s1 * w for Q6_K's 16-element halves) and
 * float min (value += min; only the types with HAS_MIN). */
typedef struct {
    float d, dmin;
    float scale[8], min[8]; /* K types: d * sc[c], -dmin * m[c] per 32-element chunk */
} BlockScales;

/* Q8_0 {fp16 d; int8 qs[32]}: d * q */
static inline void prep_q8_0(const uint8_t *b, BlockScales *s) { s->d = fp16_to_f32(read_u16(b)); }
static inline WVEC chunk_q8_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)c, (void)min, (void)s0, (void)s1;
    *scale = s->d;
    return w_load32(b + 2);
}
/* Q4_0 {fp16 d; uint8 qs[16]}: d * (nibble - 8), low nibbles first */
static inline void prep_q4_0(const uint8_t *b, BlockScales *s) { s->d = fp16_to_f32(read_u16(b)); }
static inline WVEC chunk_q4_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)c, (void)min, (void)s0, (void)s1;
    *scale = s->d;
    return w_sub(w_nib16(b + 2), 8);
}
/* Q4_1 {fp16 d, m; uint8 qs[16]}: d * nibble + m */
static inline void prep_q4_1(const uint8_t *b, BlockScales *s) {
    s->d = fp16_to_f32(read_u16(b));
    s->dmin = fp16_to_f32(read_u16(b + 2));
}
static inline WVEC chunk_q4_1(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)c, (void)s0, (void)s1;
    *scale = s->d;
    *min = s->dmin;
    return w_nib16(b + 4);
}
/* Q5_0 {fp16 d; uint32 qh; uint8 qs[16]}: d * ((nibble | bit << 4) - 16) */
static inline void prep_q5_0(const uint8_t *b, BlockScales *s) { s->d = fp16_to_f32(read_u16(b)); }
static inline WVEC chunk_q5_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)c, (void)min, (void)s0, (void)s1;
    *scale = s->d;
    return w_sub(w_or(w_nib16(b + 6), w_bits32(read_u32(b + 2))), 16);
}
/* Q4_K and Q5_K: {fp16 d, dmin; uint8 scales[12]; (Q5_K: uint8 qh[32];) uint8 qs[128]}; chunk c
 * (32 elements) is d * sc[c] * q - dmin * m[c], sc and m six bits each, packed in scales. */
static inline void prep_k_scales(const uint8_t *b, BlockScales *s) {
    const uint8_t *q = b + 4;
    s->d = fp16_to_f32(read_u16(b));
    s->dmin = fp16_to_f32(read_u16(b + 2));
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = q[j] & 63;
            m = q[j + 4] & 63;
        } else {
            sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
            m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
        s->scale[j] = s->d * (float)sc;
        s->min[j] = -(s->dmin * (float)m);
    }
}
static inline void prep_q4_k(const uint8_t *b, BlockScales *s) { prep_k_scales(b, s); }
static inline WVEC chunk_q4_k(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)s0, (void)s1;
    *scale = s->scale[c];
    *min = s->min[c];
    return w_nib32(b + 16 + 32 * (c / 2), c & 1);
}
static inline void prep_q5_k(const uint8_t *b, BlockScales *s) { prep_k_scales(b, s); }
static inline WVEC chunk_q5_k(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)s0, (void)s1;
    *scale = s->scale[c];
    *min = s->min[c];
    return w_or(w_nib32(b + 48 + 32 * (c / 2), c & 1), w_high32(b + 16, c, 1));
}
/* Q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d}: d * scales[i] * (q - 32) per 16
 * elements, q = four bits of ql | two bits of qh << 4. */
static inline void prep_q6_k(const uint8_t *b, BlockScales *s) { s->d = fp16_to_f32(read_u16(b + 208)); }
static inline WVEC chunk_q6_k(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)min;
    int half = c / 4, k = c % 4;
    const int8_t *scales = (const int8_t *)(b + 192) + 8 * half + 2 * k;
    *scale = s->d;
    *s0 = scales[0];
    *s1 = scales[1];
    return w_sub(w_or(w_nib32(b + 64 * half + 32 * (k & 1), k >> 1), w_high32(b + 128 + 32 * half, 2 * k, 3)), 32);
}

/* ---------------------------------------------------------------------------------------------
 * Activations: each row's 32-element blocks to int8 with d = max|x| / 127 and q = round-to-even
 * of x * (1 / d) (infer.kernels.quant.quantize_activations mirrors this exactly), and the block's
 * d * sum(q) for the types with a min. Row-wise: a row's blocks depend on that row only. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *dx, float *sx) {
    int64_t blocks = k / QK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * k + b * QK;
            float amax = 0.0f;
            for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(v[l]));
            float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int l = 0; l < QK; l++) {
                int32_t q = (int32_t)nearbyintf(v[l] * inverse);
                xq[(r * blocks + b) * QK + l] = (int8_t)q;
                sum += q;
            }
            dx[r * blocks + b] = d;
            sx[r * blocks + b] = d * (float)sum;
        }
}

#define QTYPE q8_0
#define QT_ELEMS 32
#define QT_BYTES 34
#define QT_HAS_MIN 0
#define QT_DOT(w, x, s0, s1) dot_s(w, x)
#include "quant_kernels_impl.h"
#define QTYPE q4_0
#define QT_ELEMS 32
#define QT_BYTES 18
#define QT_HAS_MIN 0
#define QT_DOT(w, x, s0, s1) dot_s(w, x)
#include "quant_kernels_impl.h"
#define QTYPE q4_1
#define QT_ELEMS 32
#define QT_BYTES 20
#define QT_HAS_MIN 1
#define QT_DOT(w, x, s0, s1) dot_u(w, x)
#include "quant_kernels_impl.h"
#define QTYPE q5_0
#define QT_ELEMS 32
#define QT_BYTES 22
#define QT_HAS_MIN 0
#define QT_DOT(w, x, s0, s1) dot_s(w, x)
#include "quant_kernels_impl.h"
#define QTYPE q4_k
#define QT_ELEMS 256
#define QT_BYTES 144
#define QT_HAS_MIN 1
#define QT_DOT(w, x, s0, s1) dot_u(w, x)
#include "quant_kernels_impl.h"
#define QTYPE q5_k
#define QT_ELEMS 256
#define QT_BYTES 176
#define QT_HAS_MIN 1
#define QT_DOT(w, x, s0, s1) dot_u(w, x)
#include "quant_kernels_impl.h"
#define QTYPE q6_k
#define QT_ELEMS 256
#define QT_BYTES 210
#define QT_HAS_MIN 0
#define QT_DOT(w, x, s0, s1) dot_s2(w, x, s0, s1)
#include "quant_kernels_impl.h"

/* What Python checks at load: the ISA this build holds, the types and their block sizes, the
 * activation block. A mismatch refuses the library instead of misreading the weights. */
const char *infer_quant_layout(void) {
    return "isa=" QISA " qk=32 q8_0=32:34 q4_0=32:18 q4_1=32:20 q5_0=32:22 q4_k=256:144 q5_k=256:176 q6_k=256:210";
}
