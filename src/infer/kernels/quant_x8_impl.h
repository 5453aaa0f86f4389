/* The x8 entry points of one block type (see quant_x8.h), included by quant_kernels.c once per type.
 *
 * Before including, quant_kernels.c defines X8T (the type's suffix: q4_0...), X8_ELEMS and
 * X8_FILE_BYTES (elements and bytes of a block in the file), X8_GROUP_BYTES (bytes of an x8 block:
 * 8 rows' blocks) and the type's three functions:
 *   x8_repack_<t>(rows, dst)     rows[8]: the 8 rows' file blocks (NULL: a padding row, zeros);
 *                                dst: the x8 block
 *   x8_block_<t>(gp, a, r0, b, acc, R, NZ)   (always inlined, R and NZ constants) adds x8 block b
 *                                of the 2 * NZ groups at gp[] times activation rows r0 .. r0 + R - 1
 *                                to acc[r][z], in the float sequence quant_x8.h defines
 *   x8_dequant_<t>(block, j, out) row j (0..7) of an x8 block as X8_ELEMS floats, as gguf-py does
 * and X8_TYPE_TILES: 1 where the type also runs on matrix tiles in a tile build (X8_TILES,
 * quant_tiles.h), with X8_TYPE_TILE_SIGNED (its weight bytes signed), X8_TYPE_TILE_K (the depth of
 * one tile product in bytes: 32, a chunk, unless defined; Q6_K: 16, a half chunk) and:
 *   x8_units_<t>(g0, g1, c, dst) 32-value chunk c of the x8 blocks of the groups at g0 and g1 as the
 *                                tile's B operand: 8 rows of 64 bytes (quant_kernels.c's x8_nibble_units)
 *   for a 32-value type, written once and shared with x8_block_<t>:
 *   x8_start_<t>(a, r, b)        the integer its values' offset adds to block b's sum of row r
 *                                (Q4_0: -8 * xsum)
 *   x8_epilogue_<t>(gp, a, r0, b, isum, acc, R, NZ)   the block's float sequence on its exact sums
 *   for a K type, x8_tile_chunk_<t>(gp, a, r0, c, raw, acc, R): chunk c's tile sums (raw[half])
 *   through the epilogue its x8_block_<t> uses (X8_EPILOGUE_K45, _Q6_K); a holds that chunk's
 *   activation scales only, as block 0 (the tile path's view of them)
 * The functions here are named <name>_x8_<t>; the defines are undone at the end.
 */
#define X8CAT_(a, b) a##_x8_##b
#define X8CAT(a, b) X8CAT_(a, b)
#define X8FN(name) X8CAT(name, X8T)
#define X8CAT2_(a, b) a##_##b
#define X8CAT2(a, b) X8CAT2_(a, b)
#define X8TYPEFN(name) X8CAT2(name, X8T)

/* W (n rows of k / X8_ELEMS file blocks) -> out: ceil(n / 8) groups of k / X8_ELEMS x8 blocks. */
void X8FN(quant_repack)(const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    const int64_t blocks = k / X8_ELEMS, row_bytes = blocks * X8_FILE_BYTES, groups = (n + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *rows[8];
            for (int j = 0; j < 8; j++) rows[j] = g * 8 + j < n ? w + (g * 8 + j) * row_bytes + b * X8_FILE_BYTES : NULL;
            X8TYPEFN(x8_repack)(rows, out + (x8_group_at(g, blocks) + b * x8_run_groups(g, groups)) * X8_GROUP_BYTES);
        }
}

/* acc[r][z] for activation rows r0 .. r0 + R - 1 and the groups gbase[0 .. 2 * NZ - 1] over every
 * block: each output's chain starts at 0 and takes the blocks in order. `stream`: the first pass
 * over these groups (their bytes come from memory: prefetch every line X8_AHEAD bytes ahead; a
 * later row tile finds them in L2, where the prefetches only cost). A decode tile is a run of
 * groups (quant_x8.h), one sequential stream: near its end the prefetch runs on into the next
 * run, the tile this thread takes next within its chunk of the pool's loop. */
