/* Products for CPUs with AVX2, FMA and F16C but not AVX-512 (packed.c's, where the CPU is
 * one; on AVX-512 CPUs packed_int.h's or the float tiles' own clone). Include after
 * packed.h and packed.c's tile().
 *
 * The float tiles' x86-64-v3 clone is the same C as the AVX-512 one, but GCC 12 builds
 * their 16-lane vectors for AVX2 on the stack (a 64-bit word broadcast to 16 lanes is eight
 * stores and four loads, then a stalled load; a shuffle of a loaded vector the same). In a
 * build for x86-64-v3, a 4864×896 product, one row, one core, took 4.4 / 2.0 / 6.2 / 2.0 /
 * 2.0 / 3.1 ms for 2 / 3 / 4 / 5 / 6 / 8-bit codes and 0.61 / 4.6 for bfloat16 / float16,
 * here 0.33 / 0.72 / 0.34 / 0.72 / 0.72 / 0.36 and 0.27 / 0.28 (AVX-512: 0.34 / 1.03 /
 * 0.39 / 1.03 / 1.03 / 0.45 and 0.19 / 0.23; docs/benchmarks.md). Here the same
 * arithmetic is written for AVX2's 8-lane registers: each of the tiles' 16-lane vectors of
 * a chunk (packed.h's chunk(): the same lanes, so x is arranged as for them) is two of
 * AVX2's, its codes shifted out, scaled, multiplied and added; each (weight row, row of x)
 * dot product one sequence of operations whatever the tile, so a row's result does not
 * depend on the rows beside it, bit for bit. */
#ifndef KVCHAT_PACKED_AVX2_H
#define KVCHAT_PACKED_AVX2_H

#if defined(__x86_64__) && defined(__GNUC__)

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2 static inline __attribute__((always_inline))
#define AVX2_NR(nb) ((nb) <= 2 ? 2 : 1) /* weight rows a tile: its sums stay in registers */

/* Eight codes of `bits` (3, 5 or 6) from the low bits of `word`, as floats. */
AVX2_INLINE __m256 avx2_odd(uint64_t word, __m256i low, __m256i high, __m256i codes) {
    __m256i v = _mm256_set1_epi64x((int64_t)word);
    /* the codes in the low halves of 0 … 3 and 4 … 7's 64-bit lanes; picked in the order
     * 0, 1, 4, 5, 2, 3, 6, 7, then their pairs put right */
    __m256 pairs = _mm256_shuffle_ps(_mm256_castsi256_ps(_mm256_srlv_epi64(v, low)),
                                     _mm256_castsi256_ps(_mm256_srlv_epi64(v, high)), 0x88);
    __m256i ordered = _mm256_permute4x64_epi64(_mm256_castps_si256(pairs), 0xd8);
    return _mm256_cvtepi32_ps(_mm256_and_si256(ordered, codes));
}

/* Eight float16 values, the low (`odd` 0) or high halves of the 32-bit lanes of v. */
AVX2_INLINE __m256 avx2_f16(__m256i v, int odd) {
    const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m256i sorted = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, halves), 0xd8);
    return _mm256_cvtph_ps(odd ? _mm256_extracti128_si256(sorted, 1)
                               : _mm256_castsi256_si128(sorted));
}

/* Chunk c of a row of `room` bytes as packed.h's chunk() widens it, q[2s] and q[2s + 1]
 * the lanes 0-7 and 8-15 of its vector s. */
