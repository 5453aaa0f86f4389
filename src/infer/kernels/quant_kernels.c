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
/* Input rows per pass over a weight chunk: 8 where 32 vector registers hold their accumulators
 * (AVX-512; 6 rows took 1.71 ms instead of 1.89 with 4 for a 2048x8192 Q4_0 in cache), else 4
 * (AVX2's 16 registers: 8 was no faster). */
#ifndef RB
#ifdef Q_VNNI
#define RB 8
#else
#define RB 4
#endif
#endif
/* Weight rows ahead of the ones in use to prefetch. A row pair is a few KB, too short for the
 * hardware prefetcher to find the stream before it ends: without this a streamed 2048x8192 Q4_0
 * product read 3.8 GB/s at 1 row and 1 thread on the project's EPYC; the next pair ahead gave
 * 13.9, two pairs 9.0 (a busy machine: single runs). A prefetch never faults, so addresses past
 * the weight's end are harmless. */
#ifndef AHEAD
#define AHEAD JB
#endif

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
 *   facc_set1(f), facc_mul(a, b)   f in every lane; a * b lane-wise
 *   facc_fma(acc, v, s)   acc + float(v) * s, lane-wise;  facc_sum(acc): its lanes' sum, one tree
 *   F8: 8 floats (a K super-block's chunk mins): f8_zero, f8_load(p), f8_fma(a, b, c) = a * b + c, f8_sum,
 *   f8_bytes(u) (the 8 bytes of u, low first, as floats), f8_scale(a, f) = a * f
 */
#if defined(Q_X86)
typedef __m256i WVEC;
typedef __m256i IACC;
typedef __m256 FACC;
static inline float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline WVEC w_load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline WVEC w_nib16(const uint8_t *p) { /* the 16 bytes in both halves, the upper one shifted by 4 */
    __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f));
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
static inline FACC facc_set1(float f) { return _mm256_set1_ps(f); }
static inline FACC facc_mul(FACC a, FACC b) { return _mm256_mul_ps(a, b); }
static inline FACC facc_fma(FACC acc, IACC v, FACC s) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, acc); }
typedef __m256 F8;
static inline F8 f8_zero(void) { return _mm256_setzero_ps(); }
static inline F8 f8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline F8 f8_fma(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline F8 f8_bytes(uint64_t u) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)u))); }
static inline F8 f8_scale(F8 a, float f) { return _mm256_mul_ps(a, _mm256_set1_ps(f)); }
static inline float f8_sum(F8 v);
static inline float facc_sum(FACC v) { return f8_sum(v); }
static inline float f8_sum(F8 v) {
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
static inline FACC facc_set1(float f) { return vdupq_n_f32(f); }
static inline FACC facc_mul(FACC a, FACC b) { return vmulq_f32(a, b); }
static inline FACC facc_fma(FACC acc, IACC v, FACC s) { return vfmaq_f32(acc, vcvtq_f32_s32(v), s); }
static inline float facc_sum(FACC v) { return vaddvq_f32(v); }
typedef float32x4x2_t F8;
static inline F8 f8_zero(void) { return (F8){{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
static inline F8 f8_load(const float *p) { return (F8){{vld1q_f32(p), vld1q_f32(p + 4)}}; }
static inline F8 f8_fma(F8 a, F8 b, F8 c) { return (F8){{vfmaq_f32(c.val[0], a.val[0], b.val[0]), vfmaq_f32(c.val[1], a.val[1], b.val[1])}}; }
static inline float f8_sum(F8 v) { return vaddvq_f32(vaddq_f32(v.val[0], v.val[1])); }
static inline F8 f8_bytes(uint64_t u) {
    uint16x8_t wide = vmovl_u8(vcreate_u8(u));
    return (F8){{vcvtq_f32_u32(vmovl_u16(vget_low_u16(wide))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(wide)))}};
}
static inline F8 f8_scale(F8 a, float f) { return (F8){{vmulq_n_f32(a.val[0], f), vmulq_n_f32(a.val[1], f)}}; }

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
static inline FACC facc_set1(float f) { return f; }
static inline FACC facc_mul(FACC a, FACC b) { return a * b; }
static inline FACC facc_fma(FACC acc, IACC v, FACC s) { return acc + (float)v * s; }
static inline float facc_sum(FACC v) { return v; }
typedef struct { float v[8]; } F8;
static inline F8 f8_zero(void) { F8 a; for (int l = 0; l < 8; l++) a.v[l] = 0.0f; return a; }
static inline F8 f8_load(const float *p) { F8 a; memcpy(a.v, p, sizeof a.v); return a; }
static inline F8 f8_fma(F8 a, F8 b, F8 c) { for (int l = 0; l < 8; l++) c.v[l] += a.v[l] * b.v[l]; return c; }
static inline float f8_sum(F8 v) { float t = 0.0f; for (int l = 0; l < 8; l++) t += v.v[l]; return t; }
static inline F8 f8_bytes(uint64_t u) { F8 a; for (int l = 0; l < 8; l++) a.v[l] = (float)((u >> (8 * l)) & 0xff); return a; }
static inline F8 f8_scale(F8 a, float f) { for (int l = 0; l < 8; l++) a.v[l] *= f; return a; }
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
    F8 lane[2];             /* Q6_K on x86: d * scales[0..7], d * scales[8..15] */
    F8 mins;                /* Q4_K, Q5_K: min[0..7] as a vector (computed as one, not loaded back from min[]:
                               8 scalar stores read by one vector load stall the store forwarding) */
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
static inline WVEC chunk_u_q4_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)c, (void)min, (void)s0, (void)s1;
    *scale = s->d;
    return w_nib16(b + 2);
}
static inline WVEC chunk_q4_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    return w_sub(chunk_u_q4_0(b, s, c, scale, min, s0, s1), 8);
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
static inline WVEC chunk_u_q5_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)c, (void)min, (void)s0, (void)s1;
    *scale = s->d;
    return w_or(w_nib16(b + 6), w_bits32(read_u32(b + 2)));
}
static inline WVEC chunk_q5_0(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    return w_sub(chunk_u_q5_0(b, s, c, scale, min, s0, s1), 16);
}
/* Q4_K and Q5_K: {fp16 d, dmin; uint8 scales[12]; (Q5_K: uint8 qh[32];) uint8 qs[128]}; chunk c
 * (32 elements) is d * sc[c] * q - dmin * m[c], sc and m six bits each, packed in scales. */
