/* AVX-512 (F/BW/VL) + VNNI kernels.
 *
 * I8 family: 16 output rows per tile, one 64-byte weight block per row at a time.
 * Weights stay unsigned for vpdpbusd: Q4 nibbles are q+8 already, Q8 bytes are
 * flipped to q+128; the offset is removed exactly per group with the precomputed
 * activation group sums (isum = dot(q+k, x) - k * sum(x)).  The 16 per-row int32
 * vectors are transpose-reduced so each 128-bit chunk (32 Q4 / 16 Q8 elements) yields
 * one vector holding that chunk's sum for the 16 rows; chunks are added into group
 * sums and every group ends with the reference float step, lane = output row:
 *     acc = acc + (float)isum * (wscale * xs)
 * which is bit-identical to ref.c.  Other group sizes fall back to the reference.
 *
 * F32 family: nibbles/bytes are widened to 32-bit lanes and turned into f32 through a
 * 16-entry table (vpermps) scaled per group, then FMA against a permuted copy of x.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,avx2,bmi,bmi2")

#include "internal.h"

#include <immintrin.h>
#include <limits.h>
#include <string.h>

/* ------------------------------------------------------------------ prep ---- */

/* Q4 I8 layout: per 128-element block, the 64 even elements then the 64 odd ones, so
 * low nibbles of a 64-byte weight block meet bytes 0..63 and high nibbles 64..127. */
static int prep_i8(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out) {
    if (w->fmt != COLIBRI_FMT_Q4) return 0;
    for (size_t b = 0; b < n; b += 128)
        for (int k = 0; k < 64; k++) {
            out[b + k] = qx[b + 2 * k];
            out[b + 64 + k] = qx[b + 2 * k + 1];
        }
    return 1;
}

/* F32 layout: Q4 gets, per 32 elements, the 16 even then the 16 odd ones (matching a
 * 16-byte weight chunk widened to 16 lanes); other formats a zero-padded copy. */
static int prep_f32(const colibri_weight *w, const float *x, int I, size_t n, float *out) {
    memset(out + I, 0, (n - (size_t)I) * sizeof(float));
    if (w->fmt != COLIBRI_FMT_Q4) {
        memcpy(out, x, (size_t)I * sizeof(float));
        return 1;
    }
    memset(out, 0, (size_t)I * sizeof(float));
    for (int i = 0; i < I; i++) out[(i & ~31) + ((i & 31) >> 1) + ((i & 1) << 4)] = x[i];
    return 1;
}

/* ------------------------------------------------------------- I8 family ---- */


static inline __m512i dot_q4(const uint8_t *p, __mmask64 m, __m512i xe, __m512i xo) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i w = _mm512_maskz_loadu_epi8(m, p);
    const __m512i lo = _mm512_and_si512(w, m0f);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m0f);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
}

static inline __m512i dot_q8(const uint8_t *p, __mmask64 m, __m512i x) {
    const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, p), _mm512_set1_epi8((char)0x80));
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
}

/* v[r]: 16 int32 partial sums of row r.  out[c] lane r = sum of 128-bit chunk c of v[r]. */
static inline void reduce16(const __m512i v[16], __m512i out[4]) {
    __m512i a[8], b[4];
    for (int k = 0; k < 8; k++)
        a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                                _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        b[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
                                _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
    const __m512i t0 = _mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i t1 = _mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i t2 = _mm512_shuffle_i32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i t3 = _mm512_shuffle_i32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1));
    out[0] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
    out[1] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
    out[2] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
    out[3] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

/* Largest group count handled on the fast path (stack buffers); more falls back. */
#define MAX_GROUPS 4096

static inline __mmask64 tail_mask64(size_t rem) {
    return rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
}

/* Unsigned group sums dot(q+8, x) of one Q4 row: isum[g] for g < G (isum has room for
 * G + 32 entries).  16 blocks are reduced at once; gs 64 interleaves the two groups
 * of each block in vector registers, other multiples of 32 go through chunk sums. */
