/* AVX2 lane helpers shared by the kernel files built with -mavx2 (avx2.c, affine_avx2.c):
 * one definition, so the float reductions both files rely on stay the same bits. */
#ifndef COLIBRI_AVX2_LANES_H
#define COLIBRI_AVX2_LANES_H

#include <immintrin.h>

/* In-register 8x8 transpose: out[k] lane r = in[r] lane k. */
static inline __attribute__((always_inline)) void transpose8(const __m256 in[8], __m256 out[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
            u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
    for (int k = 0; k < 4; k++) {
        out[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        out[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

/* Lanes 0..n-1 set (a mask for the last, partial step). */
static inline __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The eight lanes' sum, in the order every AVX2 F32 kernel reduces them. */
static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