static inline void prep_k_scales(const uint8_t *b, BlockScales *s) {
    s->d = fp16_to_f32(read_u16(b));
    s->dmin = fp16_to_f32(read_u16(b + 2));
    /* the eight 6-bit scales and mins, a byte each: chunks 0-3 are the low six bits of bytes 0-3
     * (scales) and 4-7 (mins); chunks 4-7 take four bits from bytes 8-11 and their top two bits
     * from the top of bytes 0-3 / 4-7 */
    uint32_t a = read_u32(b + 4), m = read_u32(b + 8), c = read_u32(b + 12);
    uint64_t scales = (uint64_t)(a & 0x3f3f3f3fu) | (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    uint64_t mins = (uint64_t)(m & 0x3f3f3f3fu) | (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((m >> 2) & 0x30303030u)) << 32;
    for (int j = 0; j < 8; j++) {
        s->scale[j] = s->d * (float)((scales >> (8 * j)) & 0xff);
        s->min[j] = -(s->dmin * (float)((mins >> (8 * j)) & 0xff));
    }
    s->mins = f8_scale(f8_bytes(mins), -s->dmin); /* (-dmin) * m == -(dmin * m), bit for bit */
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
static inline void prep_q6_k(const uint8_t *b, BlockScales *s) {
    s->d = fp16_to_f32(read_u16(b + 208));
#ifdef Q_X86
    __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
    __m256 d = _mm256_set1_ps(s->d);
    s->lane[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales)), d);
    s->lane[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))), d);
#endif
}
static inline WVEC chunk_q6_k(const uint8_t *b, const BlockScales *s, int c, float *scale, float *min, int *s0, int *s1) {
    (void)min;
    int half = c / 4, k = c % 4;
    const int8_t *scales = (const int8_t *)(b + 192) + 8 * half + 2 * k;
    *scale = s->d;
    *s0 = scales[0];
    *s1 = scales[1];
    return w_sub(w_or(w_nib32(b + 64 * half + 32 * (k & 1), k >> 1), w_high32(b + 128 + 32 * half, 2 * k, 3)), 32);
}
#ifdef Q_X86
/* On x86 Q6_K's two scales per chunk are float lanes rather than integer factors: a chunk's dot
 * product lanes 0-3 hold its first 16 elements' partial sums and lanes 4-7 the last 16's, so
 * they meet [d * sc0 x4, d * sc1 x4] (one permute of the super-block's scales) in the float
 * multiply-add the other types do anyway, and the integer product is the plain one. */
