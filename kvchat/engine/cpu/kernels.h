/* What kvchat's native kernels (rows.c, fused.c) share: float vectors of 256 bits in
 * GCC's vector extensions, the sum of eight vectors' lanes, the per-instruction-set
 * clones of the loops that use them, and the check of the arrays they are handed.
 * Include after Python.h. */
#ifndef KVCHAT_KERNELS_H
#define KVCHAT_KERNELS_H

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define VL 8 /* floats in a vector: 256 bits */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VL * 4)));

static inline __attribute__((always_inline)) vf load(const float *p) { return *(const vfu *)p; }
static inline __attribute__((always_inline)) void store(float *p, vf a) { *(vfu *)p = a; }
/* A vector of eight a's. A macro: as an inline function, compiled for the baseline
 * instruction set before target_clones copies its callers, it made fused.c's clones
 * build the vector lane by lane (attention 5 times slower). */
#define splat(a) ((vf){(a), (a), (a), (a), (a), (a), (a), (a)})

/* The sums of eight vectors' lanes in one vector, by a transpose-and-add tree (three
 * rounds of shuffles and adds instead of eight serial sums of eight lanes): a[i]'s sum
 * lands in lane SLOT[i]. Each sum's additions do not depend on the other vectors. */
#define SH __builtin_shufflevector
static const int SLOT[8] = {0, 4, 2, 6, 1, 5, 3, 7};

static inline __attribute__((always_inline)) vf lane_sums(const vf *a) {
    vf c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = SH(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SH(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        d[i] = SH(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SH(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SH(d[0], d[1], 0, 8, 2, 10, 4, 12, 6, 14) + SH(d[0], d[1], 1, 9, 3, 11, 5, 13, 7, 15);
}

/* One clone per instruction set where the compiler can make them (chosen at load). */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

/* Take the buffer of a C-contiguous array of `ndim` dimensions (numpy's) whose items are
 * `itemsize` bytes of one of the struct codes in `codes` ("f": float32, "H": uint16):
 * 0, or -1 with the exception set (ValueError from numpy for a strided or read-only one,
 * TypeError here; `what` names the type in its message). */
static int typed(PyObject *obj, Py_buffer *view, int ndim, Py_ssize_t itemsize, const char *codes,
                 int writable, const char *name, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *f = view->format;
    if (f && (*f == '<' || *f == '=' || *f == '@')) f++;
    if (view->ndim != ndim || view->itemsize != itemsize || !f || strlen(f) != 1
        || !strchr(codes, *f)) {
        PyErr_Format(PyExc_TypeError, "%s must be a %d-D %s array", name, ndim, what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The threads a kernel's parallel region takes: OpenMP's number (the cores this process may
 * run on) while the calling thread gets a core whenever it wants one, one while other
 * programs keep the cores busy. OpenMP's threads wait for the next region awake for a
 * while (native.py's GOMP_SPINCOUNT, tens of µs: waking a sleeping one took 25-40 µs on a
 * 2-core VM, a hundred times a token), which costs nothing where a core is free and
 * delays both where none is: qwen2.5-0.5b@q4's decoding step, 2 cores, two busy loops of
 * the same priority, 21-31 ms sleeping at once, 26-44 ms awake a while. So every
 * LOOK_EVERY seconds (at most) the calling thread's time waiting for a core since the
 * last look (Linux's schedstat) is compared with the time gone by: over CONTENDED of it
 * twice in a row, and the regions take one thread for the next STAY_ONE seconds. Measured
 * there, two busy loops beside the step: of the same priority 0.23-0.46 of the time,
 * nice 19 0-0.10, none 0-0.04 (the threads stay). Call with the GIL held (the state is
 * the module's). */
#define LOOK_EVERY 0.05
#define CONTENDED 0.2
#define STAY_ONE 1.0

#ifdef _OPENMP
#include <fcntl.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* Nanoseconds the calling thread has waited for a core, or -1 where that is not known. */
static long long waited_ns(void) {
#ifdef __linux__
    char text[96] = {0};
    int fd = open("/proc/thread-self/schedstat", O_RDONLY);
    if (fd < 0) return -1;
    ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    char *end = NULL;
    if (got <= 0) return -1;
    strtoull(text, &end, 10); /* time on a core, then time waiting for one */
    return end && *end == ' ' ? (long long)strtoull(end, NULL, 10) : -1;
#else
    return -1;
#endif
}

static int free_threads(void) {
    static double looked = 0, one_until = 0;
    static long long waited = -1;
    static int strikes = 0; /* looks in a row that found it waiting */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double t = now.tv_sec + now.tv_nsec * 1e-9;
    if (t - looked >= LOOK_EVERY) {
        long long w = waited_ns();
        int busy = w >= 0 && waited >= 0 && (double)(w - waited) * 1e-9 > CONTENDED * (t - looked);
        strikes = busy ? strikes + 1 : 0;
        if (strikes >= 2) one_until = t + STAY_ONE;
        looked = t;
        waited = w;
    }
    return t < one_until ? 1 : omp_get_max_threads();
}
#else
static int free_threads(void) { return 1; }
#endif

/* typed() for float32. */
static int floats(PyObject *obj, Py_buffer *view, int ndim, int writable, const char *name) {
    return typed(obj, view, ndim, 4, "f", writable, name, "float32");
}

#endif