AVX2_INLINE void avx2_chunk(const uint8_t *row, Py_ssize_t room, Py_ssize_t c, int fmt, int bits,
                            __m256 *q) {
    if (fmt >= HALF_F16) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(row + 64 * c));
        __m256i b = _mm256_loadu_si256((const __m256i *)(row + 64 * c + 32));
        if (fmt == HALF_BF16) {
            const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
            q[0] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
            q[1] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
            q[2] = _mm256_castsi256_ps(_mm256_and_si256(a, top));
            q[3] = _mm256_castsi256_ps(_mm256_and_si256(b, top));
        } else {
            q[0] = avx2_f16(a, 0);
            q[1] = avx2_f16(b, 0);
            q[2] = avx2_f16(a, 1);
            q[3] = avx2_f16(b, 1);
        }
    } else if (32 % fmt == 0) {
        const uint8_t *p = row + CODES(fmt) * fmt / 8 * c;
        int64_t w0, w1;
        memcpy(&w0, p, 8);
        const __m256i codes = _mm256_set1_epi32((1 << fmt) - 1);
        if (fmt == 8) { /* lanes 8 … 15: the next word */
            memcpy(&w1, p + 8, 8);
            const __m256i shifts = _mm256_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24);
            __m256i v0 = _mm256_srlv_epi32(_mm256_set1_epi64x(w0), shifts);
            __m256i v1 = _mm256_srlv_epi32(_mm256_set1_epi64x(w1), shifts);
            q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, codes));
            q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, codes));
        } else {
            const __m256i step = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            __m256i v = _mm256_set1_epi64x(w0);
            for (int h = 0; h < 2 * VECS(fmt); h++) { /* lanes 0-7, 8-15 of each vector */
                __m256i shifts = _mm256_add_epi32(_mm256_mullo_epi32(step, _mm256_set1_epi32(fmt)),
                                                  _mm256_set1_epi32(4 * fmt * h));
                q[h] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shifts), codes));
            }
        }
    } else {
        uint64_t w0, w1;
        odd_words(row, room, c, bits, &w0, &w1);
        const __m256i low = _mm256_setr_epi64x(0, bits, 2 * bits, 3 * bits);
        const __m256i high = _mm256_add_epi64(low, _mm256_set1_epi64x(4 * bits));
        const __m256i codes = _mm256_set1_epi32((1 << bits) - 1);
        q[0] = avx2_odd(w0, low, high, codes);
        q[1] = avx2_odd(w1, low, high, codes);
    }
}

/* y[b, o + r] for r < NR, b < nb: NR weight rows from o times nb rows of x (arranged as for
 * the float tiles; group sums in sx, which the biases multiply), as tile() computes it. */