#define Q6K_LANE_SCALES 1
static inline FACC q6_k_lane_scales(const BlockScales *s, int c) {
    int half = c / 4, k = c % 4;
    return _mm256_permutevar8x32_ps(s->lane[half], _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                                                      2 * k + 1, 2 * k + 1));
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Activations: each row's 32-element blocks to int8 with d = max|x| / 127 and q = round-to-even
 * of x * (1 / d) (infer.kernels.quant.quantize_activations mirrors this exactly), and the block's
 * d * sum(q) for the types with a min. Row-wise: a row's blocks depend on that row only.
 * With VNNI, Q4_0 and Q5_0 multiply their unsigned values (vpdpbusd's unsigned operand, no sign
 * trick per row) with the dot product started at -offset * x's lane sums: the same integers. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *dx, float *sx, int32_t *init,
                          int offset) {
    int64_t blocks = k / QK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * k + b * QK;
            int8_t *q = xq + (r * blocks + b) * QK;
            float amax = 0.0f;
            for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(v[l]));
            float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int l = 0; l < QK; l++) {
                q[l] = (int8_t)nearbyintf(v[l] * inverse);
                sum += q[l];
            }
            dx[r * blocks + b] = d;
            sx[r * blocks + b] = d * (float)sum;
            if (init) /* -offset * the sums of 4 consecutive values: the dot-product lanes' start */
                for (int l = 0; l < 8; l++)
                    init[(r * blocks + b) * 8 + l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
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
#ifdef Q_VNNI
#define QT_OFFSET 8
#endif
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
#ifdef Q_VNNI
#define QT_OFFSET 16
#endif
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
#ifdef Q6K_LANE_SCALES
#define QT_LANE_SCALES 1
#define QT_DOT(w, x, s0, s1) dot_s(w, x)
#else
#define QT_DOT(w, x, s0, s1) dot_s2(w, x, s0, s1)
#endif
#include "quant_kernels_impl.h"

/* ---------------------------------------------------------------------------------------------
 * The x8 layout (quant_x8.h): 8 weight rows interleaved, for the types registered in X8_TYPES. */
#include "quant_x8.h"

/* The 32-value block b's activation values at 4-byte unit u (values 4u .. 4u + 3) of row r. */
static inline GX x8_x(const X8Act *a, int64_t r, int64_t b, int u) { return gx_load(a->q + r * a->k + b * QK + 4 * u); }
static inline int32_t x8_xsum(const X8Act *a, int64_t r, int64_t b) { return a->sum[r * a->xblocks + b]; }
static inline float x8_dx(const X8Act *a, int64_t r, int64_t b) { return a->d[r * a->xblocks + b]; }
static inline float x8_sx(const X8Act *a, int64_t r, int64_t b) { return a->s[r * a->xblocks + b]; }

/* Row j's scale bytes (a float16 at `at` in each file block) side by side: 16 bytes at dst. */
static inline void x8_gather16(const uint8_t *const *rows, int at, uint8_t *dst) {
    for (int j = 0; j < 8; j++) {
        if (rows[j]) memcpy(dst + 2 * j, rows[j] + at, 2);
        else memset(dst + 2 * j, 0, 2);
    }
}
/* `units` 4-byte units from each row's bytes at `at`: unit u of row j at dst + 32 u + 4 j. */
static inline void x8_interleave(const uint8_t *const *rows, int at, int units, uint8_t *dst) {
    for (int u = 0; u < units; u++)
        for (int j = 0; j < 8; j++) {
            if (rows[j]) memcpy(dst + 32 * u + 4 * j, rows[j] + at + 4 * u, 4);
            else memset(dst + 32 * u + 4 * j, 0, 4);
        }
}

/* The 4-bit types' (and Q5_0's) 32 values of a block as 16 nibble bytes (low nibble value l,
 * high nibble value 16 + l) interleaved in 4 units at `qs`: unit u of row j holds values
 * 4u .. 4u+3 (low nibbles) and 16 + 4u .. 16 + 4u + 3 (high). With `fifth` >= 0, 32 bytes there
 * hold the fifth bits the same way: byte 4j + i of the unit has bit u = value 4u + i's, bit 4 + u
 * = value 16 + 4u + i's. isum[r][z] += the unsigned values' dot products with the activations. */
static inline __attribute__((always_inline)) void x8_nibble_dots(const uint8_t *const *gp, int qs, int fifth,
                                                                 const X8Act *a, int64_t r0, int64_t b,
                                                                 GI isum[X8_RB][X8_NZ_MAX], const int R, const int NZ) {
    for (int u = 0; u < 4; u++) {
        GW lo[X8_NZ_MAX], hi[X8_NZ_MAX];
        for (int z = 0; z < NZ; z++) {
            GW w = gw_load(gp[2 * z] + qs + 32 * u, gp[2 * z + 1] + qs + 32 * u);
            lo[z] = gw_lo(w), hi[z] = gw_hi(w);
            if (fifth >= 0) {
                GW h = gw_load(gp[2 * z] + fifth, gp[2 * z + 1] + fifth);
                lo[z] = gw_or(lo[z], gw_field(h, u, 1)), hi[z] = gw_or(hi[z], gw_field(h, 4 + u, 1));
            }
        }
        for (int r = 0; r < R; r++) {
            GX xl = x8_x(a, r0 + r, b, u), xh = x8_x(a, r0 + r, b, 4 + u);
            for (int z = 0; z < NZ; z++) isum[r][z] = gi_dot_u(gi_dot_u(isum[r][z], lo[z], xl), hi[z], xh);
        }
    }
}
/* acc = fmaf((float)isum, d_w * d_x, acc) per row and two-group vector, d_w the float16 scales at `at` */
static inline __attribute__((always_inline)) void x8_scale_sums(const uint8_t *const *gp, int at, const X8Act *a,
                                                                int64_t r0, int64_t b, GI isum[X8_RB][X8_NZ_MAX],
                                                                GF acc[X8_RB][X8_NZ_MAX], const int R, const int NZ) {
    for (int z = 0; z < NZ; z++) {
        GF dw = gf_fp16(gp[2 * z] + at, gp[2 * z + 1] + at);
        for (int r = 0; r < R; r++) acc[r][z] = gf_fma_i(acc[r][z], isum[r][z], gf_mul(dw, gf_set1(x8_dx(a, r0 + r, b))));
    }
}
/* Rows' nibble-byte values (the layout above) of x8 block `blk`, row j: out[l] = scale * (q - offset) + min */
static inline void x8_nibble_values(const uint8_t *blk, int j, int qs, int fifth, float scale, int offset, int has_min,
                                    float min, float *out) {
    for (int u = 0; u < 4; u++)
        for (int i = 0; i < 4; i++) {
            const uint8_t byte = blk[qs + 32 * u + 4 * j + i], high = fifth >= 0 ? blk[fifth + 4 * j + i] : 0;
            const int lo = (byte & 15) | ((high >> u) & 1) << 4, hi = (byte >> 4) | ((high >> (4 + u)) & 1) << 4;
            const float vlo = scale * (float)(lo - offset), vhi = scale * (float)(hi - offset);
            out[4 * u + i] = has_min ? vlo + min : vlo;
            out[16 + 4 * u + i] = has_min ? vhi + min : vhi;
        }
}

/* Q4_0 x8 block, 144 bytes: float16 d[8] (row j's at 2j), then the nibble units at 16 (values
 * 0..15 as stored; value = d * (q - 8), the -8 applied in integers: isum starts at -8 * sum(x)). */
static void x8_repack_q4_0(const uint8_t *const *rows, uint8_t *dst) {
    x8_gather16(rows, 0, dst);
    x8_interleave(rows, 2, 4, dst + 16);
}
static inline __attribute__((always_inline)) void x8_block_q4_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(-8 * x8_xsum(a, r0 + r, b));
    x8_nibble_dots(gp, 16, -1, a, r0, b, isum, R, NZ);
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
}
static void x8_dequant_q4_0(const uint8_t *blk, int j, float *out) {
    x8_nibble_values(blk, j, 16, -1, fp16_to_f32(read_u16(blk + 2 * j)), 8, 0, 0.0f, out);
}

