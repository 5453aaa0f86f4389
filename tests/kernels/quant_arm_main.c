/* A test program around quant_kernels.c for a machine Python cannot load the library on (the
 * ARM NEON variants, run under qemu-aarch64 by test_quant_kernels_arm.py).
 *
 * stdin: int64 type (index into the list below), n, k, m; then the weight's n rows of blocks as
 * the file stores them; then x, float32 [m, k]. The weight is repacked into the x8 layout, then
 * stdout: the "isa" line from infer_quant_layout; a line "tiles IMPL T1 T2": the tile primitives'
 * implementation ("none" in a build without tiles) and the count of products run on tiles after
 * the m-row call (T1) and after the 1-row calls (T2); then float32 y [m, n] of one call with all
 * m rows on two threads of the pool, y again row by row (m calls of 1 row, one thread), and every
 * weight row dequantized [n, k].
 *
 * With type -1 - op (a build with tiles), one tile product through infer_quant_tile_selftest, op
 * 0 (A signed, B unsigned), 1 (both signed), 2 (A unsigned, B signed): n, k and m are the C tile's
 * columns, A's bytes per row and the rows; stdin then holds A [m, k] bytes, B [k / 4, 4n] bytes
 * and C [m, n] int32; stdout: the "isa" line, then int32 the selftest's return code and C. */
#include <stdio.h>

#include "quant_kernels.c"

typedef int (*LinearFn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, const float *, float *, int);
typedef void (*RowsFn)(const uint8_t *, int64_t, int64_t, const int64_t *, int64_t, float *);
typedef void (*RepackFn)(const uint8_t *, int64_t, int64_t, uint8_t *);
static const struct { LinearFn linear; RowsFn rows; RepackFn repack; int64_t elems, bytes, x8_bytes; } TYPES[] = {
    {quant_linear_x8_q8_0, quant_dequantize_rows_x8_q8_0, quant_repack_x8_q8_0, 32, 34, 272},
    {quant_linear_x8_q4_0, quant_dequantize_rows_x8_q4_0, quant_repack_x8_q4_0, 32, 18, 144},
    {quant_linear_x8_q4_1, quant_dequantize_rows_x8_q4_1, quant_repack_x8_q4_1, 32, 20, 160},
    {quant_linear_x8_q5_0, quant_dequantize_rows_x8_q5_0, quant_repack_x8_q5_0, 32, 22, 176},
    {quant_linear_x8_q4_k, quant_dequantize_rows_x8_q4_k, quant_repack_x8_q4_k, 256, 144, 1152},
    {quant_linear_x8_q5_k, quant_dequantize_rows_x8_q5_k, quant_repack_x8_q5_k, 256, 176, 1408},
    {quant_linear_x8_q6_k, quant_dequantize_rows_x8_q6_k, quant_repack_x8_q6_k, 256, 210, 1680},
};

static void *read_all(size_t size) {
    void *p = malloc(size ? size : 1);
    if (!p || fread(p, 1, size, stdin) != size) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

#if X8_TILES
static const char *tiles_impl(void) { return infer_quant_tiles(); }
static int64_t tile_products(void) { return infer_quant_tile_products(); }
#else
static const char *tiles_impl(void) { return "none"; }
static int64_t tile_products(void) { return 0; }
#endif

static int tile_selftest(int op, int64_t n, int64_t k, int64_t m) {
#if X8_TILES
    if (n < 1 || n > 16 || k < 4 || k > 64 || k % 4 || m < 1 || m > 16) {
        fprintf(stderr, "bad tile shape\n");
        return 2;
    }
    uint8_t *a = read_all((size_t)(m * k)), *b = read_all((size_t)(k / 4 * 4 * n));
    int32_t *c = read_all(sizeof(int32_t) * (size_t)(m * n));
    printf("%s\n", infer_quant_layout());
    const int32_t rc = infer_quant_tile_selftest(a, (int)m, (int)k, k, b, (int)n, op, c);
    fwrite(&rc, sizeof rc, 1, stdout);
    fwrite(c, sizeof(int32_t), (size_t)(m * n), stdout);
    return 0;
#else
    (void)op, (void)n, (void)k, (void)m;
    fprintf(stderr, "this build has no tiles\n");
    return 2;
#endif
}

int main(void) {
    int64_t *head = read_all(4 * sizeof(int64_t)), type = head[0], n = head[1], k = head[2], m = head[3];
    if (type <= -1 && type >= -3) return tile_selftest((int)(-1 - type), n, k, m);
    if (type < 0 || type >= (int64_t)(sizeof TYPES / sizeof TYPES[0]) || n < 1 || m < 1 || k < 1 ||
        k % TYPES[type].elems) {
        fprintf(stderr, "bad header\n");
        return 2;
    }
    const int64_t blocks = k / TYPES[type].elems;
    uint8_t *raw = read_all((size_t)(n * blocks * TYPES[type].bytes));
    float *x = read_all(sizeof(float) * (size_t)(m * k)), *y = malloc(sizeof(float) * (size_t)(m * n));
    float *alone = malloc(sizeof(float) * (size_t)(m * n)), *dense = malloc(sizeof(float) * (size_t)(n * k));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
    uint8_t *w = malloc((size_t)((n + 7) / 8 * blocks * TYPES[type].x8_bytes));
    TYPES[type].repack(raw, n, k, w);
    if (TYPES[type].linear(w, n, k, x, m, NULL, y, 2)) return 3; /* a helper thread has its own tiles */
    const int64_t together = tile_products();
    for (int64_t r = 0; r < m; r++)
        if (TYPES[type].linear(w, n, k, x + r * k, 1, NULL, alone + r * n, 1)) return 3;
    printf("%s\ntiles %s %lld %lld\n", infer_quant_layout(), tiles_impl(), (long long)together,
           (long long)tile_products());
    fwrite(y, sizeof(float), (size_t)(m * n), stdout);
    fwrite(alone, sizeof(float), (size_t)(m * n), stdout);
    for (int64_t i = 0; i < n; i++) ids[i] = i;
    TYPES[type].rows(w, n, k, ids, n, dense);
    fwrite(dense, sizeof(float), (size_t)(n * k), stdout);
    return 0;
}
