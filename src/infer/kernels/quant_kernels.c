/* Quantized matrix-vector products for GGUF block types (infer.kernels.quant).
 *
 * y[m, n] = x[m, k] @ W[n, k]^T with W one of ggml's block types (Q8_0, Q4_0, Q4_1, Q5_0: blocks
 * of 32; Q4_K, Q5_K, Q6_K: super-blocks of 256), as ggml computes it: each activation row is
 * quantized to int8 per 32 elements (a float scale dx and, for the types with a min, the block's
 * sum sx = dx * sum(q)), and each 32-element chunk of a weight row meets it in an exact integer dot
 * product, times the chunk's float scales, summed in float.
 *
 * The weight is repacked once, at load, from the file's blocks into the x8 layout (quant_x8.h: 8
 * rows interleaved; quant_repack_x8_<t>), which every product reads. quant_x8.h also fixes the
 * float sequence of each output, the same on every ISA, so every variant gives the same bits.
 *
 * One source, one library per ISA (build.py's QUANT_VARIANTS, explicit flags, never
 * -march=native): AVX-512 VNNI (vpdpbusd, and AMX tiles), AVX2 (maddubs), ARM NEON with sdot (and
 * I8MM's smmla), plain C. What
 * differs per ISA is quant_x8.h's handful of vector primitives; each type's repacking, block
 * product and dequantization below use only those. quant_x8_impl.h holds the entry points,
 * included once per type.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX2__) && \
    defined(__FMA__) && defined(__F16C__)
#define QISA_VECTORS "avx512-vnni"
#define Q_X86 1
#define Q_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QISA_VECTORS "avx2"
#define Q_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define QISA_VECTORS "neon-dotprod"
#define Q_NEON 1
#else
#define QISA_VECTORS "portable"
#endif
/* Matrix tiles (quant_tiles.h) for every type's calls of several rows (x8_tile_min_rows): AMX's
 * where the build has its instructions (on AVX-512 VNNI, which keeps the fewer-row calls), ARM
 * I8MM's SMMLA where the NEON build has it (+i8mm; sdot keeps the 1-row calls), or the C emulation of them
 * where the build asks for it (-DX8_TILES_EMU: the same tile code on any CPU, for the tests). */
#if defined(Q_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(X8_TILES_EMU)
#define X8_TILES 1
#define X8_TILES_AMX 1
#define QISA "avx512-amx"
#elif defined(Q_NEON) && defined(__ARM_FEATURE_MATMUL_INT8) && !defined(X8_TILES_EMU)
#define X8_TILES 1
#define X8_TILES_SMMLA 1
#define QISA "neon-i8mm"
#elif defined(X8_TILES_EMU)
#define X8_TILES 1
#if defined(Q_VNNI)
#define QISA "avx512-amx-emu"
#else
#define QISA QISA_VECTORS "-amx-emu"
#endif
#else
#define X8_TILES 0
#define QISA QISA_VECTORS
#endif

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "thread_pool.h"
#ifdef Q_X86
#include <immintrin.h>
#endif
#ifdef Q_NEON
#include <arm_neon.h>
#endif

#define QK 32 /* elements per activation block and per weight chunk */