static inline __attribute__((always_inline)) void X8FN(tile)(const uint8_t *const *gbase, int64_t blocks, int64_t stride,
                                                             const X8Act *a, int64_t r0, GF acc[X8_RB_MAX][X8_NZ_MAX],
                                                             const int R, const int NZ, const int stream) {
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) acc[r][z] = gf_zero();
    /* Prefetch distance: the whole blocks that fit in X8_AHEAD ahead in the run's stream (Q4_0: 7
     * block rows, 8 KB). Where no block fits (the K types): X8_AHEAD bytes ahead when the tile reads
     * its whole run, one stream (AVX-512 decode; a block row ahead, 13 KB, was slower), else
     * X8_AHEAD_ROWS block rows ahead: there the bytes just ahead are another tile's groups (AVX2's
     * row tiles). docs/cpu.md, "Measurements behind the kernels' constants", has the figures. */
    const int64_t ahead = X8_AHEAD >= X8_GROUP_BYTES ? X8_AHEAD / X8_GROUP_BYTES * stride
                          : 2 * NZ >= X8_RUN ? X8_AHEAD : X8_AHEAD_ROWS * stride;
    (void)ahead; /* unused where X8_AHEAD is 0 */
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gp[2 * X8_NZ_MAX];
        for (int i = 0; i < 2 * NZ; i++) {
            gp[i] = gbase[i] + b * stride;
#if X8_AHEAD > 0
            if (stream)
                for (int line = 0; line < X8_GROUP_BYTES; line += 64) __builtin_prefetch(gp[i] + ahead + line);
#endif
        }
        X8TYPEFN(x8_block)(gp, a, r0, b, acc, R, NZ);
    }
}

/* Tiles begin .. end - 1 of a product (a chunk of the pool's loop; see quant_linear). */
static void X8FN(quant_tiles)(void *ctx, int64_t begin, int64_t end, int worker) {
    const X8Linear *job = ctx;
    const int64_t m = job->m, blocks = job->blocks, groups = job->groups;
    const X8Act act = *job->act;
    const int decode = job->decode, nz = job->nz, rb = job->rb;
    (void)worker;
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *gbase[2 * X8_NZ_MAX];
        int64_t gindex[2 * X8_NZ_MAX];
        x8_tile_groups(job, t * nz * 2, 2 * nz, X8_GROUP_BYTES, gbase, gindex);
        /* a tile's groups lie in one run (2 * nz divides X8_RUN): one stride */
        const int64_t stride = x8_run_groups(t * nz * 2, groups) * X8_GROUP_BYTES;
        GF acc[X8_RB_MAX][X8_NZ_MAX];
        for (int64_t r0 = 0; r0 < m; r0 += rb) {
            const int64_t rn = m - r0 < rb ? m - r0 : rb;
            if (decode) {
                X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 1, X8_NZ_DECODE, x8_stream_prefetch);
            } else {
                switch (rn) {
                case 1: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 1, X8_NZ, r0 == 0); break;
#if X8_RB_MAX > 2
                case 2: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 2, X8_NZ, r0 == 0); break;
                case 3: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 3, X8_NZ, r0 == 0); break;
#endif
#if X8_RB_MAX > 4
                case 4: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 4, X8_NZ, r0 == 0); break;
                case 5: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 5, X8_NZ, r0 == 0); break;
#endif
#if X8_RB_MAX > 6
                case 6: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 6, X8_NZ, r0 == 0); break;
                case 7: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, 7, X8_NZ, r0 == 0); break;
#endif
                default: X8FN(tile)(gbase, blocks, stride, &act, r0, acc, X8_RB_MAX, X8_NZ, r0 == 0); break;
                }
            }
            x8_store_tile(job, acc, r0, rn, nz, gindex, 1);
        }
    }
}

#if X8_TILES && X8_TYPE_TILES
#ifndef X8_TYPE_TILE_K
#define X8_TYPE_TILE_K 32 /* bytes of one tile product's depth: a 32-value chunk (Q6_K: 16, a half) */
#endif
#ifndef X8_TYPE_TILE_OFFSET
#define X8_TYPE_TILE_OFFSET 0
#endif
#if X8_ELEMS == QK
/* A 32-value type's sums to its epilogue (shared with x8_block_<t>). Its start value is in the
 * sums already: B holds q - offset (X8_TYPE_TILE_OFFSET), so the product is sum x * (q - offset),
 * the integer x8_start_<t> + sum x * q the vectors make. The K types define theirs beside their code. */
