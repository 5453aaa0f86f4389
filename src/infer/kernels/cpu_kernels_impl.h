/* The kernels for one element type, included by cpu_kernels.c once per type it builds.
 *
 * Before including, cpu_kernels.c defines KSFX (the type's suffix: f32, bf16), and for that suffix
 * elem_<KSFX>, vec_<KSFX>, STEP_<KSFX> and the helpers load_vec_, load_part_, mac_, load_, store_,
 * round_ and widen_ (see there). Every function below is then named <name>_<KSFX>: real functions,
 * which a debugger and a profiler see line by line, written once for all types.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, KSFX)
#define ELEM FN(elem)
#define VEC FN(vec)
#define STEP FN(STEP)

/* One weight block (JB rows at w[0..3]) against R input rows; sums[r][jj] = dot(x_r, w_jj).
 * Always inlined with a constant R at each call, so the R x JB accumulators stay in registers. */
static inline __attribute__((always_inline)) void FN(block)(const ELEM *const *w, const ELEM *x, int64_t k,
                                                            float sums[RB][JB], const int R) {
    FVEC acc[RB][JB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++) acc[r][j] = fvec_zero();
    int64_t i = 0;
    for (; i + STEP <= k; i += STEP) {
        VEC wv[JB];
        for (int j = 0; j < JB; j++) wv[j] = FN(load_vec)(w[j] + i);
        for (int j = 0; j < JB; j++) _mm_prefetch((const char *)(w[j] + AHEAD * k + i), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            VEC xv = FN(load_vec)(x + r * k + i);
            for (int j = 0; j < JB; j++) acc[r][j] = FN(mac)(acc[r][j], wv[j], xv);
        }
    }
    if (i < k) { /* the last k % STEP elements: partial loads, the other lanes zero */
        VEC wv[JB];
        for (int j = 0; j < JB; j++) wv[j] = FN(load_part)(w[j] + i, k - i);
        for (int r = 0; r < R; r++) {
            VEC xv = FN(load_part)(x + r * k + i, k - i);
            for (int j = 0; j < JB; j++) acc[r][j] = FN(mac)(acc[r][j], wv[j], xv);
        }
    }
    for (int r = 0; r < R; r++) _mm_storeu_ps(sums[r], sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

typedef struct {
    const ELEM *w, *x, *bias;
    ELEM *y;
    int64_t m, n, k;
} FN(GemvJob);

/* Weight blocks begin .. end - 1 of a product (a chunk of the pool's loop). */
static void FN(gemv_blocks)(void *ctx, int64_t begin, int64_t end, int worker) {
    const FN(GemvJob) *g = ctx;
    const ELEM *w = g->w, *x = g->x, *bias = g->bias;
    ELEM *y = g->y;
    const int64_t m = g->m, n = g->n, k = g->k;
    (void)worker;
    for (int64_t b = begin; b < end; b++) {
        int64_t j0 = b * JB, valid = n - j0 < JB ? n - j0 : JB;
        const ELEM *rows[JB];
        for (int j = 0; j < JB; j++) rows[j] = w + (j0 + (j < valid ? j : valid - 1)) * k;
        float sums[RB][JB];
        for (int64_t r0 = 0; r0 < m; r0 += RB) {
            int64_t rn = m - r0 < RB ? m - r0 : RB;
            const ELEM *xr = x + r0 * k;
            switch (rn) {
            case 1: FN(block)(rows, xr, k, sums, 1); break;
            case 2: FN(block)(rows, xr, k, sums, 2); break;
            case 3: FN(block)(rows, xr, k, sums, 3); break;
            default: FN(block)(rows, xr, k, sums, 4); break;
            }
            for (int64_t r = 0; r < rn; r++)
                for (int64_t j = 0; j < valid; j++)
                    y[(r0 + r) * n + j0 + j] = FN(store)(sums[r][j] + (bias ? FN(load)(bias, j0 + j) : 0.0f));
        }
    }
}

/* Row-major contiguous w [n, k], x [m, k], y [m, n]; bias [n] or NULL. The weight blocks are the
 * pool's items (thread_pool.h): each output is one block's, whichever thread computes it. */
void FN(gemv)(const ELEM *w, const ELEM *x, const ELEM *bias, ELEM *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    FN(GemvJob) job = {w, x, bias, y, m, n, k};
    pool_run(FN(gemv_blocks), &job, (n + JB - 1) / JB, 0, threads);
}

/* rsqrt(sum(x^2) / dim + eps) of one row, the sum in order (both RMSNorms below). */
static inline float FN(inv_rms)(const ELEM *xr, int64_t dim, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        float v = FN(load)(xr, i);
        sum += v * v;
    }
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* y = w * round(x * rsqrt(sum(x^2) / dim + eps)), per row of x [rows, dim] (RMSNorm). */
void FN(rmsnorm)(const ELEM *x, const ELEM *w, ELEM *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *xr = x + r * dim;
        float inv = FN(inv_rms)(xr, dim, eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = FN(store)(FN(load)(w, i) * FN(round)(FN(load)(xr, i) * inv));
    }
}

/* RoPE: y[n, h] = x[n, h] * cos[n] + roll(x[n, h], dim / 2) * sin[n] (sin's first half negated by
 * the caller), for n over rows (tokens) and h over heads. x is strided (heads sliced out of the
 * fused projection): row stride sn, head stride sh, elements contiguous; y is contiguous. */
void FN(rope)(const ELEM *x, int64_t sn, int64_t sh, const ELEM *cos, const ELEM *sin, ELEM *y, int64_t rows,
              int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t n = 0; n < rows; n++)
        for (int64_t h = 0; h < heads; h++) {
            const ELEM *xh = x + n * sn + h * sh, *c = cos + n * dim, *s = sin + n * dim;
            ELEM *yh = y + (n * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) {
                float rolled = FN(load)(xh, i < half ? i + half : i - half);
                yh[i] = FN(store)(FN(round)(FN(load)(xh, i) * FN(load)(c, i)) + FN(round)(rolled * FN(load)(s, i)));
            }
        }
}

/* SwiGLU's activation: y = silu(gate) * up for gate_up [rows, 2 * inter] (gate first, then up).
 * The loop is vectorised (omp simd with glibc's vector expf where it links), LANES at a time:
 * a scalar expf per element made this the costliest of the small operators. */
void FN(silu_mul)(const ELEM *gate_up, ELEM *y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *g = gate_up + r * 2 * inter, *u = g + inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            float v = FN(load)(g, i);
            y[r * inter + i] = FN(store)(FN(round)(v / (1.0f + expf(-v))) * FN(load)(u, i));
        }
    }
}

