/* 4-bit products for CPUs with AVX2 and FMA but not AVX-512 (packed.c's, where the CPU is
 * one; on AVX-512 CPUs packed_int.h's or the float tiles' own clone). Include after
 * packed.h and packed.c's tile().
 *
 * The float tiles' x86-64-v3 clone is the same C as the AVX-512 one, but GCC 12 builds
 * their 16-lane vectors for AVX2 on the stack (a 64-bit word broadcast to 16 lanes is eight
 * stores and four loads, then a stalled load; a shuffle of a loaded vector the same): a
 * 4864×896 4-bit product, one row, one core, 6.2 ms in a build for x86-64-v3, where
 * AVX-512 takes 0.35. Here the same arithmetic is written for AVX2's 8-lane registers: a
 * chunk's 8 bytes broadcast by one instruction, its 16 codes shifted out as the float
 * tiles' lanes hold them (x arranged as for them), scaled, multiplied and added; each
 * (weight row, row of x) dot product one sequence of operations whatever the tile, so a
 * row's result does not depend on the rows beside it, bit for bit. */
#ifndef KVCHAT_PACKED_AVX2_H
#define KVCHAT_PACKED_AVX2_H

#if defined(__x86_64__) && defined(__GNUC__)

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE AVX2 static inline __attribute__((always_inline))
#define AVX2_NR(nb) ((nb) <= 2 ? 2 : 1) /* weight rows a tile: its sums stay in registers */

/* y[b, o + r] for r < NR, b < nb: NR weight rows of 4-bit codes from o times nb rows of x
 * (arranged as for the float tiles: lane j of a chunk holds code (j & 1) · 8 + j / 2), the
 * codes scaled by their group's scale and its bias met with the group's sum of x. */
AVX2_INLINE void avx2_tile(const Matrix *m, int NR, int nb, const float *xs, const float *sx,
                           float *y, Py_ssize_t o) {
    __m256 lo[2][MB], hi[2][MB]; /* lanes 0-7 and 8-15 of each sum */
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < nb; b++) lo[r][b] = hi[r][b] = _mm256_setzero_ps();
    const __m256i low_shifts = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
    const __m256i high_shifts = _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28);
    const __m256i codes = _mm256_set1_epi32(15);
    Py_ssize_t per_group = m->group / 16;
    for (Py_ssize_t g = 0; g < m->groups; g++) {
        __m256 scale[2];
        for (int r = 0; r < NR; r++)
            scale[r] = _mm256_set1_ps(value(m->scales, m->kind, (o + r) * m->groups + g));
        ahead(m, NR, o, g * m->group / 2, m->group / 2);
        for (Py_ssize_t c = g * per_group; c < (g + 1) * per_group; c++)
            for (int r = 0; r < NR; r++) {
                int64_t word;
                memcpy(&word, m->w + (o + r) * m->row_bytes + 8 * c, 8);
                __m256i v = _mm256_set1_epi64x(word);
                __m256 ql = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, low_shifts), codes));
                __m256 qh = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, high_shifts), codes));
                ql = _mm256_mul_ps(ql, scale[r]);
                qh = _mm256_mul_ps(qh, scale[r]);
                for (int b = 0; b < nb; b++) {
                    const float *x = xs + b * m->in + 16 * c;
                    lo[r][b] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(x), lo[r][b]);
                    hi[r][b] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(x + 8), hi[r][b]);
                }
            }
    }
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < nb; b++) {
            __m256 sum = _mm256_add_ps(lo[r][b], hi[r][b]);
            __m128 four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            four = _mm_add_ps(four, _mm_movehl_ps(four, four));
            float s = _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
            for (Py_ssize_t g = 0; g < m->groups; g++)
                s += value(m->biases, m->kind, (o + r) * m->groups + g) * sx[b * m->groups + g];
            y[b * m->out + o + r] = s;
        }
}

#define AVX2_TILE(m, form, NR, nb, xs, sx, y, o) avx2_tile(m, NR, nb, xs, sx, y, o)

/* band() for 4-bit codes on an AVX2 CPU. */
AVX2 static void avx2_band(const Matrix *m, const float *xs, const float *sx, float *y, int nb,
                           Py_ssize_t lo, Py_ssize_t hi, int single) {
    for (Py_ssize_t o = lo; o < hi; o += single ? 1 : AVX2_NR(nb))
        if (single)
            for (int b = 0; b < nb; b++)
                avx2_tile(m, 1, 1, xs + b * m->in, sx + b * m->groups, y + b * m->out, o);
        else
            TILES_BY_NB(nb, AVX2_TILE, AVX2_NR, m, 4, xs, sx, y, o)
}

/* avx2_band runs 4-bit products: where the CPU has AVX2 and FMA but not AVX-512 (set when
 * the module loads); avx2() switches it where the CPU has AVX2, to test it on others. */
static int avx2_has, avx2_used;

static void avx2_check(void) {
    avx2_has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    avx2_used = avx2_has && !__builtin_cpu_supports("avx512f");
}

#else
static const int avx2_has = 0;
static int avx2_used = 0;
static void avx2_check(void) {}
static void avx2_band(const Matrix *m, const float *xs, const float *sx, float *y, int nb,
                      Py_ssize_t lo, Py_ssize_t hi, int single) {}
#endif

#endif