static inline __attribute__((always_inline)) void X8TYPEFN(x8_tile_chunk)(const uint8_t *const *gp, const X8Act *a,
                                                                          int64_t r0, int c,
                                                                          GI raw[2][XT_ROWS][X8_NZ_MAX],
                                                                          GF acc[][X8_NZ_MAX], const int R) {
    (void)c;
    X8TYPEFN(x8_epilogue)(gp, a, r0, 0, raw[0], acc, R, 1);
}
#endif

/* The tile path (quant_tiles.h). A tile job is one two-group vector (16 weight rows, one B tile
 * wide) by every row of the call, in two passes:
 *   1. its weights unpacked once to bytes, chunk by chunk (x8_units_<t>: the B tiles' VNNI rows),
 *      into the worker's buffer: the tiles then read bytes stored long before, never ones still in
 *      the store buffer, and every A tile reuses them;
 *   2. per A tile of R activation rows, its products in order (one per chunk; Q6_K one per half),
 *      software-pipelined over the two tile sets: product i loaded and multiplied, then product
 *      i - 1's C tile stored, then the epilogue of the chunk whose last C tile was stored a step
 *      earlier, into R x 1 accumulators that stay in registers (R a constant).
 * The tile unit takes its operations in order and the tile registers are not renamed, so a product
 * stored right after its multiply waits for it, and one loaded into the set just used waits for
 * that set's store: alternating the sets and storing a step late keeps the multiplies back to back,
 * and the vector epilogue overlaps them. The start value (Q4_0's -8 x sum, Q5_0's -16, Q6_K's -32)
 * is in the bytes. C is zeroed per product, so each chunk's sum is its exact integer dot product,
 * the integer x8_block_<t> makes with vectors, and the epilogue is x8_block_<t>'s, in the same
 * order per output: the same bits. */

/* chunk q's B bytes (8 rows of 64; Q6_K: 4 of each half) of the two groups at gp[] into dst */
static inline __attribute__((always_inline)) void X8FN(tile_unpack)(const uint8_t *const *gp, int c, uint8_t *dst) {
    X8TYPEFN(x8_units)(gp[0], gp[1], c, dst);
#if X8_TYPE_TILE_OFFSET
    for (int i = 0; i < 8 * 64; i++) dst[i] = (uint8_t)(dst[i] - X8_TYPE_TILE_OFFSET); /* q - offset, as int8 */
#endif
}

#if X8_TYPE_TILE_SIGNED
#define X8_TILE_DOT xt_dot_ss
#else
#define X8_TILE_DOT xt_dot_su
#endif
#define X8_TILE_HALVES (32 / X8_TYPE_TILE_K) /* products per chunk: 1, Q6_K 2 */
/* product i (chunk i / H, half i % H) into one tile set: its B and A loaded, C zeroed, multiplied */
#define X8_TILE_ISSUE(A, B, C, i)                                                                              \
    do {                                                                                                       \
        const int64_t q_ = (i) / X8_TILE_HALVES, h_ = (i) % X8_TILE_HALVES;                                    \
        xt_load(B, units + q_ * (8 * 64) + h_ * (16 * X8_TYPE_TILE_K), 64);                                    \
        xt_load_rows(A, act->q + r0 * act->k + q_ * QK + h_ * X8_TYPE_TILE_K, act->k, R);                      \
        xt_zero(C);                                                                                            \
        X8_TILE_DOT(C, A, B);                                                                                  \
    } while (0)

/* Pass 2 for the A tiles of R rows (a constant) covering rows r0 .. r0 + rn - 1 (padded to R with
 * the zero rows quant_linear adds), the chunks' B bytes at units. */
