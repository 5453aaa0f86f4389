/* Matrix tiles for the quantized kernels: a thin layer of AMX-like primitives beside quant_x8.h's
 * vectors, with three implementations giving the same integers: Intel AMX's instructions
 * (X8_TILES_AMX: -mamx-tile -mamx-int8), ARM's I8MM matrix multiply-accumulates (X8_TILES_SMMLA:
 * +i8mm, SMMLA / USMMLA on 2x2 blocks of the tile product, the tiles kept in memory) and a portable
 * C emulation of them (X8_TILES_EMU), which runs the same tile code, layout and tiling on any CPU,
 * so the tests check them bit for bit where there is no AMX.
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
 *   xt_load_rows(T, p, stride, n): xt_load where the caller promises that rows n and on are zero in
 *                       memory (its padding): an implementation may skip them (SMMLA: a call of 2
 *                       rows does the work of 2, not of 16); the emulation checks the promise
 *   xt_store_rows(T, p, stride, n): at least the first n rows of xt_store (AMX stores them all: the
 *                       buffer holds every configured row)
 *   xt_zero(T)
 *   xt_config(cfg): the shapes of every tile (XtConfig: palette 1), for this thread; zeroes every tile.
 *   xt_release(): this thread's tiles and configuration back to their initial state (unconfigured).
 * An operation whose shapes do not fit together (A's rows != C's, B's rows != A's bytes / 4, B's
 * bytes != C's) is a fault on the hardware; the emulation aborts, so a layout mistake cannot pass
 * the tests on a machine without AMX.
 *
 * How the kernels use them: quant_x8_impl.h's tile path (every type, calls of x8_tile_min_rows rows or
 * more). A = R activation rows' 32 int8 values of one 32-value chunk (R = 2, 4, 8 or 16), loaded in
 * place (row stride = the activations' row pitch); B = that chunk of two x8 groups (16 weight rows),
 * unpacked to bytes with quant_x8.h's vector primitives into a per-thread buffer before any tile
 * reads it: the x8 layout's 4-byte units of 8 rows are already VNNI layout for one group, and
 * gw_load(a, b) puts two groups side by side, so each stored register is one 64-byte B row; C = R x 16
 * int32, zeroed per chunk so each chunk's integer sum is exact and separate, then stored and fed to
 * the type's float epilogue (quant_x8.h's contract, in its order): the same bits as every other
 * variant. Q6_K's chunks have a scale per 16 values: its A and B tiles are 16 bytes deep, two
 * products a chunk.
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
/* after tile stores, before anything reads what they wrote: GCC's _tile_stored names no memory
 * either, so reads of its bytes could be moved before it */
#define xt_stored() xt_barrier()
#define xt_load_rows(t, p, stride, n)                                                                          \
    do {                                                                                                       \
        (void)(n);                                                                                             \
        xt_load(t, p, stride);                                                                                 \
    } while (0)
#define xt_store_rows(t, p, stride, n)                                                                         \
    do {                                                                                                       \
        (void)(n);                                                                                             \
        xt_store(t, p, stride);                                                                                \
    } while (0)
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
#elif defined(X8_TILES_SMMLA)
/* ARM I8MM: the tiles are each thread's memory, as in the emulation, and a tile product is a loop
 * of SMMLA / USMMLA over its 2x2 output blocks. vmmlaq_s32(c, a, b): c (int32x4: the 2x2 block, row
 * major) += a (2 rows of 8 int8) times b^T (2 columns of 8 int8), the sums in int32 with wraparound;
 * vusmmlaq_s32 reads its first operand unsigned. A 2x8 operand of A is two of its rows' 8 bytes at
 * k (a 64-bit zip of the rows); one of B is two columns' 8 values, and a column's values 8s .. 8s + 7
 * are its 4 bytes in B rows 2s and 2s + 1 (the VNNI layout): a 32-bit zip of the two rows gives
 * columns 4g, 4g + 1 (zip1) and 4g + 2, 4g + 3 (zip2). K not a multiple of 8 ends on zero bytes.
 * tdpbsud (A signed, B unsigned) takes USMMLA with B first, so its 2x2 blocks come out transposed
 * (columns by rows); the others have A first.
 * Each tile also keeps its count of live rows: rows from live[t] on are zero, whatever its bytes
 * hold (xt_zero and xt_config only reset the count; xt_load_rows sets it to the rows loaded), and a
 * product runs over A's live row pairs only. So a call of 2 activation rows in a 16-row A tile costs
 * 2 rows of SMMLAs, not 16, and zeroing or storing the C tiles of it touches 2 rows. */