/* A float16 (a block's scale as the file stores it) as a float, exactly. */
#if defined(Q_X86)
static inline float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(Q_NEON)
static inline float fp16_to_f32(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
#else
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
#endif

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t read_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ---------------------------------------------------------------------------------------------
 * The x8 layout (quant_x8.h): its per-ISA vectors and the activations' quantization. */
#include "quant_x8.h"
#if X8_TILES
#include "quant_tiles.h"
/* Whether calls of several rows take the tiles: the emulation and SMMLA always; AMX
 * once the OS has granted this process tile state (infer_quant_tile_permission), so a caller that
 * never asked gets the vectors' path, the same bits, rather than a fault. */
#if defined(X8_TILES_AMX)
static int x8_tiles_on = 0;
#else
static int x8_tiles_on = 1;
#endif
static int64_t x8_tile_products = 0; /* products run on tiles (the tests check the path is taken) */
/* The fewest rows a call takes the tiles with; fewer stay on the vectors (infer_quant_set_tile_min_rows).
 * On AMX a call of 2-16 rows measured slower on the tiles than on VNNI, 32 about even, 64 mostly
 * ahead (docs/cpu.md): each chunk's B is unpacked as the vectors unpack it, and the tiles' loads,
 * stores and float epilogue (which barely overlap) cost more than VNNI's dot products over few rows.
 * The emulation takes every call of 2 rows or
 * more, so the tests check every A tile height the kernels have (2, 4, 8, 16); SMMLA too (not measured). */
#if defined(X8_TILES_AMX)
static int x8_tile_min_rows = 64;
#else
static int x8_tile_min_rows = 2;
#endif
#endif

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
                                                                 GI isum[X8_RB_MAX][X8_NZ_MAX], const int R, const int NZ) {
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
                                                                int64_t r0, int64_t b, GI isum[X8_RB_MAX][X8_NZ_MAX],
                                                                GF acc[X8_RB_MAX][X8_NZ_MAX], const int R, const int NZ) {
    for (int z = 0; z < NZ; z++) {
        GF dw = gf_fp16(gp[2 * z] + at, gp[2 * z + 1] + at);
        for (int r = 0; r < R; r++) acc[r][z] = gf_fma_i(acc[r][z], isum[r][z], gf_mul(dw, gf_set1(x8_dx(a, r0 + r, b))));
    }
}
/* The tile path's B operand (quant_tiles.h) of one 32-value block of the two groups at g0 and g1:
 * 8 rows of 64 bytes at dst, row kk = the 16 weight rows' values 4kk .. 4kk + 3 (unsigned bytes;
 * rows 0-3 the low nibbles, 4-7 the high ones, as x8_nibble_dots pairs them with the activations). */