/* RMSNorm scaling by 1 + w (StackArgs.norm_offset): y = round((x * rsqrt(sum(x^2) / dim + eps)) * (1 + w)),
 * all in float32 and rounded once, as the model's norm of that kind computes it (Gemma 3's). */
void FN(offset_rmsnorm)(const ELEM *x, const ELEM *w, ELEM *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *xr = x + r * dim;
        float inv = FN(inv_rms)(xr, dim, eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = FN(store)((FN(load)(xr, i) * inv) * (1.0f + FN(load)(w, i)));
    }
}

/* The GELU-gated activation (ACT_GELU_TANH): y = gelu_tanh(gate) * up for gate_up [rows, 2 * inter], the GELU
 * rounded to the dtype first (PyTorch's F.gelu(approximate="tanh"), then the product). */
void FN(gelu_mul)(const ELEM *gate_up, ELEM *y, int64_t rows, int64_t inter) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *g = gate_up + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i++) {
            float v = FN(load)(g, i), inner = beta * (v + kappa * v * v * v);
            y[r * inter + i] = FN(store)(FN(round)(0.5f * v * (1.0f + tanhf(inner))) * FN(load)(u, i));
        }
    }
}

/* Cached rows to fetch ahead of the block in use, into L2. Each key's K (then V) row of one KV
 * head lies a whole row of heads after the last, a stride the hardware prefetcher followed poorly:
 * a 1B model's decode step over 1,024 keys read its cache at 4 GB/s without these, 16 GB/s with.
 * Four blocks ahead into L2 rather than two into L1: a 3B model (rows of 512 bytes, 4 KB apart)
 * decoded after 1,024 tokens at 10.3-10.7 tok/s against 9.5-9.6 (the 1B shape unchanged). */
#define KEYS_AHEAD (4 * LANES)
static inline void FN(fetch_rows)(const ELEM *base, const int64_t *key, int64_t from, int64_t to, int64_t kvh,
                                  int64_t g, int64_t hd) {
    for (int64_t i = from; i < to; i++)
        for (int64_t b = 0; b < hd * (int64_t)sizeof(ELEM); b += 64)
            _mm_prefetch((const char *)(base + (key[i] * kvh + g) * hd) + b, _MM_HINT_T1);
}

/* The most queries one value tile sums for (four chunks each, in registers: AVX-512 has 32 of them). */
#ifdef INFER_AVX512
#define VALUE_QUERIES 6
#else
#define VALUE_QUERIES 2
#endif

/* One block's share of the weighted sum of values for JT heads and CT chunks of LANES elements:
 * sum[jj][c] += w[jj][t] * v_t[c] for the block's bn keys in order, the JT x CT sums held in
 * registers across the block (always inlined with constant JT and CT). */
static inline __attribute__((always_inline)) void FN(value_tile)(const ELEM *const *vrow, int64_t bn,
                                                                 const float *w, int64_t w_stride, float *sum,
                                                                 int64_t sum_stride, const LMASK *mask,
                                                                 const int JT, const int CT) {
    FVEC acc[VALUE_QUERIES][4];
    for (int jj = 0; jj < JT; jj++)
        for (int c = 0; c < CT; c++) acc[jj][c] = fvec_load(sum + jj * sum_stride + c * LANES);
    for (int64_t t = 0; t < bn; t++) {
        FVEC v[4];
        for (int c = 0; c < CT; c++) v[c] = FN(widen)(vrow[t] + c * LANES, mask[c]);
        for (int jj = 0; jj < JT; jj++) {
            FVEC weight = fvec_set1(w[jj * w_stride + t]);
            for (int c = 0; c < CT; c++) acc[jj][c] = fvec_fma(weight, v[c], acc[jj][c]);
        }
    }
    for (int jj = 0; jj < JT; jj++)
        for (int c = 0; c < CT; c++) fvec_store(sum + jj * sum_stride + c * LANES, acc[jj][c]);
}

/* The shape of one attention work item: a query row's heads that share a KV head. */
typedef struct {
    int64_t groups, chunks, hd, stride; /* query heads, LANES-chunks of a head, its elements, score row length */
    float scale;
    const LMASK *mask;                  /* [chunks]: each chunk's valid lanes */
} FN(AttnShape);

/* The scores of one block of keys (rows krow[0 .. LANES - 1]; block_rows repeats a short block's
 * last row, so every lane is a real key's score) for every head of a query: score[j][i0 + t] =
 * scale * dot(query_j, k_t), each a chain over the chunks in order whose lanes fvec_sums adds;
 * top[j] takes the block's largest score (one vector reduction: a maximum is the same whatever the
 * order, and where only the sign of a zero peak could differ, exp(score - peak) does not). */
static __attribute__((noinline)) void FN(score_block)(const FN(AttnShape) *sh, const ELEM *const *krow, const float *query,
                            float *score, float *top) {
    const int64_t groups = sh->groups, chunks = sh->chunks, stride = sh->stride;
    const FVEC scale = fvec_set1(sh->scale);
    for (int64_t j = 0; j < groups; j++) {
        FVEC acc[LANES];
        for (int t = 0; t < LANES; t++) acc[t] = fvec_zero();
        for (int64_t c = 0; c < chunks; c++) {
            const FVEC q = fvec_load(query + (j * chunks + c) * LANES);
            const LMASK m = sh->mask[c];
            for (int t = 0; t < LANES; t++) acc[t] = fvec_fma(q, FN(widen)(krow[t] + LANES * c, m), acc[t]);
        }
        FVEC s = fvec_mul(fvec_sums(acc), scale);
        fvec_store(score + j * stride, s);
        const float peak = fvec_hmax(s);
        top[j] = peak > top[j] ? peak : top[j];
    }
}