#define XT_IMPL "smmla"
typedef struct {
    XtConfig cfg;
    uint8_t live[8];
    uint8_t t[8][16][64] __attribute__((aligned(16)));
} XtState;
static __thread XtState xt_state;
static inline int xt_rows(int t) { return xt_state.cfg.rows[t]; }
static inline int xt_colsb(int t) { return xt_state.cfg.colsb[t]; }
static inline void xt_check(int ok) {
    if (!ok) abort(); /* an unconfigured tile or shapes that do not fit: AMX's fault, kept here */
}
static inline void xt_config(const XtConfig *cfg) {
    xt_state.cfg = *cfg;
    memset(xt_state.live, 0, sizeof xt_state.live);
}
static inline void xt_check_rows(int t, int n) {
    const int rows = xt_rows(t), colsb = xt_colsb(t);
    xt_check(xt_state.cfg.palette == 1 && rows >= 1 && rows <= 16 && colsb >= 1 && colsb <= 64 && n >= 0 && n <= rows);
}
/* Rows r < n of tile t from p + r * stride. A product reads each row up to its bytes rounded up to
 * 16 (whole NEON registers), so a width that is not a multiple of 16 is followed by zeros. */
static inline void xt_load_rows(int t, const void *p, int64_t stride, int n) {
    xt_check_rows(t, n);
    const int colsb = xt_colsb(t);
    const uint8_t *src = p;
    if (colsb % 16 == 0) {
        for (int r = 0; r < n; r++)
            for (int o = 0; o < colsb; o += 16) vst1q_u8(xt_state.t[t][r] + o, vld1q_u8(src + r * stride + o));
    } else {
        for (int r = 0; r < n; r++) {
            memcpy(xt_state.t[t][r], src + r * stride, (size_t)colsb);
            memset(xt_state.t[t][r] + colsb, 0, (size_t)(64 - colsb));
        }
    }
    xt_state.live[t] = (uint8_t)n;
}
static inline void xt_load(int t, const void *p, int64_t stride) { xt_load_rows(t, p, stride, xt_rows(t)); }
static inline void xt_stored(void) {}
/* Rows r < n to p + r * stride: the live ones' bytes, zeros for the rest. */
static inline void xt_store_rows(int t, void *p, int64_t stride, int n) {
    xt_check_rows(t, n);
    const int colsb = xt_colsb(t), live = xt_state.live[t] < n ? xt_state.live[t] : n;
    uint8_t *dst = p;
    for (int r = 0; r < live; r++) memcpy(dst + r * stride, xt_state.t[t][r], (size_t)colsb);
    for (int r = live; r < n; r++) memset(dst + r * stride, 0, (size_t)colsb);
}
static inline void xt_store(int t, void *p, int64_t stride) { xt_store_rows(t, p, stride, xt_rows(t)); }
static inline void xt_zero(int t) { xt_state.live[t] = 0; }
/* Tile t's rows up to n (<= 16) made real: the zero rows past its live ones written as zeros. */
static inline void xt_materialize(int t, int n) {
    for (int r = xt_state.live[t]; r < n; r++) memset(xt_state.t[t][r], 0, 64);
    if (n > xt_state.live[t]) xt_state.live[t] = (uint8_t)n;
}
enum { XT_SU, XT_SS, XT_US };
/* Row pairs p0 .. p0 + P - 1 of A against the 4 columns 4g .. 4g + 3 (one 16-byte slice of B's
 * rows), K8 steps of 8 values; C's rows added to (or written, when they were zero: `fresh`). */