static inline __attribute__((always_inline)) void x8_nibble_units(const uint8_t *g0, const uint8_t *g1, int qs, int fifth,
                                                                  uint8_t *dst) {
    for (int u = 0; u < 4; u++) {
        GW w = gw_load(g0 + qs + 32 * u, g1 + qs + 32 * u), lo = gw_lo(w), hi = gw_hi(w);
        if (fifth >= 0) {
            GW h = gw_load(g0 + fifth, g1 + fifth);
            lo = gw_or(lo, gw_field(h, u, 1)), hi = gw_or(hi, gw_field(h, 4 + u, 1));
        }
        gw_store(dst + 64 * u, lo);
        gw_store(dst + 64 * (4 + u), hi);
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
static inline int32_t x8_start_q4_0(const X8Act *a, int64_t r, int64_t b) { return -8 * x8_xsum(a, r, b); }
static inline __attribute__((always_inline)) void x8_units_q4_0(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    (void)c;
    x8_nibble_units(g0, g1, 16, -1, dst);
}
static inline __attribute__((always_inline)) void x8_epilogue_q4_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                   int64_t b, GI isum[X8_RB_MAX][X8_NZ_MAX],
                                                                   GF acc[X8_RB_MAX][X8_NZ_MAX], const int R, const int NZ) {
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
}
static inline __attribute__((always_inline)) void x8_block_q4_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB_MAX][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(x8_start_q4_0(a, r0 + r, b));
    x8_nibble_dots(gp, 16, -1, a, r0, b, isum, R, NZ);
    x8_epilogue_q4_0(gp, a, r0, b, isum, acc, R, NZ);
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
static inline int32_t x8_start_q4_1(const X8Act *a, int64_t r, int64_t b) { (void)a, (void)r, (void)b; return 0; }
static inline __attribute__((always_inline)) void x8_units_q4_1(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    (void)c;
    x8_nibble_units(g0, g1, 32, -1, dst);
}
static inline __attribute__((always_inline)) void x8_epilogue_q4_1(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                   int64_t b, GI isum[X8_RB_MAX][X8_NZ_MAX],
                                                                   GF acc[X8_RB_MAX][X8_NZ_MAX], const int R, const int NZ) {
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
    for (int z = 0; z < NZ; z++) {
        GF mw = gf_fp16(gp[2 * z] + 16, gp[2 * z + 1] + 16);
        for (int r = 0; r < R; r++) acc[r][z] = gf_fma(acc[r][z], mw, gf_set1(x8_sx(a, r0 + r, b)));
    }
}
static inline __attribute__((always_inline)) void x8_block_q4_1(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB_MAX][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(x8_start_q4_1(a, r0 + r, b));
    x8_nibble_dots(gp, 32, -1, a, r0, b, isum, R, NZ);
    x8_epilogue_q4_1(gp, a, r0, b, isum, acc, R, NZ);
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
static inline int32_t x8_start_q5_0(const X8Act *a, int64_t r, int64_t b) { return -16 * x8_xsum(a, r, b); }
static inline __attribute__((always_inline)) void x8_units_q5_0(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    (void)c;
    x8_nibble_units(g0, g1, 48, 16, dst);
}
static inline __attribute__((always_inline)) void x8_epilogue_q5_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                   int64_t b, GI isum[X8_RB_MAX][X8_NZ_MAX],
                                                                   GF acc[X8_RB_MAX][X8_NZ_MAX], const int R, const int NZ) {
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
}
static inline __attribute__((always_inline)) void x8_block_q5_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB_MAX][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(x8_start_q5_0(a, r0 + r, b));
    x8_nibble_dots(gp, 48, 16, a, r0, b, isum, R, NZ);
    x8_epilogue_q5_0(gp, a, r0, b, isum, acc, R, NZ);
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
static inline int32_t x8_start_q8_0(const X8Act *a, int64_t r, int64_t b) { (void)a, (void)r, (void)b; return 0; }
/* the signed bytes as stored (the tiles' signed-by-signed product; no X8_S8_OFFSET there) */
static inline __attribute__((always_inline)) void x8_units_q8_0(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    (void)c;
    for (int u = 0; u < 8; u++) gw_store(dst + 64 * u, gw_load(g0 + 16 + 32 * u, g1 + 16 + 32 * u));
}
static inline __attribute__((always_inline)) void x8_epilogue_q8_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                   int64_t b, GI isum[X8_RB_MAX][X8_NZ_MAX],
                                                                   GF acc[X8_RB_MAX][X8_NZ_MAX], const int R, const int NZ) {
    x8_scale_sums(gp, 0, a, r0, b, isum, acc, R, NZ);
}
static inline __attribute__((always_inline)) void x8_block_q8_0(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GI isum[X8_RB_MAX][X8_NZ_MAX];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) isum[r][z] = gi_set1(x8_start_q8_0(a, r0 + r, b) - X8_S8_OFFSET * x8_xsum(a, r0 + r, b));
    for (int u = 0; u < 8; u++) {
        GW wv[X8_NZ_MAX];
        for (int z = 0; z < NZ; z++) wv[z] = gw_s8(gw_load(gp[2 * z] + 16 + 32 * u, gp[2 * z + 1] + 16 + 32 * u));
        for (int r = 0; r < R; r++) {
            GX xv = x8_x(a, r0 + r, b, u);
            for (int z = 0; z < NZ; z++) isum[r][z] = gi_dot_s8(isum[r][z], wv[z], xv);
        }
    }
    x8_epilogue_q8_0(gp, a, r0, b, isum, acc, R, NZ);
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
/* Chunk c_ = 2p + h's float sequence on its exact sums (h ? i1 : i0 [row][vector]; d, negmin: the
 * block's float16 d and -dmin; xb: its activation block, which may name c_). A macro, as Q6_K's
 * below: the vector path's code stays what it was. */
#define X8_EPILOGUE_K45(gp, d, negmin, a, r0, xb, p, h, i0, i1, acc, R, NZ)                                         \
    for (int z = 0; z < (NZ); z++) {                                                                                \
        const int c_ = 2 * (p) + (h);                                                                               \
        const uint8_t *s0 = (gp)[2 * z] + 32 + 8 * c_, *s1 = (gp)[2 * z + 1] + 32 + 8 * c_;                         \
        const GF dsc = gf_mul((d)[z], gf_bits(s0, s1, 0, 63));                                                      \
        const GF m = gf_fma(gf_bits((gp)[2 * z] + 96 + 8 * (p), (gp)[2 * z + 1] + 96 + 8 * (p), 4 * (h), 15),       \
                            gf_bits(s0, s1, 6, 3), gf_set1(16.0f)); /* low + 16 * high, exact */                    \
        const GF mn = gf_mul((negmin)[z], m);                                                                       \
        for (int r = 0; r < (R); r++) {                                                                             \
            (acc)[r][z] = gf_fma_i((acc)[r][z], (h) ? (i1)[r][z] : (i0)[r][z],                                      \
                                   gf_mul(dsc, gf_set1(x8_dx((a), (r0) + r, (xb)))));                               \
            (acc)[r][z] = gf_fma((acc)[r][z], mn, gf_set1(x8_sx((a), (r0) + r, (xb))));                             \
        }                                                                                                           \
    }