/* Q4_1 x8 block, 160 bytes: float16 d[8] at 0, m[8] at 16, the nibble units at 32 (value d * q + m).
 * After the scaled sum, acc = fmaf(m_w, sx, acc). */
static void x8_repack_q4_1(const uint8_t *const *rows, uint8_t *dst) {
    x8_gather16(rows, 0, dst);
    x8_gather16(rows, 2, dst + 16);
    x8_interleave(rows, 4, 4, dst + 32);
}
static inline __attribute__((always_inline)) void x8_block_q4_1(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(0);
    x8_nibble_dots(gp, 32, -1, a, r0, b, isum, R, NZ);
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
    for (int z = 0; z < NZ; z++) {
        GF mw = gf_fp16(gp[2 * z] + 16, gp[2 * z + 1] + 16);
        for (int r = 0; r < R; r++) acc[r][z] = gf_fma(acc[r][z], mw, gf_set1(x8_sx(a, r0 + r, b)));
    }
}
static void x8_dequant_q4_1(const uint8_t *blk, int j, float *out) {
    x8_nibble_values(blk, j, 32, -1, fp16_to_f32(read_u16(blk + 2 * j)), 0, 1, fp16_to_f32(read_u16(blk + 16 + 2 * j)),
                     out);
}

/* Q5_0 x8 block, 176 bytes: float16 d[8] at 0, the fifth bits at 16 (32 bytes), the nibble units
 * at 48 (value d * (q - 16), the -16 applied in integers). */