static inline __attribute__((always_inline)) void xt_mmla_block(int c, int a, int b, int g, int p0, const int P,
                                                                const int K8, const int op, const int fresh) {
    int8x16_t bw[8][2];
    for (int s = 0; s < K8; s++) {
        const int32x4_t r0 = vreinterpretq_s32_u8(vld1q_u8(xt_state.t[b][2 * s] + 16 * g));
        const int32x4_t r1 = vreinterpretq_s32_u8(vld1q_u8(xt_state.t[b][2 * s + 1] + 16 * g));
        bw[s][0] = vreinterpretq_s8_s32(vzip1q_s32(r0, r1));
        bw[s][1] = vreinterpretq_s8_s32(vzip2q_s32(r0, r1));
    }
    int32x4_t acc[4][2];
    for (int i = 0; i < P; i++) acc[i][0] = acc[i][1] = vdupq_n_s32(0);
    for (int s = 0; s < K8; s++)
        for (int i = 0; i < P; i++) {
            const int p = p0 + i;
            const int64x2_t x0 = vreinterpretq_s64_u8(vld1q_u8(xt_state.t[a][2 * p] + 16 * (s >> 1)));
            const int64x2_t x1 = vreinterpretq_s64_u8(vld1q_u8(xt_state.t[a][2 * p + 1] + 16 * (s >> 1)));
            const int8x16_t av = vreinterpretq_s8_s64(s & 1 ? vzip2q_s64(x0, x1) : vzip1q_s64(x0, x1));
            for (int h = 0; h < 2; h++) {
                if (op == XT_SS) acc[i][h] = vmmlaq_s32(acc[i][h], av, bw[s][h]);
                else if (op == XT_US) acc[i][h] = vusmmlaq_s32(acc[i][h], vreinterpretq_u8_s8(av), bw[s][h]);
                else acc[i][h] = vusmmlaq_s32(acc[i][h], vreinterpretq_u8_s8(bw[s][h]), av); /* transposed */
            }
        }
    for (int i = 0; i < P; i++) {
        const int p = p0 + i;
        int32x4_t row0, row1; /* rows 2p and 2p + 1, columns 4g .. 4g + 3 */
        if (op == XT_SU) {
            row0 = vuzp1q_s32(acc[i][0], acc[i][1]), row1 = vuzp2q_s32(acc[i][0], acc[i][1]);
        } else {
            const int64x2_t l0 = vreinterpretq_s64_s32(acc[i][0]), l1 = vreinterpretq_s64_s32(acc[i][1]);
            row0 = vreinterpretq_s32_s64(vzip1q_s64(l0, l1)), row1 = vreinterpretq_s32_s64(vzip2q_s64(l0, l1));
        }
        int32_t *c0 = (int32_t *)(void *)xt_state.t[c][2 * p] + 4 * g;
        int32_t *c1 = (int32_t *)(void *)xt_state.t[c][2 * p + 1] + 4 * g;
        if (!fresh) row0 = vaddq_s32(vld1q_s32(c0), row0), row1 = vaddq_s32(vld1q_s32(c1), row1);
        vst1q_s32(c0, row0);
        vst1q_s32(c1, row1);
    }
}
static inline __attribute__((always_inline)) void xt_mmla(int c, int a, int b, int pairs, int groups, const int K8,
                                                          const int op, const int fresh) {
    for (int g = 0; g < groups; g++) {
        int p = 0;
        for (; p + 2 <= pairs; p += 2) xt_mmla_block(c, a, b, g, p, 2, K8, op, fresh);
        if (p < pairs) xt_mmla_block(c, a, b, g, p, 1, K8, op, fresh);
    }
}
/* One function per depth the kernels use (a chunk of 32 values, Q6_K's halves of 16), its steps
 * unrolled with B's operands in registers, and one for any other depth. Separate functions: inlined
 * into one, GCC merged the branches (in `k8 == 4`, 4 and k8 are the same value) into the loop. */
#define XT_MMLA_DEPTH(name, K8)                                                                                 \
    static __attribute__((noinline)) void name(int c, int a, int b, int pairs, int groups, int k8, int op,          \
                                               int fresh) {                                                     \
        (void)k8;                                                                                               \
        if (op == XT_SU) xt_mmla(c, a, b, pairs, groups, K8, XT_SU, fresh);                                     \
        else if (op == XT_SS) xt_mmla(c, a, b, pairs, groups, K8, XT_SS, fresh);                                \
        else xt_mmla(c, a, b, pairs, groups, K8, XT_US, fresh);                                                 \
    }