/* score_block over a whole block copied next to each other (row t at base + t * staged) with CT
 * chunks known when compiled: the same products, sums and order as score_block, without its LANES
 * row pointers (which did not fit in registers: reloaded on every load) or a loop over the chunks. */
static inline __attribute__((always_inline)) void FN(score_staged_ct)(const FN(AttnShape) *sh, const ELEM *base,
                                                                      int64_t staged, const float *query, float *score,
                                                                      float *top, const int CT) {
    const int64_t groups = sh->groups, stride = sh->stride;
    const FVEC scale = fvec_set1(sh->scale);
    for (int64_t j = 0; j < groups; j++) {
        FVEC acc[LANES];
        for (int t = 0; t < LANES; t++) acc[t] = fvec_zero();
        for (int c = 0; c < CT; c++) {
            const FVEC q = fvec_load(query + (j * CT + c) * LANES);
            const LMASK m = sh->mask[c];
            for (int t = 0; t < LANES; t++) acc[t] = fvec_fma(q, FN(widen)(base + t * staged + LANES * c, m), acc[t]);
        }
        FVEC s = fvec_mul(fvec_sums(acc), scale);
        fvec_store(score + j * stride, s);
        const float peak = fvec_hmax(s);
        top[j] = peak > top[j] ? peak : top[j];
    }
}

/* The scores of a staged whole block (see score_staged_ct) for every head of a query. */
static __attribute__((noinline)) void FN(score_staged)(const FN(AttnShape) *sh, const ELEM *base, int64_t staged,
                                                       const float *query, float *score, float *top) {
    switch (sh->chunks) {
    case 2: FN(score_staged_ct)(sh, base, staged, query, score, top, 2); return;
    case 4: FN(score_staged_ct)(sh, base, staged, query, score, top, 4); return;
    case 8: FN(score_staged_ct)(sh, base, staged, query, score, top, 8); return;
    default: {
        const ELEM *row[LANES];
        for (int t = 0; t < LANES; t++) row[t] = base + t * staged;
        FN(score_block)(sh, row, query, score, top);
    }
    }
}

/* One block of values (rows vrow[0 .. bn - 1]) into a query's weighted sums: sum[j] += w[j][t] * v_t
 * for every head j, the keys in order; heads two at a time, chunks four at a time, in registers. */
static __attribute__((noinline)) void FN(value_block)(const FN(AttnShape) *sh, const ELEM *const *vrow, int64_t bn, const float *w, float *sum) {
    const int64_t groups = sh->groups, chunks = sh->chunks, ss = chunks * LANES;
    const ELEM *later[LANES], *const *shifted = vrow; /* the rows from chunk c on */
    for (int64_t c = 0; c < chunks; c += 4) {
        const int64_t ct = chunks - c < 4 ? chunks - c : 4;
        if (c) {
            for (int64_t t = 0; t < bn; t++) later[t] = vrow[t] + c * LANES;
            shifted = later;
        }
        for (int64_t j = 0; j < groups; j += 2) {
            const int64_t jt = groups - j < 2 ? groups - j : 2;
            const float *wj = w + j * sh->stride;
            float *acc = sum + (j * chunks + c) * LANES;
            const LMASK *m = sh->mask + c;
            switch (jt * 8 + ct) {
            case 8 + 1: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 1, 1); break;
            case 8 + 2: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 1, 2); break;
            case 8 + 3: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 1, 3); break;
            case 8 + 4: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 1, 4); break;
            case 16 + 1: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 2, 1); break;
            case 16 + 2: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 2, 2); break;
            case 16 + 3: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 2, 3); break;
            default: FN(value_tile)(shifted, bn, wj, sh->stride, acc, ss, m, 2, 4); break;
            }
        }
    }
}

#define VALUE_CASE(JT, CT) case (JT) * 8 + (CT): FN(value_tile)(shifted, n, wq, sh->stride, acc, ss, m, JT, CT); break;
/* The weighted sums of the keys every row of an item sees (rows vrow[0 .. n - 1]) for its nq queries
 * (query qi = a row's head: its weights at w + qi * stride, its sums at sum + qi * chunks * LANES):
 * VALUE_QUERIES queries and four chunks at a time, held in registers across all n keys, so a value
 * row is read once per tile of queries rather than once per row and pair of heads. Each sum takes
 * the same keys in the same order as value_block's, so the same bits. */
static __attribute__((noinline)) void FN(value_common)(const FN(AttnShape) *sh, const ELEM *const *vrow, int64_t n,
                                                       int64_t nq, const float *w, float *sum) {
    const int64_t chunks = sh->chunks, ss = chunks * LANES;
    const ELEM *later[ATTN_SEGMENT], *const *shifted = vrow; /* the rows from chunk c on */
    for (int64_t c = 0; c < chunks; c += 4) {
        const int64_t ct = chunks - c < 4 ? chunks - c : 4;
        if (c) {
            for (int64_t t = 0; t < n; t++) later[t] = vrow[t] + c * LANES;
            shifted = later;
        }
        for (int64_t q = 0; q < nq; q += VALUE_QUERIES) {
            const int64_t jt = nq - q < VALUE_QUERIES ? nq - q : VALUE_QUERIES;
            const float *wq = w + q * sh->stride;
            float *acc = sum + q * ss + c * LANES;
            const LMASK *m = sh->mask + c;
            switch (jt * 8 + ct) {
            VALUE_CASE(1, 1) VALUE_CASE(1, 2) VALUE_CASE(1, 3) VALUE_CASE(1, 4)
            VALUE_CASE(2, 1) VALUE_CASE(2, 2) VALUE_CASE(2, 3) VALUE_CASE(2, 4)
#if VALUE_QUERIES > 2
            VALUE_CASE(3, 1) VALUE_CASE(3, 2) VALUE_CASE(3, 3) VALUE_CASE(3, 4)
            VALUE_CASE(4, 1) VALUE_CASE(4, 2) VALUE_CASE(4, 3) VALUE_CASE(4, 4)
            VALUE_CASE(5, 1) VALUE_CASE(5, 2) VALUE_CASE(5, 3) VALUE_CASE(5, 4)
            VALUE_CASE(6, 1) VALUE_CASE(6, 2) VALUE_CASE(6, 3) VALUE_CASE(6, 4)
#endif
            default: break;
            }
        }
    }
}
#undef VALUE_CASE

