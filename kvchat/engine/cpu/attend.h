/* The decoding step's attention and SwiGLU, shared by fused.c (each in its own call) and
 * packed.c's layer() (a whole decoder layer in one call). Include after kernels.h.
 *
 * attend_all: for each of R rows, the grouped-query attention of its new tokens over the
 * first `span` keys and values of the row's own cache (mlx-lm's KVCache buffer, (1, kv
 * heads, capacity, head dim), read in place), then over its new keys and values up to the
 * token's own (causal), every (token, kv head) a task over the cores (see SPREAD).
 * silu_mul: SwiGLU's silu(g) · u in one pass.
 *
 * exp is computed in vectors (vexp: a degree-6 polynomial after range reduction, as
 * Cephes' expf, within 2 ulp of it); the sums run in another order than numpy's, so
 * results agree with the numpy step to float32 rounding, not bit for bit. */
#ifndef KVCHAT_ATTEND_H
#define KVCHAT_ATTEND_H

#include <stdlib.h>
#include <string.h>

/* Lane by lane, a where pick is all ones, else b (pick: a comparison's result). */
static inline __attribute__((always_inline)) vf choose(vi pick, vf a, vf b) {
    return (vf)(((vi)a & pick) | ((vi)b & ~pick));
}

/* e^x of each lane: x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by Cephes' expf polynomial,
 * 2^n put in the exponent bits. x is held to [-87.3, 88] (e^x between 1.2e-38 and
 * 1.7e38, no denormals or infinities): a softmax's zeros come out as 1e-38, SwiGLU's
 * silu of a very negative input as -1e-37 rather than -0. */
static inline __attribute__((always_inline)) vf vexp(vf x) {
    const vf lo = splat(-87.3f), hi = splat(88.0f), shift = splat(12582912.0f); /* 1.5·2²³ */
    x = choose(x < lo, lo, x);
    x = choose(x > hi, hi, x);
    vf t = x * splat(1.44269504088896341f) + shift; /* round(x / ln 2) in the low bits */
    vf n = t - shift;
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    vi e = ((vi)t - (vi)shift + 127) << 23; /* 2^n */
    return p * (vf)e;
}

static float exp1(float x) { return vexp(splat(x))[0]; }

/* out[i] = g[i] / (1 + e^-g[i]) · u[i] for i in lo … hi − 1. */
CLONES static void silu_mul(const float *g, const float *u, float *out, Py_ssize_t lo,
                            Py_ssize_t hi) {
    Py_ssize_t i = lo;
    for (; i + VL <= hi; i += VL) {
        vf a = load(g + i);
        store(out + i, a / (vexp(-a) + splat(1.0f)) * load(u + i));
    }
    for (; i < hi; i++) out[i] = g[i] / (exp1(-g[i]) + 1.0f) * u[i];
}

/* Attention over fewer keys and values than this many floats runs on the calling thread:
 * waking the others costs more. So does any attention whose caller asks (`spread`
 * false) because its next products go through BLAS: OpenMP's threads spin for a while
 * after a parallel region (libgomp's GOMP_SPINCOUNT), BLAS's threads spin after each
 * product, and on a machine with as many cores as threads the two pools then share
 * them. A step of 8 short prompts folded beside their decoding rows (168 rows, BLAS's
 * products) took 0.88-1.08 s with its attention spread over 2 cores, 0.79-0.84 s on
 * the calling thread; 3 prompts beside 2 decoding rows, 0.50-0.65 s against 0.36-0.42 s.
 * SwiGLU always runs on the calling thread: after a product through BLAS, a second
 * thread made it ten times slower, not twice as fast. */
#define SPREAD (1 << 20)
/* The same where the other threads are awake: in packed.c's layers(), whose products ran
 * on them just before, and whose attention is each layer's only long stretch on one
 * core. qwen2.5-0.5b@q4's step on 2 cores (one row, builds taking turns, median of 100):
 * 30 tokens of context 8.99 against 9.04 ms with SPREAD, 200 9.25 → 8.91, 520 10.45 →
 * 9.33, 2,000 15.4 → 11.95; 8 rows at 200, 44.7 → 41.8 (1 << 12 as fast, 1 << 16 slower
 * below 256 tokens). */
#define SPREAD_AWAKE (1 << 14)

/* Where a query's keys (or values) are: `span` cached rows of `dim` floats, then `own`
 * new rows (the row's new tokens up to the query's own, causal) `stride` floats apart. */
typedef struct {
    const float *cached, *fresh;
    Py_ssize_t span, own, stride;
} Keys;

static inline __attribute__((always_inline)) const float *key_at(const Keys *s, Py_ssize_t j,
                                                                 int dim) {
    return j < s->span ? s->cached + j * dim : s->fresh + (j - s->span) * s->stride;
}