static void x8_repack_q5_0(const uint8_t *const *rows, uint8_t *dst) {
    x8_gather16(rows, 0, dst);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++) {
            uint8_t byte = 0;
            if (rows[j]) {
                const uint32_t qh = read_u32(rows[j] + 2);
                for (int u = 0; u < 4; u++)
                    byte |= (uint8_t)(((qh >> (4 * u + i)) & 1u) << u | ((qh >> (16 + 4 * u + i)) & 1u) << (4 + u));
            }
            dst[16 + 4 * j + i] = byte;
        }
    x8_interleave(rows, 6, 4, dst + 48);
}
static inline __attribute__((always_inline)) void x8_block_q5_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(-16 * x8_xsum(a, r0 + r, b));
    x8_nibble_dots(gp, 48, 16, a, r0, b, isum, R, NZ);
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
}
static void x8_dequant_q5_0(const uint8_t *blk, int j, float *out) {
    x8_nibble_values(blk, j, 48, 16, fp16_to_f32(read_u16(blk + 2 * j)), 16, 0, 0.0f, out);
}

/* Q8_0 x8 block, 272 bytes: float16 d[8], then 8 units at 16: unit u of row j (at 16 + 32 u + 4 j)
 * holds its values 4u .. 4u + 3 (signed, as stored; value = d * q). */
static void x8_repack_q8_0(const uint8_t *const *rows, uint8_t *dst) {
    x8_gather16(rows, 0, dst);
    x8_interleave(rows, 2, 8, dst + 16);
}
static inline __attribute__((always_inline)) void x8_block_q8_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(-X8_S8_OFFSET * x8_xsum(a, r0 + r, b));
    for (int u = 0; u < 8; u++) {
        GW wv[X8_NZ_MAX];
        for (int z = 0; z < NZ; z++) wv[z] = gw_s8(gw_load(gp[2 * z] + 16 + 32 * u, gp[2 * z + 1] + 16 + 32 * u));
        for (int r = 0; r < R; r++) {
            GX xv = x8_x(a, r0 + r, b, u);
            for (int z = 0; z < NZ; z++) isum[r][z] = gi_dot_s8(isum[r][z], wv[z], xv);
        }
    }
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
}
static void x8_dequant_q8_0(const uint8_t *blk, int j, float *out) {
    const float d = fp16_to_f32(read_u16(blk + 2 * j));
    for (int u = 0; u < 8; u++)
        for (int i = 0; i < 4; i++) out[4 * u + i] = d * (float)(int8_t)blk[16 + 32 * u + 4 * j + i];
}

/* The K types: super-blocks of 256 values in 8 chunks of 32, each chunk with its own integer
 * scale (Q6_K: one per 16 values). A chunk meets its activation block (same dx) in an exact
 * integer dot product; its float work is one fmaf per output (plus the min term). Chunks 2p and
 * 2p + 1 share nibble bytes: unit (p, w) = 32 bytes at qs + 32 (8p + w), row j's 4 bytes at 4j,
 * byte i's low nibble is chunk 2p's value 4w + i and its high nibble chunk 2p + 1's. */