static inline __attribute__((always_inline)) void x8_block_k45(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                               int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                               const int NZ, const int fifth) {
    GF d[X8_NZ_MAX], negmin[X8_NZ_MAX];
    for (int z = 0; z < NZ; z++) d[z] = gf_fp16(gp[2 * z], gp[2 * z + 1]), negmin[z] = gf_fp16(gp[2 * z] + 16, gp[2 * z + 1] + 16);
    for (int p = 0; p < 4; p++) {
        GI i0[X8_RB_MAX][X8_NZ_MAX], i1[X8_RB_MAX][X8_NZ_MAX];
        for (int r = 0; r < R; r++)
            for (int z = 0; z < NZ; z++) i0[r][z] = i1[r][z] = gi_set1(0);
        /* the 8 units in runs (gp_dot_u): all 8 of 4-bit values, 4 at a time of 5-bit ones */
        const int run = fifth ? X8_RUN16(31) : X8_RUN16(15);
        for (int w0 = 0; w0 < 8; w0 += run) {
            GP run0[X8_RB_MAX][X8_NZ_MAX], run1[X8_RB_MAX][X8_NZ_MAX];
            for (int r = 0; r < R; r++)
                for (int z = 0; z < NZ; z++) run0[r][z] = gp_begin(i0[r][z]), run1[r][z] = gp_begin(i1[r][z]);
            for (int w = w0; w < w0 + run; w++) {
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
                    for (int z = 0; z < NZ; z++) run0[r][z] = gp_dot_u(run0[r][z], lo[z], x0), run1[r][z] = gp_dot_u(run1[r][z], hi[z], x1);
                }
            }
            for (int r = 0; r < R; r++)
                for (int z = 0; z < NZ; z++) i0[r][z] = gi_end(i0[r][z], run0[r][z]), i1[r][z] = gi_end(i1[r][z], run1[r][z]);
        }
        for (int h = 0; h < 2; h++) {
            X8_EPILOGUE_K45(gp, d, negmin, a, r0, 8 * (b) + c_, p, h, i0, i1, acc, R, NZ) /* c_: the macro's chunk */
        }
    }
}
static inline __attribute__((always_inline)) void x8_block_q4_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    x8_block_k45(gp, a, r0, b, acc, R, NZ, 0);
}
static inline __attribute__((always_inline)) void x8_block_q5_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    x8_block_k45(gp, a, r0, b, acc, R, NZ, 1);
}
#if X8_TILES
/* Chunk c (values 0..31 of it; chunks 2p and 2p + 1 share the nibble units (p, w)) as the tile's B
 * operand: row w = the low (c even) or high nibbles of unit (p, w), with Q5_K's fifth bits. */
