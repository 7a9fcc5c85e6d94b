/* kvchat.engine.cpu.rows: y = x · wᵀ for a few rows of x, reading the weights once.
 *
 * A batched decoding step multiplies B rows (one token of each of B conversations) by
 * every weight matrix. For 2 to 8 rows numpy's OpenBLAS sgemm costs 2.3 to 2.6 times
 * one row's gemv on a 2-core x86 machine: it copies ("packs") the weights before it
 * computes, so an 8-row step cannot beat about 3.2 times a 1-row step's throughput.
 * Here each thread takes a band of the weight's rows and, for four weight rows at a
 * time, keeps 4 × B running dot products in vector registers while it streams the
 * four rows once: the weights are read once per step whatever B is, and the 8-row
 * projections of qwen2.5-0.5b cost about 1.5 times one row's gemv (numbers beside
 * KERNEL_ROWS in linear.py).
 *
 * The build (pyproject.toml's ext-modules) is optional: where no C compiler is at hand,
 * kvchat.engine.cpu.linear uses numpy's BLAS for these rows as before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

#define NR 4     /* weight rows a tile streams together */
#define MB 8     /* rows of x a tile takes (more go in groups of MB) */
#define MAX_ROWS 64

/* y[b, o + r] for b < nb, r < NR: weight rows o … o + NR − 1 times nb rows of x. */
static inline __attribute__((always_inline)) void tile(
    const float *w, Py_ssize_t k_len, const float *x, float *y, Py_ssize_t n, Py_ssize_t o,
    int nb) {
    vf acc[NR][MB];
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < MB; b++) acc[r][b] = (vf){0};  /* unused ones add zeros */
    Py_ssize_t k = 0;
    for (; k + VL <= k_len; k += VL) {
        vf wr[NR];
        for (int r = 0; r < NR; r++) wr[r] = load(w + (o + r) * k_len + k);
        for (int b = 0; b < nb; b++) {
            vf xb = load(x + b * k_len + k);
            for (int r = 0; r < NR; r++) acc[r][b] += wr[r] * xb;
        }
    }
    for (int r = 0; r < NR; r++) {
        vf sums = lane_sums(acc[r]);
        for (int b = 0; b < nb; b++) {
            float s = sums[SLOT[b]];
            for (Py_ssize_t j = k; j < k_len; j++) s += w[(o + r) * k_len + j] * x[b * k_len + j];
            y[b * n + o + r] = s;
        }
    }
}

static void row_by_row(
    const float *w, Py_ssize_t k_len, const float *x, Py_ssize_t rows, float *y, Py_ssize_t n,
    Py_ssize_t o) {
    for (Py_ssize_t b = 0; b < rows; b++) {
        float s = 0;
        for (Py_ssize_t j = 0; j < k_len; j++) s += w[o * k_len + j] * x[b * k_len + j];
        y[b * n + o] = s;
    }
}

/* Weight rows lo … hi − 1 (a multiple of NR apart) times every row of x. */
CLONES static void band(
    const float *w, Py_ssize_t n, Py_ssize_t k_len, const float *x, Py_ssize_t rows, float *y,
    Py_ssize_t lo, Py_ssize_t hi) {
    for (Py_ssize_t o = lo; o < hi; o += NR) {
        for (Py_ssize_t b0 = 0; b0 < rows; b0 += MB) {
            const float *xb = x + b0 * k_len;
            float *yb = y + b0 * n;
            switch (rows - b0 < MB ? rows - b0 : MB) {  /* a constant nb: unrolled */
            case 1: tile(w, k_len, xb, yb, n, o, 1); break;
            case 2: tile(w, k_len, xb, yb, n, o, 2); break;
            case 3: tile(w, k_len, xb, yb, n, o, 3); break;
            case 4: tile(w, k_len, xb, yb, n, o, 4); break;
            case 5: tile(w, k_len, xb, yb, n, o, 5); break;
            case 6: tile(w, k_len, xb, yb, n, o, 6); break;
            case 7: tile(w, k_len, xb, yb, n, o, 7); break;
            default: tile(w, k_len, xb, yb, n, o, 8); break;
            }
        }
    }
}

/* A band of tiles for each thread (OpenMP's outlined region is not cloned: band is). */
static void product(const float *w, Py_ssize_t n, Py_ssize_t k_len, const float *x,
                    Py_ssize_t rows, float *y, int team) {
    Py_ssize_t tiles = n / NR;
#ifdef _OPENMP
#pragma omp parallel num_threads(team)
    {
        Py_ssize_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        band(w, n, k_len, x, rows, y, tiles * t / nt * NR, tiles * (t + 1) / nt * NR);
    }
#else
    (void)team;
    band(w, n, k_len, x, rows, y, 0, tiles * NR);
#endif
    for (Py_ssize_t o = tiles * NR; o < n; o++) row_by_row(w, k_len, x, rows, y, n, o);
}

static PyObject *matmul_t(PyObject *self, PyObject *args) {
    PyObject *w_obj, *x_obj, *y_obj;
    if (!PyArg_ParseTuple(args, "OOO:matmul_t", &w_obj, &x_obj, &y_obj)) return NULL;
    Py_buffer w, x, y;
    if (floats(w_obj, &w, 2, 0, "w") < 0) return NULL;
    if (floats(x_obj, &x, 2, 0, "x") < 0) { PyBuffer_Release(&w); return NULL; }
    if (floats(y_obj, &y, 2, 1, "out") < 0) { PyBuffer_Release(&w); PyBuffer_Release(&x); return NULL; }
    Py_ssize_t n = w.shape[0], k_len = w.shape[1], rows = x.shape[0];
    PyObject *result = NULL;
    if (x.shape[1] != k_len || y.shape[0] != rows || y.shape[1] != n)
        PyErr_SetString(PyExc_ValueError, "shapes do not match: w (n, k), x (rows, k), out (rows, n)");
    else if (rows < 1 || rows > MAX_ROWS)
        PyErr_Format(PyExc_ValueError, "x must have 1 to %d rows", MAX_ROWS);
    else {
        int team = free_threads();
        Py_BEGIN_ALLOW_THREADS
        product(w.buf, n, k_len, x.buf, rows, y.buf, team);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return result;
}

static PyMethodDef methods[] = {
    {"matmul_t", matmul_t, METH_VARARGS,
     "matmul_t(w, x, out): out = x @ w.T for C-contiguous float32 arrays w (n, k), x (rows, k)"
     " with 1 to 64 rows, and out (rows, n); each weight row is read once for all rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvchat.engine.cpu.rows",
    "x @ w.T for a few rows, reading the weights once (see rows.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_rows(void) { return PyModule_Create(&module); }
