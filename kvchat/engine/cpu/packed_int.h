/* 4 and 8-bit products in 8-bit integers, for CPUs with AVX-512 VNNI (packed.c's, where it
 * has them; elsewhere its float tiles). Include after packed.h.
 *
 * A float tile spends three vector instructions on 16 4-bit codes (shift, table lookup,
 * multiply-add), five on 8-bit ones: bound by them, not by memory. VNNI's vpdpbusd
 * multiplies 64 unsigned bytes by 64 signed ones and adds each four into a 32-bit lane,
 * so a 64-byte load of codes (a chunk: 64 8-bit codes, or 128 4-bit ones, whose low
 * nibbles, the even codes, and high nibbles, the odd, two masks and a shift make two
 * vectors of bytes) meets x in one instruction a vector, if x is bytes too. So x is split,
 * per group, into three signed 8-bit digits: X = round(x / s) with s = max |x| / (127 ·
 * 65536), X = 65536·a + 256·b + c, a, b, c in −128 … 127 (a 24-bit integer, float32's
 * precision: a product's error, measured against float64, 2e-7 of its largest). A lane's
 * sums are exact in int32: 4 bits ((Σ q·a) << 8 + Σ q·b) << 8 + Σ q·c, at most 8 · 15 ·
 * 128 · 65793 < 2³¹; 8 bits Σ q·a apart and (Σ q·b) << 8 + Σ q·c, each at most 4 · 255 ·
 * 128 · 257. Then a float times s and the group's scale; the biases meet the groups' sums
 * of x at the end. qwen2.5-0.5b's 4864×896, one row of x, one core: 4 bits 0.13 against
 * the float tiles' 0.26 ms, 8 bits 0.22 against 0.44 ms.
 *
 * Groups are 32, 64 or 128 codes (a lane's codes in one group; the groups of 512 codes, at
 * most 16, in one vector of scales). Each (weight row, row of x) dot product is the same
 * sequence of operations whatever the tile: a row's result does not depend on the rows
 * beside it, bit for bit. */
#ifndef KVCHAT_PACKED_INT_H
#define KVCHAT_PACKED_INT_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define INTS __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
#define INTS_INLINE INTS static inline __attribute__((always_inline))
#define DIGITS_MAX 8323072.0f /* 127 · 65536: the largest |X| */
#define CODES_OF(bits) (512 / (bits)) /* codes a chunk (64 bytes) */
#define PLANES(bits) ((bits) == 4 ? 2 : 1) /* vectors of bytes a chunk's codes make */

/* A chunk of a row of x: for each plane (4 bits: the even codes' places, then the odd;
 * 8 bits: one) its a, b and c digits, 64 bytes each (byte j: the plane's j-th place),
 * then scale[i], s of lane i's group (lane i reads bytes 4i … 4i + 3). */
static inline Py_ssize_t digits_bytes(int bits) { return PLANES(bits) * 3 * 64 + 16 * 4; }

static int ints_ready = -1; /* the CPU has the instructions (checked once) */
static int ints_on = 1;     /* integer(): the float tiles instead, to compare */

static int ints_available(void) {
    if (ints_ready < 0) {
        __builtin_cpu_init();
        ints_ready = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
                  && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
    }
    return ints_ready;
}

/* Whether m's products go through this file's kernels. */
static int ints_take(const Matrix *m) {
    return (m->fmt == 4 || m->fmt == 8) && ints_on && ints_available()
        && (m->group == 32 || m->group == 64 || m->group == 128);
}

/* Chunks of a row (the places past `in` zero). */
static inline Py_ssize_t ints_chunks(const Matrix *m) {
    return (m->in + CODES_OF(m->bits) - 1) / CODES_OF(m->bits);
}

/* Bytes of a row of x as digits. */
static inline Py_ssize_t ints_row_bytes(const Matrix *m) {
    return ints_chunks(m) * digits_bytes(m->bits);
}

/* X's three digits, each lane of x (its place's scale's inverse in inv), at a, a + 64 and
 * a + 128. */
INTS_INLINE void split(__m512 x, __m512 inv, int8_t *a) {
    __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
    __m512i low = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
    __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, low), 8);
    __m512i mid = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
    __m512i high = _mm512_srai_epi32(_mm512_sub_epi32(X1, mid), 8);
    _mm_storeu_si128((__m128i *)a, _mm512_cvtepi32_epi8(high));
    _mm_storeu_si128((__m128i *)(a + 64), _mm512_cvtepi32_epi8(mid));
    _mm_storeu_si128((__m128i *)(a + 128), _mm512_cvtepi32_epi8(low));
}

