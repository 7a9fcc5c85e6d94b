/* kvchat.engine.cpu.packed: products with weights as MLX stores them, widened in registers.
 *
 * A 4-bit model's weights are an eighth of its float32 twin's bytes; decoding reads every
 * weight once a token, so it can go up to eight times as fast, as long as nothing widens
 * them in memory first. Two forms are read here:
 *
 * - affine packed (mx.quantize): uint32 (out, in · bits / 32), each row one little-endian
 *   bit stream of `bits`-bit codes q, each group of `group` codes along a row with its
 *   scale s and bias b (float32, or the bits of float16 / bfloat16): a value is s·q + b.
 *   A group's dot product with x is Σ (s·q)·x + b · Σ x, Σ x taken once per row of x.
 * - float16 / bfloat16, as their uint16 bits (out, in).
 *
 * affine_t / half_t: out (n, out) = x (n, in) · Wᵀ. As in rows.c, each thread takes
 * bands of weight rows and keeps the dot products of a tile of weight rows × up to 8 rows
 * of x in vector registers while it streams the tile's weights once. For 2, 4 and 8 bits
 * a 64-bit word of codes is broadcast to 16 lanes, each shifting out its own code, so x is
 * first rearranged to match; 3, 5 and 6 bits widen 16 codes of 2 × `bits` bytes at a time.
 * A 4-bit code picks its value s·q + b from its group's 16 (one shuffle, in place of
 * masking, widening and scaling it: one 4864×896 row on one core 0.29 against 0.35 ms,
 * 8 rows 0.83-1.14 against 1.19-1.41 ms); other codes are scaled. Every (weight row, row
 * of x) dot product is the same sequence of operations whatever the tile, the band or
 * the number of rows: a row's result does not depend on the rows beside it, bit for bit.
 *
 * affine_rows / half_rows: chosen weight rows widened to float32 (an embedding's lookup;
 * a prompt's products widen a tile of weight rows at a time for BLAS).
 *
 * The build (pyproject.toml's ext-modules) is optional: without it kvchat.engine.cpu.stored
 * computes the same with numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

enum { F32 = 0, F16 = 1, BF16 = 2 }; /* how scales, biases or 16-bit weights are held */
#define ODD 3 /* `fmt` of 3, 5 and 6-bit codes (one loop, the width read at run time) */
#define HALF_F16 16 /* of float16 weights (else: bits of the codes, 2, 4 or 8) */
#define HALF_BF16 17
#define MB 8 /* rows of x a tile takes (more go in groups of MB) */
#define TILE 16 /* dot products a tile keeps: weight rows NR_OF(nb) × nb rows of x */
#define NR_OF(nb) ((nb) <= 4 ? 4 : 2)
/* A product of fewer weight values × rows than this runs on the calling thread: waking
 * the others costs more than they save. */
#define PARALLEL_WORK (1 << 18)

/* The kernels' vectors: 16 floats, 512 bits (AVX-512's registers; two of AVX2's, four of
 * SSE's or NEON's where those are what the clone has). With 8 lanes an 8-row tile was
 * bound by its multiply-adds at 3.8 times a row's time; the same tile in 16 lanes does
 * half the instructions. */
#define WL 16
typedef float wf __attribute__((vector_size(WL * 4)));
typedef float wfu __attribute__((vector_size(WL * 4), aligned(4)));
typedef int32_t wi __attribute__((vector_size(WL * 4)));
typedef uint32_t wu __attribute__((vector_size(WL * 4)));
typedef uint32_t wuu __attribute__((vector_size(WL * 4), aligned(1)));
typedef uint64_t wq __attribute__((vector_size(WL * 4)));
typedef uint64_t wqq __attribute__((vector_size(WL * 8)));

static const wf IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline __attribute__((always_inline)) wf ints(wu a) { return __builtin_convertvector((wi)a, wf); }

/* float16 bits (the low 16 of each lane), widened: normal, subnormal, infinite and NaN
 * (GCC 12 widens a vector of _Float16 one lane at a time, even where F16C is at hand). */
