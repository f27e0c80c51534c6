/* AVX2 + FMA kernels (no VNNI): one output row at a time.
 *
 * I8 family: 32 weight bytes per step.  Q4 low/high nibbles (unsigned, q+8) meet a
 * permuted copy of the int8 activations through vpmaddubsw (pairs stay far below the
 * int16 limit: 2*15*127), Q8 uses the sign trick maddubs(|w|, sign(x, w))
 * (2*128*127 < 32767).  Group sums are exact int32; the float step per group is the
 * reference's, so results are bit-identical to ref.c.  Fast group sizes: per row,
 * multiples of 64, and 32 (each 128-bit half of a block is one group).
 * F32 family: bytes widened to 8 x i32, converted and FMA'd against x.
 */
#pragma GCC target("avx2,fma,bmi,bmi2")

#include "internal.h"

#include <immintrin.h>
#include <limits.h>
#include <string.h>

/* Q4 I8 layout: per 64 elements, the 32 even then the 32 odd ones. */
static int prep_i8(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out) {
    if (w->fmt != COLIBRI_FMT_Q4) return 0;
    for (size_t b = 0; b < n; b += 64)
        for (int k = 0; k < 32; k++) {
            out[b + k] = qx[b + 2 * k];
            out[b + 32 + k] = qx[b + 2 * k + 1];
        }
    return 1;
}

/* F32 layout: Q4 gets, per 16 elements, the 8 even then the 8 odd ones. */
static int prep_f32(const colibri_weight *w, const float *x, int I, size_t n, float *out) {
    memset(out + I, 0, (n - (size_t)I) * sizeof(float));
    if (w->fmt != COLIBRI_FMT_Q4) {
        memcpy(out, x, (size_t)I * sizeof(float));
        return 1;
    }
    memset(out, 0, (size_t)I * sizeof(float));
    for (int i = 0; i < I; i++) out[(i & ~15) + ((i & 15) >> 1) + ((i & 1) << 3)] = x[i];
    return 1;
}

/* 32 bytes at p, zero-filled past `avail` (weights are never over-read). */
static inline __m256i load32(const uint8_t *p, size_t avail) {
    if (avail >= 32) return _mm256_loadu_si256((const __m256i *)p);
    uint8_t tmp[32] = {0};
    memcpy(tmp, p, avail);
    return _mm256_loadu_si256((const __m256i *)tmp);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static float i8_q4_one(const mm_job *j, const uint8_t *row, int o, int s) {
    const int8_t *x = j->qxp + (size_t)s * j->ldx;
    const int32_t *gsum = j->gsum + (size_t)s * j->G;
    const float *sc = j->w->scales + (size_t)o * j->G;
    const float xs = j->xs[s];
    const size_t nbytes = j->wrow;
    const int nblk = (int)((nbytes + 31) / 32);
    const int cpg = j->G == 1 || j->gsz < 64 ? INT_MAX : j->gsz / 64;
    const __m256i m0f = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i gacc = _mm256_setzero_si256();
    float acc = 0.0f;
    for (int b = 0, g = 0, cnt = 0; b < nblk; b++) {
        const __m256i w = load32(row + 32 * (size_t)b, nbytes - 32 * (size_t)b);
        const __m256i lo = _mm256_and_si256(w, m0f);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m0f);
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(x + 64 * (size_t)b));
        const __m256i xo = _mm256_loadu_si256((const __m256i *)(x + 64 * (size_t)b + 32));
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        const __m256i d = _mm256_madd_epi16(p, ones);
        if (j->gsz == 32 && j->G > 1) { /* two groups per block: one per 128-bit half */
            const __m128i h[2] = {_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1)};
            for (int k = 0; k < 2 && g < j->G; k++, g++) {
                __m128i t = _mm_add_epi32(h[k], _mm_shuffle_epi32(h[k], _MM_SHUFFLE(1, 0, 3, 2)));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
                const int32_t isum = _mm_cvtsi128_si32(t) - 8 * gsum[g];
                acc = acc + (float)isum * (sc[g] * xs);
            }
            continue;
        }
        gacc = _mm256_add_epi32(gacc, d);
        if (++cnt == cpg || b == nblk - 1) {
            const int32_t isum = hsum8_epi32(gacc) - 8 * gsum[g];
            acc = acc + (float)isum * (sc[g] * xs);
            gacc = _mm256_setzero_si256();
            cnt = 0;
            g++;
        }
    }
    return acc;
}

static float i8_q8_one(const mm_job *j, const uint8_t *row, int o, int s) {
    const int8_t *x = j->qx + (size_t)s * j->ldx;
    const size_t nbytes = j->wrow;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (size_t b = 0; b < nbytes; b += 32) {
        const __m256i w = load32(row + b, nbytes - b);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
        if ((b & 32) == 0) a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(p, ones));
        else a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(p, ones));
    }
    const int32_t isum = hsum8_epi32(_mm256_add_epi32(a0, a1));
    float acc = 0.0f;
    acc = acc + (float)isum * (j->w->scales[o] * j->xs[s]);
    return acc;
}

