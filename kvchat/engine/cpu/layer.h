/* packed.c's layers(): decoder layers of a llama-family model (mlx-lm's llama and qwen2)
 * for the decoding step, whole, one after another in one call (a step's 24 layers: the
 * GIL let go once, not 24 times, and the threads kept busy). Include at the end of
 * packed.c, after attend.h.
 *
 * The numpy step makes about fifteen calls a layer (two RMSNorms, the rotations, the
 * biases, the residual sums, SwiGLU, attention and four products, each handing arrays
 * between numpy and C), 6-7 ms of a 17 ms step of qwen2.5-0.5b at 4 bits on 2 cores,
 * and between two products OpenMP's threads may fall asleep. Here, for the n tokens of
 * the step's rows (each row's tokens after one another), each layer:
 *
 *   h = RMSNorm(x); q, k, v = h · Wq,k,vᵀ + biases; q and k turned by RoPE (cos, sin of
 *   each token's angles); each row's tokens attend to its cache and its new keys and
 *   values (attend.h); x += attention · Woᵀ + bias; h = RMSNorm(x);
 *   x += (silu(h · Wgateᵀ + b) · (h · Wupᵀ + b)) · Wdownᵀ + b
 *
 * x is updated in place; the turned keys and the values are written to new_k and new_v,
 * for the caller to hand to the caches once every layer has read them. The products are
 * packed.c's (each row's result the same bit for bit whatever the rows beside it, as is
 * everything else here: a row's arithmetic never reads another row), in the same order
 * of additions as the numpy step, whose figures they match to float32 rounding. */
#ifndef KVCHAT_LAYER_H
#define KVCHAT_LAYER_H

#include <math.h>

enum { Q, K, V, O, GATE, UP, DOWN, MATRICES }; /* a layer's matrices, in this order */

/* out = x · weight / sqrt(mean(x²) + eps), row by row (n rows of d): numpy's order. */
static void rms_rows(const float *x, Py_ssize_t n, Py_ssize_t d, const float *weight,
                     float eps, float *out) {
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *r = x + t * d;
        float sum = 0;
        for (Py_ssize_t i = 0; i < d; i++) sum += r[i] * r[i];
        float scale = 1.0f / sqrtf(sum / (float)d + eps);
        for (Py_ssize_t i = 0; i < d; i++) out[t * d + i] = (r[i] * scale) * weight[i];
    }
}

/* y[t] += bias (n rows of d), where there is one. */
static void add_bias(float *y, Py_ssize_t n, Py_ssize_t d, const float *bias) {
    if (bias)
        for (Py_ssize_t t = 0; t < n; t++)
            for (Py_ssize_t i = 0; i < d; i++) y[t * d + i] += bias[i];
}

/* The first 2 · half features of each of the heads of each of n tokens (dim apart) turned
 * by token t's angles (cos, sin: half each a token): in pairs (2i, 2i + 1) where
 * `traditional`, else (i, half + i), as rope.py's rotate. */
static void rotate_heads(float *x, Py_ssize_t n, Py_ssize_t heads, Py_ssize_t dim,
                         const float *cos, const float *sin, Py_ssize_t half, int traditional) {
    for (Py_ssize_t t = 0; t < n; t++)
        for (Py_ssize_t h = 0; h < heads; h++) {
            float *p = x + (t * heads + h) * dim;
            const float *c = cos + t * half, *s = sin + t * half;
            for (Py_ssize_t i = 0; i < half; i++) {
                float *a = traditional ? p + 2 * i : p + i, *b = traditional ? a + 1 : a + half;
                float ra = *a * c[i] - *b * s[i], rb = *a * s[i] + *b * c[i];
                *a = ra;
                *b = rb;
            }
        }
}

/* What a layer's call computes with, its arrays' views held. */
typedef struct {
    Matrix m[MATRICES];
    const float *bias[MATRICES], *norm[2];
    float eps[2], scale;
    const float *cos, *sin;
    Py_ssize_t n, d, heads, kv_heads, dim, half, hidden;
    int traditional;
    float *x, *new_k, *new_v;
} Layer;

/* The layer for the n tokens of n_rows rows (rows: attend.h's), without the GIL: 0, or -1
 * where memory ran out. */