static inline __attribute__((always_inline)) void X8FN(tile_pass)(const X8Linear *job, const X8Act *act,
                                                                  const uint8_t *const *gbase, int64_t stride,
                                                                  const int64_t *gindex, const uint8_t *units,
                                                                  int64_t r0, int64_t rn, const int R) {
    const int64_t chunks = job->blocks * (X8_ELEMS / QK), products = chunks * X8_TILE_HALVES;
    const int RB = R < 8 ? R : 8; /* rows per epilogue call */
    int32_t sums[2][X8_TILE_HALVES][XT_ROWS * 16] __attribute__((aligned(64))); /* [chunk parity][half] */
    GF chain[XT_ROWS]; /* each row's accumulators: registers (AMX: R a constant, the loops unrolled) */
    for (int r = 0; r < R; r++) chain[r] = gf_zero();
    for (int64_t i = 0; i <= products + 1; i++) {
        if (i < products) { /* product i, in set i % 2 */
            if (i & 1) X8_TILE_ISSUE(XT_A1, XT_B1, XT_C1, i);
            else X8_TILE_ISSUE(XT_A0, XT_B0, XT_C0, i);
        }
        if (i >= 1 && i <= products) { /* product i - 1's sums, from the other set */
            const int64_t j = i - 1;
            int32_t *dst = sums[(j / X8_TILE_HALVES) & 1][j % X8_TILE_HALVES];
            if (j & 1) xt_store_rows(XT_C1, dst, 64, R);
            else xt_store_rows(XT_C0, dst, 64, R);
            xt_stored(); /* the C tile's bytes are in sums before anything reads them */
        }
        if (i >= 2 && (i - 2) % X8_TILE_HALVES == X8_TILE_HALVES - 1) { /* chunk p's last sums were stored a step ago */
            const int64_t p = (i - 2) / X8_TILE_HALVES, b = p / (X8_ELEMS / QK);
            const uint8_t *gp[2] = {gbase[0] + b * stride, gbase[1] + b * stride};
            /* the epilogue's view of chunk p's activation scales: this A tile's row r at [r] (block
             * 0 of a one-block row), so every row's scale is one pointer plus a constant (with the
             * rows' own layout the compiler kept a pointer per row and ran out of registers); what
             * else it might read is not there (null) */
            const X8Act view = {NULL, job->d_by_block + p * job->padded + r0, NULL,
                                job->s_by_block + p * job->padded + r0, act->k, 1, NULL};
#if defined(X8_TILES_AMX)
#pragma GCC unroll 2
#endif
            for (int r1 = 0; r1 < R; r1 += RB) { /* RB rows a call: the chunk's scales loaded once per call */
                GI raw[2][XT_ROWS][X8_NZ_MAX];
                GF acc[XT_ROWS][X8_NZ_MAX];
                for (int r = 0; r < RB; r++) {
                    for (int h = 0; h < X8_TILE_HALVES; h++) raw[h][r][0] = gi_load(sums[p & 1][h] + 16 * (r1 + r));
                    acc[r][0] = chain[r1 + r];
                }
                X8TYPEFN(x8_tile_chunk)(gp, &view, r1, (int)(p % (X8_ELEMS / QK)), raw, acc, RB);
                for (int r = 0; r < RB; r++) chain[r1 + r] = acc[r][0];
            }
        }
    }
    GF acc[XT_ROWS][X8_NZ_MAX];
    for (int r = 0; r < rn; r++) acc[r][0] = chain[r];
    x8_store_tile(job, acc, r0, rn, 1, gindex, 0);
}
#undef X8_TILE_ISSUE
#undef X8_TILE_HALVES
#undef X8_TILE_DOT