static inline __attribute__((always_inline)) void x8_units_k45(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst,
                                                               const int fifth) {
    const int p = c >> 1, h = c & 1;
    for (int w = 0; w < 8; w++) {
        const GW v = gw_load(g0 + 128 + 32 * (8 * p + w), g1 + 128 + 32 * (8 * p + w));
        GW u = h ? gw_hi(v) : gw_lo(v);
        if (fifth) {
            const int at = 1152 + 32 * (2 * p + (w >> 2));
            u = gw_or(u, gw_field(gw_load(g0 + at, g1 + at), 4 * h + (w & 3), 1));
        }
        gw_store(dst + 64 * w, u);
    }
}
static inline __attribute__((always_inline)) void x8_units_q4_k(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    x8_units_k45(g0, g1, c, dst, 0);
}
static inline __attribute__((always_inline)) void x8_units_q5_k(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    x8_units_k45(g0, g1, c, dst, 1);
}
/* The tiles' sums of chunk c (raw[0]: the unsigned values' exact dot products) to the epilogue */
static inline __attribute__((always_inline)) void x8_tile_chunk_k45(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                    int c, GI raw[2][XT_ROWS][X8_NZ_MAX],
                                                                    GF acc[][X8_NZ_MAX], const int R) {
    const GF d[1] = {gf_fp16(gp[0], gp[1])}, negmin[1] = {gf_fp16(gp[0] + 16, gp[1] + 16)};
    X8_EPILOGUE_K45(gp, d, negmin, a, r0, 0, c >> 1, c & 1, raw[0], raw[0], acc, R, 1)
}
static inline __attribute__((always_inline)) void x8_tile_chunk_q4_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                     int c, GI raw[2][XT_ROWS][X8_NZ_MAX],
                                                                     GF acc[][X8_NZ_MAX], const int R) {
    x8_tile_chunk_k45(gp, a, r0, c, raw, acc, R);
}
static inline __attribute__((always_inline)) void x8_tile_chunk_q5_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                     int c, GI raw[2][XT_ROWS][X8_NZ_MAX],
                                                                     GF acc[][X8_NZ_MAX], const int R) {
    x8_tile_chunk_k45(gp, a, r0, c, raw, acc, R);
}
#endif
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
/* Chunk c's half sums (each started at -32 * its activation sum: half0, half1 [row][vector]) times
 * their int8 scales, then its float sequence (activation block xb; d: the block's float16 d). A
 * macro, not a function: the vector path's code is then exactly what it was before the tile path
 * shared it (as an inline function it was scheduled differently, and measured a few percent slower). */
#define X8_EPILOGUE_Q6_K(gp, d, a, r0, xb, c, half0, half1, acc, R, NZ)                                       \
    for (int z = 0; z < (NZ); z++) {                                                                           \
        const GI sc0 = gi_i8((gp)[2 * z] + 16 + 16 * (c), (gp)[2 * z + 1] + 16 + 16 * (c));                     \
        const GI sc1 = gi_i8((gp)[2 * z] + 24 + 16 * (c), (gp)[2 * z + 1] + 24 + 16 * (c));                     \
        for (int r = 0; r < (R); r++)                                                                          \
            (acc)[r][z] = gf_fma_i((acc)[r][z], gi_add(gi_mul((half0)[r][z], sc0), gi_mul((half1)[r][z], sc1)), \
                                   gf_mul((d)[z], gf_set1(x8_dx((a), (r0) + r, (xb)))));                        \
    }