static inline size_t x8_k_nibble_at(int qs, int j, int c, int l) { return (size_t)(qs + 32 * (8 * (c >> 1) + (l >> 2)) + 4 * j + (l & 3)); }
static inline void x8_k_put_nibble(uint8_t *dst, int qs, int j, int c, int l, int v) {
    dst[x8_k_nibble_at(qs, j, c, l)] |= (uint8_t)((v & 15) << (4 * (c & 1)));
}
static inline int x8_k_nibble(const uint8_t *blk, int qs, int j, int c, int l) {
    return (blk[x8_k_nibble_at(qs, j, c, l)] >> (4 * (c & 1))) & 15;
}
/* 6-bit scale and min of chunk c from a Q4_K/Q5_K file block's 12 scale bytes s */
static inline void x8_k_scale_min(const uint8_t *s, int c, int *sc, int *m) {
    if (c < 4) {
        *sc = s[c] & 63, *m = s[c + 4] & 63;
    } else {
        *sc = (s[c + 4] & 15) | ((s[c - 4] >> 6) << 4), *m = (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
    }
}

/* Q4_K x8 block, 1152 bytes (the file's 8 blocks): float16 d[8] at 0 and -dmin[8] at 16 (the sign
 * flipped at repack: exact), the six-bit scales and mins of chunk c, row j: sc | (m >> 4) << 6 in
 * byte 32 + 8c + j and m's low four bits in nibble c % 2 of byte 96 + 8 (c / 2) + j; the nibble
 * units at 128. Q5_K x8 block, 1408 bytes: the same, then the fifth bits at 1152: unit (p, t) =
 * 32 bytes at 1152 + 32 (2p + t), byte 4j + i's bit s = row j's value 4 (4t + s) + i of chunk 2p,
 * bit 4 + s the same of chunk 2p + 1. Per output, chunk c in order (isum exact):
 *     acc = fmaf((float)isum_c, (d * sc_c) * dx_c, acc);  acc = fmaf((-dmin) * m_c, sx_c, acc) */
static void x8_repack_k45(const uint8_t *const *rows, uint8_t *dst, int fifth) {
    memset(dst, 0, fifth ? 1408 : 1152);
    const int qs = fifth ? 48 : 16; /* the file's nibbles (Q5_K: after qh[32] at 16) */
    for (int j = 0; j < 8; j++) {
        const uint8_t *f = rows[j];
        if (!f) continue;
        memcpy(dst + 2 * j, f, 2);
        dst[16 + 2 * j] = f[2], dst[16 + 2 * j + 1] = (uint8_t)(f[3] ^ 0x80);
        for (int c = 0; c < 8; c++) {
            int sc, m;
            x8_k_scale_min(f + 4, c, &sc, &m);
            dst[32 + 8 * c + j] = (uint8_t)(sc | (m >> 4) << 6);
            dst[96 + 8 * (c >> 1) + j] |= (uint8_t)((m & 15) << (4 * (c & 1)));
            for (int l = 0; l < QK; l++) {
                x8_k_put_nibble(dst, 128, j, c, l, f[qs + 32 * (c >> 1) + l] >> (4 * (c & 1)));
                if (fifth)
                    dst[1152 + 32 * (2 * (c >> 1) + (l >> 4)) + 4 * j + (l & 3)] |=
                        (uint8_t)(((f[16 + l] >> c) & 1) << (4 * (c & 1) + ((l >> 2) & 3)));
            }
        }
    }
}
static void x8_repack_q4_k(const uint8_t *const *rows, uint8_t *dst) { x8_repack_k45(rows, dst, 0); }
static void x8_repack_q5_k(const uint8_t *const *rows, uint8_t *dst) { x8_repack_k45(rows, dst, 1); }
static inline __attribute__((always_inline)) void x8_block_k45(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                               int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                               const int NZ, const int fifth) {
    GF d[X8_NZ_MAX], negmin[X8_NZ_MAX];
    for (int z = 0; z < NZ; z++) d[z] = gf_fp16(gp[2 * z], gp[2 * z + 1]), negmin[z] = gf_fp16(gp[2 * z] + 16, gp[2 * z + 1] + 16);
    for (int p = 0; p < 4; p++) {
        GI i0[X8_RB][X8_NZ_MAX], i1[X8_RB][X8_NZ_MAX];
        for (int r = 0; r < R; r++)
            for (int z = 0; z < NZ; z++) i0[r][z] = i1[r][z] = gi_set1(0);
        for (int w = 0; w < 8; w++) {
            GW lo[X8_NZ_MAX], hi[X8_NZ_MAX];
            for (int z = 0; z < NZ; z++) {
                GW v = gw_load(gp[2 * z] + 128 + 32 * (8 * p + w), gp[2 * z + 1] + 128 + 32 * (8 * p + w));
                lo[z] = gw_lo(v), hi[z] = gw_hi(v);
                if (fifth) {
                    const int at = 1152 + 32 * (2 * p + (w >> 2));
                    GW h = gw_load(gp[2 * z] + at, gp[2 * z + 1] + at);
                    lo[z] = gw_or(lo[z], gw_field(h, w & 3, 1)), hi[z] = gw_or(hi[z], gw_field(h, 4 + (w & 3), 1));
                }
            }
            for (int r = 0; r < R; r++) {
                GX x0 = x8_x(a, r0 + r, 8 * b + 2 * p, w), x1 = x8_x(a, r0 + r, 8 * b + 2 * p + 1, w);
                for (int z = 0; z < NZ; z++) i0[r][z] = gi_dot_u(i0[r][z], lo[z], x0), i1[r][z] = gi_dot_u(i1[r][z], hi[z], x1);
            }
        }
        for (int h = 0; h < 2; h++) {
            const int c = 2 * p + h;
            for (int z = 0; z < NZ; z++) {
                const uint8_t *s0 = gp[2 * z] + 32 + 8 * c, *s1 = gp[2 * z + 1] + 32 + 8 * c;
                const GF dsc = gf_mul(d[z], gf_bits(s0, s1, 0, 63));
                const GF m = gf_fma(gf_bits(gp[2 * z] + 96 + 8 * p, gp[2 * z + 1] + 96 + 8 * p, 4 * h, 15),
                                    gf_bits(s0, s1, 6, 3), gf_set1(16.0f)); /* low + 16 * high, exact */
                const GF mn = gf_mul(negmin[z], m);
                for (int r = 0; r < R; r++) {
                    acc[r][z] = gf_fma_i(acc[r][z], h ? i1[r][z] : i0[r][z], gf_mul(dsc, gf_set1(x8_dx(a, r0 + r, 8 * b + c))));
                    acc[r][z] = gf_fma(acc[r][z], mn, gf_set1(x8_sx(a, r0 + r, 8 * b + c)));
                }
            }
        }
    }
}
static inline __attribute__((always_inline)) void x8_block_q4_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    x8_block_k45(gp, a, r0, b, acc, R, NZ, 0);
}
static inline __attribute__((always_inline)) void x8_block_q5_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    x8_block_k45(gp, a, r0, b, acc, R, NZ, 1);
}
static void x8_dequant_k45(const uint8_t *blk, int j, float *out, int fifth) {
    const float d = fp16_to_f32(read_u16(blk + 2 * j)), negmin = fp16_to_f32(read_u16(blk + 16 + 2 * j));
    for (int c = 0; c < 8; c++) {
        const int m = (blk[96 + 8 * (c >> 1) + j] >> (4 * (c & 1)) & 15) | (blk[32 + 8 * c + j] >> 6) << 4;
        const float scale = d * (float)(blk[32 + 8 * c + j] & 63), min = negmin * (float)m;
        for (int l = 0; l < QK; l++) {
            int q = x8_k_nibble(blk, 128, j, c, l);
            if (fifth) q |= ((blk[1152 + 32 * (2 * (c >> 1) + (l >> 4)) + 4 * j + (l & 3)] >> (4 * (c & 1) + ((l >> 2) & 3))) & 1) << 4;
            out[QK * c + l] = scale * (float)q + min;
        }
    }
}
static void x8_dequant_q4_k(const uint8_t *blk, int j, float *out) { x8_dequant_k45(blk, j, out, 0); }
static void x8_dequant_q5_k(const uint8_t *blk, int j, float *out) { x8_dequant_k45(blk, j, out, 1); }