/* Rows krow[0 .. LANES - 1] of block i0 of a key list of n keys (a short last block repeats its
 * last key), and the rows of the block KEYS_AHEAD keys on fetched (the list's first nf keys may be
 * fetched: it may go on past the n in use, into the next segment's). With `stage` (LANES rows of `staged`
 * elements), the block's rows are first copied there, one after another: where a cache row is a
 * multiple of 4 KB (8 KV heads of 128 float32s), every key's row of a head falls in the same L1
 * sets, so a block of 16 rows overflows their ways and each head of the group reads it again from
 * L2 (a 3B model after 1,024 tokens: +3% decode speed). The values are the same, so is every sum. */
static inline void FN(block_rows)(const ELEM *base, const int64_t *key, int64_t n, int64_t nf, int64_t i0,
                                  int64_t kvh, int64_t g, int64_t hd, const ELEM **row, ELEM *stage, int64_t staged) {
    const int64_t bn = n - i0 < LANES ? n - i0 : LANES, ahead = i0 + KEYS_AHEAD;
    FN(fetch_rows)(base, key, ahead < nf ? ahead : nf, ahead + LANES < nf ? ahead + LANES : nf, kvh, g, hd);
    for (int64_t t = 0; t < LANES; t++) row[t] = base + (key[i0 + (t < bn ? t : bn - 1)] * kvh + g) * hd;
    if (!stage) return;
    for (int64_t t = 0; t < LANES; t++) {
        if (t < bn) memcpy(stage + t * staged, row[t], sizeof(ELEM) * (size_t)hd);
        row[t] = stage + (t < bn ? t : bn - 1) * staged;
    }
}

#define ATTN_ROWS 8 /* query rows of one sequence per work item: they share the reads of their common keys */

/* One thread's scratch for attention items (see attention_items), allocated on its first chunk. */
typedef struct {
    float *score, *query, *sum;
    float *part; /* a job whose items hold every segment (AttnJob.inner): the item's partial results */
    int64_t *key;
    ELEM *stage;
    int ready, ok;
} FN(AttnScratch);

typedef struct {
    const StackArgs *a;
    const int64_t *read_rows;
    int64_t read_start;
    const uint8_t *mask;
    const ELEM *qk, *ks, *vs;
    ELEM *out;
    int64_t segments;         /* of every row group's key lists: 1, or the context's ATTN_SEGMENT-key segments */
    int64_t part_stride;      /* a segment's partial result: its peak, its total, then (from LANES) its sum */
    float *part;              /* segments > 1: [rows, heads, segments, part_stride] */
    _Atomic int64_t *done;    /* segments > 1: per row group and KV head, its segments finished */
    FN(AttnScratch) *scratch; /* one per worker */
    _Atomic int failed;
    int inner;                /* segments > 1: an item takes every segment of its rows in turn (see attention) */
} FN(AttnJob);

/* A head's output row o[0 .. hd - 1] = sum / total (zeros where no key was visible). */
static inline void FN(attn_out)(const float *sum, float total, int64_t chunks, int64_t hd, ELEM *o) {
    float inv = total > 0.0f ? 1.0f / total : 0.0f, lane[LANES];
    for (int64_t c = 0; c < chunks; c++) {
        fvec_storeu(lane, fvec_mul(fvec_load(sum + c * LANES), fvec_set1(inv)));
        for (int64_t e = 0; e < LANES && LANES * c + e < hd; e++) o[LANES * c + e] = FN(store)(lane[e]);
    }
}

/* Rows r0 .. r0 + nr - 1, the heads of KV head g: their segments' partial results (row rr's head j
 * at part + rr * row_stride + j * segments * part_stride, one after another) merged in segment order
 * (each scaled by exp(its peak - the largest peak)) into their output rows. */
static void FN(merge_segments)(const FN(AttnJob) *job, int64_t r0, int64_t nr, int64_t g, const float *part,
                               int64_t row_stride) {
    const StackArgs *a = job->a;
    const int64_t heads = a->heads, groups = heads / a->kv_heads, hd = a->head_dim;
    const int64_t chunks = (hd + LANES - 1) / LANES, segs = job->segments, ps = job->part_stride;
    float sum[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int64_t rr = 0; rr < nr; rr++)
        for (int64_t j = 0; j < groups; j++) {
            const int64_t h = g * groups + j;
            const float *p = part + rr * row_stride + j * segs * ps; /* row rr's head h: its segments' results */
            float peak = -INFINITY, total = 0.0f;
            for (int64_t s = 0; s < segs; s++)
                if (p[s * ps + 1] > 0.0f && p[s * ps] > peak) peak = p[s * ps];
            for (int64_t c = 0; c < chunks; c++) fvec_store(sum + c * LANES, fvec_zero());
            for (int64_t s = 0; s < segs; s++) {
                if (!(p[s * ps + 1] > 0.0f)) continue; /* a segment with no visible key */
                const float f = expf(p[s * ps] - peak);
                const FVEC fv = fvec_set1(f);
                total += f * p[s * ps + 1];
                for (int64_t c = 0; c < chunks; c++)
                    fvec_store(sum + c * LANES, fvec_fma(fv, fvec_load(p + s * ps + LANES + c * LANES), fvec_load(sum + c * LANES)));
            }
            FN(attn_out)(sum, total, chunks, hd, job->out + ((r0 + rr) * heads + h) * hd);
        }
}