static inline __attribute__((always_inline)) wf widen_f16(wu h) {
    wu e = h & 0x7c00, mag = (h & 0x7fff) << 13;
    wu normal = mag + (112 << 23);
    wu tiny = (wu)(ints(h & 0x3ff) * 0x1p-24f);
    wu zero = (wu)(e == 0);
    wu v = (tiny & zero) | (normal & ~zero);
    v += (wu)(e == 0x7c00) & (112 << 23);
    return (wf)(v | ((h & 0x8000) << 16));
}

static inline float scalar16(uint16_t h, int fmt) {
    wu v = {h};
    return fmt == HALF_BF16 ? ((wf)(v << 16))[0] : widen_f16(v)[0];
}

/* Element i of a scale or bias array held as `kind`. */
static inline float value(const void *p, int kind, Py_ssize_t i) {
    if (kind == F32) return ((const float *)p)[i];
    return scalar16(((const uint16_t *)p)[i], kind == F16 ? HALF_F16 : HALF_BF16);
}

/* A chunk: the values widened at once (8 bytes of 2 or 4-bit codes, 16 bytes of 8-bit
 * ones, 16 codes of 3, 5 or 6 bits, 32 16-bit values), as VECS vectors; lane j of vector
 * s holds the chunk's value POS(fmt, s, j). x is laid out to match (arrange). */
#define CODES(fmt) ((fmt) == 2 || (fmt) >= HALF_F16 ? 32 : 16)
#define VECS(fmt) (CODES(fmt) / WL)
#define LANES(fmt) ((fmt) == 8 ? 8 : 16) /* lanes a 64-bit word of codes fills */
#define POS(fmt, s, j)                                                                     \
    ((fmt) >= HALF_F16 ? 2 * (j) + (s)                                                     \
     : 32 % (fmt)      ? (j)                                                               \
                       : (j) / LANES(fmt) * (64 / (fmt)) + ((j) & 1) * (32 / (fmt))        \
                             + ((j) % LANES(fmt) >> 1) + 8 * (s))

/* Chunk c of a row (of packed codes or 16-bit values) as VECS(fmt) vectors of floats. Two,
 * four or eight-bit codes: a 64-bit word in each pair of lanes, each lane shifting out its
 * own code; three, five, six: the 64 bits of eight codes in each of eight lanes; 16-bit
 * values: two in each lane of a 64-byte load. */
static inline __attribute__((always_inline)) void chunk(const uint8_t *row, Py_ssize_t c,
                                                        int fmt, int bits, const wf *table,
                                                        wf *q) {
    if (fmt >= HALF_F16) {
        wu v = *(const wuu *)(row + 64 * c);
        if (fmt == HALF_BF16) {
            q[0] = (wf)(v << 16);
            q[1] = (wf)(v & 0xffff0000u);
        } else {
            q[0] = widen_f16(v & 0xffff);
            q[1] = widen_f16(v >> 16);
        }
    } else if (32 % fmt == 0) {
        const uint8_t *p = row + CODES(fmt) * fmt / 8 * c;
        uint64_t w0, w1;
        memcpy(&w0, p, 8);
        wu v = (wu)(wq){w0, w0, w0, w0, w0, w0, w0, w0};
        if (fmt == 8) { /* lanes 8 … 15: the next word */
            memcpy(&w1, p + 8, 8);
            const wq high = {0, 0, 0, 0, ~0ull, ~0ull, ~0ull, ~0ull};
            v = (wu)(((wq)v & ~high) | ((wq){w1, w1, w1, w1, w1, w1, w1, w1} & high));
        }
        const wu step = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
        const wu shifts = fmt == 8 ? (step & 3) * 8 : step * fmt;
        if (fmt == 4 && table) /* a lane's code picks its value (the shuffle reads 4 bits) */
            q[0] = __builtin_shuffle(*table, (wi)(v >> shifts));
        else
            for (int s = 0; s < VECS(fmt); s++)
                q[s] = ints((v >> (shifts + 8 * fmt * s)) & ((1u << fmt) - 1));
    } else {
        uint64_t w0 = 0, w1 = 0;
        memcpy(&w0, row + 2 * bits * c, bits);
        memcpy(&w1, row + 2 * bits * c + bits, bits);
        const wqq shifts = (wqq){0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7} * (uint64_t)bits;
        wqq v = (wqq){w0, w0, w0, w0, w0, w0, w0, w0, w1, w1, w1, w1, w1, w1, w1, w1};
        q[0] = __builtin_convertvector(__builtin_convertvector((v >> shifts) & ((1u << bits) - 1), wi), wf);
    }
}

