/* Matrix tiles for the quantized kernels: a thin layer of AMX-like primitives beside quant_x8.h's
 * vectors, with two implementations giving the same integers: Intel AMX's instructions
 * (X8_TILES_AMX: -mamx-tile -mamx-int8) and a portable C emulation of them (X8_TILES_EMU), which
 * runs the same tile code, layout and tiling on any CPU, so the tests check them bit for bit where
 * there is no AMX.
 *
 * Included by quant_kernels.c where X8_TILES is set. A tile is up to 16 rows of up to 64 bytes;
 * there are 8 (tile numbers are constants: the instructions encode them). The operands, as AMX
 * defines them:
 *   A: M rows (M <= 16) x K bytes (K <= 64, a multiple of 4), int8 or uint8;
 *   B: K / 4 rows x 4N bytes (N <= 16) in VNNI layout: row kk holds, for each of N columns n, the
 *      4 consecutive k-values 4kk .. 4kk + 3 of column n at bytes 4n .. 4n + 3;
 *   C: M rows x N int32.
 *   xt_dot_su(C, A, B): C[m][n] += sum over kk < K/4, i < 4 of A[m][4kk + i] (signed) *
 *                       B[kk][4n + i] (unsigned), in int32 with wraparound (tdpbsud)
 *   xt_dot_ss(C, A, B): the same with B signed (tdpbssd); xt_dot_us: A unsigned, B signed (tdpbusd)
 *   xt_load(T, p, stride): tile T's rows r = the bytes at p + r * stride (its configured rows and
 *                       bytes per row; the rest of the tile zero); xt_store(T, p, stride) the reverse
 *   xt_zero(T)
 *   xt_config(cfg): the shapes of every tile (XtConfig: palette 1), for this thread; zeroes every tile.
 *   xt_release(): this thread's tiles and configuration back to their initial state (unconfigured).
 * An operation whose shapes do not fit together (A's rows != C's, B's rows != A's bytes / 4, B's
 * bytes != C's) is a fault on the hardware; the emulation aborts, so a layout mistake cannot pass
 * the tests on a machine without AMX.
 *
 * How the kernels use them: quant_x8_impl.h's tile path (every type, calls of 2 rows or more).
 * A = 16 activation rows' 32 int8 values of one 32-value chunk, loaded in place (row stride = the
 * activations' row pitch); B = that chunk of two x8 groups (16 weight rows), unpacked to bytes with
 * quant_x8.h's vector primitives and stored to a small buffer: the x8 layout's 4-byte units of 8
 * rows are already VNNI layout for one group, and gw_load(a, b) puts two groups side by side, so
 * each stored register is one 64-byte B row; C = 16 x 16 int32, zeroed per chunk so each chunk's
 * integer sum is exact and separate, then stored and fed to the type's float epilogue (quant_x8.h's
 * contract, in its order): the same bits as every other variant. Q6_K's chunks have a scale per
 * 16 values: its A and B tiles are 16 bytes deep, two products a chunk.
 */
#include <stdlib.h>

/* ldtilecfg's 64-byte operand */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) XtConfig;
_Static_assert(sizeof(XtConfig) == 64, "the tile configuration is 64 bytes");

static inline void xt_set(XtConfig *c, int t, int rows, int colsb) {
    c->palette = 1;
    c->rows[t] = (uint8_t)rows;
    c->colsb[t] = (uint16_t)colsb;
}

#if defined(X8_TILES_AMX)
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#define XT_IMPL "amx"
/* GCC's _tile_loadd and _tile_loadconfig tell the compiler nothing of the memory they read (no
 * memory operand but ldtilecfg's first 8 bytes, no "memory" clobber), so the stores that fill a B
 * buffer or a configuration could be moved after them or dropped as dead. A compiler barrier
 * first makes every store before it land first (no instruction; the emulation cannot show this). */
#define xt_barrier() __asm__ volatile("" ::: "memory")
#define xt_config(cfg)                                                                                         \
    do {                                                                                                       \
        xt_barrier();                                                                                          \
        _tile_loadconfig(cfg);                                                                                 \
    } while (0)
#define xt_load(t, p, stride)                                                                                  \
    do {                                                                                                       \
        xt_barrier();                                                                                          \
        _tile_loadd(t, p, stride);                                                                             \
    } while (0)
#define xt_store(t, p, stride) _tile_stored(t, p, stride)
#define xt_zero(t) _tile_zero(t)
#define xt_dot_su(c, a, b) _tile_dpbsud(c, a, b)
#define xt_dot_ss(c, a, b) _tile_dpbssd(c, a, b)
#define xt_dot_us(c, a, b) _tile_dpbusd(c, a, b)
/* the tiles back to their initial state at the end of a job: a core holding tile data in use
 * saves and restores it on every context switch, and Intel asks software to release it when done */
#define xt_release() _tile_release()
/* Linux gives a process tile state only on request (the register file is 8 KB): once per process,
 * for every thread. 0 where granted, else the errno (the OS or the VM does not enable it). */
