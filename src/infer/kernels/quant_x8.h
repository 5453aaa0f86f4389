/* The "x8" layout of the quantized kernels: 8 weight rows interleaved, made once at load.
 *
 * Included by quant_kernels.c (every ISA variant reads this layout, and only it).
 *
 * Layout. A weight of n rows becomes ceil(n / 8) groups of 8 rows (the last one padded with zero
 * blocks), stored in runs of X8_RUN groups interleaved block by block (below: x8_group_at), each
 * X8 block holding the 8 rows' blocks (same columns) interleaved in 4-byte units, so one 32-bit lane of a vector holds 4 consecutive
 * values of one row and a vector dot product against 4 activation bytes broadcast to every lane
 * gives the 8 rows' partial sums in 8 int32 lanes. Each type's exact bytes are documented with its
 * code in quant_kernels.c (x8_repack_<t>).
 *
 * Arithmetic (the contract every variant and the numpy reference share, bit for bit): activation
 * row r is quantized per 32 values (int8 xq, float dx, int sum xsum, float sx = dx * (float)xsum:
 * quantize_rows below). Output y[r, j] is one float32 chain over the weight's blocks in
 * order, started at 0:
 *     acc = fmaf((float)isum, d_w * d_x, acc)       (d_w * d_x: one float32 multiply)
 *     acc = fmaf(m_w, sx, acc)                      (only the types with a min, e.g. Q4_1)
 * where isum is the block's exact integer dot product of the weight's integer values (offsets
 * such as Q4_0's -8 included) with xq; then y = acc (+ bias[j], one float32 add). A type with
 * other scales (the K types) documents its own sequence beside its code. So the bits of y[r, j]
 * depend only on x[r] and W[j]: not on the number of rows in the call, the tiling, the thread
 * count or the ISA.
 *
 * Vectors. GW: 64 weight bytes, two groups' 32-byte units side by side (16 lanes of 4 bytes:
 * lanes 0-7 the first group's rows, 8-15 the second's); GI: 16 int32 lanes (the integer sums);
 * GF: 16 float lanes (the accumulators); GX: 4 activation bytes in every lane. AVX-512: one zmm;
 * AVX2: two ymm; NEON: four 128-bit registers; portable: arrays.
 *   gw_load(a, b)         32 bytes at a (lanes 0-7) and 32 at b (lanes 8-15)
 *   gw_lo(w), gw_hi(w)    each byte's low / high nibble
 *   gw_or(a, b), gw_field(w, s, mask): lane-wise or; ((w >> s) & mask) << 4 per byte (mask 1: a fifth
 *                         bit; mask 3: Q6_K's top two bits)
 *   gx_load(p)            the 4 bytes at p in every lane
 *   gi_set1(v)            v in every lane
 *   gi_dot_u(acc, w, x)   acc + per lane sum of 4 products w (unsigned, <= 128) x x (signed, |x| <= 127)
 *   gw_s8(w)/gi_dot_s8(acc, gw_s8(w), x) - X8_S8_OFFSET * sum(x): the same with w signed (-128..127);
 *                         the caller starts isum at -X8_S8_OFFSET * xsum
 *   GP, gp_begin(acc), gp_dot_u(p, w, x), gi_end(acc, p): a run of gi_dot_u's on acc, the same
 *                         integers. AVX2 keeps the run's sums in its maddubs' int16 pairs and widens
 *                         them once, at gi_end (the other ISAs add into acc as gi_dot_u does), so a run
 *                         must fit in int16: at most X8_RUN16(wmax) units of values w <= wmax
 *   gf_zero(), gf_set1(f), gf_fp16(a, b): 8 float16 at a and 8 at b as floats
 *   gf_mul(a, b), gf_fma_i(acc, isum, s) = fmaf((float)isum, s, acc), gf_fma(acc, a, b) = fmaf(a, b, acc)
 *   gf_store(p, v)        16 floats
 * For the K types' per-chunk scales:
 *   gf_bits(a, b, s, m)   (byte >> s) & m of 8 bytes at a (lanes 0-7) and 8 at b (lanes 8-15), as floats
 *                         (m < 256 >> s)
 *   gi_i8(a, b)           8 int8 at a and 8 at b as int32
 *   gi_add(a, b), gi_mul(a, b): lane-wise int32 sum, product (low 32 bits)
 * For the tile path (quant_tiles.h), which hands the unpacked weights to tile loads and takes the
 * tiles' integer sums back from memory:
 *   gw_store(p, w)        the 64 bytes at p (lanes in order: the first group's 32, then the second's)
 *   gi_load(p)            16 int32 at p
 */