static inline int32_t x8_start_q6_k(const X8Act *a, int64_t r, int64_t xb, int t) {
    const int32_t s16 = a->sum16[r * a->xblocks + xb];
    return -32 * (t ? x8_xsum(a, r, xb) - s16 : s16);
}
static inline __attribute__((always_inline)) void x8_block_q6_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                int64_t b, GF acc[X8_RB_MAX][X8_NZ_MAX], const int R,
                                                                const int NZ) {
    GF d[X8_NZ_MAX];
    for (int z = 0; z < NZ; z++) d[z] = gf_fp16(gp[2 * z], gp[2 * z + 1]);
    for (int c = 0; c < 8; c++) {
        const int64_t xb = 8 * b + c;
        GI half[2][X8_RB_MAX][X8_NZ_MAX];
        for (int r = 0; r < R; r++) {
            const int32_t s0 = x8_start_q6_k(a, r0 + r, xb, 0), s1 = x8_start_q6_k(a, r0 + r, xb, 1);
            for (int z = 0; z < NZ; z++) half[0][r][z] = gi_set1(s0), half[1][r][z] = gi_set1(s1);
        }
        for (int t = 0; t < 2; t++) {
            GW top[X8_NZ_MAX];
            for (int z = 0; z < NZ; z++) top[z] = gw_load(gp[2 * z] + 1168 + 32 * (2 * c + t), gp[2 * z + 1] + 1168 + 32 * (2 * c + t));
            /* gi_dot_u, not runs of gp_dot_u: 6-bit values allow runs of 2 units only, and those
             * measured slower on AVX2 (docs/cpu.md, "Measurements behind the kernels' constants") */
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
        X8_EPILOGUE_Q6_K(gp, d, a, r0, xb, c, half[0], half[1], acc, R, NZ)
    }
}
#if X8_TILES
/* Chunk c as the tile's B operand: row w = the 6-bit values 4w .. 4w + 3 (unsigned); rows 0-3 are
 * the first half (values 0-15), 4-7 the second: each half a B tile of its own (K = 16), since the
 * halves have their own scales. */
static inline __attribute__((always_inline)) void x8_units_q6_k(const uint8_t *g0, const uint8_t *g1, int c, uint8_t *dst) {
    for (int t = 0; t < 2; t++) {
        const GW top = gw_load(g0 + 1168 + 32 * (2 * c + t), g1 + 1168 + 32 * (2 * c + t));
        for (int s = 0; s < 4; s++) {
            const int w = 4 * t + s;
            const GW v = gw_load(g0 + 144 + 32 * (8 * (c >> 1) + w), g1 + 144 + 32 * (8 * (c >> 1) + w));
            gw_store(dst + 64 * w, gw_or(c & 1 ? gw_hi(v) : gw_lo(v), gw_field(top, 2 * s, 3)));
        }
    }
}
/* The tiles' two half sums of chunk c (started already: B holds q - 32) to the shared epilogue */
static inline __attribute__((always_inline)) void x8_tile_chunk_q6_k(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                     int c, GI raw[2][XT_ROWS][X8_NZ_MAX],
                                                                     GF acc[][X8_NZ_MAX], const int R) {
    const GF d[1] = {gf_fp16(gp[0], gp[1])};
    X8_EPILOGUE_Q6_K(gp, d, a, r0, 0, c, raw[0], raw[1], acc, R, 1)
}
#endif
static void x8_dequant_q6_k(const uint8_t *blk, int j, float *out) {
    const float d = fp16_to_f32(read_u16(blk + 2 * j));
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < QK; l++) {
            const int top = (blk[1168 + 32 * (2 * c + (l >> 4)) + 4 * j + (l & 3)] >> (2 * ((l >> 2) & 3))) & 3;
            const float scale = d * (float)(int8_t)blk[16 + 16 * c + 8 * (l >> 4) + j];
            out[QK * c + l] = scale * (float)((x8_k_nibble(blk, 144, j, c, l) | top << 4) - 32);
        }
}

/* Registration: one include per type, and its name:x8 block bytes in X8_TYPES (Python mirrors
 * both in quant.QUANT_TYPES). */
#define X8T q8_0
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 1
#define X8_TYPE_RB_FEW X8_RB_FEW
#define X8_ELEMS 32
#define X8_FILE_BYTES 34
#define X8_GROUP_BYTES 272
#include "quant_x8_impl.h"
#define X8T q4_0
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 1
#define X8_TYPE_TILE_OFFSET 8 /* B holds q - 8, signed: the start value in the product */
#define X8_TYPE_RB_FEW X8_RB_FEW
#define X8_ELEMS 32
#define X8_FILE_BYTES 18
#define X8_GROUP_BYTES 144
#include "quant_x8_impl.h"
#define X8T q4_1
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 0
#define X8_TYPE_RB_FEW X8_RB_FEW
#define X8_ELEMS 32
#define X8_FILE_BYTES 20
#define X8_GROUP_BYTES 160
#include "quant_x8_impl.h"
#define X8T q5_0
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 1
#define X8_TYPE_TILE_OFFSET 16 /* B holds q - 16, signed: the start value in the product */
#define X8_TYPE_RB_FEW X8_RB_FEW
#define X8_ELEMS 32
#define X8_FILE_BYTES 22
#define X8_GROUP_BYTES 176
#include "quant_x8_impl.h"
/* The K types on tiles: one tile product per 32-value chunk (Q6_K: two of 16 values, one per
 * half-chunk scale), each chunk's sums to the chunk's shared epilogue. */