/* Cached value rows ahead of the keys' pass that it asks the cache for. The values' pass
 * reads each row a vector of dimensions at a time (the outputs stay in registers), so
 * from memory it would read one line of each row per pass, rows 4 lines apart (head dim
 * 64); fetched whole beside the keys' stream, they wait in L2. qwen2.5-0.5b@q4's layers,
 * 2 cores, one row, builds taking turns (medians of 60-80, ms): 2,000 tokens of context
 * 12.32-12.96 → 11.78-12.39 (five pairs, each 0.4-0.7 faster), 520 10.91 / 9.09 → 10.53 /
 * 8.98, 200 8.71 / 8.73 → 8.69 / 8.61; 8 rows at 520, 58.3 → 56.3. (32 rows ahead the
 * same; the first line of the next key and value rows 16 ahead, no faster.) */
#define VALUES_AHEAD 8

/* Attention of `gn` (at most 8) queries of one kv head (each `dim` floats, consecutive)
 * over their keys and values, the scores at scores + g · width. A key's gn dot products
 * are summed in one lane_sums tree; the gn outputs' vector of dims stays in registers
 * while the values stream. Called with a constant gn, so that the loops over it unroll. */
static inline __attribute__((always_inline)) void attend_block(
    const float *q, const Keys *keys, const Keys *values, int gn, int dim, float scale,
    float *scores, float *out) {
    Py_ssize_t width = keys->span + keys->own;
    for (Py_ssize_t j = 0; j < width; j++) {
        const float *key = key_at(keys, j, dim);
        if (j + VALUES_AHEAD < values->span) /* a value row whole, one line at a time */
            for (int d = 0; d < dim; d += 16)
                __builtin_prefetch(values->cached + (j + VALUES_AHEAD) * dim + d, 0, 3);
        vf acc[8] = {{0}};
        for (int d = 0; d < dim; d += VL) {
            vf kd = load(key + d);
            for (int g = 0; g < gn; g++) acc[g] += load(q + g * dim + d) * kd;
        }
        vf sums = lane_sums(acc) * splat(scale);
        for (int g = 0; g < gn; g++) scores[g * width + j] = sums[SLOT[g]];
    }
    vf total[8] = {{0}};
    for (int g = 0; g < gn; g++) { /* softmax numerators, in place, and their sums */
        float *row = scores + g * width, top = row[0];
        for (Py_ssize_t j = 1; j < width; j++) top = row[j] > top ? row[j] : top;
        Py_ssize_t j = 0;
        for (; j + VL <= width; j += VL) {
            vf e = vexp(load(row + j) - splat(top));
            store(row + j, e);
            total[g] += e;
        }
        for (; j < width; j++) total[g][0] += (row[j] = exp1(row[j] - top));
    }
    vf inv = splat(1.0f) / lane_sums(total); /* lanes past gn: 1 / 0, unused */
    for (int d = 0; d < dim; d += VL) {
        vf o[8] = {{0}};
        for (Py_ssize_t j = 0; j < width; j++) {
            vf val = load(key_at(values, j, dim) + d);
            for (int g = 0; g < gn; g++) o[g] += splat(scores[g * width + j]) * val;
        }
        for (int g = 0; g < gn; g++) store(out + g * dim + d, o[g] * splat(inv[SLOT[g]]));
    }
}

/* One token's attention for one kv head: its `group` queries, eight at a time; `scores`
 * has room for group · (span + own) floats. */
CLONES static void attend_head(const float *q, const Keys *keys, const Keys *values,
                               int group, int dim, float scale, float *scores, float *out) {
    for (int g0 = 0; g0 < group; g0 += 8) {
        const float *qg = q + g0 * dim;
        float *s = scores + g0 * (keys->span + keys->own), *o = out + g0 * dim;
        switch (group - g0 < 8 ? group - g0 : 8) { /* a constant gn: unrolled */
        case 1: attend_block(qg, keys, values, 1, dim, scale, s, o); break;
        case 2: attend_block(qg, keys, values, 2, dim, scale, s, o); break;
        case 3: attend_block(qg, keys, values, 3, dim, scale, s, o); break;
        case 4: attend_block(qg, keys, values, 4, dim, scale, s, o); break;
        case 5: attend_block(qg, keys, values, 5, dim, scale, s, o); break;
        case 6: attend_block(qg, keys, values, 6, dim, scale, s, o); break;
        case 7: attend_block(qg, keys, values, 7, dim, scale, s, o); break;
        default: attend_block(qg, keys, values, 8, dim, scale, s, o); break;
        }
    }
}

typedef struct {
    const float *keys, *values; /* the row's cache buffers, (kv heads, capacity, dim) */
    Py_ssize_t span, capacity;
    Py_ssize_t first, count; /* its new tokens: q, k, v and out rows first … first + count − 1 */
} Row;

