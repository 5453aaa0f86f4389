/* The kernels of one block type, included by quant_kernels.c once per type.
 *
 * Before including, quant_kernels.c defines QTYPE (the type's suffix: q4_0...), QT_ELEMS and
 * QT_BYTES (elements and bytes per block), QT_HAS_MIN (1: values have a float min term) and
 * QT_DOT(w, x, s0, s1) (the int8 dot product its lanes need), and prep_<QTYPE>/chunk_<QTYPE>;
 * QT_LANE_SCALES where each chunk's float scales differ per lane (q6_k_lane_scales).
 * Every function below is named <name>_<QTYPE>; the defines are undone at the end.
 */
#define QCAT_(a, b) a##_##b
#define QCAT(a, b) QCAT_(a, b)
#define QFN(name) QCAT(name, QTYPE)
#define CHUNKS (QT_ELEMS / QK)
/* Q4_K, Q5_K: a super-block's 8 chunk mins meet the row's 8 block sums in one vector multiply-add */
#define KMIN (QT_HAS_MIN && CHUNKS == 8)

/* JB weight rows (w[j], `blocks` blocks each) against R quantized input rows; out[r][j] = their
 * dot product. Always inlined with a constant R at each call, so the R x JB accumulators stay in
 * registers. Each (r, j) has its own accumulators, updated chunk by chunk in order: the result
 * does not depend on R, on the other rows, nor on which thread runs it. */
static inline __attribute__((always_inline)) void QFN(rows)(const uint8_t *const *w, int64_t blocks,
                                                            const int8_t *xq, const float *dx, const float *sx,
                                                            const int32_t *xinit, float out[RB][JB], const int R) {
    (void)xinit;
    const int64_t xblocks = blocks * CHUNKS;
#ifdef QT_OFFSET
    /* the unsigned product for 1-2 rows (22% faster at one); with more rows the sign trick's
     * extra instruction per row costs less than the offsets' loads. Both give the same integers,
     * so a row's bits do not depend on which one ran. */
    const int UNSIGNED = R <= 2;
#endif
    FACC acc[RB][JB];
    float macc[RB][JB];
    F8 kmin[RB][JB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++) {
            acc[r][j] = facc_zero();
            macc[r][j] = 0.0f;
            if (KMIN) kmin[r][j] = f8_zero();
        }
    for (int64_t b = 0; b < blocks; b++) {
        BlockScales s[JB];
        for (int j = 0; j < JB; j++) {
            QFN(prep)(w[j] + b * QT_BYTES, &s[j]);
            __builtin_prefetch(w[j] + AHEAD * blocks * QT_BYTES + b * QT_BYTES);
        }
        if (KMIN)
            for (int r = 0; r < R; r++) {
                F8 sums = f8_load(sx + r * xblocks + b * CHUNKS);
                for (int j = 0; j < JB; j++) kmin[r][j] = f8_fma(s[j].mins, sums, kmin[r][j]);
            }
        /* unrolled: each chunk's nibble half, bit shift and scale index become constants */
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; c++) {
            const int64_t xb = b * CHUNKS + c;
            WVEC wv[JB];
            float scale[JB], min[JB];
            int s0[JB], s1[JB];
            for (int j = 0; j < JB; j++) {
                min[j] = 0.0f;
                s0[j] = s1[j] = 1;
#ifdef QT_OFFSET
                if (UNSIGNED)
                    wv[j] = QFN(chunk_u)(w[j] + b * QT_BYTES, &s[j], c, &scale[j], &min[j], &s0[j], &s1[j]);
                else
#endif
                    wv[j] = QFN(chunk)(w[j] + b * QT_BYTES, &s[j], c, &scale[j], &min[j], &s0[j], &s1[j]);
            }
            /* the scales broadcast once per chunk and row, multiplied lane-wise (the same float
             * product as scale * dx, one instruction instead of a multiply and a broadcast) */
            FACC wscale[JB];
#ifdef QT_LANE_SCALES
            for (int j = 0; j < JB; j++) wscale[j] = q6_k_lane_scales(&s[j], c);
#else
            for (int j = 0; j < JB; j++) wscale[j] = facc_set1(scale[j]);
#endif
            for (int r = 0; r < R; r++) {
                WVEC xv = x_load(xq + (r * xblocks + xb) * QK);
                FACC d = facc_set1(dx[r * xblocks + xb]);
#ifdef QT_OFFSET
                __m256i start = UNSIGNED ? _mm256_loadu_si256((const __m256i *)(xinit + (r * xblocks + xb) * 8))
                                         : _mm256_setzero_si256();
#endif
                for (int j = 0; j < JB; j++) {
#ifdef QT_OFFSET
                    IACC dot = UNSIGNED ? _mm256_dpbusd_epi32(start, wv[j], xv) : QT_DOT(wv[j], xv, s0[j], s1[j]);
#else
                    IACC dot = QT_DOT(wv[j], xv, s0[j], s1[j]);
#endif
                    acc[r][j] = facc_fma(acc[r][j], dot, facc_mul(wscale[j], d));
                    if (QT_HAS_MIN && !KMIN) macc[r][j] += min[j] * sx[r * xblocks + xb];
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++)
            out[r][j] = KMIN ? facc_sum(acc[r][j]) + f8_sum(kmin[r][j])
                        : QT_HAS_MIN ? facc_sum(acc[r][j]) + macc[r][j] : facc_sum(acc[r][j]);
}

/* y[m, n] = x[m, k] @ W^T (+ bias[n]); W: n rows of k / QT_ELEMS blocks. Returns 0, or 1 where
 * the activations' scratch could not be allocated (y untouched). k is a multiple of QT_ELEMS. */
int QFN(quant_linear)(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, const float *bias, float *y,
                      int threads) {
    const int64_t blocks = k / QT_ELEMS, xblocks = k / QK, row_bytes = blocks * QT_BYTES;
    int8_t *xq = malloc((size_t)(m * k) + 1);
    float *dx = malloc(sizeof(float) * (size_t)(m * xblocks) + 1), *sx = malloc(sizeof(float) * (size_t)(m * xblocks) + 1);
#ifdef QT_OFFSET
    int32_t *xinit = malloc(sizeof(int32_t) * 8 * (size_t)(m * xblocks) + 1);
    const int offset = QT_OFFSET;
#else
    int32_t *xinit = NULL;
    const int offset = 0;
#endif
    if (!xq || !dx || !sx || (offset && !xinit)) {
        free(xq), free(dx), free(sx), free(xinit);
        return 1;
    }
    quantize_rows(x, m, k, xq, dx, sx, xinit, offset);
    const int64_t pairs = (n + JB - 1) / JB;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < pairs; p++) {
        /* a last partial block repeats its final row and stores only the real outputs */
        const int64_t j0 = p * JB, valid = n - j0 < JB ? n - j0 : JB;
        const uint8_t *rows[JB];
        for (int j = 0; j < JB; j++) rows[j] = w + (j0 + (j < valid ? j : valid - 1)) * row_bytes;
        float out[RB][JB];
        for (int64_t r0 = 0; r0 < m; r0 += RB) {
            const int64_t rn = m - r0 < RB ? m - r0 : RB;
            const int8_t *xr = xq + r0 * k;
            const float *dr = dx + r0 * xblocks, *sr = sx + r0 * xblocks;
            const int32_t *ir = xinit ? xinit + r0 * xblocks * 8 : NULL;
            switch (rn) {
            case 1: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 1); break;
            case 2: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 2); break;
            case 3: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 3); break;
#if RB > 4
            case 4: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 4); break;
            case 5: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 5); break;
            case 6: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 6); break;
            case 7: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, 7); break;