static int xt_request_permission(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0) return 0;
    return errno ? errno : -1;
}
#else
/* The emulation: each thread's 8 tiles and configuration, as the hardware keeps them per thread. */
#define XT_IMPL "emu"
typedef struct {
    XtConfig cfg;
    uint8_t t[8][16][64];
} XtState;
static __thread XtState xt_state;
static inline void xt_config(const XtConfig *cfg) {
    xt_state.cfg = *cfg;
    memset(xt_state.t, 0, sizeof xt_state.t);
}
static inline int xt_rows(int t) { return xt_state.cfg.rows[t]; }
static inline int xt_colsb(int t) { return xt_state.cfg.colsb[t]; }
static inline void xt_check(int ok) {
    if (!ok) abort(); /* the hardware's fault: an unconfigured tile or shapes that do not fit */
}
static inline void xt_load(int t, const void *p, int64_t stride) {
    const int rows = xt_rows(t), colsb = xt_colsb(t);
    xt_check(xt_state.cfg.palette == 1 && rows >= 1 && rows <= 16 && colsb >= 1 && colsb <= 64);
    memset(xt_state.t[t], 0, sizeof xt_state.t[t]);
    for (int r = 0; r < rows; r++) memcpy(xt_state.t[t][r], (const uint8_t *)p + r * stride, (size_t)colsb);
}
static inline void xt_store(int t, void *p, int64_t stride) {
    const int rows = xt_rows(t), colsb = xt_colsb(t);
    xt_check(xt_state.cfg.palette == 1 && rows >= 1 && rows <= 16 && colsb >= 1 && colsb <= 64);
    for (int r = 0; r < rows; r++) memcpy((uint8_t *)p + r * stride, xt_state.t[t][r], (size_t)colsb);
}
static inline void xt_zero(int t) { memset(xt_state.t[t], 0, sizeof xt_state.t[t]); }
/* C[m][n] += the 4-byte dot products, the sum taken modulo 2^32 (the instructions' wraparound) */
static inline void xt_dot(int c, int a, int b, int a_signed, int b_signed) {
    const int m_rows = xt_rows(a), k4 = xt_colsb(a) / 4, n = xt_colsb(c) / 4;
    xt_check(xt_state.cfg.palette == 1 && m_rows >= 1 && xt_colsb(a) % 4 == 0 && k4 >= 1 && xt_rows(c) == m_rows &&
             xt_rows(b) == k4 && xt_colsb(b) == xt_colsb(c) && xt_colsb(c) % 4 == 0);
    for (int m = 0; m < m_rows; m++)
        for (int j = 0; j < n; j++) {
            uint32_t acc;
            memcpy(&acc, xt_state.t[c][m] + 4 * j, 4);
            for (int kk = 0; kk < k4; kk++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t x = xt_state.t[a][m][4 * kk + i], w = xt_state.t[b][kk][4 * j + i];
                    const int32_t xv = a_signed ? (int32_t)(int8_t)x : (int32_t)x, wv = b_signed ? (int32_t)(int8_t)w : (int32_t)w;
                    acc += (uint32_t)(xv * wv); /* |xv * wv| <= 2^14: exact in int32 */
                }
            memcpy(xt_state.t[c][m] + 4 * j, &acc, 4);
        }
}
#define xt_dot_su(c, a, b) xt_dot(c, a, b, 1, 0)
#define xt_dot_ss(c, a, b) xt_dot(c, a, b, 1, 1)
#define xt_dot_us(c, a, b) xt_dot(c, a, b, 0, 1)
static inline void xt_release(void) { memset(&xt_state, 0, sizeof xt_state); }
static int xt_request_permission(void) { return 0; }
#endif

/* The x8 tile path's tiles: one A tile (16 activation rows x one 32-value chunk, or Q6_K's
 * 16-value half), B and C for each of the two two-group vectors of a tile of 4 groups (one run:
 * quant_x8.h), and Q6_K's second half's B tiles. */
#define XT_A 0
#define XT_B0 1
#define XT_B1 2
#define XT_C0 3
#define XT_C1 4
#define XT_B0H 5
#define XT_B1H 6
#define XT_ROWS 16 /* activation rows per A tile */
/* depth: bytes of each row of A (32: a chunk; 16: Q6_K's half chunks) */
static inline void xt_config_x8(int depth) {
    XtConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    xt_set(&cfg, XT_A, XT_ROWS, depth);
    xt_set(&cfg, XT_B0, depth / 4, 64);
    xt_set(&cfg, XT_B1, depth / 4, 64);
    xt_set(&cfg, XT_C0, XT_ROWS, 64);
    xt_set(&cfg, XT_C1, XT_ROWS, 64);
    if (depth == 16) xt_set(&cfg, XT_B0H, 4, 64), xt_set(&cfg, XT_B1H, 4, 64);
    xt_config(&cfg);
}