/* Units of unsigned weight values <= wmax in one gp_dot_u run: each int16 pair sum of a unit is at
 * most 2 * wmax * 128 in magnitude (|x| <= 127; 128 even if an inf or NaN activation packs to -128),
 * so the run's sum stays within int16 (4-bit values: 8 units, 5-bit: 4, 6-bit: 2). */
#define X8_RUN16(wmax) (32767 / (2 * 128 * (wmax)))

#if defined(Q_X86) && defined(Q_VNNI)
typedef __m512i GW;
typedef __m512i GI;
typedef __m512i GX;
typedef __m512 GF;
#define X8_S8_OFFSET 128 /* vpdpbusd multiplies unsigned by signed: a signed weight byte goes in as w + 128 */
static inline GW gw_load(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline GW gw_lo(GW w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0f)); }
static inline GW gw_hi(GW w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0f)); }
static inline GW gw_or(GW a, GW b) { return _mm512_or_si512(a, b); }
static inline GW gw_field(GW w, int s, int mask) {
    return _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(w, _mm_cvtsi32_si128(s)), _mm512_set1_epi8((char)mask)), 4);
}
static inline GX gx_load(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline GI gi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline GI gi_dot_u(GI acc, GW w, GX x) { return _mm512_dpbusd_epi32(acc, w, x); }
static inline GW gw_s8(GW w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
static inline GI gi_dot_s8(GI acc, GW w, GX x) { return _mm512_dpbusd_epi32(acc, w, x); }
typedef GI GP;
static inline GP gp_begin(GI acc) { return acc; }
static inline GP gp_dot_u(GP p, GW w, GX x) { return gi_dot_u(p, w, x); }
static inline GI gi_end(GI acc, GP p) { (void)acc; return p; }
static inline GF gf_zero(void) { return _mm512_setzero_ps(); }
static inline GF gf_set1(float f) { return _mm512_set1_ps(f); }
static inline GF gf_fp16(const uint8_t *a, const uint8_t *b) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                        _mm_loadu_si128((const __m128i *)b), 1);
    return _mm512_cvtph_ps(h);
}
static inline GF gf_mul(GF a, GF b) { return _mm512_mul_ps(a, b); }
static inline GF gf_fma_i(GF acc, GI v, GF s) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, acc); }
static inline GF gf_fma(GF acc, GF a, GF b) { return _mm512_fmadd_ps(a, b, acc); }
static inline void gf_store(float *p, GF v) { _mm512_storeu_ps(p, v); }
static inline __m128i x8_two8(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}
static inline GF gf_bits(const uint8_t *a, const uint8_t *b, int s, int m) {
    const __m128i v = _mm_and_si128(_mm_srl_epi16(x8_two8(a, b), _mm_cvtsi32_si128(s)), _mm_set1_epi8((char)m));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
static inline GI gi_i8(const uint8_t *a, const uint8_t *b) { return _mm512_cvtepi8_epi32(x8_two8(a, b)); }
static inline GI gi_add(GI a, GI b) { return _mm512_add_epi32(a, b); }
static inline GI gi_mul(GI a, GI b) { return _mm512_mullo_epi32(a, b); }
static inline void gw_store(uint8_t *p, GW w) { _mm512_storeu_si512((void *)p, w); }
static inline GI gi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
/* Activation rows per tile and two-group vectors per tile: R x NZ accumulators and as many
 * integer sums, plus the unpacked weights, in 32 registers; 4 x 2 measured fastest of the shapes
 * that fit (docs/cpu.md, "Measurements behind the kernels' constants"). */
#ifndef X8_RB
#define X8_RB 4
#endif
/* A call of a few rows (a verification pass: X8_FEW_ROWS or fewer) takes the 32-value types' tiles
 * six rows at a time: a 6-row pass then reads and unpacks each weight tile once instead of for 4 +
 * 2 rows (the K types keep X8_RB: their scales take the registers; docs/cpu.md has the figures). */
#ifndef X8_RB_FEW
#define X8_RB_FEW 6
#endif
#ifndef X8_NZ
#define X8_NZ 2
#endif
#ifndef X8_NZ_DECODE
#define X8_NZ_DECODE 2 /* one activation row: a whole run of 4 groups per tile (X8_RUN, below) */
#endif

#elif defined(Q_X86)
typedef struct { __m256i a, b; } GW;
typedef GW GI;
typedef __m256i GX;
typedef struct { __m256 a, b; } GF;
#define X8_S8_OFFSET 0 /* the sign trick: |w| (unsigned) times x with w's sign */
static inline GW gw_load(const uint8_t *a, const uint8_t *b) {
    return (GW){_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b)};
}
static inline __m256i x8_lo256(__m256i w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0f)); }
static inline __m256i x8_hi256(__m256i w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0f)); }
static inline GW gw_lo(GW w) { return (GW){x8_lo256(w.a), x8_lo256(w.b)}; }
static inline GW gw_hi(GW w) { return (GW){x8_hi256(w.a), x8_hi256(w.b)}; }
static inline GW gw_or(GW a, GW b) { return (GW){_mm256_or_si256(a.a, b.a), _mm256_or_si256(a.b, b.b)}; }
static inline __m256i x8_field_256(__m256i w, int s, int mask) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(w, _mm_cvtsi32_si128(s)), _mm256_set1_epi8((char)mask)), 4);
}
static inline GW gw_field(GW w, int s, int mask) { return (GW){x8_field_256(w.a, s, mask), x8_field_256(w.b, s, mask)}; }
static inline GX gx_load(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline GI gi_set1(int32_t v) { return (GI){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
/* maddubs: pairs of u8 x s8 products summed into int16 (no saturation: w <= 128, |x| <= 127), then
 * pairs of those into int32 */
static inline __m256i x8_dot256(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline GI gi_dot_u(GI acc, GW w, GX x) { return (GI){x8_dot256(acc.a, w.a, x), x8_dot256(acc.b, w.b, x)}; }
static inline GW gw_s8(GW w) { return w; }
static inline GI gi_dot_s8(GI acc, GW w, GX x) {
    return (GI){x8_dot256(acc.a, _mm256_abs_epi8(w.a), _mm256_sign_epi8(x, w.a)),
                x8_dot256(acc.b, _mm256_abs_epi8(w.b), _mm256_sign_epi8(x, w.b))};
}
/* a run: int16 pairs summed (one add per unit instead of a madd and an add), widened at the end */
typedef GW GP;
static inline GP gp_begin(GI acc) { (void)acc; return (GP){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline GP gp_dot_u(GP p, GW w, GX x) {
    return (GP){_mm256_add_epi16(p.a, _mm256_maddubs_epi16(w.a, x)), _mm256_add_epi16(p.b, _mm256_maddubs_epi16(w.b, x))};
}
static inline GI gi_end(GI acc, GP p) {
    const __m256i ones = _mm256_set1_epi16(1);
    return (GI){_mm256_add_epi32(acc.a, _mm256_madd_epi16(p.a, ones)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(p.b, ones))};
}
static inline GF gf_zero(void) { return (GF){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline GF gf_set1(float f) { return (GF){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline GF gf_fp16(const uint8_t *a, const uint8_t *b) {
    return (GF){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b))};
}
static inline GF gf_mul(GF a, GF b) { return (GF){_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
static inline GF gf_fma_i(GF acc, GI v, GF s) {
    return (GF){_mm256_fmadd_ps(_mm256_cvtepi32_ps(v.a), s.a, acc.a), _mm256_fmadd_ps(_mm256_cvtepi32_ps(v.b), s.b, acc.b)};
}
static inline GF gf_fma(GF acc, GF a, GF b) { return (GF){_mm256_fmadd_ps(a.a, b.a, acc.a), _mm256_fmadd_ps(a.b, b.b, acc.b)}; }
static inline void gf_store(float *p, GF v) { _mm256_storeu_ps(p, v.a), _mm256_storeu_ps(p + 8, v.b); }
static inline __m256 x8_bits256(const uint8_t *a, int s, int m) {
    const __m128i v = _mm_and_si128(_mm_srl_epi16(_mm_loadl_epi64((const __m128i *)a), _mm_cvtsi32_si128(s)), _mm_set1_epi8((char)m));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
static inline __m256i x8_i8_256(const uint8_t *a) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)a)); }
static inline GF gf_bits(const uint8_t *a, const uint8_t *b, int s, int m) { return (GF){x8_bits256(a, s, m), x8_bits256(b, s, m)}; }
static inline GI gi_i8(const uint8_t *a, const uint8_t *b) { return (GI){x8_i8_256(a), x8_i8_256(b)}; }
static inline GI gi_add(GI a, GI b) { return (GI){_mm256_add_epi32(a.a, b.a), _mm256_add_epi32(a.b, b.b)}; }
static inline GI gi_mul(GI a, GI b) { return (GI){_mm256_mullo_epi32(a.a, b.a), _mm256_mullo_epi32(a.b, b.b)}; }
static inline void gw_store(uint8_t *p, GW w) { _mm256_storeu_si256((__m256i *)p, w.a), _mm256_storeu_si256((__m256i *)(p + 32), w.b); }
static inline GI gi_load(const int32_t *p) { return (GI){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8))}; }
/* 16 ymm registers: one two-group vector (two ymm) by 4 rows spills some accumulators and still
 * beat 2 rows (docs/cpu.md, "Measurements behind the kernels' constants") */
#ifndef X8_RB
#define X8_RB 4
#endif
/* A few rows' call (see the AVX-512 variant): 6-row tiles here too, though they spill more of the
 * accumulators (5 and 6 rows, run on the project's EPYC: docs/cpu.md) */
#ifndef X8_RB_FEW
#define X8_RB_FEW 6
#endif
#ifndef X8_NZ
#define X8_NZ 1
#endif
#define X8_NZ_DECODE 2

#elif defined(Q_NEON)
/* four 128-bit registers per vector: sdot multiplies signed bytes (every weight byte here is
 * below 128 as unsigned, or signed Q8_0), vfmaq_f32 is one rounding like fmaf */
typedef struct { uint8x16_t v[4]; } GW;
typedef struct { int32x4_t v[4]; } GI;
typedef int8x16_t GX;
typedef struct { float32x4_t v[4]; } GF;
#define X8_S8_OFFSET 0
static inline GW gw_load(const uint8_t *a, const uint8_t *b) {
    return (GW){{vld1q_u8(a), vld1q_u8(a + 16), vld1q_u8(b), vld1q_u8(b + 16)}};
}
static inline GW gw_lo(GW w) {
    for (int i = 0; i < 4; i++) w.v[i] = vandq_u8(w.v[i], vdupq_n_u8(0x0f));
    return w;
}
static inline GW gw_hi(GW w) {
    for (int i = 0; i < 4; i++) w.v[i] = vshrq_n_u8(w.v[i], 4);
    return w;
}
static inline GW gw_or(GW a, GW b) {
    for (int i = 0; i < 4; i++) a.v[i] = vorrq_u8(a.v[i], b.v[i]);
    return a;
}
static inline GW gw_field(GW w, int s, int mask) {
    for (int i = 0; i < 4; i++)
        w.v[i] = vshlq_n_u8(vandq_u8(vshlq_u8(w.v[i], vdupq_n_s8((int8_t)-s)), vdupq_n_u8((uint8_t)mask)), 4);
    return w;
}
static inline GX gx_load(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return vreinterpretq_s8_s32(vdupq_n_s32(v)); }
static inline GI gi_set1(int32_t v) { return (GI){{vdupq_n_s32(v), vdupq_n_s32(v), vdupq_n_s32(v), vdupq_n_s32(v)}}; }
static inline GI gi_dot_u(GI acc, GW w, GX x) {
    for (int i = 0; i < 4; i++) acc.v[i] = vdotq_s32(acc.v[i], vreinterpretq_s8_u8(w.v[i]), x);
    return acc;
}
static inline GW gw_s8(GW w) { return w; }
static inline GI gi_dot_s8(GI acc, GW w, GX x) { return gi_dot_u(acc, w, x); }
typedef GI GP;
static inline GP gp_begin(GI acc) { return acc; }
static inline GP gp_dot_u(GP p, GW w, GX x) { return gi_dot_u(p, w, x); }
static inline GI gi_end(GI acc, GP p) { (void)acc; return p; }
static inline GF gf_zero(void) { return (GF){{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
static inline GF gf_set1(float f) { return (GF){{vdupq_n_f32(f), vdupq_n_f32(f), vdupq_n_f32(f), vdupq_n_f32(f)}}; }
static inline float32x4_t x8_fp16x4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }
static inline GF gf_fp16(const uint8_t *a, const uint8_t *b) {
    return (GF){{x8_fp16x4(a), x8_fp16x4(a + 8), x8_fp16x4(b), x8_fp16x4(b + 8)}};
}
static inline GF gf_mul(GF a, GF b) {
    for (int i = 0; i < 4; i++) a.v[i] = vmulq_f32(a.v[i], b.v[i]);
    return a;
}
static inline GF gf_fma_i(GF acc, GI v, GF s) {
    for (int i = 0; i < 4; i++) acc.v[i] = vfmaq_f32(acc.v[i], vcvtq_f32_s32(v.v[i]), s.v[i]);
    return acc;
}
static inline GF gf_fma(GF acc, GF a, GF b) {
    for (int i = 0; i < 4; i++) acc.v[i] = vfmaq_f32(acc.v[i], a.v[i], b.v[i]);
    return acc;
}
static inline void gf_store(float *p, GF v) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.v[i]);
}
static inline GF gf_bits(const uint8_t *a, const uint8_t *b, int s, int m) {
    const int8x8_t shift = vdup_n_s8((int8_t)-s);
    const uint8x8_t mask = vdup_n_u8((uint8_t)m);
    const uint16x8_t wa = vmovl_u8(vand_u8(vshl_u8(vld1_u8(a), shift), mask)), wb = vmovl_u8(vand_u8(vshl_u8(vld1_u8(b), shift), mask));
    return (GF){{vcvtq_f32_u32(vmovl_u16(vget_low_u16(wa))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(wa))),
                 vcvtq_f32_u32(vmovl_u16(vget_low_u16(wb))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(wb)))}};
}
static inline GI gi_i8(const uint8_t *a, const uint8_t *b) {
    const int16x8_t wa = vmovl_s8(vld1_s8((const int8_t *)a)), wb = vmovl_s8(vld1_s8((const int8_t *)b));
    return (GI){{vmovl_s16(vget_low_s16(wa)), vmovl_s16(vget_high_s16(wa)), vmovl_s16(vget_low_s16(wb)),
                 vmovl_s16(vget_high_s16(wb))}};
}
static inline GI gi_add(GI a, GI b) {
    for (int i = 0; i < 4; i++) a.v[i] = vaddq_s32(a.v[i], b.v[i]);
    return a;
}
static inline GI gi_mul(GI a, GI b) {
    for (int i = 0; i < 4; i++) a.v[i] = vmulq_s32(a.v[i], b.v[i]);
    return a;
}
static inline void gw_store(uint8_t *p, GW w) {
    for (int i = 0; i < 4; i++) vst1q_u8(p + 16 * i, w.v[i]);
}
static inline GI gi_load(const int32_t *p) { return (GI){{vld1q_s32(p), vld1q_s32(p + 4), vld1q_s32(p + 8), vld1q_s32(p + 12)}}; }
/* 32 registers: 2 rows x one two-group vector, four registers each: 8 of integer sums and 8 of
 * accumulators, the rest for the unpacked weights */
#ifndef X8_RB
#define X8_RB 2
#endif
#ifndef X8_NZ
#define X8_NZ 1
#endif
#ifndef X8_NZ_DECODE
#define X8_NZ_DECODE 2
#endif

#else /* portable C: the same integers, and fmaf for every fused multiply-add */
typedef struct { uint8_t b[64]; } GW;
typedef struct { int32_t v[16]; } GI;
typedef struct { int8_t b[4]; } GX;
typedef struct { float v[16]; } GF;
#define X8_S8_OFFSET 0
static inline GW gw_load(const uint8_t *a, const uint8_t *b) { GW w; memcpy(w.b, a, 32); memcpy(w.b + 32, b, 32); return w; }
static inline GW gw_lo(GW w) { for (int l = 0; l < 64; l++) w.b[l] &= 0x0f; return w; }
static inline GW gw_hi(GW w) { for (int l = 0; l < 64; l++) w.b[l] >>= 4; return w; }
static inline GW gw_or(GW a, GW b) { for (int l = 0; l < 64; l++) a.b[l] |= b.b[l]; return a; }
static inline GW gw_field(GW w, int s, int mask) {
    for (int l = 0; l < 64; l++) w.b[l] = (uint8_t)(((w.b[l] >> s) & mask) << 4);
    return w;
}
static inline GX gx_load(const int8_t *p) { GX x; memcpy(x.b, p, 4); return x; }
static inline GI gi_set1(int32_t v) { GI a; for (int l = 0; l < 16; l++) a.v[l] = v; return a; }
static inline GI gi_dot_u(GI acc, GW w, GX x) {
    for (int l = 0; l < 16; l++)
        for (int i = 0; i < 4; i++) acc.v[l] += (int32_t)w.b[4 * l + i] * x.b[i];
    return acc;
}
static inline GW gw_s8(GW w) { return w; }
static inline GI gi_dot_s8(GI acc, GW w, GX x) {
    for (int l = 0; l < 16; l++)
        for (int i = 0; i < 4; i++) acc.v[l] += (int32_t)(int8_t)w.b[4 * l + i] * x.b[i];
    return acc;
}
typedef GI GP;
static inline GP gp_begin(GI acc) { return acc; }
static inline GP gp_dot_u(GP p, GW w, GX x) { return gi_dot_u(p, w, x); }
static inline GI gi_end(GI acc, GP p) { (void)acc; return p; }
static inline GF gf_zero(void) { GF a; for (int l = 0; l < 16; l++) a.v[l] = 0.0f; return a; }
static inline GF gf_set1(float f) { GF a; for (int l = 0; l < 16; l++) a.v[l] = f; return a; }
static inline GF gf_fp16(const uint8_t *a, const uint8_t *b) {
    GF f;
    for (int l = 0; l < 8; l++) f.v[l] = fp16_to_f32(read_u16(a + 2 * l)), f.v[l + 8] = fp16_to_f32(read_u16(b + 2 * l));
    return f;
}
static inline GF gf_mul(GF a, GF b) { for (int l = 0; l < 16; l++) a.v[l] *= b.v[l]; return a; }
static inline GF gf_fma_i(GF acc, GI v, GF s) { for (int l = 0; l < 16; l++) acc.v[l] = fmaf((float)v.v[l], s.v[l], acc.v[l]); return acc; }
static inline GF gf_fma(GF acc, GF a, GF b) { for (int l = 0; l < 16; l++) acc.v[l] = fmaf(a.v[l], b.v[l], acc.v[l]); return acc; }
static inline void gf_store(float *p, GF v) { memcpy(p, v.v, sizeof v.v); }
static inline GF gf_bits(const uint8_t *a, const uint8_t *b, int s, int m) {
    GF f;
    for (int l = 0; l < 8; l++) f.v[l] = (float)((a[l] >> s) & m), f.v[l + 8] = (float)((b[l] >> s) & m);
    return f;
}
static inline GI gi_i8(const uint8_t *a, const uint8_t *b) {
    GI v;
    for (int l = 0; l < 8; l++) v.v[l] = (int8_t)a[l], v.v[l + 8] = (int8_t)b[l];
    return v;
}
static inline GI gi_add(GI a, GI b) { for (int l = 0; l < 16; l++) a.v[l] += b.v[l]; return a; }
static inline GI gi_mul(GI a, GI b) { for (int l = 0; l < 16; l++) a.v[l] *= b.v[l]; return a; }
static inline void gw_store(uint8_t *p, GW w) { memcpy(p, w.b, 64); }
static inline GI gi_load(const int32_t *p) { GI v; memcpy(v.v, p, sizeof v.v); return v; }
#ifndef X8_RB
#define X8_RB 2
#endif
#ifndef X8_NZ
#define X8_NZ 1
#endif
#define X8_NZ_DECODE 2
#endif

#define X8_NZ_MAX (X8_NZ > X8_NZ_DECODE ? X8_NZ : X8_NZ_DECODE)
#ifndef X8_RB_FEW
#define X8_RB_FEW X8_RB
#endif
#define X8_RB_MAX (X8_RB_FEW > X8_RB ? X8_RB_FEW : X8_RB) /* the accumulators' row dimension */
/* Whether a 1-row call's tiles, each reading its whole run of groups as one stream, prefetch
 * ahead in software (infer_quant_set_stream_prefetch; on by default). Where the hardware
 * prefetcher follows such a stream better alone, the software prefetches only cost; which one is
 * faster changed on one machine from hour to hour, so the engine measures it (infer.kernels.cpu's
 * STREAMS). The same bits either way. */
static int x8_stream_prefetch = 1;
#define X8_FEW_ROWS 16 /* the most rows a call may have for its type's X8_TYPE_RB_FEW tiles */
/* Bytes ahead of the block in use to prefetch, every cache line of it, in each group's stream on
 * the first pass over a tile: a streamed weight reads fastest with every line prefetched about
 * 1 KB ahead, and the prefetches cost a little where the tile is already in L2 (a prefill's later
 * row tiles; docs/cpu.md, "Measurements behind the kernels' constants"). */
#ifndef X8_AHEAD
#define X8_AHEAD 1024
#endif
#ifndef X8_AHEAD_ROWS
#define X8_AHEAD_ROWS 2 /* block rows ahead for a tile of part of a run (quant_x8_impl.h's tile) */
#endif

/* Groups are stored in runs of X8_RUN (the last run may be shorter): a run's groups interleaved
 * block by block, so a tile of a run's groups reads one sequential stream. Eight separate streams
 * read much slower than one on a core (the prefetchers follow one stream best; software
 * prefetching did not close the gap). Runs of 4 make every AVX-512 tile
 * (4 groups, a decode step's and a verification's alike) and AVX2's decode tile one whole run;
 * with runs of 8, AVX-512's 8-group decode tiles ran a decode step's small products slower on two
 * threads and its row tiles read half-runs (docs/cpu.md has the figures).
 * Block b of group g is at x8_group_at(g) + b * x8_stride(g), both in x8 blocks of its type. */
#define X8_RUN 4
static inline int64_t x8_run_groups(int64_t g, int64_t groups) {
    const int64_t start = g - g % X8_RUN;
    return groups - start < X8_RUN ? groups - start : X8_RUN;
}
static inline int64_t x8_group_at(int64_t g, int64_t blocks) { return (g - g % X8_RUN) * blocks + g % X8_RUN; }
_Static_assert(X8_RUN % (2 * X8_NZ) == 0 && X8_RUN % (2 * X8_NZ_DECODE) == 0, "a tile's groups must lie in one run");

/* The quantized activations of a call: row r's value e is q[r * k + e]; its 32-value block c has
 * scale d[r * xblocks + c], integer sum sum[...], the integer sum of its first 16 values
 * sum16[...] (Q6_K's 16-value scales) and float sum s[...] = d * (float)sum. */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *sum;
    const float *s;
    int64_t k, xblocks;
    const int32_t *sum16;
} X8Act;

#if defined(Q_X86)
/* One activation block as quantize_rows' plain C computes it, in AVX2: 32 floats -> 32 int8 at q (in
 * order), d = max|v| / 127, q = round-to-even of v * (1 / d) (cvtps_epi32 under the default
 * rounding mode, as nearbyintf), and the integer sums of all 32 and of the first 16 values. */
static inline float x8_quantize32(const float *v, int8_t *q, int32_t *sum, int32_t *sum16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 inv = _mm256_set1_ps(inverse);
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
    const __m256i s0 = _mm256_add_epi32(qi[0], qi[1]), s1 = _mm256_add_epi32(qi[2], qi[3]);
    __m128i h = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(s0), _mm256_extracti128_si256(s0, 1)),
                               _mm_add_epi32(_mm256_castsi256_si128(s1), _mm256_extracti128_si256(s1, 1)));
    h = _mm_hadd_epi32(h, h); /* [first 16, last 16, ...] */
    *sum16 = _mm_cvtsi128_si32(h);
    *sum = *sum16 + _mm_extract_epi32(h, 1);
    /* packs work per 128-bit half: the dword permute puts the 32 bytes back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
}
#endif

typedef struct {
    const float *x;
    int64_t k;
    int8_t *xq;
    float *dx, *sx;
    int32_t *xsum, *xsum16;
} X8Quantize;

/* Activation rows begin .. end - 1 quantized (a chunk of the pool's loop). */
static void x8_quantize_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    const X8Quantize *j = ctx;
    const int64_t k = j->k, blocks = k / QK;
    (void)worker;
    for (int64_t r = begin; r < end; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = j->x + r * k + b * QK;
            int8_t *q = j->xq + r * k + b * QK;
            int32_t sum = 0, sum16 = 0;
#if defined(Q_X86)
            const float d = x8_quantize32(v, q, &sum, &sum16);
#else
            float amax = 0.0f;
            /* fmaxf's result (a NaN never wins either way), as a comparison GCC vectorizes */
            for (int l = 0; l < QK; l++) amax = fabsf(v[l]) > amax ? fabsf(v[l]) : amax;
            const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
            for (int l = 0; l < QK; l++) {
                q[l] = (int8_t)nearbyintf(v[l] * inverse);
                sum += q[l];
                if (l == 15) sum16 = sum;
            }
#endif
            j->dx[r * blocks + b] = d;
            j->xsum[r * blocks + b] = sum;
            j->xsum16[r * blocks + b] = sum16;
            j->sx[r * blocks + b] = d * (float)sum;
        }
}