static int run_layer(const Layer *L, const Row *rows, Py_ssize_t n_rows, int team) {
    Py_ssize_t n = L->n, d = L->d, wide = L->heads * L->dim, kv = L->kv_heads * L->dim;
    float *h = malloc(sizeof(float) * n * (d + 2 * wide + d + 2 * L->hidden));
    if (!h) return -1;
    float *q = h + n * d, *att = q + n * wide, *y = att + n * wide, *g = y + n * d;
    float *u = g + n * L->hidden;
    int failed = 0;
    rms_rows(L->x, n, d, L->norm[0], L->eps[0], h);
    float *qkv[3] = {q, L->new_k, L->new_v};
    failed |= products_into(&L->m[Q], 3, h, n, qkv, team);
    if (!failed) {
        add_bias(q, n, wide, L->bias[Q]);
        add_bias(L->new_k, n, kv, L->bias[K]);
        add_bias(L->new_v, n, kv, L->bias[V]);
        rotate_heads(q, n, L->heads, L->dim, L->cos, L->sin, L->half, L->traditional);
        rotate_heads(L->new_k, n, L->kv_heads, L->dim, L->cos, L->sin, L->half, L->traditional);
        failed |= attend_all(q, L->new_k, L->new_v, rows, n_rows, n, (int)L->heads,
                             (int)L->kv_heads, (int)L->dim, L->scale, team, SPREAD_AWAKE, att);
    }
    if (!failed) failed |= products_into(&L->m[O], 1, att, n, &y, team);
    if (!failed) {
        add_bias(y, n, d, L->bias[O]);
        for (Py_ssize_t i = 0; i < n * d; i++) L->x[i] += y[i];
        rms_rows(L->x, n, d, L->norm[1], L->eps[1], h);
        float *gu[2] = {g, u};
        failed |= products_into(&L->m[GATE], 2, h, n, gu, team);
    }
    if (!failed) {
        add_bias(g, n, L->hidden, L->bias[GATE]);
        add_bias(u, n, L->hidden, L->bias[UP]);
        silu_mul(g, u, g, 0, n * L->hidden);
        failed |= products_into(&L->m[DOWN], 1, g, n, &y, team);
    }
    if (!failed) {
        add_bias(y, n, d, L->bias[DOWN]);
        for (Py_ssize_t i = 0; i < n * d; i++) L->x[i] += y[i];
    }
    free(h);
    return failed ? -1 : 0;
}

/* Each matrix's in and out as the layer needs them (x's width d, `wide` = heads · dim,
 * `kv` = kv heads · dim, the MLP's `hidden`): 0, or -1 with the exception set. */
static int layer_shapes(const Layer *L) {
    Py_ssize_t d = L->d, wide = L->heads * L->dim, kv = L->kv_heads * L->dim, f = L->hidden;
    Py_ssize_t want[MATRICES][2] = {{wide, d}, {kv, d}, {kv, d}, {d, wide},
                                    {f, d},    {f, d},  {d, f}};
    static const char *names[MATRICES] = {"q", "k", "v", "o", "gate", "up", "down"};
    for (int i = 0; i < MATRICES; i++)
        if (L->m[i].out != want[i][0] || L->m[i].in != want[i][1]) {
            PyErr_Format(PyExc_ValueError, "the %s matrix is (%zd, %zd), the layer wants (%zd, %zd)",
                         names[i], L->m[i].out, L->m[i].in, want[i][0], want[i][1]);
            return -1;
        }
    return 0;
}

/* The float32 vector obj of `len` items in *v (NULL where obj is None): 0, or -1. */
static int vector_of(PyObject *obj, Py_ssize_t len, Py_buffer *v, const float **out,
                     const char *name) {
    *out = NULL;
    if (obj == Py_None) return 0;
    if (floats(obj, v, 1, 0, name) < 0) return -1;
    *out = v->buf;
    if (v->shape[0] == len) return 0;
    PyErr_Format(PyExc_ValueError, "%s must have %zd items", name, len);
    PyBuffer_Release(v);
    v->obj = NULL;
    return -1;
}

/* A layer as parsed from its spec, its views held (see parse_layer). */
typedef struct {
    Layer L;
    /* each matrix's three views, the biases, the norms, cos, sin, new_k, new_v */
    Py_buffer views[3 * MATRICES + MATRICES + 2 + 4];
    Row *rows;
    Py_buffer *held; /* the rows' cache buffers, 2 a row */
    Py_ssize_t n_rows;
} Parsed;

static void release_layer(Parsed *P) {
    if (P->held)
        for (Py_ssize_t i = 0; i < 2 * P->n_rows; i++)
            if (P->held[i].obj) PyBuffer_Release(&P->held[i]);
    PyMem_Free(P->rows);
    PyMem_Free(P->held);
    release(P->views, (int)(sizeof P->views / sizeof *P->views));
}

/* Layer `spec` for x (n tokens × d, at `x`) whose rows have counts[r] tokens each: 0, or
 * -1 with the exception set and nothing held. A spec: (matrices, biases, (norm, eps),
 * (norm, eps), cos, sin, traditional, heads, scale, keys, values, spans, new_k, new_v). */
