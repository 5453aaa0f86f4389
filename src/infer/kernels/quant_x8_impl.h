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
 *   for a K type, x8_tile_chunk_<t>(gp, a, r0, b, c, raw, acc, R): chunk c's tile sums (raw[half])
 *   through the start values and the epilogue its x8_block_<t> uses (X8_EPILOGUE_K45, _Q6_K)
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
     * its whole run, one stream (AVX-512 decode; longer was slower, 1-row decode shapes, one thread:
     * Q6_K 25.4 GB/s at 1 KB, 20.4 at one block row, 13 KB; Q4_0 31.6 at 7 rows, 25.4 at 1 KB), else
     * X8_AHEAD_ROWS block rows ahead: there the bytes just ahead are another tile's groups (AVX2's
     * row tiles; measured on AVX2 decode tiles when they were 4 of a run of 8 groups, Q4_K 2048 x
     * 8192, 1 row, one thread: 0.36 ms at 2 rows, 0.42 at 1, 0.59 at 1 KB) */
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
            x8_store_tile(job, acc, r0, rn, nz, gindex);
        }
    }
}

#if X8_TILES && X8_TYPE_TILES
#ifndef X8_TYPE_TILE_K
#define X8_TYPE_TILE_K 32 /* bytes of one tile product's depth: a 32-value chunk (Q6_K: 16, a half) */
#endif
#if X8_ELEMS == QK
/* A 32-value type's sums: its start value added in int32, then its epilogue (both shared with
 * x8_block_<t>). The K types define theirs beside their code. */
static inline __attribute__((always_inline)) void X8TYPEFN(x8_tile_chunk)(const uint8_t *const *gp, const X8Act *a,
                                                                          int64_t r0, int64_t b, int c,
                                                                          GI raw[2][XT_ROWS][X8_NZ_MAX],
                                                                          GF acc[][X8_NZ_MAX], const int R) {
    (void)c;
    for (int r = 0; r < R; r++) {
        const GI start = gi_set1(X8TYPEFN(x8_start)(a, r0 + r, b));
        for (int z = 0; z < 2; z++) raw[0][r][z] = gi_add(raw[0][r][z], start);
    }
    X8TYPEFN(x8_epilogue)(gp, a, r0, b, raw[0], acc, R, 2);
}
#endif

/* The tile path (quant_tiles.h): block b of the 4 groups at gp[] (one run: two two-group vectors)
 * times activation rows r0 .. r0 + rn - 1, added to acc[r - r0][z] in the type's float sequence.
 * Per 32-value chunk, in order: the weights unpacked once for all rn rows (a B tile per two-group
 * vector; Q6_K: one per half); per A tile of XT_ROWS rows, the C tiles zeroed, so what they give is
 * the chunk's exact integer dot products, the integers x8_block_<t> makes with vectors, fed to the
 * same epilogue: the same bits. */
static inline __attribute__((always_inline)) void X8FN(tile_block)(const uint8_t *const *gp, const X8Act *a, int64_t r0,
                                                                   int64_t rn, int64_t b, GF (*acc)[X8_NZ_MAX]) {
    uint8_t units[2][8 * 64] __attribute__((aligned(64)));
    int32_t sums[2][2][XT_ROWS * 16] __attribute__((aligned(64))); /* [half][two-group vector] */
    for (int c = 0; c < X8_ELEMS / QK; c++) {
        const int64_t xb = b * (X8_ELEMS / QK) + c;
        X8TYPEFN(x8_units)(gp[0], gp[1], c, units[0]);
        X8TYPEFN(x8_units)(gp[2], gp[3], c, units[1]);
        xt_load(XT_B0, units[0], 64);
        xt_load(XT_B1, units[1], 64);
#if X8_TYPE_TILE_K == 16
        xt_load(XT_B0H, units[0] + 256, 64);
        xt_load(XT_B1H, units[1] + 256, 64);
#endif
        for (int64_t t0 = 0; t0 < rn; t0 += XT_ROWS) {
            /* rows tr and on (past the call's last) are the zero rows quant_linear pads the
             * activations with: the A tile's loads and the C tiles' stores say so, and only the
             * first tr rows of the sums are read (SMMLA then skips the rest) */
            const int tr = rn - t0 < XT_ROWS ? (int)(rn - t0) : XT_ROWS;
            const int8_t *x = a->q + (r0 + t0) * a->k + xb * QK;
            xt_load_rows(XT_A, x, a->k, tr);
            xt_zero(XT_C0);
            xt_zero(XT_C1);
#if X8_TYPE_TILE_SIGNED
            xt_dot_ss(XT_C0, XT_A, XT_B0);
            xt_dot_ss(XT_C1, XT_A, XT_B1);
#else
            xt_dot_su(XT_C0, XT_A, XT_B0);
            xt_dot_su(XT_C1, XT_A, XT_B1);
#endif
            xt_store_rows(XT_C0, sums[0][0], 64, tr);
            xt_store_rows(XT_C1, sums[0][1], 64, tr);
#if X8_TYPE_TILE_K == 16
            xt_load_rows(XT_A, x + 16, a->k, tr);
            xt_zero(XT_C0);
            xt_zero(XT_C1);
            xt_dot_su(XT_C0, XT_A, XT_B0H);
            xt_dot_su(XT_C1, XT_A, XT_B1H);
            xt_store_rows(XT_C0, sums[1][0], 64, tr);
            xt_store_rows(XT_C1, sums[1][1], 64, tr);
#endif
            GI raw[2][XT_ROWS][X8_NZ_MAX];
            for (int r = 0; r < tr; r++)
                for (int h = 0; h < 32 / X8_TYPE_TILE_K; h++)
                    for (int z = 0; z < 2; z++) raw[h][r][z] = gi_load(sums[h][z] + 16 * r);
            X8TYPEFN(x8_tile_chunk)(gp, a, r0 + t0, b, c, raw, acc + t0, tr);
        }
    }
}

