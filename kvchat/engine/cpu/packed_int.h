/* 4-bit products in 8-bit integers, for CPUs with AVX-512 VNNI (packed.c's, where it has
 * them; elsewhere its float tiles). Include after packed.h.
 *
 * A float tile spends three vector instructions on 16 codes (shift, table lookup,
 * multiply-add): bound by them, not by memory. VNNI's vpdpbusd multiplies 64 unsigned
 * bytes by 64 signed ones and adds each four into a 32-bit lane, so a 64-byte load of
 * codes (128 of them, a chunk: low nibbles the even ones, high nibbles the odd) needs
 * two masks and a shift to be two vectors of bytes, each of which meets x in one
 * instruction, if x is bytes too. So x is split, per group, into three signed 8-bit
 * digits: X = round(x / s) with s = max |x| / (127 · 65536), X = 65536·a + 256·b + c,
 * a, b, c in −128 … 127 (a 24-bit integer, float32's precision: a product's error,
 * measured against float64, 2e-7 of its largest). A lane's Σ q·X is exact in int32:
 * ((Σ q·a) << 8 + Σ q·b) << 8 + Σ q·c, at most 8 · 15 · 128 · 65793 < 2³¹. Then it is
 * a float times s and the group's scale; the biases meet the groups' sums of x at the end.
 * qwen2.5-0.5b's 4864×896, one row of x, one core: 0.12 against the float tiles' 0.26 ms.
 *
 * Groups are 32, 64 or 128 codes (a lane's 8 codes in one group; four chunks' groups, at
 * most 16, in one vector of scales). Each (weight row, row of x) dot product is the same
 * sequence of operations whatever the tile: a row's result does not depend on the rows
 * beside it, bit for bit. */
#ifndef KVCHAT_PACKED_INT_H
#define KVCHAT_PACKED_INT_H

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_INT4 1
#include <immintrin.h>

#define INT4 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
#define INT4_INLINE INT4 static inline __attribute__((always_inline))
#define CHUNK4 128             /* codes a chunk: one 64-byte load */
#define DIGITS_MAX 8323072.0f /* 127 · 65536: the largest |X| */

/* Chunk c of a row of x: digits[0 … 5] its a, b, c of the even codes' places, then of the
 * odd (byte j of each: the place 2j, or 2j + 1); scale[i], s of lane i's group. */
typedef struct {
    int8_t digits[6][64];
    float scale[16];
} Digits;

static int int4_ready = -1; /* the CPU has the instructions (checked once) */
static int int4_on = 1;     /* integer(): the float tiles instead, to compare */

static int int4_available(void) {
    if (int4_ready < 0) {
        __builtin_cpu_init();
        int4_ready = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
                  && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
    }
    return int4_ready;
}

/* Whether m's products go through this file's kernels. */
static int int4_takes(const Matrix *m) {
    return m->fmt == 4 && int4_on && int4_available()
        && (m->group == 32 || m->group == 64 || m->group == 128);
}

static inline Py_ssize_t int4_chunks(const Matrix *m) { return (m->in + CHUNK4 - 1) / CHUNK4; }

/* X's three digits, each lane of x (its place's scale's inverse in inv). */
INT4_INLINE void split(__m512 x, __m512 inv, int8_t *a, int8_t *b, int8_t *c) {
    __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
    __m512i low = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
    __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, low), 8);
    __m512i mid = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
    __m512i high = _mm512_srai_epi32(_mm512_sub_epi32(X1, mid), 8);
    _mm_storeu_si128((__m128i *)a, _mm512_cvtepi32_epi8(high));
    _mm_storeu_si128((__m128i *)b, _mm512_cvtepi32_epi8(mid));
    _mm_storeu_si128((__m128i *)c, _mm512_cvtepi32_epi8(low));
}

/* The n rows of x as digits (int4_chunks(m) a row, the places past `in` zero) and the sums
 * of their groups (sums, n × groups). */
INT4 static void int4_arrange(const Matrix *m, const float *x, Py_ssize_t n, Digits *xs,
                              float *sums) {
    Py_ssize_t chunks = int4_chunks(m), G = m->group;
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (Py_ssize_t b = 0; b < n; b++) {
        const float *xb = x + b * m->in;
        Digits *out = xs + b * chunks;
        memset(out + chunks - 1, 0, sizeof *out);
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
                Digits *d = out + e / CHUNK4;
                Py_ssize_t j = e % CHUNK4 / 2; /* byte of the even and odd places' digits */
                __m512 v0 = _mm512_loadu_ps(xb + e), v1 = _mm512_loadu_ps(xb + e + 16);
                split(_mm512_permutex2var_ps(v0, evens, v1), inv, d->digits[0] + j,
                      d->digits[1] + j, d->digits[2] + j);
                split(_mm512_permutex2var_ps(v0, odds, v1), inv, d->digits[3] + j,
                      d->digits[4] + j, d->digits[5] + j);
                for (int lane = 0; lane < 4; lane++) d->scale[e % CHUNK4 / 8 + lane] = scale;
            }
        }
    }
}