/* The activation rows quantized per 32 values (quant.quantize_activations mirrors it exactly), with
 * each block's integer sums; rows in parallel (a row's blocks depend on that row only). */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *dx, int32_t *xsum, float *sx,
                          int32_t *xsum16, int threads) {
    X8Quantize job = {x, k, xq, dx, sx, xsum, xsum16};
    pool_run(x8_quantize_rows, &job, m, 1, threads);
}

/* One quantized product's tiles (quant_x8_impl.h's quant_linear). */
typedef struct {
    const uint8_t *w;
    int64_t n, m, blocks, groups;
    const X8Act *act;
    const float *bias;
    float *y;
    int decode, nz, rb;
    uint8_t *units; /* the tile path's unpacked weights, a buffer per worker (quant_x8_impl.h) */
    /* the tile path's activation scales by block: d_by_block[b * padded + r] = d[r * xblocks + b]
     * (and s), so an epilogue finds a tile's rows at fixed offsets from one pointer */
    const float *d_by_block, *s_by_block;
    int64_t padded;
} X8Linear;

/* The 2 * nz groups of a product's tile from group `first` on (x8 blocks of group_bytes): where each
 * starts, and its index (-1 for a group past the last: it repeats the last real group, computed and
 * never stored). */
static inline void x8_tile_groups(const X8Linear *job, int64_t first, int count, int64_t group_bytes,
                                  const uint8_t **gbase, int64_t *gindex) {
    for (int i = 0; i < count; i++) {
        const int64_t g = first + i;
        gindex[i] = g < job->groups ? g : -1;
        gbase[i] = job->w + x8_group_at(g < job->groups ? g : job->groups - 1, job->blocks) * group_bytes;
    }
}