/* The n rows of x as digits (ints_row_bytes(m) a row) and the sums of their groups (sums,
 * n × groups). */
INTS static void ints_arrange(const Matrix *m, const float *x, Py_ssize_t n, uint8_t *xs,
                              float *sums) {
    Py_ssize_t G = m->group, codes = CODES_OF(m->bits), unit = digits_bytes(m->bits);
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (Py_ssize_t b = 0; b < n; b++) {
        const float *xb = x + b * m->in;
        uint8_t *row = xs + b * ints_row_bytes(m);
        memset(row + ints_row_bytes(m) - unit, 0, unit);
        for (Py_ssize_t g = 0; g < m->groups; g++) {
            const float *p = xb + g * G;
            __m512 most = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
            for (Py_ssize_t i = 0; i < G; i += 16) {
                __m512 v = _mm512_loadu_ps(p + i);
                most = _mm512_max_ps(most, _mm512_abs_ps(v)); /* a NaN: see below */
                sum = _mm512_add_ps(sum, v);
            }
            sums[b * m->groups + g] = _mm512_reduce_add_ps(sum);
            float top = _mm512_reduce_max_ps(most);
            /* not finite (an infinite or NaN lane; a NaN's max may have dropped it, not its
             * sum): every product with the group NaN, as a float product's would be */
            int finite = top <= 3.4e38f && sums[b * m->groups + g] == sums[b * m->groups + g];
            float scale = finite ? top / DIGITS_MAX : __builtin_nanf("");
            __m512 inv = _mm512_set1_ps(finite && top > 0 ? DIGITS_MAX / top : 0);
            for (Py_ssize_t e = g * G; e < (g + 1) * G; e += 32) {
                uint8_t *d = row + e / codes * unit;
                Py_ssize_t at = e % codes; /* the chunk's place */
                __m512 v0 = _mm512_loadu_ps(xb + e), v1 = _mm512_loadu_ps(xb + e + 16);
                if (m->bits == 4) { /* place 2j + 1 of the chunk: byte j of the odd plane */
                    split(_mm512_permutex2var_ps(v0, evens, v1), inv, (int8_t *)d + at / 2);
                    split(_mm512_permutex2var_ps(v0, odds, v1), inv, (int8_t *)d + 192 + at / 2);
                } else {
                    split(v0, inv, (int8_t *)d + at);
                    split(v1, inv, (int8_t *)d + at + 16);
                }
                float *lanes = (float *)(d + unit - 64);
                for (int lane = 0; lane < 32 * 16 / codes; lane++) lanes[at * 16 / codes + lane] = scale;
            }
        }
    }
}

/* Up to 16 scales or biases from index i, held as `kind` (lanes past `mask` zero). */
INTS_INLINE __m512 sixteen(const void *p, int kind, Py_ssize_t i, __mmask16 mask) {
    if (kind == F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
    if (kind == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One chunk's Σ q·X in each lane, as a float: its codes' planes (q[0], and q[1] for 4 bits)
 * and the row of x's digits (d). */
INTS_INLINE __m512 dot(int bits, const __m512i *q, const uint8_t *d) {
    __m512i d0 = _mm512_loadu_si512(d), d1 = _mm512_loadu_si512(d + 64);
    __m512i d2 = _mm512_loadu_si512(d + 128);
    if (bits == 8) {
        __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], d0);
        __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], d1);
        __m512i bc = _mm512_dpbusd_epi32(_mm512_slli_epi32(b, 8), q[0], d2);
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(bc));
    }
    __m512i e0 = _mm512_loadu_si512(d + 192), e1 = _mm512_loadu_si512(d + 256);
    __m512i e2 = _mm512_loadu_si512(d + 320);
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], d0);
    a = _mm512_dpbusd_epi32(a, q[1], e0);
    a = _mm512_slli_epi32(a, 8);
    a = _mm512_dpbusd_epi32(a, q[0], d1);
    a = _mm512_dpbusd_epi32(a, q[1], e1);
    a = _mm512_slli_epi32(a, 8);
    a = _mm512_dpbusd_epi32(a, q[0], d2);
    a = _mm512_dpbusd_epi32(a, q[1], e2);
    return _mm512_cvtepi32_ps(a);
}

/* y[b, o + r] for r < NR, b < nb: NR weight rows from o times nb rows of x (their digits
 * from xs, ints_row_bytes(m) a row; their groups' sums in sums). */
