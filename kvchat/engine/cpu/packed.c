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
 * Where the CPU has AVX-512 a 4-bit code picks its value s·q + b from its group's 16 (one
 * shuffle, in place of masking, widening and scaling it: one 4864×896 row on one core 0.29
 * against 0.35 ms, 8 rows 0.83-1.14 against 1.19-1.41 ms); other codes, and 4-bit ones on
 * other CPUs (see look_up), are scaled. Every (weight row, row
 * of x) dot product is the same sequence of operations whatever the tile, the band or
 * the number of rows: a row's result does not depend on the rows beside it, bit for bit.
 * Where the CPU has AVX-512 VNNI, 4 and 8-bit products in groups of 32, 64 or 128 run in
 * 8-bit integers instead, x split into three 8-bit digits (packed_int.h: twice as fast).
 * Where it has AVX2 but not AVX-512, the float tiles run in packed_avx2.h's 8-lane kernels
 * (GCC builds the tiles' 16-lane vectors on the stack for AVX2: 3 to 20 times as long).
 *
 * products_t: several such products of one x (a layer's q, k and v; its gate and up) in one
 * call, each matrix's rows banded as if it were alone, every band in one parallel region.
 *
 * affine_rows / half_rows: chosen weight rows widened to float32 (an embedding's lookup;
 * a prompt's products widen a tile of weight rows at a time for BLAS).
 *
 * layers: llama-family decoder layers whole, their products these (layer.h).
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
#include "attend.h"
#include "packed.h"

/* Bytes ahead of a tile's reading that it asks the cache for. A tile's rows are one
 * stretch of memory (o … o + NR − 1, and the next tile's after them) that it reads as NR
 * short streams at once, one a row, each a row's length at most: too short for the
 * hardware's prefetchers to follow. So each step also asks for the lines AHEAD bytes past
 * the step's share of the stretch, read as one stream. 2-core AMD EPYC (STREAM-like read
 * 24 GB/s on one core, 48 on two), bfloat16 151936×896, one row: 13 GB/s on one thread
 * with no prefetch, 10.9 with each row's line 1 KiB ahead, 17.6 / 21.9 / 29.6 / 28.1 /
 * 23.0 with the stretch 2 / 4 / 8 / 16 / 32 KiB ahead; on two threads 26 against 56 GB/s
 * 8 KiB ahead; 8 rows (bound by their multiply-adds) 10 against 16 GB/s. */
#define AHEAD 8192
#define MB 8 /* rows of x a tile takes (more go in groups of MB) */
#define TILE 16 /* dot products a tile keeps: weight rows NR_OF(nb) × nb rows of x */
#define NR_OF(nb) ((nb) <= 4 ? 4 : 2)
/* CALL(m, form, NR(k), k, …) for k = nb, 1 … MB rows of x, each k a constant, so that the
 * tile called is unrolled for it: the float tiles' (BAND) and the integer ones' (INTS_BAND,
 * packed_int.h). */
#define TILES_BY_NB(nb, CALL, NR, m, form, ...)                                            \
    switch (nb) {                                                                          \
    case 1: CALL(m, form, NR(1), 1, __VA_ARGS__); break;                                   \
    case 2: CALL(m, form, NR(2), 2, __VA_ARGS__); break;                                   \
    case 3: CALL(m, form, NR(3), 3, __VA_ARGS__); break;                                   \
    case 4: CALL(m, form, NR(4), 4, __VA_ARGS__); break;                                   \
    case 5: CALL(m, form, NR(5), 5, __VA_ARGS__); break;                                   \
    case 6: CALL(m, form, NR(6), 6, __VA_ARGS__); break;                                   \
    case 7: CALL(m, form, NR(7), 7, __VA_ARGS__); break;                                   \
    default: CALL(m, form, NR(8), 8, __VA_ARGS__); break;                                  \
    }
/* A product of fewer weight values × rows than this runs on the calling thread: waking
 * the others costs more than they save. */
#define PARALLEL_WORK (1 << 18)
/* 4 bits: groups whose tables a tile makes at a time, ahead of their products (4 rows' of
 * them, 4 KiB, stay in L1). */
#define SEG 16
#define MAX_PARTS 8 /* matrices one call of products_t multiplies */

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
 * group's scale; 4 bits: its codes' values in the row's group's table, table[r · per_row])
 * times the same of row b of x (xs, arranged). */
static inline __attribute__((always_inline)) void products(const Matrix *m, int fmt, int NR,
                                                           int nb, const float *xs,
                                                           Py_ssize_t o, Py_ssize_t c,
                                                           const float *scale, const wf *table,
                                                           int per_row, wf *tot) {
    wf q[4][2];
    for (int r = 0; r < NR; r++) {
        chunk(m->w + (o + r) * m->row_bytes, m->row_bytes, c, fmt, m->bits,
              table ? table + r * per_row : NULL, q[r]);
        if (fmt < HALF_F16 && !table)
            for (int s = 0; s < VECS(fmt); s++) q[r][s] *= scale[r];
    }
    for (int b = 0; b < nb; b++)
        for (int s = 0; s < VECS(fmt); s++) {
            wf xb = *(const wfu *)(xs + b * m->in + c * CODES(fmt) + s * WL);
            for (int r = 0; r < NR; r++) tot[r * nb + b] += q[r][s] * xb;
        }
}

/* The prefetch of a tile of NR rows from weight row o whose step reads `bytes` of each row
 * from byte `done` of it (see AHEAD). */
static inline __attribute__((always_inline)) void ahead(const Matrix *m, int NR, Py_ssize_t o,
                                                        Py_ssize_t done, Py_ssize_t bytes) {
    const uint8_t *p = m->w + o * m->row_bytes + NR * done + AHEAD;
    for (Py_ssize_t k = 0; k < NR * bytes; k += 64) __builtin_prefetch(p + k, 0, 3);
}

#include "packed_int.h" /* 4 and 8 bits in 8-bit integers, where the CPU has AVX-512 VNNI */

/* 4 bits: row `row`'s groups g0 … g1 − 1 as tables of their 16 values, lane q of
 * table[g − g0] holding s·q + b. The product is rounded before the sum in every clone (a
 * fused multiply-add where the clone has one would round once: not bit for bit). */
static inline __attribute__((always_inline)) void tables(const Matrix *m, Py_ssize_t row,
                                                         Py_ssize_t g0, Py_ssize_t g1, wf *table) {
    for (Py_ssize_t g = g0; g < g1; g++) {
        wf product = IOTA * value(m->scales, m->kind, row * m->groups + g);
        __asm__("" : "+m"(product));
        table[g - g0] = product + value(m->biases, m->kind, row * m->groups + g);
    }
}

/* y[b, o + r] for r < NR, b < nb: NR weight rows from o times nb rows of x, arranged in xs
 * (group sums in sx, which the biases multiply). fmt, NR and nb are constants where it is
 * inlined. Scaling the codes once for all rows of x (rather than each group's dot product,
 * s · Σ q·x) keeps one sum per row pair: an 8-row tile in 16 registers. */
static inline __attribute__((always_inline)) void tile(const Matrix *m, int fmt, int NR, int nb,
                                                       const float *xs, const float *sx,
                                                       float *y, Py_ssize_t o, int look) {
    wf tot[TILE]; /* tot[r · nb + b]: a flat array, small enough to live in registers */
    for (int i = 0; i < NR * nb; i++) tot[i] = (wf){0};
    Py_ssize_t chunks = m->in / CODES(fmt);
    if (fmt >= HALF_F16) {
        for (Py_ssize_t c = 0; c < chunks; c++) {
            ahead(m, NR, o, 64 * c, 64);
            products(m, fmt, NR, nb, xs, o, c, NULL, NULL, 0, tot);
        }
    } else if (fmt == 4 && look && nb == 1) {
        /* One row of x: each group's tables made ahead, 16 groups at a time, so that the
         * products run through them with no group's set-up between its chunks (4864×896 on
         * one core 0.289 against 0.263 ms). With more rows the multiply-adds bound a tile
         * and tables kept in registers, one group at a time, were faster (8 rows 1.26 against
         * 1.39 ms). */
        Py_ssize_t per_group = m->group / CODES(4);
        for (Py_ssize_t g0 = 0; g0 < m->groups; g0 += SEG) {
            Py_ssize_t g1 = g0 + SEG < m->groups ? g0 + SEG : m->groups;
            wf table[4 * SEG]; /* table[r · SEG + g − g0]: row r's group g */
            for (int r = 0; r < NR; r++) tables(m, o + r, g0, g1, table + r * SEG);
            for (Py_ssize_t g = g0; g < g1; g++) {
                ahead(m, NR, o, g * m->group / 2, m->group / 2);
                for (Py_ssize_t c = g * per_group; c < (g + 1) * per_group; c++)
                    products(m, 4, NR, nb, xs, o, c, NULL, table + (g - g0), SEG, tot);
            }
        }
    } else {
        Py_ssize_t per_group = m->group / CODES(fmt);
        for (Py_ssize_t g = 0; g < m->groups; g++) {
            float scale[4];
            wf table[4]; /* 4 bits looked up: the group's tables, table[r] row r's */
            for (int r = 0; r < NR; r++) {
                scale[r] = value(m->scales, m->kind, (o + r) * m->groups + g);
                if (fmt == 4 && look) tables(m, o + r, g, g + 1, table + r);
            }
            ahead(m, NR, o, g * m->group * m->bits / 8, m->group * m->bits / 8);
            for (Py_ssize_t c = g * per_group; c < (g + 1) * per_group; c++)
                products(m, fmt, NR, nb, xs, o, c, scale, fmt == 4 && look ? table : NULL, 1, tot);
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
            else if (fmt != 4 || !look) /* (4 bits looked up: the biases are in the tables) */
                for (Py_ssize_t g = 0; g < m->groups; g++)
                    s += value(m->biases, m->kind, (o + r) * m->groups + g) * sx[b * m->groups + g];
            y[b * m->out + o + r] = s;
        }
    }
}


#define BAND(fmt, look)                                                                    \
    for (Py_ssize_t o = lo; o < hi; o += step)                                             \
        if (single) /* one weight row a tile, each row of x alone: the same arithmetic */  \
            for (int b = 0; b < nb; b++)                                                   \
                tile(m, fmt, 1, 1, xs + b * m->in, sx + b * m->groups, y + b * m->out, o,  \
                     look);                                                                \
        else                                                                               \
            TILES_BY_NB(nb, tile, NR_OF, m, fmt, xs, sx, y, o, look)

/* Whether the float tiles' 4-bit codes pick their values from their groups' tables (chunk()'s
 * shuffle): where the CPU has AVX-512 that is one vpermps, but without it GCC builds the
 * 16-lane shuffle from many instructions (a build of these kernels for x86-64-v3 on an
 * AVX-512 machine: 4864×896, one row, one core, 9.1 ms looked up, 6.2 scaled), so there
 * the codes are scaled as the other widths' are. Set when the module loads (cpu_check);
 * lookup() switches it, to compare them. */
static int look_up;

/* Weight rows lo … hi − 1 times nb ≤ MB rows of x, in one format: a constant fmt and nb, so
 * that each tile is unrolled; `single`, one weight row a tile (a matrix's last rows when
 * they are not a multiple of 4). */
CLONES static void band(const Matrix *m, const float *xs, const float *sx, float *y, int nb,
                        Py_ssize_t lo, Py_ssize_t hi, int single) {
    Py_ssize_t step = single ? 1 : NR_OF(nb);
    switch (m->fmt) {
    case 2: BAND(2, 0) break;
    case ODD: BAND(ODD, 0) break;
    case 4:
        if (look_up)
            BAND(4, 1)
        else
            BAND(4, 0)
        break;
    case 8: BAND(8, 0) break;
    case HALF_F16: BAND(HALF_F16, 0) break;
    default: BAND(HALF_BF16, 0) break;
    }
}

#ifdef HALF_F16C
/* band() for float16 weights where the CPU has AVX-512 and F16C: their values widened by
 * vcvtph2ps (packed.h's HALF_F16C), the same figures as band()'s v4 clone, bit for bit. */
F16C_TARGET static void band_f16c(const Matrix *m, const float *xs, const float *sx, float *y,
                                  int nb, Py_ssize_t lo, Py_ssize_t hi, int single) {
    Py_ssize_t step = single ? 1 : NR_OF(nb);
    BAND(HALF_F16C, 0)
}

static int f16c_ready; /* the CPU runs band_f16c (set when the module loads) */

/* What the CPU has that the kernels choose by, when the module loads. */
static void cpu_check(void) {
    __builtin_cpu_init();
    look_up = __builtin_cpu_supports("avx512f") != 0;
    f16c_ready = look_up && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
              && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2")
              && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
#define band_f16c band
static const int f16c_ready = 0;
static void cpu_check(void) {}
#endif

#include "packed_avx2.h" /* the float tiles on CPUs with AVX2 but not AVX-512 */

/* One matrix's product within a call: the matrix, x arranged for it (xs: floats, or
 * where `ints` (ints_take(m) when the call began) digits, packed_int.h's; group sums in
 * sx), and its out. */
typedef struct {
    const Matrix *m;
    int ints;
    const void *xs;
    const float *sx;
    float *y;
} Part;

/* Bytes of a row of x arranged for m, as digits or floats. */
static Py_ssize_t arranged_bytes(const Matrix *m, int ints) {
    return ints ? ints_row_bytes(m) : m->in * (Py_ssize_t)sizeof(float);
}

/* Weight rows lo … hi − 1 of a part's matrix times every row of x, MB rows of x at a time. */
static void rows_of(const Part *p, Py_ssize_t n, Py_ssize_t lo, Py_ssize_t hi, int single) {
    const Matrix *m = p->m;
    for (Py_ssize_t b0 = 0; b0 < n; b0 += MB) {
        const void *xs = (const char *)p->xs + b0 * arranged_bytes(m, p->ints);
        int nb = n - b0 < MB ? (int)(n - b0) : MB;
        if (p->ints)
            ints_band(m, xs, p->sx + b0 * m->groups, p->y + b0 * m->out, nb, lo, hi, single);
        else if (avx2_used)
            avx2_band(m, xs, p->sx + b0 * m->groups, p->y + b0 * m->out, nb, lo, hi, single);
        else if (m->fmt == HALF_F16 && f16c_ready)
            band_f16c(m, xs, p->sx + b0 * m->groups, p->y + b0 * m->out, nb, lo, hi, single);
        else
            band(m, xs, p->sx + b0 * m->groups, p->y + b0 * m->out, nb, lo, hi, single);
    }
}

/* Every row of x times every weight row of each part's matrix, in one parallel region (a
 * layer's q, k and v, or its gate and up, wake OpenMP's sleeping threads once, not three
 * times or twice): each matrix cut into bands as if it were alone, about four a thread,
 * handed out to the threads as they come free (a thread slowed by another process takes
 * fewer); a matrix's last rows past a multiple of 4, and a small product, on the calling
 * thread. */
static void product(const Part *parts, int count, Py_ssize_t n, int team) {
    Py_ssize_t work = 0, chunk[MAX_PARTS], first[MAX_PARTS + 1] = {0};
    for (int p = 0; p < count; p++) work += parts[p].m->out * parts[p].m->in * n;
    int threads = work >= PARALLEL_WORK ? team : 1;
    for (int p = 0; p < count; p++) {
        Py_ssize_t full = parts[p].m->out / 4 * 4;
        chunk[p] = (full / (4 * threads) + 3) / 4 * 4;
        if (chunk[p] < 4) chunk[p] = 4;
        first[p + 1] = first[p] + (full + chunk[p] - 1) / chunk[p];
    }
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
    for (Py_ssize_t t = 0; t < first[count]; t++) {
        int p = 0;
        while (t >= first[p + 1]) p++;
        Py_ssize_t lo = (t - first[p]) * chunk[p], full = parts[p].m->out / 4 * 4;
        rows_of(&parts[p], n, lo, lo + chunk[p] < full ? lo + chunk[p] : full, 0);
    }
    for (int p = 0; p < count; p++) rows_of(&parts[p], n, parts[p].m->out / 4 * 4, parts[p].m->out, 1);
}

/* x laid out as chunk() widens its chunks (xs; the values after the last whole chunk as
 * they are), and the sums of its groups (sx, affine only; 4-bit codes looked up leave them
 * unread, their biases are in the tables). fmt is a constant where it is inlined, so that
 * POS folds: qwen2.5's 4864-wide x took 28 µs with fmt read at run time, longer than its
 * product with 4 rows. */
static inline __attribute__((always_inline)) void arrange_as(const Matrix *m, int fmt,
                                                             const float *x, Py_ssize_t n,
                                                             float *xs, float *sx) {
    int vecs = VECS(fmt), n_codes = CODES(fmt);
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

CLONES static void arrange(const Matrix *m, const float *x, Py_ssize_t n, float *xs, float *sx) {
    switch (m->fmt) {
    case 2: arrange_as(m, 2, x, n, xs, sx); break;
    case ODD: arrange_as(m, ODD, x, n, xs, sx); break;
    case 4: arrange_as(m, 4, x, n, xs, sx); break;
    case 8: arrange_as(m, 8, x, n, xs, sx); break;
    case HALF_F16: arrange_as(m, HALF_F16, x, n, xs, sx); break;
    default: arrange_as(m, HALF_BF16, x, n, xs, sx);
    }
}

#define NATURAL(fmt)                                                                       \
    chunk(row, m->row_bytes, c, fmt, m->bits, NULL, q);                                    \
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

/* ys[i] = x · m[i]ᵀ for `count` matrices and the n rows of x, x arranged once for each
 * format among them, without the GIL: 0, or -1 where memory ran out. */
static int products_into(const Matrix *m, int count, const float *x, Py_ssize_t n,
                         float *const *ys, int team) {
    Part parts[MAX_PARTS];
    void *xs[MAX_PARTS] = {NULL};
    float *sx[MAX_PARTS] = {NULL};
    int failed = 0;
    for (int i = 0; i < count && !failed; i++) {
        int same = 0; /* an earlier matrix that reads x arranged the same way */
        while (same < i && (m[same].fmt != m[i].fmt || m[same].group != m[i].group)) same++;
        if (same < i) {
            parts[i] = (Part){&m[i], parts[same].ints, parts[same].xs, parts[same].sx, ys[i]};
            continue;
        }
        int ints = ints_take(&m[i]);
        xs[i] = malloc(n * arranged_bytes(&m[i], ints));
        sx[i] = malloc(sizeof(float) * (n * m[i].groups + 1));
        if (!xs[i] || !sx[i]) {
            failed = 1;
            break;
        }
        parts[i] = (Part){&m[i], ints, xs[i], sx[i], ys[i]};
        if (ints)
            ints_arrange(&m[i], x, n, xs[i], sx[i]);
        else
            arrange(&m[i], x, n, xs[i], sx[i]);
    }
    if (!failed) product(parts, count, n, team);
    for (int i = 0; i < count; i++) {
        free(xs[i]);
        free(sx[i]);
    }
    return failed ? -1 : 0;
}

/* products_into for Python's x and outs: None, or NULL with the exception set. */
static PyObject *multiply_all(const Matrix *m, int count, PyObject *x_obj,
                              PyObject *const *y_objs) {
    Py_buffer x, y[MAX_PARTS];
    float *ys[MAX_PARTS];
    int held = 0, failed;
    PyObject *result = NULL;
    if (floats(x_obj, &x, 2, 0, "x") < 0) return NULL;
    Py_ssize_t n = x.shape[0];
    for (; held < count; held++) {
        if (floats(y_objs[held], &y[held], 2, 1, "out") < 0) goto done;
        ys[held] = y[held].buf;
        if (x.shape[1] != m[held].in || y[held].shape[0] != n || y[held].shape[1] != m[held].out
            || n < 1) {
            PyErr_SetString(PyExc_ValueError, "shapes do not match: w (out, in), x (n ≥ 1, in), "
                                              "out (n, out)");
            held++;
            goto done;
        }
    }
    int team = free_threads();
    Py_BEGIN_ALLOW_THREADS
    failed = products_into(m, count, x.buf, n, ys, team);
    Py_END_ALLOW_THREADS
    result = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
done:
    release(y, held);
    PyBuffer_Release(&x);
    return result;
}

/* out = x · mᵀ. */
static PyObject *multiply(const Matrix *m, PyObject *x_obj, PyObject *y_obj) {
    return multiply_all(m, 1, x_obj, &y_obj);
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
            int team = free_threads();
            Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(dynamic) num_threads(team) if (count * m->in >= PARALLEL_WORK)
            for (Py_ssize_t r = 0; r < count; r++)
                (avx2_used ? avx2_widen_row : widen_row)(m, id[r], o + r * m->in);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

typedef PyObject *(*Then)(const Matrix *, PyObject *, PyObject *);

/* The affine matrix of the first six arguments, handed to `then` with the last two. */
static PyObject *with_affine(PyObject *args, const char *format, Then then) {
    PyObject *objs[3], *a, *b;
    int kind, bits;
    Py_ssize_t group;
    if (!PyArg_ParseTuple(args, format, &objs[0], &objs[1], &objs[2], &kind, &bits, &group, &a,
                          &b))
        return NULL;
    Py_buffer v[3];
    Matrix m;
    if (affine_matrix(objs, kind, bits, group, v, &m) < 0) return NULL;
    PyObject *result = then(&m, a, b);
    release(v, 3);
    return result;
}

/* The 16-bit matrix of the first two arguments, handed to `then` with the last two. */
static PyObject *with_half(PyObject *args, const char *format, Then then) {
    PyObject *w, *a, *b;
    int kind;
    if (!PyArg_ParseTuple(args, format, &w, &kind, &a, &b)) return NULL;
    Py_buffer v;
    Matrix m;
    if (half_matrix(w, kind, &v, &m) < 0) return NULL;
    PyObject *result = then(&m, a, b);
    PyBuffer_Release(&v);
    return result;
}

/* The matrix of `spec`, the arguments affine_t (six) or half_t (two) take before x (their
 * views held in v[0 … 2]): 0, or -1 with the exception set and nothing held. */
static int matrix_of(PyObject *spec, Py_buffer *v, Matrix *m) {
    PyObject *objs[3];
    int kind, bits;
    Py_ssize_t group;
    memset(v, 0, 3 * sizeof *v);
    if (!PyTuple_Check(spec) || (PyTuple_GET_SIZE(spec) != 6 && PyTuple_GET_SIZE(spec) != 2)) {
        PyErr_SetString(PyExc_TypeError, "each matrix must be a tuple of affine_t's six first "
                                         "arguments or half_t's two");
        return -1;
    }
    if (PyTuple_GET_SIZE(spec) == 2)
        return PyArg_ParseTuple(spec, "Oi", &objs[0], &kind) ? half_matrix(objs[0], kind, v, m)
                                                             : -1;
    if (!PyArg_ParseTuple(spec, "OOOiin", &objs[0], &objs[1], &objs[2], &kind, &bits, &group))
        return -1;
    return affine_matrix(objs, kind, bits, group, v, m);
}

static PyObject *products_t(PyObject *self, PyObject *args) {
    PyObject *specs_obj, *x, *outs_obj;
    if (!PyArg_ParseTuple(args, "OOO:products_t", &specs_obj, &x, &outs_obj)) return NULL;
    PyObject *specs = PySequence_Fast(specs_obj, "matrices must be a sequence");
    if (!specs) return NULL;
    PyObject *outs = PySequence_Fast(outs_obj, "outs must be a sequence"), *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(specs);
    Py_buffer v[MAX_PARTS][3];
    Matrix m[MAX_PARTS];
    int held = 0;
    if (!outs)
        goto done;
    if (count < 1 || count > MAX_PARTS || PySequence_Fast_GET_SIZE(outs) != count) {
        PyErr_Format(PyExc_ValueError, "1 to %d matrices, and one out each", MAX_PARTS);
        goto done;
    }
    for (; held < count; held++)
        if (matrix_of(PySequence_Fast_GET_ITEM(specs, held), v[held], &m[held]) < 0) goto done;
    result = multiply_all(m, (int)count, x, PySequence_Fast_ITEMS(outs));
done:
    for (int i = 0; i < held; i++) release(v[i], 3);
    Py_XDECREF(outs);
    Py_DECREF(specs);
    return result;
}

static PyObject *affine_t(PyObject *self, PyObject *args) {
    return with_affine(args, "OOOiinOO:affine_t", multiply);
}

static PyObject *affine_rows(PyObject *self, PyObject *args) {
    return with_affine(args, "OOOiinOO:affine_rows", widen);
}

static PyObject *half_t(PyObject *self, PyObject *args) {
    return with_half(args, "OiOO:half_t", multiply);
}

static PyObject *half_rows(PyObject *self, PyObject *args) {
    return with_half(args, "OiOO:half_rows", widen);
}

#include "layer.h" /* whole decoder layers in one call */

/* A switch of the kernels (integer, lookup, avx2): *on set first where args give a bool (on
 * only where the CPU `can`); whether it is on. */
static PyObject *switched(PyObject *args, const char *format, int *on, int can) {
    int want = -1;
    if (!PyArg_ParseTuple(args, format, &want)) return NULL;
    if (want >= 0) *on = want && can;
    return PyBool_FromLong(*on && can);
}

static PyObject *integer(PyObject *self, PyObject *args) {
    return switched(args, "|p:integer", &ints_on, ints_available());
}

static PyObject *lookup(PyObject *self, PyObject *args) {
    return switched(args, "|p:lookup", &look_up, 1);
}

static PyObject *avx2(PyObject *self, PyObject *args) {
    return switched(args, "|p:avx2", &avx2_used, avx2_has);
}

static PyObject *threads(PyObject *self, PyObject *args) { return PyLong_FromLong(free_threads()); }

static PyMethodDef methods[] = {
    {"affine_t", affine_t, METH_VARARGS,
     "affine_t(w, scales, biases, kind, bits, group_size, x, out): out = x @ Wᵀ for MLX's "
     "affine packed W: w uint32 (out, in · bits / 32), scales and biases (out, in / "
     "group_size) float32 (kind 0) or uint16 bits of float16 (1) or bfloat16 (2); x float32 "
     "(n, in), out float32 (n, out). Each weight is read once for all rows."},
    {"half_t", half_t, METH_VARARGS,
     "half_t(w, kind, x, out): out = x @ Wᵀ for W the uint16 bits (out, in) of float16 "
     "(kind 1) or bfloat16 (kind 2) weights; x float32 (n, in), out float32 (n, out)."},
    {"products_t", products_t, METH_VARARGS,
     "products_t(matrices, x, outs): outs[i] = x @ W_iᵀ for up to 8 matrices that share x "
     "(a layer's q, k and v), each given as the arguments affine_t or half_t takes before x; "
     "the same figures as their calls one by one, in one parallel region."},
    {"layers", layers, METH_VARARGS,
     "layers(x, counts, specs): decoder layers of a llama-family model, one after another, for "
     "the step's tokens x (tokens, features), updated in place (see layer.h); counts: each "
     "row's tokens. A spec: (matrices, biases, (norm, eps), (norm, eps), cos, sin, traditional, "
     "heads, scale, keys, values, spans, new_k, new_v): matrices and biases q, k, v, o, gate, "
     "up, down (as products_t takes them; a bias None where there is none); cos, sin (tokens, "
     "turned pairs); keys, values, spans as fused.attend takes them; the turned new keys and "
     "the values written to new_k and new_v (tokens, kv heads, dim). Nothing changes unless "
     "every spec is right."},
    {"avx2", avx2, METH_VARARGS,
     "avx2([on]) -> bool: whether the float tiles' products and rows widened run in AVX2's "
     "own kernels (packed_avx2.h), as they do where the CPU has AVX2 but not AVX-512; "
     "avx2(True) where it has both, to compare them, avx2(False) the tiles' own clones."},
    {"lookup", lookup, METH_VARARGS,
     "lookup([on]) -> bool: whether the float tiles' 4-bit codes pick their values from their "
     "groups' tables of 16, as they do where the CPU has AVX-512; lookup(False) scales them as "
     "other widths' are (as on other CPUs), lookup(True) the tables."},
    {"integer", integer, METH_VARARGS,
     "integer([on]) -> bool: whether 4 and 8-bit products (groups of 32, 64 or 128) run in 8-bit "
     "integers, as they do where the CPU has AVX-512 VNNI; integer(False) the float tiles "
     "instead (to compare them), integer(True) back."},
    {"threads", threads, METH_NOARGS,
     "threads() -> int: the threads a product's parallel region takes now: the cores this "
     "process may run on while the calling thread gets a core whenever it wants one, 1 while "
     "other programs keep the cores busy (see kernels.h)."},
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

PyMODINIT_FUNC PyInit_packed(void) {
    cpu_check();
    avx2_check();
    return PyModule_Create(&module);
}