/* y's rows r0 .. r0 + rn - 1 at a tile's groups (gindex, as x8_tile_groups gives them) from the
 * accumulators acc[r][z] (vector z: groups 2z and 2z + 1), the bias added (one float32 add).
 * `wide`: a whole group's 8 floats stored at once (the vector path, where several-row calls
 * measured faster so); the AMX tile path stores a float at a time, which measured faster there on
 * large calls (with wide stores its tile loads stalled; docs/cpu.md has the figures). */
static inline __attribute__((always_inline)) void x8_store_tile(const X8Linear *job, GF (*acc)[X8_NZ_MAX], int64_t r0,
                                                                int64_t rn, int nz, const int64_t *gindex,
                                                                const int wide) {
    const int64_t n = job->n;
    for (int64_t r = 0; r < rn; r++)
        for (int z = 0; z < nz; z++) {
            float lanes[16];
            gf_store(lanes, acc[r][z]);
            for (int half = 0; half < 2; half++) {
                const int64_t g = gindex[2 * z + half];
                if (g < 0) continue;
                const float *v = lanes + 8 * half;
                float *dst = job->y + (r0 + r) * n + g * 8;
                if (wide && g * 8 + 8 <= n) { /* a whole group: 8 floats at once (the same values) */
                    if (job->bias)
                        for (int j = 0; j < 8; j++) dst[j] = v[j] + job->bias[g * 8 + j];
                    else
                        memcpy(dst, v, 8 * sizeof(float));
                    continue;
                }
                for (int64_t j = 0; j < 8 && g * 8 + j < n; j++) dst[j] = job->bias ? v[j] + job->bias[g * 8 + j] : v[j];
            }
        }
}