/* Tiles begin .. end - 1 of a tile product: each a run's 4 groups (two B tiles) by every row of
 * the call, X8_TILE_SPAN rows of accumulators at a time. */
static void X8FN(quant_tile_rows)(void *ctx, int64_t begin, int64_t end, int worker) {
    const X8Linear *job = ctx;
    const int64_t m = job->m, blocks = job->blocks, groups = job->groups;
    const X8Act act = *job->act;
    (void)worker;
    xt_config_x8(X8_TYPE_TILE_K); /* each thread's own tile configuration (a pool thread's first tile job...) */
    for (int64_t t = begin; t < end; t++) {
        const uint8_t *gbase[4];
        int64_t gindex[4];
        x8_tile_groups(job, t * 4, 4, X8_GROUP_BYTES, gbase, gindex);
        const int64_t stride = x8_run_groups(t * 4, groups) * X8_GROUP_BYTES;
        const int64_t ahead = X8_AHEAD >= X8_GROUP_BYTES ? X8_AHEAD / X8_GROUP_BYTES * stride : X8_AHEAD;
        (void)ahead;
        for (int64_t r0 = 0; r0 < m; r0 += X8_TILE_SPAN) {
            const int64_t rn = m - r0 < X8_TILE_SPAN ? m - r0 : X8_TILE_SPAN;
            GF acc[X8_TILE_SPAN][X8_NZ_MAX];
            for (int64_t r = 0; r < rn; r++)
                for (int z = 0; z < 2; z++) acc[r][z] = gf_zero();
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *gp[4];
                for (int i = 0; i < 4; i++) {
                    gp[i] = gbase[i] + b * stride;
#if X8_AHEAD > 0
                    if (r0 == 0)
                        for (int line = 0; line < X8_GROUP_BYTES; line += 64) __builtin_prefetch(gp[i] + ahead + line);
#endif
                }
                X8FN(tile_block)(gp, &act, r0, rn, b, acc);
            }
            x8_store_tile(job, acc, r0, rn, 2, gindex);
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
    /* 2 rows or more on tiles (1 row stays on the vectors: a decode step is bound by memory, not
     * arithmetic); the activations padded with zero rows to whole A tiles, which the tiles read */
    const int on_tiles = m >= 2 && x8_tiles_on;
    const int64_t padded = on_tiles ? (m + XT_ROWS - 1) / XT_ROWS * XT_ROWS : m;
#else
    const int64_t padded = m;
#endif
    int8_t *xq = malloc((size_t)(padded * k) + 1);
    float *dx = malloc(sizeof(float) * (size_t)(m * xblocks) + 1), *sx = malloc(sizeof(float) * (size_t)(m * xblocks) + 1);
    int32_t *xsum = malloc(2 * sizeof(int32_t) * (size_t)(m * xblocks) + 1);
    if (!xq || !dx || !sx || !xsum) {
        free(xq), free(dx), free(sx), free(xsum);
        return 1;
    }
    quantize_rows(x, m, k, xq, dx, xsum, sx, xsum + m * xblocks, threads);
    const X8Act act = {xq, dx, xsum, sx, k, xblocks, xsum + m * xblocks};
#if X8_TILES && X8_TYPE_TILES
    if (on_tiles) {
        memset(xq + m * k, 0, (size_t)((padded - m) * k));
        X8Linear job = {w, n, m, blocks, groups, &act, bias, y, 0, 2, XT_ROWS};
        __atomic_fetch_add(&x8_tile_products, 1, __ATOMIC_RELAXED);
        pool_run(X8FN(quant_tile_rows), &job, (groups + 3) / 4, 0, threads);
        free(xq), free(dx), free(sx), free(xsum);
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
