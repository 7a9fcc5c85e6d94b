/* How kvchat.engine.cpu.packed (packed.c) reads MLX's formats: the formats, its vectors of
 * 16 floats, and a chunk of a row widened into them (for the products, in the lanes' order
 * x is laid out in; for a row widened in memory, in the row's order). Include after
 * kernels.h. */
#ifndef KVCHAT_PACKED_H
#define KVCHAT_PACKED_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2 }; /* how scales, biases or 16-bit weights are held */
#define ODD 3 /* `fmt` of 3, 5 and 6-bit codes (one loop, the width read at run time) */
#define HALF_F16 16 /* of float16 weights (else: bits of the codes, 2, 4 or 8) */
#define HALF_BF16 17

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
typedef uint32_t hu __attribute__((vector_size(WL * 2))); /* half a wu */

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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* `fmt` of float16 weights in packed.c's band_f16c: widen_f16's values through F16C's
 * vcvtph2ps, three instructions a vector where widen_f16 takes about sixteen (4864×896,
 * one row, one core: 0.23 against 0.75 ms; bfloat16 0.18). Only a function compiled for
 * these instructions (F16C_TARGET) takes it: they cannot be inlined into band's clones. */
#define HALF_F16C 18
#define F16C_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
F16C_TARGET static inline wf widen_f16c(wu h) {
    return (wf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)h));
}
#endif

/* One value, in scalar code (widen_f16 on a vector of one lane, compiled for the baseline
 * instruction set, made a 4-bit product with float16 scales 2.4 times as long as with
 * bfloat16 scales: 4864×896, one row, one core, 0.63 against 0.26 ms). A float16 goes
 * through the compiler's half type where it has one: F16C's vcvtph2ps in the clones whose
 * instruction set has it, exact as the bits below are. */
static inline __attribute__((always_inline)) float scalar16(uint16_t h, int fmt) {
    uint32_t bits = (uint32_t)h << 16;
    if (fmt != HALF_BF16) {
#ifdef __FLT16_MAX__
        _Float16 half;
        memcpy(&half, &h, 2);
        return (float)half;
#else
        uint32_t sign = bits & 0x80000000u, e = h & 0x7c00, mantissa = h & 0x3ff;
        if (e == 0) { /* zero or subnormal: exact */
            float tiny = (float)mantissa * 0x1p-24f;
            return sign ? -tiny : tiny;
        }
        bits = sign | mantissa << 13 | (e == 0x7c00 ? 0x7f800000u : (e + (112 << 10)) << 13);
#endif
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Element i of a scale or bias array held as `kind`. */
static inline __attribute__((always_inline)) float value(const void *p, int kind, Py_ssize_t i) {
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

/* Chunk c's 16 codes of `bits` (3, 5 or 6) in a row of `room` bytes: its two halves' eight
 * codes in the low bits of *w0 and *w1, read as 8 bytes each where the row has them (a copy
 * of 3, 5 or 6 bytes is put together on the stack and stalls the load after it), exactly
 * at the row's end. */
static inline __attribute__((always_inline)) void odd_words(const uint8_t *row, Py_ssize_t room,
                                                            Py_ssize_t c, int bits,
                                                            uint64_t *w0, uint64_t *w1) {
    const uint8_t *p = row + 2 * bits * c;
    *w0 = *w1 = 0;
    if (2 * bits * (c + 1) + 8 - bits <= room) {
        memcpy(w0, p, 8);
        memcpy(w1, p + bits, 8);
    } else {
        memcpy(w0, p, bits);
        memcpy(w1, p + bits, bits);
    }
}

/* Chunk c of a row of `room` bytes (of packed codes or 16-bit values) as VECS(fmt) vectors
 * of floats. Two, four or eight-bit codes: a 64-bit word in each pair of lanes, each lane
 * shifting out its own code; three, five, six: the 64 bits of eight codes in each of eight
 * 64-bit lanes, twice, each shifting out its own code, narrowed to 32 bits and joined (as
 * 16 64-bit lanes, 1.87 ms for a 4864×896 row on one core, now 1.03), read by odd_words
 * (byte by byte: 4.2-4.4 ms); 16-bit values: two in each lane of a 64-byte load. */
static inline __attribute__((always_inline)) void chunk(const uint8_t *row, Py_ssize_t room,
                                                        Py_ssize_t c, int fmt, int bits,
                                                        const wf *table, wf *q) {
    if (fmt >= HALF_F16) {
        wu v = *(const wuu *)(row + 64 * c);
        if (fmt == HALF_BF16) {
            q[0] = (wf)(v << 16);
            q[1] = (wf)(v & 0xffff0000u);
#ifdef HALF_F16C
        } else if (fmt == HALF_F16C) {
            q[0] = widen_f16c(v & 0xffff);
            q[1] = widen_f16c(v >> 16);
#endif
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
        uint64_t w0, w1;
        odd_words(row, room, c, bits, &w0, &w1);
        const wq shifts = (wq){0, 1, 2, 3, 4, 5, 6, 7} * (uint64_t)bits;
        hu a = __builtin_convertvector((wq){w0, w0, w0, w0, w0, w0, w0, w0} >> shifts, hu);
        hu b = __builtin_convertvector((wq){w1, w1, w1, w1, w1, w1, w1, w1} >> shifts, hu);
        wu joined = SH(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        q[0] = ints(joined & ((1u << bits) - 1));
    }
}

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

#endif