/* Q6_K x8 block, 1680 bytes: float16 d[8] at 0, the int8 scales sc[8 chunks][2 halves][8 rows]
 * at 16 (half 0: a chunk's values 0-15), the low four bits as nibble units at 144, the top two
 * bits at 1168: unit (c, t) = 32 bytes at 1168 + 32 (2c + t), byte 4j + i's bits 2s, 2s + 1 =
 * row j's value 4 (4t + s) + i of chunk c. A value is (low | top << 4) - 32: the unsigned
 * (low | top << 4) goes into the dot product, each half's sum started at -32 * its activation
 * sum. Per output, chunk c in order (isum exact, |isum| < 2^24):
 *     isum_c = sc0 * dot(values 0-15) + sc1 * dot(values 16-31);  acc = fmaf((float)isum_c, d * dx_c, acc) */
static void x8_repack_q6_k(const uint8_t *const *rows, uint8_t *dst) {
    memset(dst, 0, 1680);
    for (int j = 0; j < 8; j++) {
        const uint8_t *f = rows[j];
        if (!f) continue;
        memcpy(dst + 2 * j, f + 208, 2);
        for (int c = 0; c < 8; c++) {
            const int half = c / 4, kk = c % 4;
            dst[16 + 16 * c + j] = f[192 + 8 * half + 2 * kk], dst[16 + 16 * c + 8 + j] = f[192 + 8 * half + 2 * kk + 1];
            for (int l = 0; l < QK; l++) {
                const int low = (f[64 * half + 32 * (kk & 1) + l] >> (4 * (kk >> 1))) & 15;
                const int top = (f[128 + 32 * half + l] >> (2 * kk)) & 3;
                x8_k_put_nibble(dst, 144, j, c, l, low);
                dst[1168 + 32 * (2 * c + (l >> 4)) + 4 * j + (l & 3)] |= (uint8_t)(top << (2 * ((l >> 2) & 3)));
            }
        }
    }
}
static inline __attribute__((always_inline)) void x8_block_q6_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GF d[X8_NZ_MAX];
    for (int z = 0; z < NZ; z++) d[z] = gf_fp16(gp[2 * z], gp[2 * z + 1]);
    for (int c = 0; c < 8; c++) {
        const int64_t xb = 8 * b + c;
        GI half[2][X8_RB][X8_NZ_MAX];
        for (int r = 0; r < R; r++) {
            const int32_t s16 = a->sum16[(r0 + r) * a->xblocks + xb];
            for (int z = 0; z < NZ; z++) half[0][r][z] = gi_set1(-32 * s16), half[1][r][z] = gi_set1(-32 * (x8_xsum(a, r0 + r, xb) - s16));
        }
        for (int t = 0; t < 2; t++) {
            GW top[X8_NZ_MAX];
            for (int z = 0; z < NZ; z++) top[z] = gw_load(gp[2 * z] + 1168 + 32 * (2 * c + t), gp[2 * z + 1] + 1168 + 32 * (2 * c + t));
            for (int s = 0; s < 4; s++) {
                const int w = 4 * t + s;
                GW u[X8_NZ_MAX];
                for (int z = 0; z < NZ; z++) {
                    GW v = gw_load(gp[2 * z] + 144 + 32 * (8 * (c >> 1) + w), gp[2 * z + 1] + 144 + 32 * (8 * (c >> 1) + w));
                    u[z] = gw_or(c & 1 ? gw_hi(v) : gw_lo(v), gw_field(top[z], 2 * s, 3));
                }
                for (int r = 0; r < R; r++) {
                    GX xv = x8_x(a, r0 + r, xb, w);
                    for (int z = 0; z < NZ; z++) half[t][r][z] = gi_dot_u(half[t][r][z], u[z], xv);
                }
            }
        }
        for (int z = 0; z < NZ; z++) {
            const GI sc0 = gi_i8(gp[2 * z] + 16 + 16 * c, gp[2 * z + 1] + 16 + 16 * c);
            const GI sc1 = gi_i8(gp[2 * z] + 24 + 16 * c, gp[2 * z + 1] + 24 + 16 * c);
            for (int r = 0; r < R; r++)
                acc[r][z] = gf_fma_i(acc[r][z], gi_add(gi_mul(half[0][r][z], sc0), gi_mul(half[1][r][z], sc1)),
                                     gf_mul(d[z], gf_set1(x8_dx(a, r0 + r, xb))));
        }
    }
}
static void x8_dequant_q6_k(const uint8_t *blk, int j, float *out) {
    const float d = fp16_to_f32(read_u16(blk + 2 * j));
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < QK; l++) {
            const int top = (blk[1168 + 32 * (2 * c + (l >> 4)) + 4 * j + (l & 3)] >> (2 * ((l >> 2) & 3))) & 3;
            const float scale = d * (float)(int8_t)blk[16 + 16 * c + 8 * (l >> 4) + j];
            out[QK * c + l] = scale * (float)((x8_k_nibble(blk, 144, j, c, l) | top << 4) - 32);
        }
}

