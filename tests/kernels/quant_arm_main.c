/* A test program around quant_kernels.c for a machine Python cannot load the library on (the
 * ARM NEON variant, run under qemu-aarch64 by test_quant_kernels_arm.py).
 *
 * stdin: int64 type (index into the list below), n, k, m; then the weight's n rows of blocks;
 * then x, float32 [m, k]. stdout: "isa" line from infer_quant_layout, then float32 y [m, n] of one
 * call with all m rows, y again row by row (m calls of 1 row), and every weight row dequantized
 * [n, k]; then, for the types with an x8 layout, the same three from the weight repacked to x8. */
#include "quant_kernels.c"

typedef int (*LinearFn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, const float *, float *, int);
typedef void (*RowsFn)(const uint8_t *, int64_t, const int64_t *, int64_t, float *);
typedef void (*RepackFn)(const uint8_t *, int64_t, int64_t, uint8_t *);
typedef void (*RowsX8Fn)(const uint8_t *, int64_t, int64_t, const int64_t *, int64_t, float *); /* + n */
typedef struct { LinearFn linear; RowsX8Fn rows; RepackFn repack; int64_t group_bytes; } X8Fns;
static const struct { LinearFn linear; RowsFn rows; int64_t elems, bytes; X8Fns x8; } TYPES[] = {
    {quant_linear_q8_0, quant_dequantize_rows_q8_0, 32, 34, {quant_linear_x8_q8_0, quant_dequantize_rows_x8_q8_0, quant_repack_x8_q8_0, 272}},
    {quant_linear_q4_0, quant_dequantize_rows_q4_0, 32, 18, {quant_linear_x8_q4_0, quant_dequantize_rows_x8_q4_0, quant_repack_x8_q4_0, 144}},
    {quant_linear_q4_1, quant_dequantize_rows_q4_1, 32, 20, {quant_linear_x8_q4_1, quant_dequantize_rows_x8_q4_1, quant_repack_x8_q4_1, 160}},
    {quant_linear_q5_0, quant_dequantize_rows_q5_0, 32, 22, {quant_linear_x8_q5_0, quant_dequantize_rows_x8_q5_0, quant_repack_x8_q5_0, 176}},
    {quant_linear_q4_k, quant_dequantize_rows_q4_k, 256, 144, {quant_linear_x8_q4_k, quant_dequantize_rows_x8_q4_k, quant_repack_x8_q4_k, 1152}},
    {quant_linear_q5_k, quant_dequantize_rows_q5_k, 256, 176, {quant_linear_x8_q5_k, quant_dequantize_rows_x8_q5_k, quant_repack_x8_q5_k, 1408}},
    {quant_linear_q6_k, quant_dequantize_rows_q6_k, 256, 210, {quant_linear_x8_q6_k, quant_dequantize_rows_x8_q6_k, quant_repack_x8_q6_k, 1680}},
};

/* y for all m rows in one call, y row by row, the n rows dequantized: the harness's three outputs */
static int emit(LinearFn linear, RowsFn rows, RowsX8Fn rows_x8, const uint8_t *w, int64_t n, int64_t k, const float *x,
                int64_t m, float *y, float *dense, int64_t *ids) {
    if (linear(w, n, k, x, m, NULL, y, 1)) return 3;
    fwrite(y, sizeof(float), (size_t)(m * n), stdout);
    for (int64_t r = 0; r < m; r++) {
        if (linear(w, n, k, x + r * k, 1, NULL, y, 1)) return 3;
        fwrite(y, sizeof(float), (size_t)n, stdout);
    }
    for (int64_t i = 0; i < n; i++) ids[i] = i;
    if (rows_x8) rows_x8(w, n, k, ids, n, dense);
    else rows(w, k, ids, n, dense);
    fwrite(dense, sizeof(float), (size_t)(n * k), stdout);
    return 0;
}

static void *read_all(size_t size) {
    void *p = malloc(size ? size : 1);
    if (!p || fread(p, 1, size, stdin) != size) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

int main(void) {
    int64_t *head = read_all(4 * sizeof(int64_t)), type = head[0], n = head[1], k = head[2], m = head[3];
    if (type < 0 || type >= (int64_t)(sizeof TYPES / sizeof TYPES[0]) || n < 1 || m < 1 || k < 1 ||
        k % TYPES[type].elems) {
        fprintf(stderr, "bad header\n");
        return 2;
    }
    uint8_t *w = read_all((size_t)(n * (k / TYPES[type].elems) * TYPES[type].bytes));
    float *x = read_all(sizeof(float) * (size_t)(m * k)), *y = malloc(sizeof(float) * (size_t)(m * n));
    float *dense = malloc(sizeof(float) * (size_t)(n * k));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
    printf("%s\n", infer_quant_layout());
    int failed = emit(TYPES[type].linear, TYPES[type].rows, NULL, w, n, k, x, m, y, dense, ids);
    const X8Fns *x8 = &TYPES[type].x8;
    if (!failed && x8->linear) {
        uint8_t *packed = malloc((size_t)((n + 7) / 8 * (k / TYPES[type].elems) * x8->group_bytes));
        x8->repack(w, n, k, packed);
        failed = emit(x8->linear, NULL, x8->rows, packed, n, k, x, m, y, dense, ids);
    }
    return failed;
}