/* Tiles begin .. end - 1 of a tile product (each a two-group vector by every row of the call) */
static void X8FN(quant_tile_rows)(void *ctx, int64_t begin, int64_t end, int worker) {
    const X8Linear *job = ctx;
    const int64_t m = job->m, blocks = job->blocks, groups = job->groups;
    const X8Act act = *job->act;
    const int R = job->rb; /* rows per A tile: quant_linear's choice */
    uint8_t *units = job->units + (int64_t)worker * blocks * (X8_ELEMS / QK) * (8 * 64);
    /* each thread's own tile configuration (a pool thread's first tile job...): A and C of R rows */
    xt_config_x8(X8_TYPE_TILE_K, R);
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *gbase[2];
        int64_t gindex[2];
        x8_tile_groups(job, t * 2, 2, X8_GROUP_BYTES, gbase, gindex);
        const int64_t stride = x8_run_groups(t * 2, groups) * X8_GROUP_BYTES;
        const int64_t ahead = X8_AHEAD >= X8_GROUP_BYTES ? X8_AHEAD / X8_GROUP_BYTES * stride : X8_AHEAD;
        (void)ahead;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *gp[2] = {gbase[0] + b * stride, gbase[1] + b * stride};
#if X8_AHEAD > 0
            for (int i = 0; i < 2; i++)
                for (int line = 0; line < X8_GROUP_BYTES; line += 64) __builtin_prefetch(gp[i] + ahead + line);
#endif
            for (int c = 0; c < X8_ELEMS / QK; c++)
                X8FN(tile_unpack)(gp, c, units + (b * (X8_ELEMS / QK) + c) * (8 * 64));
        }
        for (int64_t r0 = 0; r0 < m; r0 += R) {
            const int64_t rn = m - r0 < R ? m - r0 : R;
#if defined(X8_TILES_AMX)
            switch (R) { /* a kernel per A tile height, its rows' chains in registers */
            case 2: X8FN(tile_pass)(job, &act, gbase, stride, gindex, units, r0, rn, 2); break;
            case 4: X8FN(tile_pass)(job, &act, gbase, stride, gindex, units, r0, rn, 4); break;
            case 8: X8FN(tile_pass)(job, &act, gbase, stride, gindex, units, r0, rn, 8); break;
            default: X8FN(tile_pass)(job, &act, gbase, stride, gindex, units, r0, rn, XT_ROWS); break;
            }
#else
            /* the emulation's and SMMLA's tiles are memory: one kernel, R at run time (four, each
             * with the emulated operations inlined, took minutes to compile) */
            X8FN(tile_pass)(job, &act, gbase, stride, gindex, units, r0, rn, R);
#endif
        }
    }
    xt_release();
}
#endif

/* y[m, n] = x[m, k] @ W^T (+ bias[n]) with W in the x8 layout (quant_repack_x8_<t>'s out), on
 * `threads` threads of the pool (thread_pool.h; the tiles are its items, claimed in runs of
 * consecutive tiles); y[r, j] is quant_x8.h's float sequence, the same bits whatever m, the tiling,
 * the thread count and the thread that computes it. Returns 0, or 1 where the activations' scratch could not be
 * allocated (y untouched). */