AVX2_INLINE void avx2_tile(const Matrix *m, int fmt, int NR, int nb, const float *xs,
                           const float *sx, float *y, Py_ssize_t o) {
    __m256 lo[2][MB], hi[2][MB]; /* lanes 0-7 and 8-15 of each sum */
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < nb; b++) lo[r][b] = hi[r][b] = _mm256_setzero_ps();
    int half = fmt >= HALF_F16;
    Py_ssize_t chunks = m->in / CODES(fmt), per_group = half ? chunks : m->group / CODES(fmt);
    Py_ssize_t chunk_bytes = CODES(fmt) * (half ? 16 : m->bits) / 8;
    for (Py_ssize_t g = 0; g < (half ? 1 : m->groups); g++) {
        __m256 scale[2];
        if (!half) {
            for (int r = 0; r < NR; r++)
                scale[r] = _mm256_set1_ps(value(m->scales, m->kind, (o + r) * m->groups + g));
            ahead(m, NR, o, g * per_group * chunk_bytes, per_group * chunk_bytes);
        }
        for (Py_ssize_t c = g * per_group; c < (g + 1) * per_group; c++) {
            if (half) ahead(m, NR, o, c * chunk_bytes, chunk_bytes);
            for (int r = 0; r < NR; r++) {
                __m256 q[4];
                avx2_chunk(m->w + (o + r) * m->row_bytes, m->row_bytes, c, fmt, m->bits, q);
                for (int s = 0; s < VECS(fmt); s++) {
                    __m256 ql = q[2 * s], qh = q[2 * s + 1];
                    if (!half) {
                        ql = _mm256_mul_ps(ql, scale[r]);
                        qh = _mm256_mul_ps(qh, scale[r]);
                    }
                    for (int b = 0; b < nb; b++) {
                        const float *x = xs + b * m->in + c * CODES(fmt) + s * WL;
                        lo[r][b] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(x), lo[r][b]);
                        hi[r][b] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(x + 8), hi[r][b]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < NR; r++) {
        const uint8_t *row = m->w + (o + r) * m->row_bytes;
        for (int b = 0; b < nb; b++) {
            __m256 sum = _mm256_add_ps(lo[r][b], hi[r][b]);
            __m128 four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            four = _mm_add_ps(four, _mm_movehl_ps(four, four));
            float s = _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
            if (half) /* the values after the last whole chunk */
                for (Py_ssize_t j = chunks * CODES(fmt); j < m->in; j++)
                    s += scalar16(((const uint16_t *)row)[j], fmt) * xs[b * m->in + j];
            else
                for (Py_ssize_t g = 0; g < m->groups; g++)
                    s += value(m->biases, m->kind, (o + r) * m->groups + g) * sx[b * m->groups + g];
            y[b * m->out + o + r] = s;
        }
    }
}

#define AVX2_TILE(m, fmt, NR, nb, xs, sx, y, o) avx2_tile(m, fmt, NR, nb, xs, sx, y, o)
#define AVX2_BAND(fmt)                                                                     \
    for (Py_ssize_t o = lo; o < hi; o += single ? 1 : AVX2_NR(nb))                         \
        if (single)                                                                        \
            for (int b = 0; b < nb; b++)                                                   \
                avx2_tile(m, fmt, 1, 1, xs + b * m->in, sx + b * m->groups, y + b * m->out, o); \
        else                                                                               \
            TILES_BY_NB(nb, AVX2_TILE, AVX2_NR, m, fmt, xs, sx, y, o)

/* band() on an AVX2 CPU. */
AVX2 static void avx2_band(const Matrix *m, const float *xs, const float *sx, float *y, int nb,
                           Py_ssize_t lo, Py_ssize_t hi, int single) {
    switch (m->fmt) {
    case 2: AVX2_BAND(2) break;
    case ODD: AVX2_BAND(ODD) break;
    case 4: AVX2_BAND(4) break;
    case 8: AVX2_BAND(8) break;
    case HALF_F16: AVX2_BAND(HALF_F16) break;
    default: AVX2_BAND(HALF_BF16) break;
    }
}

/* widen_row() on an AVX2 CPU: weight row `id` in `out`, eight values at a time in the row's
 * order (its v3 clone, 16-lane vectors on the stack: 4864×896 widened whole, one core, 7.6 to
 * 22 ms where AVX-512 takes 0.7 to 1.4). */
AVX2 static void avx2_widen_row(const Matrix *m, Py_ssize_t id, float *out) {
    const uint8_t *row = m->w + id * m->row_bytes;
    Py_ssize_t k = 0;
    if (m->fmt >= HALF_F16) {
        for (; k + 8 <= m->in; k += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * k));
            _mm256_storeu_ps(out + k, m->fmt == HALF_BF16
                                          ? _mm256_castsi256_ps(
                                                _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                          : _mm256_cvtph_ps(h));
        }
        for (; k < m->in; k++) out[k] = scalar16(((const uint16_t *)row)[k], m->fmt);
        return;
    }
    int bits = m->bits;
    const __m256i codes = _mm256_set1_epi32((1 << bits) - 1);
    const __m256i shifts =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    const __m256i low = _mm256_setr_epi64x(0, bits, 2 * bits, 3 * bits);
    const __m256i high = _mm256_add_epi64(low, _mm256_set1_epi64x(4 * bits));
    for (; k < m->in; k += 8) { /* eight codes: `bits` bytes (in is a multiple of the group) */
        const uint8_t *p = row + k / 8 * bits;
        __m256 q;
        if (bits == 8) {
            q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        } else if (bits == 4 || bits == 2) { /* (sizes the compiler knows: one load) */
            uint32_t word = 0;
            if (bits == 4)
                memcpy(&word, p, 4);
            else
                memcpy(&word, p, 2);
            __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts);
            q = _mm256_cvtepi32_ps(_mm256_and_si256(v, codes));
        } else {
            uint64_t word = 0;
            if (p + 8 <= row + m->row_bytes)
                memcpy(&word, p, 8);
            else
                memcpy(&word, p, bits);
            q = avx2_odd(word, low, high, codes);
        }
        Py_ssize_t g = id * m->groups + k / m->group;
        q = _mm256_fmadd_ps(q, _mm256_set1_ps(value(m->scales, m->kind, g)),
                            _mm256_set1_ps(value(m->biases, m->kind, g)));
        _mm256_storeu_ps(out + k, q);
    }
}

/* avx2_band runs the float tiles' products and avx2_widen_row widens rows where the CPU has
 * AVX2, FMA and F16C but not AVX-512 (set when the module loads); avx2() switches them where
 * the CPU has those, to test them on others. */
static int avx2_has, avx2_used;

static void avx2_check(void) {
    avx2_has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("f16c");
    avx2_used = avx2_has && !__builtin_cpu_supports("avx512f");
}

#else
static const int avx2_has = 0;
static int avx2_used = 0;
static void avx2_check(void) {}
static void avx2_band(const Matrix *m, const float *xs, const float *sx, float *y, int nb,
                      Py_ssize_t lo, Py_ssize_t hi, int single) {}
static void avx2_widen_row(const Matrix *m, Py_ssize_t id, float *out) {}
#endif

#endif