static void q4_group_sums(const mm_job *j, const uint8_t *row, const int8_t *x, int32_t *isum) {
    const size_t nbytes = j->wrow;
    const int nblocks = (int)((nbytes + 63) / 64);
    const int I = j->w->I, gsz = j->gsz;
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    if (gsz != 64) memset(isum, 0, (size_t)j->G * sizeof(int32_t));
    for (int b0 = 0; b0 < nblocks; b0 += 16) {
        const int n = nblocks - b0 < 16 ? nblocks - b0 : 16;
        __m512i v[16], c4[4];
        for (int k = 0; k < 16; k++) {
            if (k >= n) {
                v[k] = _mm512_setzero_si512();
                continue;
            }
            const size_t off = (size_t)(b0 + k) * 64;
            _mm_prefetch((const char *)row + off + 1024, _MM_HINT_T0);
            v[k] = dot_q4(row + off, tail_mask64(nbytes - off), _mm512_loadu_si512(x + 2 * off),
                          _mm512_loadu_si512(x + 2 * off + 64));
        }
        reduce16(v, c4); /* c4[c] lane k: chunk c (32 elements) of block b0 + k */
        if (gsz == 64) {
            const __m512i ga = _mm512_add_epi32(c4[0], c4[1]), gb = _mm512_add_epi32(c4[2], c4[3]);
            _mm512_storeu_si512(isum + 2 * b0, _mm512_permutex2var_epi32(ga, lo_idx, gb));
            _mm512_storeu_si512(isum + 2 * b0 + 16, _mm512_permutex2var_epi32(ga, hi_idx, gb));
        } else {
            int32_t cs[4][16];
            for (int c = 0; c < 4; c++) _mm512_storeu_si512(cs[c], c4[c]);
            for (int k = 0; k < n; k++)
                for (int c = 0; c < 4; c++) {
                    const int e = ((b0 + k) * 4 + c) * 32; /* first element of the chunk */
                    if (e < I) isum[e / gsz] += cs[c][k];
                }
        }
    }
}

/* Whole-row unsigned dot for per-row formats: dot(q+k, x), k = 8 (Q4) or 128 (Q8). */
static int32_t row_sum(const mm_job *j, const uint8_t *row, const int8_t *x, int q4) {
    const size_t nbytes = j->wrow;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    for (size_t off = 0; off < nbytes; off += 64) {
        const __mmask64 m = tail_mask64(nbytes - off);
        _mm_prefetch((const char *)row + off + 1024, _MM_HINT_T0);
        if (q4) a0 = _mm512_add_epi32(a0, dot_q4(row + off, m, _mm512_loadu_si512(x + 2 * off),
                                                 _mm512_loadu_si512(x + 2 * off + 64)));
        else if (off & 64) a1 = _mm512_add_epi32(a1, dot_q8(row + off, m, _mm512_loadu_si512(x + off)));
        else a0 = _mm512_add_epi32(a0, dot_q8(row + off, m, _mm512_loadu_si512(x + off)));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
}

/* The reference float step over all groups of one output, in group order:
 * p[g] = (float)(isum[g] - corr * gsum[g]) * (ws[g] * xs) vectorised (lane-wise the
 * same operations), then acc = acc + p[g] sequentially from 0.0f. */
static float group_step(const int32_t *isum, const int32_t *gsum, const float *ws, int G, int corr,
                        float xs_s) {
    float p[MAX_GROUPS + 16];
    const __m512 xs = _mm512_set1_ps(xs_s);
    const __m512i k = _mm512_set1_epi32(corr);
    for (int g = 0; g < G; g += 16) {
        const __mmask16 m = (__mmask16)(G - g >= 16 ? 0xffff : (1u << (G - g)) - 1);
        const __m512i iv = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(m, isum + g),
                                            _mm512_mullo_epi32(k, _mm512_maskz_loadu_epi32(m, gsum + g)));
        const __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ws + g), xs);
        _mm512_storeu_ps(p + g, _mm512_mul_ps(_mm512_cvtepi32_ps(iv), t));
    }
    float acc = 0.0f;
    for (int g = 0; g < G; g++) acc = acc + p[g];
    return acc;
}

static void i8_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q4 = w->fmt == COLIBRI_FMT_Q4;
    if (!(w->fmt == COLIBRI_FMT_Q8 || (q4 && (j->G == 1 || (j->gsz % 32 == 0 && j->G <= MAX_GROUPS))))) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    int32_t isum[MAX_GROUPS + 32];
    const int corr = q4 ? 8 : 128;
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        const float *ws = w->scales + (size_t)o * j->G;
        for (int s = 0; s < j->S; s++) {
            const int8_t *x = (q4 ? j->qxp : j->qx) + (size_t)s * j->ldx;
            const int32_t *gsum = j->gsum + (size_t)s * j->G;
            if (j->G == 1) isum[0] = row_sum(j, row, x, q4);
            else q4_group_sums(j, row, x, isum);
            j->y[(size_t)s * w->O + o] = group_step(isum, gsum, ws, j->G, corr, j->xs[s]);
        }
    }
}

/* ------------------------------------------------------------ F32 family ---- */

static inline float hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
}