/* Attention items begin .. end - 1 (a chunk of the pool's loop; see attention). */
static void FN(attention_items)(void *ctx, int64_t begin, int64_t end, int worker) {
    FN(AttnJob) *job = ctx;
    const StackArgs *a = job->a;
    const int64_t *read_rows = job->read_rows, read_start = job->read_start;
    const uint8_t *mask = job->mask;
    const ELEM *qk = job->qk, *ks = job->ks, *vs = job->vs;
    ELEM *out = job->out;
    int64_t hd = a->head_dim, heads = a->heads, kvh = a->kv_heads, groups = heads / kvh;
    int64_t L = a->context, chunks = (hd + LANES - 1) / LANES;
    int64_t per_seq = (a->width + ATTN_ROWS - 1) / ATTN_ROWS, segs = job->segments, ps = job->part_stride;
    /* an item holds one segment of each row's list (a single segment: the whole list): its scores,
     * and its keys with the next KEYS_AHEAD for fetching */
    const int64_t span = segs > 1 ? ATTN_SEGMENT : L, klen = segs > 1 ? ATTN_SEGMENT + KEYS_AHEAD : (L > 0 ? L : 1);
    const int64_t stride = (span + LANES - 1) / LANES * LANES;
    int64_t width = groups * chunks * LANES;
    /* a block's rows are staged (see block_rows) where cache rows lie a multiple of 4 KB apart */
    const int stages = kvh * hd * (int64_t)sizeof(ELEM) % 4096 == 0;
    const int64_t staged = chunks * LANES; /* a staged row's elements */
    FN(AttnScratch) *s = &job->scratch[worker];
    if (!s->ready) {
        /* per row of an item, per head: its scores (then weights; each row 64-byte aligned and
         * padded to whole blocks), its query and its weighted sum, in float32; the row's keys */
        s->score = aligned_alloc(64, sizeof(float) * (size_t)(ATTN_ROWS * stride * groups + LANES));
        s->query = aligned_alloc(64, sizeof(float) * (size_t)(ATTN_ROWS * width));
        s->sum = aligned_alloc(64, sizeof(float) * (size_t)(ATTN_ROWS * width));
        s->key = malloc(sizeof(int64_t) * (size_t)(ATTN_ROWS * klen));
        s->part = job->inner ? aligned_alloc(64, sizeof(float) * (size_t)(ATTN_ROWS * groups * segs * ps)) : NULL;
        s->stage = aligned_alloc(64, (sizeof(ELEM) * (size_t)(LANES * staged) + 63) / 64 * 64);
        s->ok = s->score && s->query && s->sum && s->key && s->stage && (s->part || !job->inner);
        s->ready = 1;
    }
    if (!s->ok) {
        atomic_store(&job->failed, 1);
        return;
    }
    float *score = s->score, *query = s->query, *sum = s->sum;
    int64_t *key = s->key;
    ELEM *stage = s->stage;
    LMASK mask_of[MAX_HEAD_DIM / LANES];
    for (int64_t c = 0; c < chunks; c++) mask_of[c] = lanes(hd - LANES * c);
    const FN(AttnShape) sh = {groups, chunks, hd, stride, a->scale, mask_of};
    for (int64_t p = begin; p < end; p++) {
        /* KV head g of row group q / kvh, its segments first .. last - 1 (all of them in an inner job):
         * a thread's consecutive items read every head of the same keys, whose rows lie side by side */
        const int64_t g = p % kvh, q = job->inner ? p : p / kvh / segs * kvh + g;
        const int64_t first = job->inner ? 0 : p / kvh % segs, last = job->inner ? segs : first + 1;
        const int64_t b = q / kvh / per_seq, r0 = b * a->width + q / kvh % per_seq * ATTN_ROWS;
        const int64_t nr = b * a->width + a->width - r0 < ATTN_ROWS ? b * a->width + a->width - r0 : ATTN_ROWS;
        for (int64_t seg = first; seg < last; seg++) {
            const int64_t s0 = seg * ATTN_SEGMENT, s1 = segs > 1 ? s0 + ATTN_SEGMENT : L; /* list indices */
            const int64_t s2 = s1 + KEYS_AHEAD; /* the list goes on to here for fetching: the next segment's keys */
            int64_t n[ATTN_ROWS], nf[ATTN_ROWS], shared = ATTN_SEGMENT + L;
            float top[ATTN_ROWS][MAX_GROUP], total[ATTN_ROWS][MAX_GROUP];
            for (int64_t rr = 0; rr < nr; rr++) {
                const uint8_t *visible = mask ? mask + (r0 + rr) * L : NULL;
                int64_t *keys = key + rr * klen, count = 0;
                const int64_t seen = a->causal ? L - a->width + (r0 + rr - b * a->width) + 1 : L; /* (see StackArgs) */
                /* positions before the first hidden one are their own list indices, the same in every row */
                const uint8_t *gap = visible && seen > 0 ? memchr(visible, 0, (size_t)seen) : NULL;
                const int64_t lead = gap ? gap - visible : seen;
                for (int64_t l = s0; l < lead && l < s2; l++) keys[count++] = read_rows ? read_rows[b * L + l] : read_start + l;
                for (int64_t l = lead + 1, index = lead; l < seen && index < s2; l++) /* the rest, after the gap */
                    if (visible[l]) {
                        if (index >= s0) keys[count++] = read_rows ? read_rows[b * L + l] : read_start + l;
                        index++;
                    }
                nf[rr] = count;
                n[rr] = count < s1 - s0 ? count : s1 - s0;
                const int64_t common_here = (lead < s1 ? lead : s1) - s0;
                shared = common_here < shared ? common_here : shared;
                for (int64_t j = 0; j < groups; j++) {
                    const ELEM *qh = qk + ((r0 + rr) * (heads + kvh) + g * groups + j) * hd;
                    for (int64_t c = 0; c < chunks; c++)
                        fvec_store(query + rr * width + (j * chunks + c) * LANES, FN(widen)(qh + LANES * c, mask_of[c]));
                    top[rr][j] = -INFINITY;
                }
            }
            /* blocks that are the same keys in every row's list */
            const int64_t common = shared > 0 ? shared / LANES * LANES : 0;
            const ELEM *row[LANES];
            /* the first keys' rows, then the values' of the whole segment (theirs arrive during the scores) */
            FN(fetch_rows)(ks, key, 0, nf[0] < KEYS_AHEAD ? nf[0] : KEYS_AHEAD, kvh, g, hd);
            for (int64_t rr = 0; rr < nr; rr++)
                if (rr == 0 || n[rr] > common) FN(fetch_rows)(vs, key + rr * klen, rr ? common : 0, n[rr], kvh, g, hd);
            for (int64_t i0 = 0; i0 < common; i0 += LANES) {
                /* a common block is read by every row of the item: copied next to each other once, its
                 * rows are one base and stride to the scores (the same values, so the same sums) */
                FN(block_rows)(ks, key, common, nf[0], i0, kvh, g, hd, row, stage, staged);
                for (int64_t rr = 0; rr < nr; rr++)
                    FN(score_staged)(&sh, stage, staged, query + rr * width, score + rr * stride * groups + i0, top[rr]);
            }
            for (int64_t rr = 0; rr < nr; rr++)
                for (int64_t i0 = common; i0 < n[rr]; i0 += LANES) {
                    FN(block_rows)(ks, key + rr * klen, n[rr], nf[rr], i0, kvh, g, hd, row, stages ? stage : NULL, staged);
                    FN(score_block)(&sh, row, query + rr * width, score + rr * stride * groups + i0, top[rr]);
                }
            for (int64_t rr = 0; rr < nr; rr++) {
                const int64_t padded = (n[rr] + LANES - 1) / LANES * LANES;
                for (int64_t j = 0; j < groups; j++) {
                    float *w = score + (rr * groups + j) * stride, peak = top[rr][j];
    #pragma omp simd
                    for (int64_t i = 0; i < n[rr]; i++) w[i] = expf(w[i] - peak);
                    for (int64_t i = n[rr]; i < padded; i++) w[i] = 0.0f;
                    FVEC tot = fvec_zero();
                    for (int64_t i = 0; i < padded; i += LANES) tot = tot + fvec_load(w + i);
                    total[rr][j] = fvec_sum(tot);
                }
                for (int64_t e = 0; e < width; e += LANES) fvec_store(sum + rr * width + e, fvec_zero());
            }
            if (common > 0) { /* (their rows were fetched into L2 before the scores) */
                const ELEM *vrow[ATTN_SEGMENT];
                for (int64_t i = 0; i < common; i++) vrow[i] = vs + (key[i] * kvh + g) * hd;
                FN(value_common)(&sh, vrow, common, nr * groups, score, sum);
            }
            for (int64_t rr = 0; rr < nr; rr++) {
                for (int64_t i0 = common; i0 < n[rr]; i0 += LANES) {
                    FN(block_rows)(vs, key + rr * klen, n[rr], nf[rr], i0, kvh, g, hd, row, stages ? stage : NULL, staged);
                    FN(value_block)(&sh, row, n[rr] - i0 < LANES ? n[rr] - i0 : LANES, score + rr * stride * groups + i0,
                                    sum + rr * width);
                }
                for (int64_t j = 0; j < groups; j++) {
                    const float *sj = sum + rr * width + j * chunks * LANES;
                    if (segs == 1) {
                        FN(attn_out)(sj, total[rr][j], chunks, hd, out + ((r0 + rr) * heads + g * groups + j) * hd);
                        continue;
                    }
                    float *pp = job->inner ? s->part + ((rr * groups + j) * segs + seg) * ps
                                      : job->part + (((r0 + rr) * heads + g * groups + j) * segs + seg) * ps;
                    pp[0] = top[rr][j];
                    pp[1] = total[rr][j];
                    for (int64_t c = 0; c < chunks; c++) fvec_store(pp + LANES + c * LANES, fvec_load(sj + c * LANES));
                }
            }
        }
        /* the item's last segment to finish merges them (the counter orders the partial results' stores) */
        if (segs > 1 && job->inner) FN(merge_segments)(job, r0, nr, g, s->part, groups * segs * ps);
        else if (segs > 1 && atomic_fetch_add(&job->done[q], 1) == segs - 1)
            FN(merge_segments)(job, r0, nr, g, job->part + (r0 * heads + g * groups) * segs * ps, heads * segs * ps);
    }
}