static int parse_layer(PyObject *spec, float *x, Py_ssize_t n, Py_ssize_t d, PyObject *counts,
                       Parsed *P) {
    PyObject *specs, *biases, *norm_objs[2], *cos_obj, *sin_obj, *new_k_obj, *new_v_obj;
    PyObject *keys, *values, *spans;
    memset(P, 0, sizeof *P);
    Layer *L = &P->L;
    if (!PyTuple_Check(spec)) {
        PyErr_SetString(PyExc_TypeError, "each layer must be a tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(spec, "O!O!(Of)(Of)OOpnfO!O!O!OO:layers", &PyTuple_Type, &specs,
                          &PyTuple_Type, &biases, &norm_objs[0], &L->eps[0], &norm_objs[1],
                          &L->eps[1], &cos_obj, &sin_obj, &L->traditional, &L->heads, &L->scale,
                          &PyList_Type, &keys, &PyList_Type, &values, &PyList_Type, &spans,
                          &new_k_obj, &new_v_obj))
        return -1;
    Py_buffer *mv = P->views, *bv = mv + 3 * MATRICES, *nv = bv + MATRICES, *cs = nv + 2;
    Py_buffer *sn = cs + 1, *nk = cs + 2, *nvv = cs + 3;
    P->n_rows = PyList_GET_SIZE(spans);
    if (PyTuple_GET_SIZE(specs) != MATRICES || PyTuple_GET_SIZE(biases) != MATRICES) {
        PyErr_SetString(PyExc_ValueError, "seven matrices and seven biases (q, k, v, o, gate, up, "
                                          "down), a bias None where there is none");
        goto fail;
    }
    for (int i = 0; i < MATRICES; i++)
        if (matrix_of(PyTuple_GET_ITEM(specs, i), mv + 3 * i, &L->m[i]) < 0) goto fail;
    if (floats(cos_obj, cs, 2, 0, "cos") < 0 || floats(sin_obj, sn, 2, 0, "sin") < 0
        || floats(new_k_obj, nk, 3, 1, "new_k") < 0 || floats(new_v_obj, nvv, 3, 1, "new_v") < 0)
        goto fail;
    L->x = x, L->n = n, L->d = d, L->new_k = nk->buf, L->new_v = nvv->buf;
    L->cos = cs->buf, L->sin = sn->buf;
    L->kv_heads = nk->shape[1], L->dim = nk->shape[2], L->half = cs->shape[1];
    L->hidden = L->m[GATE].out;
    if (L->kv_heads < 1 || L->heads % L->kv_heads || L->dim % VL
        || memcmp(nk->shape, nvv->shape, 3 * sizeof(Py_ssize_t)) || nk->shape[0] != n
        || memcmp(cs->shape, sn->shape, 2 * sizeof(Py_ssize_t)) || cs->shape[0] != n
        || L->half < 1 || 2 * L->half > L->dim) {
        PyErr_SetString(PyExc_ValueError,
                        "new_k and new_v must be (tokens, kv heads, dim), heads a multiple of kv "
                        "heads, dim of 8, cos and sin (tokens, ≤ dim / 2)");
        goto fail;
    }
    if (layer_shapes(L) < 0) goto fail;
    for (int i = 0; i < MATRICES; i++)
        if (vector_of(PyTuple_GET_ITEM(biases, i), L->m[i].out, &bv[i], &L->bias[i], "a bias") < 0)
            goto fail;
    for (int i = 0; i < 2; i++)
        if (vector_of(norm_objs[i], d, &nv[i], &L->norm[i], "a norm's weight") < 0) goto fail;
    if (!L->norm[0] || !L->norm[1]) {
        PyErr_SetString(PyExc_TypeError, "the norms' weights must be float32 vectors");
        goto fail;
    }
    if (PyList_GET_SIZE(keys) != P->n_rows || PyList_GET_SIZE(values) != P->n_rows
        || PyList_GET_SIZE(counts) != P->n_rows) {
        PyErr_SetString(PyExc_ValueError, "keys, values, spans and counts need one entry a row");
        goto fail;
    }
    if (!(P->rows = PyMem_Calloc(P->n_rows ? P->n_rows : 1, sizeof *P->rows))
        || !(P->held = PyMem_Calloc(P->n_rows ? 2 * P->n_rows : 1, sizeof *P->held))) {
        PyErr_NoMemory();
        goto fail;
    }
    if (cache_rows(keys, values, spans, counts, P->n_rows, n, (int)L->kv_heads, (int)L->dim,
                   P->rows, P->held) < 0)
        goto fail;
    return 0;
fail:
    release_layer(P);
    return -1;
}

static PyObject *layers(PyObject *self, PyObject *args) {
    PyObject *x_obj, *counts, *specs, *result = NULL;
    if (!PyArg_ParseTuple(args, "OO!O!:layers", &x_obj, &PyList_Type, &counts, &PyList_Type,
                          &specs))
        return NULL;
    Py_buffer x;
    if (floats(x_obj, &x, 2, 1, "x") < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(specs), parsed = 0;
    Parsed *P = PyMem_Calloc(count ? count : 1, sizeof *P);
    if (!P)
        PyErr_NoMemory();
    else if (x.shape[0] < 1)
        PyErr_SetString(PyExc_ValueError, "x must be (tokens ≥ 1, features)");
    else {
        while (parsed < count && parse_layer(PyList_GET_ITEM(specs, parsed), x.buf, x.shape[0],
                                             x.shape[1], counts, &P[parsed]) == 0)
            parsed++;
        if (parsed == count) { /* every layer's arguments right: then x changes, not before */
            int failed = 0, team = free_threads();
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < count && !failed; i++)
                failed = run_layer(&P[i].L, P[i].rows, P[i].n_rows, team);
            Py_END_ALLOW_THREADS
            result = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
        }
    }
    for (Py_ssize_t i = 0; i < parsed; i++) release_layer(&P[i]);
    PyMem_Free(P);
    PyBuffer_Release(&x);
    return result;
}

#endif
