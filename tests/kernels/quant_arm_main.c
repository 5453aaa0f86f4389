/* A test program around quant_kernels.c for a machine Python cannot load the library on (the
 * ARM NEON variant, run under qemu-aarch64 by test_quant_kernels_arm.py).
 *
 * stdin: int64 type (index into the list below), n, k, m; then the weight's n rows of blocks as
 * the file stores them; then x, float32 [m, k]. The weight is repacked into the x8 layout, then
 * stdout: the "isa" line from infer_quant_layout, then float32 y [m, n] of one call with all m
 * rows, y again row by row (m calls of 1 row), and every weight row dequantized [n, k]. */
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

int main(void) {
    int64_t *head = read_all(4 * sizeof(int64_t)), type = head[0], n = head[1], k = head[2], m = head[3];
    if (type < 0 || type >= (int64_t)(sizeof TYPES / sizeof TYPES[0]) || n < 1 || m < 1 || k < 1 ||
        k % TYPES[type].elems) {
        fprintf(stderr, "bad header\n");
        return 2;
    }
    const int64_t blocks = k / TYPES[type].elems;
    uint8_t *raw = read_all((size_t)(n * blocks * TYPES[type].bytes));
    float *x = read_all(sizeof(float) * (size_t)(m * k)), *y = malloc(sizeof(float) * (size_t)(m * n));
    float *dense = malloc(sizeof(float) * (size_t)(n * k));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
    uint8_t *w = malloc((size_t)((n + 7) / 8 * blocks * TYPES[type].x8_bytes));
    TYPES[type].repack(raw, n, k, w);
    printf("%s\n", infer_quant_layout());
    if (TYPES[type].linear(w, n, k, x, m, NULL, y, 1)) return 3;
    fwrite(y, sizeof(float), (size_t)(m * n), stdout);
    for (int64_t r = 0; r < m; r++) {
        if (TYPES[type].linear(w, n, k, x + r * k, 1, NULL, y, 1)) return 3;
        fwrite(y, sizeof(float), (size_t)n, stdout);
    }
    for (int64_t i = 0; i < n; i++) ids[i] = i;
    TYPES[type].rows(w, n, k, ids, n, dense);
    fwrite(dense, sizeof(float), (size_t)(n * k), stdout);
    return 0;
}