#define X8T q4_k
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 0
#define X8_TYPE_RB_FEW X8_RB
#define X8_ELEMS 256
#define X8_FILE_BYTES 144
#define X8_GROUP_BYTES 1152
#include "quant_x8_impl.h"
#define X8T q5_k
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 0
#define X8_TYPE_RB_FEW X8_RB
#define X8_ELEMS 256
#define X8_FILE_BYTES 176
#define X8_GROUP_BYTES 1408
#include "quant_x8_impl.h"
#define X8T q6_k
#define X8_TYPE_TILES 1
#define X8_TYPE_TILE_SIGNED 1
#define X8_TYPE_TILE_OFFSET 32 /* B holds q - 32, signed: the start value in the product */
#define X8_TYPE_TILE_K 16
#define X8_TYPE_RB_FEW X8_RB
#define X8_ELEMS 256
#define X8_FILE_BYTES 210
#define X8_GROUP_BYTES 1680
#include "quant_x8_impl.h"
#define X8_TYPES " x8=q8_0:272,q4_0:144,q4_1:160,q5_0:176,q4_k:1152,q5_k:1408,q6_k:1680"

/* A 1-row call's whole-run tiles prefetch in software (1) or leave the stream to the hardware (0);
 * returns the setting before. See quant_x8.h. */
int infer_quant_set_stream_prefetch(int on) {
    const int before = x8_stream_prefetch;
    x8_stream_prefetch = on != 0;
    return before;
}

#if X8_TILES
/* Asks the OS for tile state once per process (AMX: arch_prctl; the emulation needs none) and
 * turns the tile path on where granted. Returns 0, or the errno of the refusal. */
int infer_quant_tile_permission(void) {
    const int err = xt_request_permission();
    if (err == 0) x8_tiles_on = 1;
    return err;
}

/* "amx", "smmla" or "emu": the implementation of the tile primitives in this build. */
const char *infer_quant_tiles(void) { return XT_IMPL; }

/* Calls of at least `rows` rows (2 or more) take the tiles from now on; returns the setting before, or
 * 0 (nothing changed) for rows < 2: a 1-row call always stays on the vectors. */
int infer_quant_set_tile_min_rows(int rows) {
    if (rows < 2) return 0;
    const int before = x8_tile_min_rows;
    x8_tile_min_rows = rows;
    return before;
}

/* How many products have run on tiles in this process. */
int64_t infer_quant_tile_products(void) { return __atomic_load_n(&x8_tile_products, __ATOMIC_RELAXED); }

/* One tile product through the primitives, for the tests: C (m x n int32, row pitch 4n bytes)
 * += A (m rows of kbytes bytes at a, row pitch a_stride) times B (kbytes / 4 rows of 4n bytes at
 * b, VNNI layout, row pitch 4n), op 0: A signed, B unsigned (dpbsud); 1: both signed (dpbssd);
 * 2: A unsigned, B signed (dpbusd). Returns 0, 1 for shapes no tile holds, 2 where the tiles are
 * not usable (AMX without the OS's permission). Tiles 5-7; the kernels configure theirs per job. */
int infer_quant_tile_selftest(const void *a, int m, int kbytes, int64_t a_stride, const void *b, int n, int op,
                              int32_t *c) {
    if (m < 1 || m > 16 || kbytes < 4 || kbytes > 64 || kbytes % 4 || n < 1 || n > 16 || op < 0 || op > 2) return 1;
    if (!x8_tiles_on) return 2;
    XtConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    xt_set(&cfg, 5, m, kbytes);
    xt_set(&cfg, 6, kbytes / 4, 4 * n);
    xt_set(&cfg, 7, m, 4 * n);
    xt_config(&cfg);
    xt_load(5, a, a_stride);
    xt_load(6, b, 4 * n);
    xt_load(7, c, 4 * n);
    if (op == 0) xt_dot_su(7, 5, 6);
    else if (op == 1) xt_dot_ss(7, 5, 6);
    else xt_dot_us(7, 5, 6);
    xt_store(7, c, 4 * n);
    xt_release();
    return 0;
}
#endif

/* What Python checks at load: the ISA this build holds, the types and their block sizes, the
 * activation block. A mismatch refuses the library instead of misreading the weights. */
const char *infer_quant_layout(void) {
    return "isa=" QISA " qk=32 q8_0=32:34 q4_0=32:18 q4_1=32:20 q5_0=32:22 q4_k=256:144 q5_k=256:176 q6_k=256:210" X8_TYPES;
}