/* A weight matrix as handed over. */
typedef struct {
    const uint8_t *w;
    Py_ssize_t out, in, row_bytes;
    int fmt;                     /* 2, ODD, 4, 8, HALF_F16 or HALF_BF16 */
    int bits;                    /* of the codes (affine only) */
    Py_ssize_t group, groups;    /* affine only */
    const void *scales, *biases; /* (out, groups) */
    int kind;                    /* the scales' and biases' F32 / F16 / BF16 */
} Matrix;

/* tot[r · nb + b] += chunk c of weight row o + r (its codes times scale[r], the row's
 * group's scale) times the same of row b of x (xs, arranged). */
static inline __attribute__((always_inline)) void products(const Matrix *m, int fmt, int NR,
                                                           int nb, const float *xs,
                                                           Py_ssize_t o, Py_ssize_t c,
                                                           const float *scale, const wf *table,
                                                           wf *tot) {
    wf q[4][2];
    for (int r = 0; r < NR; r++) {
        chunk(m->w + (o + r) * m->row_bytes, c, fmt, m->bits, fmt == 4 ? table + r : NULL, q[r]);
        if (fmt < HALF_F16 && fmt != 4)
            for (int s = 0; s < VECS(fmt); s++) q[r][s] *= scale[r];
    }
    for (int b = 0; b < nb; b++)
        for (int s = 0; s < VECS(fmt); s++) {
            wf xb = *(const wfu *)(xs + b * m->in + c * CODES(fmt) + s * WL);
            for (int r = 0; r < NR; r++) tot[r * nb + b] += q[r][s] * xb;
        }
}

/* y[b, o + r] for r < NR, b < nb: NR weight rows from o times nb rows of x, arranged in xs
 * (group sums in sx, which the biases multiply). fmt, NR and nb are constants where it is
 * inlined. Scaling the codes once for all rows of x (rather than each group's dot product,
 * s · Σ q·x) keeps one sum per row pair: an 8-row tile in 16 registers. */
static inline __attribute__((always_inline)) void tile(const Matrix *m, int fmt, int NR, int nb,
                                                       const float *xs, const float *sx,
                                                       float *y, Py_ssize_t o) {
    wf tot[TILE]; /* tot[r · nb + b]: a flat array, small enough to live in registers */
    for (int i = 0; i < NR * nb; i++) tot[i] = (wf){0};
    Py_ssize_t chunks = m->in / CODES(fmt);
    if (fmt >= HALF_F16) {
        for (Py_ssize_t c = 0; c < chunks; c++) products(m, fmt, NR, nb, xs, o, c, NULL, NULL, tot);
    } else {
        Py_ssize_t per_group = m->group / CODES(fmt);
        for (Py_ssize_t g = 0; g < m->groups; g++) {
            float scale[4];
            wf table[4]; /* 4 bits: the group's 16 values, s·q + b */
            for (int r = 0; r < NR; r++) {
                scale[r] = value(m->scales, m->kind, (o + r) * m->groups + g);
                if (fmt == 4) { /* rounded twice in every tile: not fused in some (bit for bit) */
                    wf product = IOTA * scale[r];
                    __asm__("" : "+m"(product));
                    table[r] = product + value(m->biases, m->kind, (o + r) * m->groups + g);
                }
            }
            for (Py_ssize_t c = g * per_group; c < (g + 1) * per_group; c++)
                products(m, fmt, NR, nb, xs, o, c, scale, table, tot);
        }
    }
    for (int r = 0; r < NR; r++) {
        vf halves[MB] = {{0}}; /* each sum's two halves added, then its eight lanes */
        for (int b = 0; b < nb; b++)
            halves[b] = __builtin_shufflevector(tot[r * nb + b], tot[r * nb + b], 0, 1, 2, 3, 4, 5, 6, 7)
                      + __builtin_shufflevector(tot[r * nb + b], tot[r * nb + b], 8, 9, 10, 11, 12, 13, 14, 15);
        vf sums = lane_sums(halves);
        const uint8_t *row = m->w + (o + r) * m->row_bytes;
        for (int b = 0; b < nb; b++) {
            float s = sums[SLOT[b]];
            if (fmt >= HALF_F16) /* the values after the last whole chunk */
                for (Py_ssize_t j = chunks * CODES(fmt); j < m->in; j++)
                    s += scalar16(((const uint16_t *)row)[j], fmt) * xs[b * m->in + j];
            else if (fmt != 4) /* (4 bits: the biases are in the tables) */
                for (Py_ssize_t g = 0; g < m->groups; g++)
                    s += value(m->biases, m->kind, (o + r) * m->groups + g) * sx[b * m->groups + g];
            y[b * m->out + o + r] = s;
        }
    }
}


