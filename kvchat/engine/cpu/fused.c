/* kvchat.engine.cpu.fused: SwiGLU in one pass, the decoding step's attention in one call.
 *
 * The numpy decoding step spends most of what is not matmul on many small numpy calls:
 * a row's attention over its cache is about twenty of them (rotate, group, scores,
 * max, exp, sums, weighted values), about 0.1 ms a row and layer whatever the cache's
 * length, so 8 rows of qwen2.5-0.5b cost about 20 ms a step, and 8 short prompts
 * folded into a step (18 tokens each) about 100 ms. SwiGLU over many rows is five passes
 * over the activations. Here:
 *
 * - swiglu(g, u, out): out = silu(g) · u in one pass;
 * - attend(q, k, v, keys, values, spans, counts, scale, out, spread): each row's new tokens'
 *   grouped-query attention over its cache and its new keys and values (on the calling
 *   thread where `spread` is false: see SPREAD).
 *
 * Their kernels are attend.h's, which packed.c's layer() uses too.
 * The build (pyproject.toml's ext-modules) is optional: without it the numpy step runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "attend.h"

/* ------------------------------------------------------------------ Python side */

static PyObject *swiglu(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO:swiglu", &objs[0], &objs[1], &objs[2])) return NULL;
    Py_buffer b[3];
    const char *names[3] = {"g", "u", "out"};
    for (int i = 0; i < 3; i++)
        if (floats(objs[i], &b[i], 2, i == 2, names[i]) < 0) {
            while (i--) PyBuffer_Release(&b[i]);
            return NULL;
        }
    PyObject *result = NULL;
    if (b[0].len != b[1].len || b[0].len != b[2].len)
        PyErr_SetString(PyExc_ValueError, "g, u and out must have the same shape");
    else {
        Py_BEGIN_ALLOW_THREADS
        silu_mul(b[0].buf, b[1].buf, b[2].buf, 0, b[0].len / 4);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    for (int i = 0; i < 3; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyObject *attend(PyObject *self, PyObject *args) {
    PyObject *objs[4], *keys, *values, *spans, *counts;
    float scale;
    int spread = 1;
    if (!PyArg_ParseTuple(args, "OOOO!O!O!O!fO|p:attend", &objs[0], &objs[1], &objs[2],
                          &PyList_Type, &keys, &PyList_Type, &values, &PyList_Type, &spans,
                          &PyList_Type, &counts, &scale, &objs[3], &spread))
        return NULL;
    Py_buffer b[4];
    const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4; i++)
        if (floats(objs[i], &b[i], 3, i == 3, names[i]) < 0) {
            while (i--) PyBuffer_Release(&b[i]);
            return NULL;
        }
    Py_ssize_t n_tokens = b[0].shape[0], heads = b[0].shape[1], dim = b[0].shape[2];
    Py_ssize_t n_rows = PyList_GET_SIZE(spans);
    Py_ssize_t kv_heads = b[1].shape[1];
    PyObject *result = NULL;
    Row *rows = NULL;
    Py_buffer *held = NULL;
    if (memcmp(b[0].shape, b[3].shape, 3 * sizeof(Py_ssize_t))
        || memcmp(b[1].shape, b[2].shape, 3 * sizeof(Py_ssize_t)) || b[1].shape[0] != n_tokens
        || b[1].shape[2] != dim || kv_heads < 1 || heads % kv_heads || dim % VL)
        PyErr_SetString(PyExc_ValueError,
                        "q and out must be (tokens, heads, dim), k and v (tokens, kv heads, dim), "
                        "heads a multiple of kv heads and dim of 8");
    else if (PyList_GET_SIZE(keys) != n_rows || PyList_GET_SIZE(values) != n_rows
             || PyList_GET_SIZE(counts) != n_rows)
        PyErr_SetString(PyExc_ValueError, "keys, values, spans and counts need one entry a row");
    else if (!(rows = PyMem_Calloc(n_rows ? n_rows : 1, sizeof *rows))
             || !(held = PyMem_Calloc(n_rows ? 2 * n_rows : 1, sizeof *held)))
        PyErr_NoMemory();
    else if (cache_rows(keys, values, spans, counts, n_rows, n_tokens, kv_heads, dim, rows,
                        held) == 0) {
        int failed, threads = spread ? free_threads() : 1;
        Py_BEGIN_ALLOW_THREADS
        failed = attend_all(b[0].buf, b[1].buf, b[2].buf, rows, n_rows, n_tokens, heads,
                            kv_heads, dim, scale, threads, SPREAD, b[3].buf);
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < 2 * n_rows; i++)
            if (held[i].obj) PyBuffer_Release(&held[i]);
        result = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
    }
    PyMem_Free(rows);
    PyMem_Free(held);
    for (int i = 0; i < 4; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"swiglu", swiglu, METH_VARARGS,
     "swiglu(g, u, out): out = silu(g) * u for C-contiguous 2-D float32 arrays of one shape."},
    {"attend", attend, METH_VARARGS,
     "attend(q, k, v, keys, values, spans, counts, scale, out, spread=True): grouped-query "
     "attention of each row's counts[r] new tokens over its cache's first spans[r] keys and "
     "values, then its new keys and values up to the token's own (causal); over the cores "
     "unless spread is false."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvchat.engine.cpu.fused",
    "SwiGLU, and the decoding step's attention in one call (see fused.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_fused(void) { return PyModule_Create(&module); }