/* Attention of every query row of the pass over its visible cached keys (see decoder_stack).
 * A work item is a segment (ATTN_SEGMENT) of the key lists of up to ATTN_ROWS query rows of one
 * sequence and one KV head, an item of the pool's loop (thread_pool.h). Each row's visible keys
 * form its own list, taken in blocks of LANES: a block's scores are LANES dot products (chunks in
 * order) whose lanes one transpose tree sums, the softmax is float32 with the vector exp, and the
 * values are summed key by key in order, in registers across a block. The leading blocks every row
 * of the item sees whole (the cached context of a verification pass or a prefill chunk) are read
 * once for all of them; a row's arithmetic is the same as alone, so its result depends on its
 * visible keys only, never on the pass around it or the thread computing it. Returns 0, or -1 where
 * memory could not be allocated. */
static int FN(attention)(const StackArgs *a, const int64_t *read_rows, int64_t read_start, const uint8_t *mask,
                         const ELEM *qk, const ELEM *ks, const ELEM *vs, ELEM *out) {
    const int64_t per_seq = (a->width + ATTN_ROWS - 1) / ATTN_ROWS, items = a->batch * per_seq * a->kv_heads;
    const int64_t segs = a->context > ATTN_SEGMENT ? (a->context + ATTN_SEGMENT - 1) / ATTN_SEGMENT : 1;
    const int64_t ps = ((a->head_dim + LANES - 1) / LANES + 1) * LANES;
    const int threads = a->threads < 1 ? 1 : a->threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : a->threads;
    FN(AttnJob) job = {a, read_rows, read_start, mask, qk, ks, vs, out, segs, ps, NULL, NULL,
                       calloc((size_t)threads, sizeof(FN(AttnScratch))), 0};
    int failed = !job.scratch;
    /* Where the pass has items enough for every thread (a prefill chunk: a row group per ATTN_ROWS
     * query rows), an item takes its rows' segments in turn, each computed as a segment item would,
     * and merges them itself: the same bits, without a pass-sized buffer of partial results (fresh
     * pages at every call: tens of MB for a 512-token chunk after a few thousand tokens) and a
     * counter shared between the threads per item. Segment items are for passes of a few rows
     * (decode steps, verifications), where they are what keeps every thread busy. */
    job.inner = segs > 1 && items >= 8 * threads;
    if (segs > 1 && !job.inner && !failed) {
        job.part = aligned_alloc(64, (sizeof(float) * (size_t)(a->rows * a->heads * segs * ps) + 63) / 64 * 64);
        job.done = calloc((size_t)items, sizeof(_Atomic int64_t));
        failed = !job.part || !job.done;
    }
    if (!failed) pool_run(FN(attention_items), &job, job.inner ? items : items * segs, 1, threads);
    for (int t = 0; job.scratch && t < threads; t++) {
        free(job.scratch[t].score);
        free(job.scratch[t].query);
        free(job.scratch[t].sum);
        free(job.scratch[t].key);
        free(job.scratch[t].stage);
        free(job.scratch[t].part);
    }
    free(job.scratch);
    free(job.part);
    free((void *)job.done);
    return failed || atomic_load(&job.failed) ? -1 : 0;
}