/* Up to 16 scales or biases from index i, held as `kind` (lanes past `mask` zero). */
INT4_INLINE __m512 sixteen(const void *p, int kind, Py_ssize_t i, __mmask16 mask) {
    if (kind == F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
    if (kind == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* y[b, o + r] for r < NR, b < nb: NR weight rows from o times nb rows of x (their digits
 * from xs, `chunks` a row; their groups' sums in sums). */
INT4_INLINE void int4_tile(const Matrix *m, int NR, int nb, const Digits *xs, const float *sums,
                           float *y, Py_ssize_t o) {
    __m512 tot[TILE];
    for (int i = 0; i < NR * nb; i++) tot[i] = _mm512_setzero_ps();
    Py_ssize_t chunks = int4_chunks(m), whole = m->in / CHUNK4;
    int shift = __builtin_ctzll((unsigned long long)m->group);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i lanes = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    __mmask64 tail = (1ull << (m->in % CHUNK4 / 2)) - 1; /* bytes of a row's last chunk */
    for (Py_ssize_t c0 = 0; c0 < chunks; c0 += 4) {
        Py_ssize_t g0 = c0 * CHUNK4 >> shift, ng = m->groups - g0;
        __mmask16 window = ng >= 16 ? 0xffff : (__mmask16)((1u << ng) - 1);
        __m512 scales[4];
        for (int r = 0; r < NR; r++) scales[r] = sixteen(m->scales, m->kind, (o + r) * m->groups + g0, window);
        for (Py_ssize_t c = c0; c < c0 + 4 && c < chunks; c++) {
            __m512i lo[4], hi[4];
            __m512 scale[4];
            __m512i place = _mm512_srli_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32((int)(c - c0) * CHUNK4)), shift);
            ahead(m, NR, o, 64 * c, 64);
            for (int r = 0; r < NR; r++) {
                const uint8_t *p = m->w + (o + r) * m->row_bytes + 64 * c;
                __m512i v = c < whole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail, p);
                lo[r] = _mm512_and_si512(v, low4);
                hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                scale[r] = _mm512_permutexvar_ps(place, scales[r]);
            }
            for (int b = 0; b < nb; b++) {
                const Digits *d = xs + b * chunks + c;
                __m512i d0 = _mm512_loadu_si512(d->digits[0]), d1 = _mm512_loadu_si512(d->digits[1]);
                __m512i d2 = _mm512_loadu_si512(d->digits[2]), d3 = _mm512_loadu_si512(d->digits[3]);
                __m512i d4 = _mm512_loadu_si512(d->digits[4]), d5 = _mm512_loadu_si512(d->digits[5]);
                __m512 s = _mm512_loadu_ps(d->scale);
                for (int r = 0; r < NR; r++) {
                    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], d0);
                    a = _mm512_dpbusd_epi32(a, hi[r], d3);
                    a = _mm512_slli_epi32(a, 8);
                    a = _mm512_dpbusd_epi32(a, lo[r], d1);
                    a = _mm512_dpbusd_epi32(a, hi[r], d4);
                    a = _mm512_slli_epi32(a, 8);
                    a = _mm512_dpbusd_epi32(a, lo[r], d2);
                    a = _mm512_dpbusd_epi32(a, hi[r], d5);
                    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), s);
                    tot[r * nb + b] = _mm512_fmadd_ps(f, scale[r], tot[r * nb + b]);
                }
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

#define INT4_NR(nb) ((nb) <= 2 ? 4 : 2)

/* band()'s work for a matrix int4_takes(). */
INT4 static void int4_band(const Matrix *m, const Digits *xs, const float *sums, float *y,
                           int nb, Py_ssize_t lo, Py_ssize_t hi, int single) {
    Py_ssize_t chunks = int4_chunks(m);
    for (Py_ssize_t o = lo; o < hi; o += single ? 1 : INT4_NR(nb)) switch (single ? 0 : nb) {
        case 0:
            for (int b = 0; b < nb; b++)
                int4_tile(m, 1, 1, xs + b * chunks, sums + b * m->groups, y + b * m->out, o);
            break;
        case 1: int4_tile(m, INT4_NR(1), 1, xs, sums, y, o); break;
        case 2: int4_tile(m, INT4_NR(2), 2, xs, sums, y, o); break;
        case 3: int4_tile(m, INT4_NR(3), 3, xs, sums, y, o); break;
        case 4: int4_tile(m, INT4_NR(4), 4, xs, sums, y, o); break;
        case 5: int4_tile(m, INT4_NR(5), 5, xs, sums, y, o); break;
        case 6: int4_tile(m, INT4_NR(6), 6, xs, sums, y, o); break;
        case 7: int4_tile(m, INT4_NR(7), 7, xs, sums, y, o); break;
        default: int4_tile(m, INT4_NR(8), 8, xs, sums, y, o); break;
        }
}

#else
#define HAVE_INT4 0
typedef struct {
    char unused;
} Digits;
static int int4_on = 0;
static int int4_available(void) { return 0; }
static int int4_takes(const Matrix *m) { return 0; }
static inline Py_ssize_t int4_chunks(const Matrix *m) { return 0; }
static void int4_arrange(const Matrix *m, const float *x, Py_ssize_t n, Digits *xs, float *sums) {}
static void int4_band(const Matrix *m, const Digits *xs, const float *sums, float *y, int nb,
                      Py_ssize_t lo, Py_ssize_t hi, int single) {}
#endif

#endif