/* Every new token of every row, each kv head a task: token i of a row attends to the
 * row's cache and to its new tokens up to i. Over `threads` where it reads more than
 * `spread` floats (SPREAD, or SPREAD_AWAKE), else on the calling thread. */
static int attend_all(const float *q, const float *k, const float *v, const Row *rows,
                      Py_ssize_t n_rows, Py_ssize_t n_tokens, int heads, int kv_heads, int dim,
                      float scale, int threads, Py_ssize_t spread, float *out) {
    int group = heads / kv_heads, failed = 0;
    Py_ssize_t work = 0, *row_of = malloc(sizeof(Py_ssize_t) * (n_tokens ? n_tokens : 1));
    if (!row_of) return 1;
    for (Py_ssize_t r = 0; r < n_rows; r++) {
        work += 2 * (rows[r].span + rows[r].count) * rows[r].count * kv_heads * dim;
        for (Py_ssize_t i = 0; i < rows[r].count; i++) row_of[rows[r].first + i] = r;
    }
#pragma omp parallel for schedule(dynamic) reduction(| : failed) num_threads(threads) \
    if (threads > 1 && work > spread)
    for (Py_ssize_t t = 0; t < n_tokens * kv_heads; t++) {
        Py_ssize_t token = t / kv_heads, h = t % kv_heads;
        const Row *row = rows + row_of[token];
        Py_ssize_t own = token - row->first + 1, cached = h * row->capacity * dim;
        Py_ssize_t fresh = (row->first * kv_heads + h) * dim, stride = kv_heads * dim;
        Keys keys = {row->span ? row->keys + cached : NULL, k + fresh, row->span, own, stride};
        Keys values = {row->span ? row->values + cached : NULL, v + fresh, row->span, own, stride};
        float *scores = malloc(sizeof(float) * group * (row->span + own));
        if (!scores) {
            failed = 1;
            continue;
        }
        Py_ssize_t at = (token * heads + h * group) * dim;
        attend_head(q + at, &keys, &values, group, dim, scale, scores, out + at);
        free(scores);
    }
    free(row_of);
    return failed;
}

/* Each row's cache buffers as Row entries, their views in `held` (2 per row): 0, or -1
 * with the exception set and nothing held. */
static int cache_rows(PyObject *keys, PyObject *values, PyObject *spans, PyObject *counts,
                      Py_ssize_t n_rows, Py_ssize_t n_tokens, int kv_heads, int dim, Row *rows,
                      Py_buffer *held) {
    Py_ssize_t first = 0;
    for (Py_ssize_t r = 0; r < n_rows; r++) {
        Py_ssize_t span = PyNumber_AsSsize_t(PyList_GET_ITEM(spans, r), PyExc_OverflowError);
        if (span == -1 && PyErr_Occurred()) goto fail;
        Py_ssize_t count = PyNumber_AsSsize_t(PyList_GET_ITEM(counts, r), PyExc_OverflowError);
        if (count == -1 && PyErr_Occurred()) goto fail;
        if (count < 1 || count > n_tokens - first) {
            PyErr_SetString(PyExc_ValueError, "counts must be at least 1 and add up to the tokens");
            goto fail;
        }
        rows[r] = (Row){NULL, NULL, span, 0, first, count};
        first += count;
        memset(&held[2 * r], 0, 2 * sizeof(Py_buffer));
        if (span == 0) continue;
        if (floats(PyList_GET_ITEM(keys, r), &held[2 * r], 4, 0, "keys") < 0) goto fail;
        if (floats(PyList_GET_ITEM(values, r), &held[2 * r + 1], 4, 0, "values") < 0) {
            PyBuffer_Release(&held[2 * r]);
            held[2 * r].obj = NULL;
            goto fail;
        }
        Py_ssize_t *ks = held[2 * r].shape, *vs = held[2 * r + 1].shape;
        if (ks[0] != 1 || ks[1] != kv_heads || ks[3] != dim || memcmp(ks, vs, 4 * sizeof *ks)
            || span < 0 || span > ks[2]) {
            PyErr_SetString(PyExc_ValueError,
                            "a row's keys and values must be (1, kv heads, capacity ≥ span, dim)");
            PyBuffer_Release(&held[2 * r]);
            PyBuffer_Release(&held[2 * r + 1]);
            held[2 * r].obj = held[2 * r + 1].obj = NULL;
            goto fail;
        }
        rows[r] = (Row){held[2 * r].buf, held[2 * r + 1].buf, span, ks[2], rows[r].first, count};
    }
    if (first == n_tokens) return 0;
    PyErr_SetString(PyExc_ValueError, "counts must be at least 1 and add up to the tokens");
fail:
    for (Py_ssize_t i = 0; i < 2 * n_rows; i++)
        if (held[i].obj) PyBuffer_Release(&held[i]);
    return -1;
}

#endif