XT_MMLA_DEPTH(xt_mmla_k4, 4)
XT_MMLA_DEPTH(xt_mmla_k2, 2)
XT_MMLA_DEPTH(xt_mmla_any, k8)
#undef XT_MMLA_DEPTH
/* C[m][n] += the dot products (the emulation's xt_dot, on SMMLA), over A's live row pairs */
static inline void xt_dot(int c, int a, int b, const int op) {
    const int m_rows = xt_rows(a), k4 = xt_colsb(a) / 4, n = xt_colsb(c) / 4;
    xt_check(xt_state.cfg.palette == 1 && m_rows >= 1 && xt_colsb(a) % 4 == 0 && k4 >= 1 && xt_rows(c) == m_rows &&
             xt_rows(b) == k4 && xt_colsb(b) == xt_colsb(c) && xt_colsb(c) % 4 == 0);
    const int live = xt_state.live[a] < m_rows ? xt_state.live[a] : m_rows, pairs = (live + 1) / 2;
    if (pairs == 0) return; /* C += 0 */
    const int k8 = (k4 + 1) / 2, groups = (n + 3) / 4, fresh = xt_state.live[c] == 0;
    xt_materialize(a, 2 * pairs); /* an odd live count's partner row */
    xt_materialize(b, 2 * k8);    /* B's zero rows, and the one past an odd K / 4 */
    if (!fresh) xt_materialize(c, 2 * pairs);
    else xt_state.live[c] = (uint8_t)(2 * pairs);
    (k8 == 4 ? xt_mmla_k4 : k8 == 2 ? xt_mmla_k2 : xt_mmla_any)(c, a, b, pairs, groups, k8, op, fresh);
}
#define xt_dot_su(c, a, b) xt_dot(c, a, b, XT_SU)
#define xt_dot_ss(c, a, b) xt_dot(c, a, b, XT_SS)
#define xt_dot_us(c, a, b) xt_dot(c, a, b, XT_US)
static inline void xt_release(void) {
    memset(&xt_state.cfg, 0, sizeof xt_state.cfg);
    memset(xt_state.live, 0, sizeof xt_state.live);
}
static int xt_request_permission(void) { return 0; }
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
static inline void xt_stored(void) {}
/* The promise xt_load_rows' callers make (rows n and on zero in memory) checked, then the whole load */
static inline void xt_load_rows(int t, const void *p, int64_t stride, int n) {
    xt_check(n >= 0 && n <= xt_rows(t));
    for (int r = n; r < xt_rows(t); r++)
        for (int i = 0; i < xt_colsb(t); i++) xt_check(((const uint8_t *)p)[r * stride + i] == 0);
    xt_load(t, p, stride);
}
static inline void xt_store_rows(int t, void *p, int64_t stride, int n) {
    xt_check(n >= 0 && n <= xt_rows(t));
    xt_store(t, p, stride);
}
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

/* The x8 tile path's tiles: two sets of an A tile (R activation rows x one 32-value chunk, or one
 * of Q6_K's 16-value halves), the B tile of one two-group vector (16 weight rows) and their C tile.
 * Consecutive products take the two sets in turn: the tile registers are not renamed, so a product
 * in the set the previous one used would wait for it (its loads for the previous product to finish
 * reading A and B, its zeroing for the previous store to finish reading C). */
#define XT_A0 0
#define XT_B0 1
#define XT_C0 2
#define XT_A1 3
#define XT_B1 4
#define XT_C1 5
#define XT_ROWS 16 /* activation rows per A tile, at most */
/* depth: bytes of each row of A (32: a chunk; 16: Q6_K's half chunks); rows: of A and C (<= XT_ROWS) */
static inline void xt_config_x8(int depth, int rows) {
    XtConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    for (int set = 0; set < 2; set++) {
        xt_set(&cfg, set ? XT_A1 : XT_A0, rows, depth);
        xt_set(&cfg, set ? XT_B1 : XT_B0, depth / 4, 64);
        xt_set(&cfg, set ? XT_C1 : XT_C0, rows, 64);
    }
    xt_config(&cfg);
}