INTS_INLINE void ints_tile(const Matrix *m, int bits, int NR, int nb, const uint8_t *xs,
                           const float *sums, float *y, Py_ssize_t o) {
    __m512 tot[TILE];
    for (int i = 0; i < NR * nb; i++) tot[i] = _mm512_setzero_ps();
    Py_ssize_t codes = CODES_OF(bits), chunks = ints_chunks(m), whole = m->in / codes;
    Py_ssize_t unit = digits_bytes(bits), per_window = 512 / codes, x_row = ints_row_bytes(m);
    int shift = __builtin_ctzll((unsigned long long)m->group);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)codes / 16));
    __mmask64 tail = (1ull << (m->in % codes * bits / 8)) - 1; /* bytes of a row's last chunk */
    for (Py_ssize_t c0 = 0; c0 < chunks; c0 += per_window) {
        Py_ssize_t g0 = c0 * codes >> shift, ng = m->groups - g0;
        __mmask16 window = ng >= 16 ? 0xffff : (__mmask16)((1u << ng) - 1);
        __m512 scales[4];
        for (int r = 0; r < NR; r++) scales[r] = sixteen(m->scales, m->kind, (o + r) * m->groups + g0, window);
        for (Py_ssize_t c = c0; c < c0 + per_window && c < chunks; c++) {
            __m512i q[4][2];
            __m512 scale[4];
            __m512i place = _mm512_srli_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32((int)((c - c0) * codes))), shift);
            ahead(m, NR, o, 64 * c, 64);
            for (int r = 0; r < NR; r++) {
                const uint8_t *p = m->w + (o + r) * m->row_bytes + 64 * c;
                __m512i v = c < whole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail, p);
                if (bits == 4) {
                    q[r][0] = _mm512_and_si512(v, low4);
                    q[r][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                } else
                    q[r][0] = v;
                scale[r] = _mm512_permutexvar_ps(place, scales[r]);
            }
            for (int b = 0; b < nb; b++) {
                const uint8_t *d = xs + b * x_row + c * unit;
                __m512 s = _mm512_loadu_ps((const float *)(d + unit - 64));
                for (int r = 0; r < NR; r++)
                    tot[r * nb + b] = _mm512_fmadd_ps(_mm512_mul_ps(dot(bits, q[r], d), s), scale[r],
                                                      tot[r * nb + b]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < nb; b++) {
            __m512 bias = _mm512_setzero_ps();
            for (Py_ssize_t g = 0; g < m->groups; g += 16) {
                Py_ssize_t left = m->groups - g;
                __mmask16 k = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                bias = _mm512_fmadd_ps(sixteen(m->biases, m->kind, (o + r) * m->groups + g, k),
                                       _mm512_maskz_loadu_ps(k, sums + b * m->groups + g), bias);
            }
            y[b * m->out + o + r] = _mm512_reduce_add_ps(tot[r * nb + b]) + _mm512_reduce_add_ps(bias);
        }
}

#define INTS_NR(nb) ((nb) <= 2 ? 4 : 2)
#define INTS_BAND(bits)                                                                    \
    for (Py_ssize_t o = lo; o < hi; o += single ? 1 : INTS_NR(nb))                          \
        if (single)                                                                        \
            for (int b = 0; b < nb; b++)                                                   \
                ints_tile(m, bits, 1, 1, xs + b * ints_row_bytes(m), sums + b * m->groups, \
                          y + b * m->out, o);                                              \
        else                                                                               \
            TILES_BY_NB(nb, ints_tile, INTS_NR, m, bits, xs, sums, y, o)

/* band()'s work for a matrix ints_take(). */
INTS static void ints_band(const Matrix *m, const uint8_t *xs, const float *sums, float *y,
                           int nb, Py_ssize_t lo, Py_ssize_t hi, int single) {
    if (m->bits == 4) {
        INTS_BAND(4)
    } else {
        INTS_BAND(8)
    }
}

#else
static int ints_on = 0;
static int ints_available(void) { return 0; }
static int ints_take(const Matrix *m) { return 0; }
static inline Py_ssize_t ints_row_bytes(const Matrix *m) { return 0; }
static void ints_arrange(const Matrix *m, const float *x, Py_ssize_t n, uint8_t *xs, float *sums) {}
static void ints_band(const Matrix *m, const uint8_t *xs, const float *sums, float *y, int nb,
                      Py_ssize_t lo, Py_ssize_t hi, int single) {}
#endif

#endif