#define BAND(fmt)                                                                          \
    for (Py_ssize_t o = lo; o < hi; o += step) {                                           \
        switch (single ? 0 : nb) {                                                         \
        case 0: /* one weight row a tile, each row of x alone: the same arithmetic */      \
            for (int b = 0; b < nb; b++)                                                   \
                tile(m, fmt, 1, 1, xs + b * m->in, sx + b * m->groups, y + b * m->out, o); \
            break;                                                                         \
        case 1: tile(m, fmt, NR_OF(1), 1, xs, sx, y, o); break;                            \
        case 2: tile(m, fmt, NR_OF(2), 2, xs, sx, y, o); break;                            \
        case 3: tile(m, fmt, NR_OF(3), 3, xs, sx, y, o); break;                            \
        case 4: tile(m, fmt, NR_OF(4), 4, xs, sx, y, o); break;                            \
        case 5: tile(m, fmt, NR_OF(5), 5, xs, sx, y, o); break;                            \
        case 6: tile(m, fmt, NR_OF(6), 6, xs, sx, y, o); break;                            \
        case 7: tile(m, fmt, NR_OF(7), 7, xs, sx, y, o); break;                            \
        default: tile(m, fmt, NR_OF(8), 8, xs, sx, y, o); break;                           \
        }                                                                                  \
    }

/* Weight rows lo … hi − 1 times nb ≤ MB rows of x, in one format: a constant fmt and nb, so
 * that each tile is unrolled; `single`, one weight row a tile (a matrix's last rows when
 * they are not a multiple of 4). */
CLONES static void band(const Matrix *m, const float *xs, const float *sx, float *y, int nb,
                        Py_ssize_t lo, Py_ssize_t hi, int single) {
    Py_ssize_t step = single ? 1 : NR_OF(nb);
    switch (m->fmt) {
    case 2: BAND(2) break;
    case ODD: BAND(ODD) break;
    case 4: BAND(4) break;
    case 8: BAND(8) break;
    case HALF_F16: BAND(HALF_F16) break;
    default: BAND(HALF_BF16) break;
    }
}

/* Every row of x (arranged in xs, group sums in sx) times every weight row: bands of
 * weight rows handed out to the threads as they come free (a thread slowed by another
 * process takes fewer), on the calling thread alone for a small product. */
static void product(const Matrix *m, const float *xs, const float *sx, Py_ssize_t n, float *y) {
    Py_ssize_t full = m->out / 4 * 4, work = m->out * m->in * n;
    int threads = 1;
#ifdef _OPENMP
    threads = work >= PARALLEL_WORK ? omp_get_max_threads() : 1;
#endif
    Py_ssize_t chunk = (full / (4 * threads) + 3) / 4 * 4;
    if (chunk < 4) chunk = 4;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
    for (Py_ssize_t lo = 0; lo < full; lo += chunk)
        for (Py_ssize_t b0 = 0; b0 < n; b0 += MB)
            band(m, xs + b0 * m->in, sx + b0 * m->groups, y + b0 * m->out,
                 n - b0 < MB ? (int)(n - b0) : MB, lo, lo + chunk < full ? lo + chunk : full, 0);
    for (Py_ssize_t b0 = 0; b0 < n; b0 += MB)
        band(m, xs + b0 * m->in, sx + b0 * m->groups, y + b0 * m->out,
             n - b0 < MB ? (int)(n - b0) : MB, full, m->out, 1);
}