static void FN(add_into)(ELEM *x, const ELEM *y, int64_t n) { /* x += y, rounded */
    for (int64_t i = 0; i < n; i++) x[i] = FN(store)(FN(load)(x, i) + FN(load)(y, i));
}

/* y[m, n] = x[m, k] @ W^T (+ bias) for projection `proj` of `layer`: the float weight w on the
 * streaming kernel above, or, where a->quant_index gives the projection quantized parts, each part
 * on its quantized kernel (float32 stacks only), its outputs at its columns of y. The quantized
 * kernel runs its own OpenMP loop with a->threads, called from this serial code (never nested).
 * `scratch` holds m * n floats for a part's outputs where several parts share the row. Returns
 * 0, -1 where a quantized kernel could not allocate, -2 for a descriptor that does not fit. */
static int FN(project)(const StackArgs *a, int64_t layer, int proj, const ELEM *w, const ELEM *x, const ELEM *bias,
                       ELEM *y, int64_t m, int64_t n, int64_t k, float *scratch) {
    const int64_t *index = a->quant_index ? a->quant_index + (layer * STACK_PROJECTIONS + proj) * 2 : NULL;
    if (!index || index[1] == 0) {
        FN(gemv)(w, x, bias, y, m, n, k, a->threads);
        return 0;
    }
    if (sizeof(ELEM) != sizeof(float) || !a->quant_parts || index[0] < 0) return -2;
    const float *xf = (const float *)(const void *)x, *bf = (const float *)(const void *)bias;
    float *yf = (float *)(void *)y;
    int64_t covered = 0;
    for (int64_t i = 0; i < index[1]; i++) {
        const QuantPart *p = a->quant_parts + index[0] + i;
        if (p->in_features != k || p->offset != covered || p->rows <= 0 || p->offset + p->rows > n) return -2;
        covered += p->rows;
        /* one row, or the only part: the outputs land in place; else in scratch, then their columns */
        int direct = m == 1 || index[1] == 1;
        float *out = direct ? yf + p->offset : scratch;
        if (p->linear(p->blocks, p->rows, k, xf, m, bf ? bf + p->offset : NULL, out, a->threads)) return -1;
        if (!direct)
            for (int64_t r = 0; r < m; r++)
                memcpy(yf + r * n + p->offset, scratch + r * p->rows, sizeof(float) * (size_t)p->rows);
    }
    return covered == n ? 0 : -2;
}

/* x [rows, hidden] copied to the capture buffer at `address`, its rows a->capture_stride apart. */
static void FN(capture_rows)(const StackArgs *a, int64_t address, const ELEM *x) {
    const int64_t d = a->hidden, stride = a->capture_stride ? a->capture_stride : d;
    ELEM *out = (ELEM *)address;
    if (stride == d) {
        memcpy(out, x, sizeof(ELEM) * (size_t)(a->rows * d));
        return;
    }
    for (int64_t r = 0; r < a->rows; r++) memcpy(out + r * stride, x + r * d, sizeof(ELEM) * (size_t)d);
}

/* The block's RMSNorm (StackArgs.norm_offset's kind) of rows [rows, dim] of x into y (y may be x:
 * a row is read before it is written). */
static void FN(block_norm)(const StackArgs *a, const ELEM *x, const ELEM *w, ELEM *y, int64_t rows, int64_t dim) {
    if (a->norm_offset)
        FN(offset_rmsnorm)(x, w, y, rows, dim, a->eps);
    else
        FN(rmsnorm)(x, w, y, rows, dim, a->eps);
}

/* Every decoder layer over a->x, in place. Returns 0, -1 where memory ran out, -2 for a descriptor
 * that does not fit (a quantized projection's, the activation, a causal pass's; x is then partly
 * updated: the caller discards it). */