int X8FN(quant_linear)(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, const float *bias, float *y,
                       int threads) {
    const int64_t blocks = k / X8_ELEMS, xblocks = k / QK, groups = (n + 7) / 8;
#if X8_TILES && X8_TYPE_TILES
    /* calls of x8_tile_min_rows rows or more on tiles (1 row stays on the vectors: a decode step is
     * bound by memory, not arithmetic), in A tiles of R rows (2, 4, 8 or 16: the fewest that hold a call of fewer than 16);
     * the activations padded with zero rows to whole A tiles, which the tiles and the epilogue read */
    const int on_tiles = m >= 2 && m >= x8_tile_min_rows && x8_tiles_on;
    const int tile_rows = m >= XT_ROWS ? XT_ROWS : m <= 2 ? 2 : m <= 4 ? 4 : m <= 8 ? 8 : XT_ROWS;
    const int64_t padded = on_tiles ? (m + tile_rows - 1) / tile_rows * tile_rows : m;
#else
    const int64_t padded = m;
#endif
    int8_t *xq = malloc((size_t)(padded * k) + 1);
    float *dx = malloc(sizeof(float) * (size_t)(padded * xblocks) + 1), *sx = malloc(sizeof(float) * (size_t)(padded * xblocks) + 1);
    int32_t *xsum = malloc(2 * sizeof(int32_t) * (size_t)(padded * xblocks) + 1);
    if (!xq || !dx || !sx || !xsum) {
        free(xq), free(dx), free(sx), free(xsum);
        return 1;
    }
    int32_t *xsum16 = xsum + padded * xblocks;
    quantize_rows(x, m, k, xq, dx, xsum, sx, xsum16, threads);
    const X8Act act = {xq, dx, xsum, sx, k, xblocks, xsum16};
#if X8_TILES && X8_TYPE_TILES
    if (on_tiles) {
        const size_t pad_rows = (size_t)(padded - m);
        memset(xq + m * k, 0, pad_rows * (size_t)k);
        memset(dx + m * xblocks, 0, pad_rows * (size_t)xblocks * sizeof(float));
        memset(sx + m * xblocks, 0, pad_rows * (size_t)xblocks * sizeof(float));
        memset(xsum + m * xblocks, 0, pad_rows * (size_t)xblocks * sizeof(int32_t));
        memset(xsum16 + m * xblocks, 0, pad_rows * (size_t)xblocks * sizeof(int32_t));
        /* each worker's unpacked B bytes of one two-group vector: 16 bytes per weight value's row */
        const int workers = threads < 1 ? 1 : threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads;
        uint8_t *units = malloc((size_t)workers * (size_t)(k / QK) * (8 * 64) + 64);
        float *by_block = malloc(2 * sizeof(float) * (size_t)(padded * xblocks) + 1);
        if (!units || !by_block) {
            free(units), free(by_block), free(xq), free(dx), free(sx), free(xsum);
            return 1;
        }
        for (int64_t r = 0; r < padded; r++)
            for (int64_t c = 0; c < xblocks; c++) {
                by_block[c * padded + r] = dx[r * xblocks + c];
                by_block[(xblocks + c) * padded + r] = sx[r * xblocks + c];
            }
        X8Linear job = {w, n, m, blocks, groups, &act, bias, y, 0, 1, tile_rows, units, by_block, by_block + xblocks * padded, padded};
        __atomic_fetch_add(&x8_tile_products, 1, __ATOMIC_RELAXED);
        pool_run(X8FN(quant_tile_rows), &job, (groups + 1) / 2, 0, threads);
        free(units), free(by_block), free(xq), free(dx), free(sx), free(xsum);
        return 0;
    }
#endif
    /* One activation row: X8_NZ_DECODE two-group vectors per tile, always (a balance rule that took
     * the row tiles' smaller ones for some weights read their runs in interleaved halves, and with
     * the pool's per-thread runs left a decode step's small products no faster on two threads than
     * on one: docs/cpu.md). Else X8_RB rows (X8_TYPE_RB_FEW in a call of at most X8_FEW_ROWS) x
     * X8_NZ two-group vectors. */
    const int64_t pairs = (groups + 1) / 2;
    const int decode = m == 1, nz = decode ? X8_NZ_DECODE : X8_NZ,
              rb = decode ? 1 : m <= X8_FEW_ROWS ? X8_TYPE_RB_FEW : X8_RB;
    const int64_t tiles = (pairs + nz - 1) / nz;
    X8Linear job = {w, n, m, blocks, groups, &act, bias, y, decode, nz, rb};
    pool_run(X8FN(quant_tiles), &job, tiles, 0, threads);
    free(xq), free(dx), free(sx), free(xsum);
    return 0;
}

/* out[i, :] = row ids[i] of W (x8 layout, n rows of k columns) in float, as gguf-py dequantizes it
 * (n: where the last run of groups ends). */
void X8FN(quant_dequantize_rows)(const uint8_t *w, int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out) {
    const int64_t blocks = k / X8_ELEMS, groups = (n + 7) / 8;
    for (int64_t i = 0; i < count; i++) {
        const int64_t g = ids[i] / 8, stride = x8_run_groups(g, groups) * X8_GROUP_BYTES;
        const uint8_t *group = w + x8_group_at(g, blocks) * X8_GROUP_BYTES;
        for (int64_t b = 0; b < blocks; b++)
            X8TYPEFN(x8_dequant)(group + b * stride, (int)(ids[i] % 8), out + i * k + b * X8_ELEMS);
    }
}

#undef X8FN
#undef X8CAT
#undef X8CAT_
#undef X8TYPEFN
#undef X8CAT2
#undef X8CAT2_
#undef X8T
#undef X8_ELEMS
#undef X8_FILE_BYTES
#undef X8_GROUP_BYTES
#undef X8_TYPE_RB_FEW
#undef X8_TYPE_TILES
#ifdef X8_TYPE_TILE_SIGNED
#undef X8_TYPE_TILE_SIGNED
#endif
#ifdef X8_TYPE_TILE_K
#undef X8_TYPE_TILE_K
#endif
#ifdef X8_TYPE_TILE_OFFSET
#undef X8_TYPE_TILE_OFFSET
#endif