static inline __mmask16 mask16(size_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

static float dot_q4_f32(const mm_job *j, const uint8_t *row, const float *sc, const float *x) {
    const __m512 tab = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const size_t nbytes = j->wrow;
    int g = 0;
    if (j->gsz == 64) { /* the main case: one 32-byte step per group, no inner loop */
        for (; (size_t)(g + 1) * 32 <= nbytes; g++) {
            const __m512 ts = _mm512_mul_ps(tab, _mm512_set1_ps(sc[g]));
            const uint8_t *p = row + (size_t)g * 32;
            const float *xg = x + (size_t)g * 64;
            _mm_prefetch((const char *)p + 512, _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
            a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, ts), _mm512_loadu_ps(xg), a0);
            a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts),
                                 _mm512_loadu_ps(xg + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_permutexvar_ps(u, ts), _mm512_loadu_ps(xg + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), ts),
                                 _mm512_loadu_ps(xg + 48), a3);
        }
    }
    for (; g < j->G; g++) {
        const __m512 ts = _mm512_mul_ps(tab, _mm512_set1_ps(sc[g]));
        const size_t b0 = (size_t)g * j->gsz / 2;
        const size_t b1 = g + 1 == j->G ? nbytes : (size_t)(g + 1) * j->gsz / 2;
        size_t b = b0;
        for (; b + 32 <= b1; b += 32) { /* full 32-byte steps: unmasked loads */
            _mm_prefetch((const char *)row + b + 512, _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b)));
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b + 16)));
            a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, ts), _mm512_loadu_ps(x + 2 * b), a0);
            a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts),
                                 _mm512_loadu_ps(x + 2 * b + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_permutexvar_ps(u, ts), _mm512_loadu_ps(x + 2 * b + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), ts),
                                 _mm512_loadu_ps(x + 2 * b + 48), a3);
        }
        for (; b < b1; b += 16) { /* tail of the group/row: masked 16-byte steps */
            const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask16(b1 - b), row + b));
            a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, ts), _mm512_loadu_ps(x + 2 * b), a0);
            a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts),
                                 _mm512_loadu_ps(x + 2 * b + 16), a1);
        }
    }
    return hsum4(a0, a1, a2, a3);
}

/* Four independent FMA chains (64 elements per step) hide the FMA latency; only the
 * tail uses masked loads (full steps keep the load folded into the widening op). */
#define DOT4(LOADW)                                                                     \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
    int i = 0;                                                                          \
    for (; i + 64 <= I; i += 64) {                                                      \
        _mm_prefetch((const char *)(row + i) + 1024, _MM_HINT_T0);                      \
        a0 = _mm512_fmadd_ps(LOADW##_FULL(i), _mm512_loadu_ps(x + i), a0);              \
        a1 = _mm512_fmadd_ps(LOADW##_FULL(i + 16), _mm512_loadu_ps(x + i + 16), a1);    \
        a2 = _mm512_fmadd_ps(LOADW##_FULL(i + 32), _mm512_loadu_ps(x + i + 32), a2);    \
        a3 = _mm512_fmadd_ps(LOADW##_FULL(i + 48), _mm512_loadu_ps(x + i + 48), a3);    \
    }                                                                                   \
    for (; i < I; i += 16)                                                              \
        a0 = _mm512_fmadd_ps(LOADW(i, mask16((size_t)(I - i))), _mm512_loadu_ps(x + i), a0); \
    return hsum4(a0, a1, a2, a3)

#define LOAD_Q8(k, m) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((m), row + (k))))
#define LOAD_Q8_FULL(k) \
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + (k)))))
#define LOAD_BF16(k, m) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((m), row + (k))), 16))
#define LOAD_BF16_FULL(k)                                                                  \
    _mm512_castsi512_ps(_mm512_slli_epi32(                                                 \
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + (k)))), 16))
#define LOAD_F32(k, m) _mm512_maskz_loadu_ps((m), row + (k))
#define LOAD_F32_FULL(k) _mm512_loadu_ps(row + (k))

static float dot_q8_f32(const int8_t *row, int I, const float *x) { DOT4(LOAD_Q8); }
static float dot_bf16_f32(const uint16_t *row, int I, const float *x) { DOT4(LOAD_BF16); }
static float dot_f32_f32(const float *row, int I, const float *x) { DOT4(LOAD_F32); }

static void f32_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (j->xp == NULL || (w->fmt == COLIBRI_FMT_Q4 && j->G > 1 && j->gsz % 32 != 0)) {
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        for (int s = 0; s < j->S; s++) {
            const float *x = j->xp + (size_t)s * j->ldx;
            float r;
            switch (w->fmt) {
            case COLIBRI_FMT_F32: r = dot_f32_f32((const float *)row, w->I, x); break;
            case COLIBRI_FMT_BF16: r = dot_bf16_f32((const uint16_t *)row, w->I, x); break;
            case COLIBRI_FMT_Q8: r = w->scales[o] * dot_q8_f32((const int8_t *)row, w->I, x); break;
            default: r = dot_q4_f32(j, row, w->scales + (size_t)o * j->G, x); break;
            }
            j->y[(size_t)s * w->O + o] = r;
        }
    }
}

const isa_ops colibri_avx512_ops = {"avx512vnni", f32_rows, i8_rows, prep_f32, prep_i8, 16};