static void i8_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q4 = w->fmt == COLIBRI_FMT_Q4;
    if (!(w->fmt == COLIBRI_FMT_Q8 || (q4 && (j->G == 1 || j->gsz % 64 == 0 || j->gsz == 32)))) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        for (int s = 0; s < j->S; s++)
            j->y[(size_t)s * w->O + o] = q4 ? i8_q4_one(j, row, o, s) : i8_q8_one(j, row, o, s);
    }
}

/* ------------------------------------------------------------ F32 family ---- */

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* n (<= 16) bytes at p as a 128-bit vector, zero-filled past n. */
static inline __m128i load16(const void *p, size_t n) {
    if (n >= 16) return _mm_loadu_si128((const __m128i *)p);
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, n);
    return _mm_loadu_si128((const __m128i *)tmp);
}

static float f32_q4_one(const mm_job *j, const uint8_t *row, const float *sc, const float *x) {
    const __m256i m0f = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    const size_t nbytes = j->wrow;
    for (int g = 0; g < j->G; g++) {
        const __m256 s = _mm256_set1_ps(sc[g]);
        const size_t b0 = (size_t)g * j->gsz / 2;
        const size_t b1 = g + 1 == j->G ? nbytes : (size_t)(g + 1) * j->gsz / 2;
        for (size_t b = b0; b < b1; b += 8) {
            const size_t n = b1 - b < 8 ? b1 - b : 8;
            const __m256i v = _mm256_cvtepu8_epi32(n == 8 ? _mm_loadl_epi64((const __m128i *)(row + b))
                                                           : load16(row + b, n));
            const __m256 wl = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, m0f), eight)), s);
            const __m256 wh = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight)), s);
            a0 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x + 2 * b), a0);
            a1 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + 2 * b + 8), a1);
        }
    }
    return hsum_ps(_mm256_add_ps(a0, a1));
}

#define DOT2(LOADW, STEPB)                                                          \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                       \
    int i = 0;                                                                      \
    for (; i + 16 <= I; i += 16) {                                                  \
        a0 = _mm256_fmadd_ps(LOADW(i, 8), _mm256_loadu_ps(x + i), a0);              \
        a1 = _mm256_fmadd_ps(LOADW(i + 8, 8), _mm256_loadu_ps(x + i + 8), a1);      \
    }                                                                               \
    for (; i < I; i += 8)                                                           \
        a0 = _mm256_fmadd_ps(LOADW(i, (size_t)(I - i < 8 ? I - i : 8)), _mm256_loadu_ps(x + i), a0); \
    return hsum_ps(_mm256_add_ps(a0, a1))

#define LD_Q8(k, n)                                                                  \
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((n) == 8 ? _mm_loadl_epi64((const __m128i *)(row + (k))) \
                                                     : load16(row + (k), (n))))
#define LD_BF16(k, n) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(row + (k), 2 * (n))), 16))
#define LD_F32(k, n) _mm256_castsi256_ps(_mm256_setr_m128i(load16(row + (k), 4 * ((n) < 4 ? (n) : 4)), \
                                          load16(row + (k) + 4, 4 * ((n) > 4 ? (n) - 4 : 0))))

static float f32_q8_one(const int8_t *row, int I, const float *x) { DOT2(LD_Q8, 1); }
static float f32_bf16_one(const uint16_t *row, int I, const float *x) { DOT2(LD_BF16, 2); }
static float f32_f32_one(const float *row, int I, const float *x) { DOT2(LD_F32, 4); }

static void f32_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (j->xp == NULL || (w->fmt == COLIBRI_FMT_Q4 && j->G > 1 && j->gsz % 16 != 0)) {
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        for (int s = 0; s < j->S; s++) {
            const float *x = j->xp + (size_t)s * j->ldx;
            float r;
            switch (w->fmt) {
            case COLIBRI_FMT_F32: r = f32_f32_one((const float *)row, w->I, x); break;
            case COLIBRI_FMT_BF16: r = f32_bf16_one((const uint16_t *)row, w->I, x); break;
            case COLIBRI_FMT_Q8: r = w->scales[o] * f32_q8_one((const int8_t *)row, w->I, x); break;
            default: r = f32_q4_one(j, row, w->scales + (size_t)o * j->G, x); break;
            }
            j->y[(size_t)s * w->O + o] = r;
        }
    }
}

const isa_ops colibri_avx2_ops = {"avx2", f32_rows, i8_rows, prep_f32, prep_i8, 8};