/* x laid out as chunk() widens its chunks (xs; the values after the last whole chunk as
 * they are), and the sums of its groups (sx, affine only). */
static void arrange(const Matrix *m, const float *x, Py_ssize_t n, float *xs, float *sx) {
    int fmt = m->fmt, vecs = VECS(fmt), n_codes = CODES(fmt);
    Py_ssize_t whole = m->in / n_codes * n_codes;
    for (Py_ssize_t b = 0; b < n; b++) {
        const float *xb = x + b * m->in;
        float *out = xs + b * m->in;
        for (Py_ssize_t c = 0; c < whole; c += n_codes)
            for (int s = 0; s < vecs; s++)
                for (int j = 0; j < WL; j++) out[c + s * WL + j] = xb[c + POS(fmt, s, j)];
        memcpy(out + whole, xb + whole, sizeof(float) * (m->in - whole));
        for (Py_ssize_t g = 0; g < m->groups; g++) {
            float sum = 0;
            for (Py_ssize_t i = 0; i < m->group; i++) sum += xb[g * m->group + i];
            sx[b * m->groups + g] = sum;
        }
    }
}

/* Chunk c of a row widened, each value where it belongs (POS). */
/* A chunk widened (q, as chunk() gives it), times scale plus bias, in the row's order. */
static inline __attribute__((always_inline)) void natural(const wf *q, int fmt, float scale,
                                                          float bias, float *o) {
    wf n[2];
    switch (fmt) {
    case 2:
        n[0] = SH(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        n[1] = SH(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        break;
    case 4: n[0] = SH(q[0], q[0], 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15); break;
    case 8: n[0] = SH(q[0], q[0], 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15); break;
    case ODD: n[0] = q[0]; break;
    default: /* 16-bit */
        n[0] = SH(q[0], q[1], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        n[1] = SH(q[0], q[1], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    }
    for (int v = 0; v < VECS(fmt); v++) *(wfu *)(o + v * WL) = n[v] * scale + bias;
}

#define NATURAL(fmt)                                                                       \
    chunk(row, c, fmt, m->bits, NULL, q);                                                  \
    natural(q, fmt, scale, bias, o);                                                       \
    break;

/* Weight row `id` widened to float32 in `out` (in floats). */
CLONES static void widen_row(const Matrix *m, Py_ssize_t id, float *out) {
    const uint8_t *row = m->w + id * m->row_bytes;
    Py_ssize_t n_codes = CODES(m->fmt), chunks = m->in / n_codes;
    Py_ssize_t per_group = m->group ? m->group / n_codes : chunks;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        float scale = 1, bias = 0, *o = out + c * n_codes;
        if (m->group) {
            scale = value(m->scales, m->kind, id * m->groups + c / per_group);
            bias = value(m->biases, m->kind, id * m->groups + c / per_group);
        }
        wf q[2];
        switch (m->fmt) {
        case 2: NATURAL(2)
        case ODD: NATURAL(ODD)
        case 4: NATURAL(4)
        case 8: NATURAL(8)
        case HALF_F16: NATURAL(HALF_F16)
        default: NATURAL(HALF_BF16)
        }
    }
    for (Py_ssize_t k = chunks * n_codes; k < m->in; k++)
        out[k] = scalar16(((const uint16_t *)row)[k], m->fmt);
}

/* ------------------------------------------------------------------ Python side */

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
}

/* The affine matrix of w, scales and biases (views held in v[0 … 2]): 0, or -1 with the
 * exception set and nothing held. */
static int affine_matrix(PyObject **objs, int kind, int bits, Py_ssize_t group, Py_buffer *v,
                         Matrix *m) {
    memset(v, 0, 3 * sizeof *v);
    int scale_size = kind == F32 ? 4 : 2;
    const char *scale_code = kind == F32 ? "f" : "H", *what = kind == F32 ? "float32" : "uint16";
    if (typed(objs[0], &v[0], 2, 4, "I", 0, "w", "uint32") < 0
        || typed(objs[1], &v[1], 2, scale_size, scale_code, 0, "scales", what) < 0
        || typed(objs[2], &v[2], 2, scale_size, scale_code, 0, "biases", what) < 0) {
        release(v, 3);
        return -1;
    }
    Py_ssize_t out = v[0].shape[0], in = v[0].shape[1] * 32 / (bits ? bits : 1);
    if (kind < F32 || kind > BF16 || (bits < 2 || bits > 8 || bits == 7)
        || group < 32 || group % 32 || (v[0].shape[1] * 32) % bits || in % group)
        PyErr_SetString(PyExc_ValueError, "bits must be 2, 3, 4, 5, 6 or 8, group_size a multiple "
                                          "of 32 dividing the row, scale kind 0, 1 or 2");
    else if (v[1].shape[0] != out || v[1].shape[1] != in / group
             || memcmp(v[1].shape, v[2].shape, 2 * sizeof(Py_ssize_t)))
        PyErr_SetString(PyExc_ValueError, "scales and biases must be (out, in / group_size)");
    else {
        int fmt = bits == 3 || bits == 5 || bits == 6 ? ODD : bits;
        *m = (Matrix){v[0].buf, out, in, v[0].shape[1] * 4, fmt, bits, group, in / group,
                      v[1].buf, v[2].buf, kind};
        return 0;
    }
    release(v, 3);
    return -1;
}

/* The 16-bit matrix w (its view held in *v). */
static int half_matrix(PyObject *obj, int kind, Py_buffer *v, Matrix *m) {
    if (typed(obj, v, 2, 2, "H", 0, "w", "uint16") < 0) return -1;
    if (kind != F16 && kind != BF16) {
        PyErr_SetString(PyExc_ValueError, "kind must be 1 (float16) or 2 (bfloat16)");
        PyBuffer_Release(v);
        return -1;
    }
    *m = (Matrix){v->buf, v->shape[0], v->shape[1], v->shape[1] * 2,
                  kind == F16 ? HALF_F16 : HALF_BF16, 16, 0, 0, NULL, NULL, 0};
    return 0;
}

/* out = x · mᵀ: None, or NULL with the exception set. */
static PyObject *multiply(const Matrix *m, PyObject *x_obj, PyObject *y_obj) {
    Py_buffer x, y;
    if (floats(x_obj, &x, 2, 0, "x") < 0) return NULL;
    if (floats(y_obj, &y, 2, 1, "out") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    Py_ssize_t n = x.shape[0];
    PyObject *result = NULL;
    float *xs = NULL, *sx = NULL;
    if (x.shape[1] != m->in || y.shape[0] != n || y.shape[1] != m->out || n < 1)
        PyErr_SetString(PyExc_ValueError, "shapes do not match: w (out, in), x (n ≥ 1, in), "
                                          "out (n, out)");
    else if (!(xs = malloc(sizeof(float) * n * m->in))
             || !(sx = malloc(sizeof(float) * (n * m->groups + 1))))
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        arrange(m, x.buf, n, xs, sx);
        product(m, xs, sx, n, y.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(xs);
    free(sx);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return result;
}

/* out[i] = row ids[i] of m, widened: None, or NULL with the exception set. */
static PyObject *widen(const Matrix *m, PyObject *ids_obj, PyObject *out_obj) {
    Py_buffer ids, out;
    if (typed(ids_obj, &ids, 1, 8, "lq", 0, "ids", "int64") < 0) return NULL;
    if (floats(out_obj, &out, 2, 1, "out") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    Py_ssize_t count = ids.shape[0];
    const int64_t *id = ids.buf;
    PyObject *result = NULL;
    if (out.shape[0] != count || out.shape[1] != m->in)
        PyErr_SetString(PyExc_ValueError, "out must be (len(ids), in)");
    else {
        Py_ssize_t i = 0;
        while (i < count && id[i] >= 0 && id[i] < m->out) i++;
        if (i < count)
            PyErr_Format(PyExc_IndexError, "row %lld of a matrix of %zd rows", (long long)id[i],
                         m->out);
        else {
            float *o = out.buf;
            Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(dynamic) if (count * m->in >= PARALLEL_WORK)
            for (Py_ssize_t r = 0; r < count; r++) widen_row(m, id[r], o + r * m->in);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *affine_t(PyObject *self, PyObject *args) {
    PyObject *objs[3], *x, *out;
    int kind, bits;
    Py_ssize_t group;
    if (!PyArg_ParseTuple(args, "OOOiinOO:affine_t", &objs[0], &objs[1], &objs[2], &kind, &bits,
                          &group, &x, &out))
        return NULL;
    Py_buffer v[3];
    Matrix m;
    if (affine_matrix(objs, kind, bits, group, v, &m) < 0) return NULL;
    PyObject *result = multiply(&m, x, out);
    release(v, 3);
    return result;
}

static PyObject *affine_rows(PyObject *self, PyObject *args) {
    PyObject *objs[3], *ids, *out;
    int kind, bits;
    Py_ssize_t group;
    if (!PyArg_ParseTuple(args, "OOOiinOO:affine_rows", &objs[0], &objs[1], &objs[2], &kind,
                          &bits, &group, &ids, &out))
        return NULL;
    Py_buffer v[3];
    Matrix m;
    if (affine_matrix(objs, kind, bits, group, v, &m) < 0) return NULL;
    PyObject *result = widen(&m, ids, out);
    release(v, 3);
    return result;
}

static PyObject *half_t(PyObject *self, PyObject *args) {
    PyObject *w, *x, *out;
    int kind;
    if (!PyArg_ParseTuple(args, "OiOO:half_t", &w, &kind, &x, &out)) return NULL;
    Py_buffer v;
    Matrix m;
    if (half_matrix(w, kind, &v, &m) < 0) return NULL;
    PyObject *result = multiply(&m, x, out);
    PyBuffer_Release(&v);
    return result;
}

static PyObject *half_rows(PyObject *self, PyObject *args) {
    PyObject *w, *ids, *out;
    int kind;
    if (!PyArg_ParseTuple(args, "OiOO:half_rows", &w, &kind, &ids, &out)) return NULL;
    Py_buffer v;
    Matrix m;
    if (half_matrix(w, kind, &v, &m) < 0) return NULL;
    PyObject *result = widen(&m, ids, out);
    PyBuffer_Release(&v);
    return result;
}

static PyMethodDef methods[] = {
    {"affine_t", affine_t, METH_VARARGS,
     "affine_t(w, scales, biases, kind, bits, group_size, x, out): out = x @ Wᵀ for MLX's "
     "affine packed W: w uint32 (out, in · bits / 32), scales and biases (out, in / "
     "group_size) float32 (kind 0) or uint16 bits of float16 (1) or bfloat16 (2); x float32 "
     "(n, in), out float32 (n, out). Each weight is read once for all rows."},
    {"half_t", half_t, METH_VARARGS,
     "half_t(w, kind, x, out): out = x @ Wᵀ for W the uint16 bits (out, in) of float16 "
     "(kind 1) or bfloat16 (kind 2) weights; x float32 (n, in), out float32 (n, out)."},
    {"affine_rows", affine_rows, METH_VARARGS,
     "affine_rows(w, scales, biases, kind, bits, group_size, ids, out): out[i] = row ids[i] "
     "of the affine packed W as float32; ids int64 (m,), out float32 (m, in)."},
    {"half_rows", half_rows, METH_VARARGS,
     "half_rows(w, kind, ids, out): out[i] = row ids[i] of the 16-bit W as float32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvchat.engine.cpu.packed",
    "Products with packed and 16-bit weights, widened in registers (see packed.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_packed(void) { return PyModule_Create(&module); }