#endif
            default: QFN(rows)(rows, blocks, xr, dr, sr, ir, out, RB); break;
            }
            for (int64_t r = 0; r < rn; r++)
                for (int64_t j = 0; j < valid; j++)
                    y[(r0 + r) * n + j0 + j] = bias ? out[r][j] + bias[j0 + j] : out[r][j];
        }
    }
    free(xq), free(dx), free(sx), free(xinit);
    return 0;
}

/* out[i, :] = row ids[i] of W in float (an embedding lookup), as gguf-py dequantizes it. */
void QFN(quant_dequantize_rows)(const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, float *out) {
    const int64_t blocks = k / QT_ELEMS, row_bytes = blocks * QT_BYTES;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        float *o = out + i * k;
        for (int64_t b = 0; b < blocks; b++) {
            BlockScales s;
            QFN(prep)(row + b * QT_BYTES, &s);
            for (int c = 0; c < CHUNKS; c++) {
                float scale, min = 0.0f;
                int s0 = 1, s1 = 1;
                int8_t q[QK];
                w_store(q, QFN(chunk)(row + b * QT_BYTES, &s, c, &scale, &min, &s0, &s1));
                const float lo = scale * (float)s0, hi = scale * (float)s1;
                for (int l = 0; l < QK; l++) {
                    float v = (l < 16 ? lo : hi) * (float)q[l];
                    o[(b * CHUNKS + c) * QK + l] = QT_HAS_MIN ? v + min : v;
                }
            }
        }
    }
}

#undef CHUNKS
#undef KMIN
#undef QFN
#undef QCAT
#undef QCAT_
#undef QTYPE
#undef QT_ELEMS
#undef QT_BYTES
#undef QT_HAS_MIN
#undef QT_DOT
#undef QT_LANE_SCALES
#undef QT_OFFSET