int FN(decoder_stack)(const StackArgs *a) {
    int64_t m = a->rows, d = a->hidden, hd = a->head_dim, H = a->heads, KV = a->kv_heads;
    int64_t qkv_n = (H + 2 * KV) * hd, qk_n = (H + KV) * hd;
    ELEM *x = a->x;
    ELEM *normed = malloc(sizeof(ELEM) * (size_t)(m * d));
    ELEM *qkv = malloc(sizeof(ELEM) * (size_t)(m * qkv_n));
    ELEM *qk = malloc(sizeof(ELEM) * (size_t)(m * qk_n));
    ELEM *qk_normed = a->qk_norm ? malloc(sizeof(ELEM) * (size_t)(m * qk_n)) : NULL;
    ELEM *attn = malloc(sizeof(ELEM) * (size_t)(m * H * hd));
    ELEM *delta = malloc(sizeof(ELEM) * (size_t)(m * d));
    ELEM *gate_up = malloc(sizeof(ELEM) * (size_t)(m * 2 * a->inter));
    ELEM *act = malloc(sizeof(ELEM) * (size_t)(m * a->inter));
    int64_t widest = qkv_n > 2 * a->inter ? qkv_n : 2 * a->inter;
    float *scratch = a->quant_parts ? malloc(sizeof(float) * (size_t)(m * (widest > d ? widest : d))) : NULL;
    int status = normed && qkv && qk && attn && delta && gate_up && act && (qk_normed || !a->qk_norm)
                 && (scratch || !a->quant_parts) ? 0 : -1;
    if (a->causal && (a->batch != 1 || a->mask || a->local_layers || a->context < a->width)) status = -2;
    if (a->activation < 0 || a->activation >= STACK_ACTIVATIONS) status = -2;
    for (int64_t layer = 0; layer < a->layers && status == 0; layer++) {
        const int64_t *t = a->tensors + layer * STACK_TENSORS;
        ELEM *ks = (ELEM *)a->k_stores[layer], *vs = (ELEM *)a->v_stores[layer];
        int local = a->local_layers && a->local_layers[layer];
        const void *cos = local ? a->local_cos : a->cos, *sin = local ? a->local_sin : a->sin;
        const int64_t *write_rows = local ? a->local_write_rows : a->write_rows;
        if (a->capture && a->capture[layer]) FN(capture_rows)(a, a->capture[layer], x);
        FN(block_norm)(a, x, (const ELEM *)t[T_LN1], normed, m, d);
        status = FN(project)(a, layer, P_QKV, (const ELEM *)t[T_QKV_W], normed, (const ELEM *)t[T_QKV_B], qkv, m,
                             qkv_n, d, scratch);
        if (status != 0) break;
        if (a->qk_norm) {
            /* RMSNorm (the block's kind) over each query and key head (its own weight for each),
             * then RoPE; the norm reads the heads where they lie in the projection's output. */
            for (int64_t r = 0; r < m; r++) {
                const ELEM *qn = (const ELEM *)t[T_Q_NORM], *kn = (const ELEM *)t[T_K_NORM];
                ELEM *qo = qk_normed + r * qk_n, *ko = qk_normed + r * qk_n + H * hd;
                FN(block_norm)(a, qkv + r * qkv_n, qn, qo, H, hd);
                FN(block_norm)(a, qkv + r * qkv_n + H * hd, kn, ko, KV, hd);
            }
            FN(rope)(qk_normed, qk_n, hd, cos, sin, qk, m, H + KV, hd);
        } else {
            FN(rope)(qkv, qkv_n, hd, cos, sin, qk, m, H + KV, hd);
        }
        for (int64_t r = 0; r < m; r++) {
            int64_t row = write_rows[r];
            if (row < 0) continue;
            memcpy(ks + row * KV * hd, qk + (r * (H + KV) + H) * hd, sizeof(ELEM) * (size_t)(KV * hd));
            memcpy(vs + row * KV * hd, qkv + r * qkv_n + (H + KV) * hd, sizeof(ELEM) * (size_t)(KV * hd));
        }
        int failed = local ? FN(attention)(a, a->local_read_rows, a->local_read_start, a->local_mask, qk, ks, vs, attn)
                           : FN(attention)(a, a->read_rows, a->read_start, a->mask, qk, ks, vs, attn);
        if (failed != 0) {
            status = -1;
            break;
        }
        status = FN(project)(a, layer, P_O, (const ELEM *)t[T_O_W], attn, (const ELEM *)t[T_O_B], delta, m, d, H * hd,
                             scratch);
        if (status != 0) break;
        /* the post-attention norm, in place (row by row: each row read before written) */
        if (a->post_norms) FN(block_norm)(a, delta, (const ELEM *)t[T_POST_ATTN_NORM], delta, m, d);
        FN(add_into)(x, delta, m * d);
        FN(block_norm)(a, x, (const ELEM *)t[T_LN2], normed, m, d);
        status = FN(project)(a, layer, P_GATE_UP, (const ELEM *)t[T_GATE_UP_W], normed, (const ELEM *)t[T_GATE_UP_B],
                             gate_up, m, 2 * a->inter, d, scratch);
        if (status != 0) break;
        if (a->activation == ACT_GELU_TANH)
            FN(gelu_mul)(gate_up, act, m, a->inter);
        else
            FN(silu_mul)(gate_up, act, m, a->inter);
        status = FN(project)(a, layer, P_DOWN, (const ELEM *)t[T_DOWN_W], act, (const ELEM *)t[T_DOWN_B], delta, m, d,
                             a->inter, scratch);
        if (status != 0) break;
        if (a->post_norms) FN(block_norm)(a, delta, (const ELEM *)t[T_POST_FF_NORM], delta, m, d);
        FN(add_into)(x, delta, m * d);
    }
    if (status == 0 && a->capture && a->capture[a->layers]) FN(capture_rows)(a, a->capture[a->layers], x);
    if (status == 0 && a->head) { /* the final norm (in place: a row is read before it is written), the LM head */
        const QuantPart *h = a->head;
        if (sizeof(ELEM) != sizeof(float) || a->norm_offset || h->in_features != d || h->offset != 0 || h->rows <= 0
            || !a->final_norm || !a->logits) {
            status = -2;
        } else {
            FN(rmsnorm)(x, (const ELEM *)a->final_norm, x, m, d, a->final_eps);
            if (h->linear(h->blocks, h->rows, d, (const float *)(const void *)x, m, a->head_bias, a->logits, a->threads))
                status = -1;
        }
    }
    free(scratch);
    free(normed);
    free(qkv);
    free(qk);
    free(qk_normed);
    free(attn);
    free(delta);
    free(gate_up);
    free(act);
    return status;
}

#undef CAT_
#undef CAT
#undef FN
#undef ELEM
#undef VEC
#undef STEP