/* Registration: one include per x8 type, and its name:group bytes in X8_TYPES (Python mirrors
 * both in quant.X8_GROUP_BYTES). */
#define X8T q8_0
#define X8_ELEMS 32
#define X8_FILE_BYTES 34
#define X8_GROUP_BYTES 272
#include "quant_x8_impl.h"
#define X8T q4_0
#define X8_ELEMS 32
#define X8_FILE_BYTES 18
#define X8_GROUP_BYTES 144
#include "quant_x8_impl.h"
#define X8T q4_1
#define X8_ELEMS 32
#define X8_FILE_BYTES 20
#define X8_GROUP_BYTES 160
#include "quant_x8_impl.h"
#define X8T q5_0
#define X8_ELEMS 32
#define X8_FILE_BYTES 22
#define X8_GROUP_BYTES 176
#include "quant_x8_impl.h"
#define X8T q4_k
#define X8_ELEMS 256
#define X8_FILE_BYTES 144
#define X8_GROUP_BYTES 1152
#include "quant_x8_impl.h"
#define X8T q5_k
#define X8_ELEMS 256
#define X8_FILE_BYTES 176
#define X8_GROUP_BYTES 1408
#include "quant_x8_impl.h"
#define X8T q6_k
#define X8_ELEMS 256
#define X8_FILE_BYTES 210
#define X8_GROUP_BYTES 1680
#include "quant_x8_impl.h"
#define X8_TYPES " x8=q8_0:272,q4_0:144,q4_1:160,q5_0:176,q4_k:1152,q5_k:1408,q6_k:1680"

/* What Python checks at load: the ISA this build holds, the types and their block sizes, the
 * activation block. A mismatch refuses the library instead of misreading the weights. */
const char *infer_quant_layout(void) {
    return "isa=" QISA " qk=32 q8_0=32:34 q4_0=32:18 q4_1=32:20 q5_0=32:22 q4_k=256:144 q5_k=256:176 q6_k=256:210" X8_TYPES;
}
