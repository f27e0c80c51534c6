/* AVX-512 (F/BW/VL) + VNNI kernels.
 *
 * I8 family.  Weights stay unsigned for vpdpbusd: Q4 nibbles are q+8 already, Q8
 * bytes are flipped to q+128; the offset is removed exactly per group with the
 * precomputed activation group sums (isum = dot(q+k, x) - k * sum(x), exact int32).
 * A tile of 16 output rows is computed with lane = output row from the dot products
 * on: every 64-byte block of the 16 rows is dotted, the 16 dot vectors are reduced in
 * registers to chunk sums (grouped Q4: each group's sum goes straight into the float
 * step) or accumulated over the whole row and reduced once (per-row formats), and the
 * reference float step runs 16 outputs an instruction:
 *     acc = acc + (float)isum * (wscale * xs)     for each group in order
 * which is bit-identical to ref.c.  The next tile's bytes are prefetched as each block
 * is read.  Q4 group sizes that are not multiples of 32 fall back to the reference.
 * FP4 runs the grouped Q4 tile with each nibble first mapped (vpshufb) to its code's
 * integer plus 12 (0..24, unsigned) and 12 * sum(x) removed per group.
 *
 * F32 family.  Nibbles/bytes are widened to 32-bit lanes and turned into f32 through a
 * 16-entry table (vpermps) scaled per group, then FMA'd against a permuted copy of x;
 * up to 4 activation rows share one pass over a weight row.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,avx2,bmi,bmi2")

#include "internal.h"

#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------ prep ---- */

/* Q4 (FP4) I8 layout: per 128-element block, the 64 even elements then the 64 odd ones,
 * so low nibbles of a 64-byte weight block meet bytes 0..63 and high nibbles 64..127.
 * Q2/Q3 get the quad layout of affine_avx512.c. */
static int prep_i8(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out) {
    if (colibri_is_affine(w->fmt)) return colibri_affine_prep_i8_avx512(w, qx, n, out);
    if (!colibri_is_nibble(w->fmt)) return 0;
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
    if (w->fmt == COLIBRI_FMT_Q3) return colibri_affine_prep_f32_avx512(w, x, I, n, out); /* its dword-byte order */
    memset(out + I, 0, (n - (size_t)I) * sizeof(float));
    if (!colibri_is_nibble(w->fmt)) {
        memcpy(out, x, (size_t)I * sizeof(float));
        return 1;
    }
    memset(out, 0, (size_t)I * sizeof(float));
    for (int i = 0; i < I; i++) out[(i & ~31) + ((i & 31) >> 1) + ((i & 1) << 4)] = x[i];
    return 1;
}

/* ------------------------------------------------------------- I8 family ---- */

/* colibri_quant_row (ref.c) sixteen lanes at a time, with the same operations so the
 * same bits: the largest |x| (a maximum is exact in any order; max_ps keeps the running
 * value when an element is NaN, as the scalar comparison does), the division by the
 * scale, the clamps (min/max with the constant first, so a NaN passes through as in the
 * scalar ternaries), NaN to 0, and round-half-even by adding and subtracting 1.5 * 2^23.
 * A serial step of every integer matmul: the scalar loop was ~3% of a small model's
 * decode. */
static void quant_row(const float *x, int I, int8_t *q, size_t ldq, float *xs) {
    __m512 vmax = _mm512_setzero_ps();
    for (int i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
        vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + i)), vmax);
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float s = amax / 127.0f;
    if (!(s > 0.0f) || isinf(s)) { /* zero row (or non-finite): all-zero codes */
        colibri_quant_row(x, I, q, ldq, xs);
        return;
    }
    *xs = s;
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    for (int i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vs);
        v = _mm512_max_ps(lo, _mm512_min_ps(hi, v));
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
        v = _mm512_sub_ps(_mm512_add_ps(v, magic), magic);
        _mm512_mask_cvtepi32_storeu_epi8(q + i, m, _mm512_cvttps_epi32(v));
    }
    memset(q + I, 0, ldq - (size_t)I);
}

/* 64 bytes of a Q4 row (masked past its end: zero nibbles) dotted into acc: the low
 * nibbles against the even activations, the high ones against the odd (prep_i8). */
static inline __m512i dot_q4(__m512i acc, const uint8_t *p, __mmask64 m, __m512i xe, __m512i xo) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i w = m == ~(__mmask64)0 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(m, p);
    const __m512i lo = _mm512_and_si512(w, m0f);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m0f);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xe), hi, xo);
}

/* The same for FP4: each nibble becomes its code's integer plus 12 (0..24) through a
 * byte shuffle, so the products stay unsigned x signed; the caller removes 12 * sum(x). */
static inline __m512i dot_fp4(__m512i acc, const uint8_t *p, __mmask64 m, __m512i xe, __m512i xo) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i w = m == ~(__mmask64)0 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(m, p);
    const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(w, m0f));
    const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w, 4), m0f));
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xe), hi, xo);
}

/* Largest group count handled on the fast path (stack buffers); more falls back. */
#define MAX_GROUPS 1024

/* colibri_fp4_scale sixteen bytes at a time: 2^(e - 128) as f32 bits, (e - 1) << 23 for
 * e >= 2, the subnormals 2^-128 and 2^-127 below, NaN for 255. */
static void fp4_scales(const uint8_t *e, int G, float *out) {
    for (int g = 0; g < G; g += 16) {
        const __mmask16 m = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, e + g));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
        __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(v, _mm512_set1_epi32(2)), tiny, normal);
        bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255)), bits,
                                       _mm512_set1_epi32(0x7fc00000));
        _mm512_mask_storeu_ps(out + g, m, _mm512_castsi512_ps(bits));
    }
}

static inline __mmask64 tail_mask64(size_t rem) {
    return rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
}

/* In-register 16x16 transpose: out[k] lane r = in[r] lane k. */
static inline void transpose16(const __m512 in[16], __m512 out[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) { /* u[4i + c] lane l: rows 4i..4i+3 of column 4l + c */
        const __m512 v = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
        const __m512 w = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 w2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
        out[c] = _mm512_shuffle_f32x4(v, v2, 0x88);
        out[8 + c] = _mm512_shuffle_f32x4(v, v2, 0xdd);
        out[4 + c] = _mm512_shuffle_f32x4(w, w2, 0x88);
        out[12 + c] = _mm512_shuffle_f32x4(w, w2, 0xdd);
    }
}

/* 16 rows' dot vectors v[r] (16 int32 lanes each) to chunk sums with lane = row:
 * C[c] lane r = lanes 4c..4c+3 of v[r] added, i.e. row r's sum over the block's 32
 * elements of chunk c.  Pairs of rows, then quads, are merged in registers and the
 * final 4x4 transpose moves whole 128-bit lanes. */
static inline void chunk_sums16(const __m512i v[16], __m512i C[4]) {
    __m512i a[8], b[4];
    for (int k = 0; k < 8; k++) /* lane pair per row pair: [r0 s02, r1 s02, r0 s13, r1 s13] */
        a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                                _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    for (int h = 0; h < 4; h++) /* b[h] 128-bit lane c: chunk c of rows 4h..4h+3 */
        b[h] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * h], a[2 * h + 1]),
                                _mm512_unpackhi_epi64(a[2 * h], a[2 * h + 1]));
    const __m512i u0 = _mm512_shuffle_i32x4(b[0], b[1], 0x44), u1 = _mm512_shuffle_i32x4(b[0], b[1], 0xee);
    const __m512i u2 = _mm512_shuffle_i32x4(b[2], b[3], 0x44), u3 = _mm512_shuffle_i32x4(b[2], b[3], 0xee);
    C[0] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    C[1] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
    C[2] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    C[3] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
}

/* One tile of up to 16 rows of a grouped Q4 weight (group size a multiple of 32) on
 * activation row s, lane = output row: every 64-byte block of the 16 rows is dotted,
 * reduced to chunk sums in registers (chunk_sums16) and each group's sum goes straight into
 * the reference float step
 *     acc = acc + (float)(isum - 8 * gsum[g]) * (wscale * xs)     g = 0, 1, ...
 * with the tile's scales transposed once (wsT[g] lane r).  No per-row group sums are
 * stored and no transpose of them is needed, so short rows (a small model's 576-wide
 * experts are 4.5 blocks) cost what long ones do per byte. */
static inline __attribute__((always_inline)) __m512 q4_tile16(const mm_job *j, const uint8_t *const rows[16],
                                                              const int8_t *x, const __m512 *wsT, int s,
                                                              int fp4) {
    const size_t nbytes = j->wrow, pf = 16 * nbytes; /* the next tile's same position */
    const int nblocks = (int)((nbytes + 63) / 64), cpg = j->gsz / 32;
    const int nchunks = (j->w->I + 31) / 32;
    const __m512 xs = _mm512_set1_ps(j->xs[s]);
    const int32_t *gsum = j->gsum + (size_t)s * j->G;
    __m512 acc = _mm512_setzero_ps();
    __m512i cur = _mm512_setzero_si512();
    int g = 0;
    for (int b = 0; b < nblocks; b++) {
        const size_t off = (size_t)b * 64;
        const __mmask64 m = tail_mask64(nbytes - off);
        const __m512i xe = _mm512_loadu_si512(x + 2 * off), xo = _mm512_loadu_si512(x + 2 * off + 64);
        __m512i v[16], C[4];
        for (int r = 0; r < 16; r++) {
            _mm_prefetch((const char *)rows[r] + off + pf, _MM_HINT_T1);
            v[r] = fp4 ? dot_fp4(_mm512_setzero_si512(), rows[r] + off, m, xe, xo)
                       : dot_q4(_mm512_setzero_si512(), rows[r] + off, m, xe, xo);
        }
        chunk_sums16(v, C);
        for (int c = 0; c < 4; c++) {
            const int k = 4 * b + c; /* chunk index along the row */
            if (k >= nchunks) break;
            cur = _mm512_add_epi32(cur, C[c]);
            if ((k + 1) % cpg && k + 1 < nchunks) continue; /* the group goes on */
            const __m512i iv = _mm512_sub_epi32(cur, _mm512_set1_epi32(gsum[g] * (fp4 ? 12 : 8)));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_mul_ps(wsT[g], xs)));
            cur = _mm512_setzero_si512();
            g++;
        }
    }
    return acc;
}

/* The scales of a tile's rows, transposed: out[g] lane r = ws[r][g]. */
static void transpose_scales(const float *const ws[16], int G, __m512 *out) {
    for (int g0 = 0; g0 < G; g0 += 16) {
        const int n = G - g0 < 16 ? G - g0 : 16;
        const __mmask16 m = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
        __m512 in[16], col[16];
        for (int r = 0; r < 16; r++) in[r] = _mm512_maskz_loadu_ps(m, ws[r] + g0);
        transpose16(in, col);
        for (int k = 0; k < n; k++) out[g0 + k] = col[k];
    }
}

/* One tile of up to 16 rows of a per-row weight (Q8, or Q4 with one scale a row) on
 * activation row s, lane = output row: each row's unsigned dot accumulates over the whole
 * row in a vector of its own, the 16 vectors are reduced once at the end (chunk_sums16 and
 * three adds), and the reference's single float step follows:
 *     acc = 0 + (float)(isum - k * sum(x)) * (wscale * xs),   k = 8 (Q4) or 128 (Q8). */
static __m512 row_tile16(const mm_job *j, const uint8_t *const rows[16], const int8_t *x, __m512 ws,
                         int s, int q4) {
    const size_t nbytes = j->wrow, pf = 16 * nbytes; /* the next tile's same position */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[16], C[4];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_si512();
    if (q4)
        for (size_t off = 0; off < nbytes; off += 64) {
            const __mmask64 m = tail_mask64(nbytes - off);
            const __m512i xe = _mm512_loadu_si512(x + 2 * off), xo = _mm512_loadu_si512(x + 2 * off + 64);
            for (int r = 0; r < 16; r++) {
                _mm_prefetch((const char *)rows[r] + off + pf, _MM_HINT_T1);
                acc[r] = dot_q4(acc[r], rows[r] + off, m, xe, xo);
            }
        }
    else
        for (size_t off = 0; off < nbytes; off += 64) {
            const __mmask64 m = tail_mask64(nbytes - off);
            const __m512i xv = _mm512_loadu_si512(x + off);
            for (int r = 0; r < 16; r++) {
                _mm_prefetch((const char *)rows[r] + off + pf, _MM_HINT_T1);
                const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[r] + off), flip);
                acc[r] = _mm512_dpbusd_epi32(acc[r], w, xv);
            }
        }
    chunk_sums16(acc, C);
    const __m512i isum = _mm512_add_epi32(_mm512_add_epi32(C[0], C[1]), _mm512_add_epi32(C[2], C[3]));
    const __m512i iv = _mm512_sub_epi32(isum, _mm512_set1_epi32(j->gsum[s] << (q4 ? 3 : 7)));
    const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_mul_ps(ws, _mm512_set1_ps(j->xs[s])));
    return _mm512_add_ps(_mm512_setzero_ps(), p);
}

/* I8 rows: tiles of 16 output rows, lane = row, for every activation row. Grouped Q4 goes
 * through q4_tile16 (a group's sum straight into the float step), per-row formats through
 * row_tile16 (one reduction a row); Q4 groups that are not multiples of 32 fall back to
 * the reference. Lanes past the tile's last row repeat its first: computed, not stored. */
static void i8_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (colibri_is_affine(w->fmt)) {
        colibri_affine_i8_rows_avx512(j, o0, o1);
        return;
    }
    const int q4 = w->fmt == COLIBRI_FMT_Q4, fp4 = w->fmt == COLIBRI_FMT_FP4;
    const int grouped = j->G > 1 && j->gsz % 32 == 0 && j->G <= MAX_GROUPS;
    if (!(w->fmt == COLIBRI_FMT_Q8 || (q4 && (j->G == 1 || grouped)) || (fp4 && grouped))) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    const int8_t *qx = q4 || fp4 ? j->qxp : j->qx; /* the int8 activation rows, laid out per format */
    __m512 wsT[MAX_GROUPS];
    for (int o = o0; o < o1; o += 16) {
        const int n = o1 - o < 16 ? o1 - o : 16;
        const __mmask16 keep = (__mmask16)((1u << n) - 1);
        const uint8_t *rows[16];
        for (int r = 0; r < 16; r++) rows[r] = (const uint8_t *)w->data + (size_t)(o + (r < n ? r : 0)) * j->wrow;
        if (j->G == 1) {
            const __m512 wsv = _mm512_mask_loadu_ps(_mm512_set1_ps(w->scales[o]), keep, w->scales + o);
            for (int s = 0; s < j->S; s++) {
                const __m512 acc = row_tile16(j, rows, qx + (size_t)s * j->ldx, wsv, s, q4);
                _mm512_mask_storeu_ps(j->y + (size_t)s * w->O + o, keep, acc);
            }
            continue;
        }
        if (fp4) { /* the tile's e8m0 bytes decoded, then transposed as Q4's scales */
            static _Thread_local float decoded[16 * MAX_GROUPS];
            const float *ws[16];
            for (int r = 0; r < 16; r++) {
                const size_t row = (size_t)(o + (r < n ? r : 0)) * j->G;
                fp4_scales((const uint8_t *)w->scales + row, j->G, decoded + (size_t)r * j->G);
                ws[r] = decoded + (size_t)r * j->G;
            }
            transpose_scales(ws, j->G, wsT);
            for (int s = 0; s < j->S; s++) {
                const __m512 acc = q4_tile16(j, rows, qx + (size_t)s * j->ldx, wsT, s, 1);
                _mm512_mask_storeu_ps(j->y + (size_t)s * w->O + o, keep, acc);
            }
            continue;
        }
        const float *ws[16];
        for (int r = 0; r < 16; r++) ws[r] = w->scales + (size_t)(o + (r < n ? r : 0)) * j->G;
        transpose_scales(ws, j->G, wsT);
        for (int s = 0; s < j->S; s++) {
            const __m512 acc = q4_tile16(j, rows, qx + (size_t)s * j->ldx, wsT, s, 0);
            _mm512_mask_storeu_ps(j->y + (size_t)s * w->O + o, keep, acc);
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

/* F32 family.  Each weight row is widened once and applied to up to NS activation
 * rows (prefill reuse); every activation row keeps its own accumulators and sees
 * exactly the operations of a single-row call, so batching never changes a bit. */
#define NS 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void fma_rows(__m512 w, const float *const *x, size_t e, int N, __m512 a[NS][4], int k) {
    for (int n = 0; n < N; n++) a[n][k] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[n] + e), a[n][k]);
}

ALWAYS_INLINE void finish(__m512 a[NS][4], int N, float scale, float *r) {
    for (int n = 0; n < N; n++) r[n] = scale * hsum4(a[n][0], a[n][1], a[n][2], a[n][3]);
}

/* 32 bytes of nibbles at p (64 weights from element e: the first 16 bytes scaled by
 * table t0, the next 16 by t1) against x: four FMA chains. */
ALWAYS_INLINE void fma_step64(const uint8_t *p, __m512 t0, __m512 t1, const float *const *x, size_t e, int N,
                              __m512 a[NS][4]) {
    _mm_prefetch((const char *)p + 1536, _MM_HINT_T0);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    fma_rows(_mm512_permutexvar_ps(v, t0), x, e, N, a, 0);
    fma_rows(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t0), x, e + 16, N, a, 1);
    fma_rows(_mm512_permutexvar_ps(u, t1), x, e + 32, N, a, 2);
    fma_rows(_mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), t1), x, e + 48, N, a, 3);
}

/* Q4 (FP4) through a 16-entry table scaled per group: vpermps turns each nibble (low 4
 * bits of a widened byte) into its dequantised f32 weight in one instruction; `tab` holds
 * what each nibble stands for (Q4: n - 8; FP4: its e2m1 code's integer). */
ALWAYS_INLINE void acc_q4_n(const mm_job *j, const uint8_t *row, const float *sc, const float *const *x,
                            int N, __m512 a[NS][4], __m512 tab) {
    for (int n = 0; n < NS; n++)
        for (int k = 0; k < 4; k++) a[n][k] = _mm512_setzero_ps();
    const size_t nbytes = j->wrow;
    int g = 0;
    if (j->gsz == 32) /* FP4's groups: two a 32-byte step */
        for (; (size_t)(g + 2) * 16 <= nbytes; g += 2)
            fma_step64(row + (size_t)g * 16, _mm512_mul_ps(tab, _mm512_set1_ps(sc[g])),
                       _mm512_mul_ps(tab, _mm512_set1_ps(sc[g + 1])), x, (size_t)g * 32, N, a);
    if (j->gsz == 64) /* the main case: one 32-byte step per group, no inner loop */
        for (; (size_t)(g + 1) * 32 <= nbytes; g++) {
            const __m512 ts = _mm512_mul_ps(tab, _mm512_set1_ps(sc[g]));
            fma_step64(row + (size_t)g * 32, ts, ts, x, (size_t)g * 64, N, a);
        }
    for (; g < j->G; g++) {
        const __m512 ts = _mm512_mul_ps(tab, _mm512_set1_ps(sc[g]));
        const size_t b0 = (size_t)g * j->gsz / 2;
        const size_t b1 = g + 1 == j->G ? nbytes : (size_t)(g + 1) * j->gsz / 2;
        size_t b = b0;
        for (; b + 32 <= b1; b += 32) fma_step64(row + b, ts, ts, x, 2 * b, N, a); /* unmasked */
        for (; b < b1; b += 16) { /* tail of the group/row: masked 16-byte steps */
            const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask16(b1 - b), row + b));
            fma_rows(_mm512_permutexvar_ps(v, ts), x, 2 * b, N, a, 0);
            fma_rows(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts), x, 2 * b + 16, N, a, 1);
        }
    }
}

/* Row o of a nibble weight: Q4's float scales, or FP4's e8m0 bytes decoded first. */
ALWAYS_INLINE void acc_nibble_n(const mm_job *j, int o, const uint8_t *row, const float *const *x, int N,
                                __m512 a[NS][4]) {
    const colibri_weight *w = j->w;
    if (w->fmt == COLIBRI_FMT_FP4) {
        float sc[MAX_GROUPS]; /* G <= MAX_GROUPS (f32_rows) */
        fp4_scales((const uint8_t *)w->scales + (size_t)o * j->G, j->G, sc);
        acc_q4_n(j, row, sc, x, N, a, _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
        return;
    }
    acc_q4_n(j, row, w->scales + (size_t)o * j->G, x, N, a,
             _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
}

ALWAYS_INLINE void dot_q4_n(const mm_job *j, int o, const uint8_t *row, const float *const *x, int N,
                            float *r) {
    __m512 a[NS][4];
    acc_nibble_n(j, o, row, x, N, a);
    finish(a, N, 1.0f, r);
}

/* 16 weights of an F32/BF16/Q8 row at element i as f32 (masked: zero past the row). */
ALWAYS_INLINE __m512 load_w(int fmt, const uint8_t *row, int i, __mmask16 m, int full) {
    if (fmt == COLIBRI_FMT_F32) {
        const float *r = (const float *)row + i;
        return full ? _mm512_loadu_ps(r) : _mm512_maskz_loadu_ps(m, r);
    }
    if (fmt == COLIBRI_FMT_BF16) {
        const uint16_t *r = (const uint16_t *)row + i;
        const __m256i h = full ? _mm256_loadu_si256((const __m256i *)r) : _mm256_maskz_loadu_epi16(m, r);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const int8_t *r = (const int8_t *)row + i;
    const __m128i q = full ? _mm_loadu_si128((const __m128i *)r) : _mm_maskz_loadu_epi8(m, r);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

/* Four independent FMA chains per activation row (64 elements per step) hide the FMA
 * latency; only the tail uses masked loads. Q8 applies its row scale at the end. */
ALWAYS_INLINE void acc_plain_n(int fmt, const uint8_t *row, int I, const float *const *x, int N,
                               __m512 a[NS][4]) {
    const int esize = fmt == COLIBRI_FMT_F32 ? 4 : fmt == COLIBRI_FMT_BF16 ? 2 : 1;
    for (int n = 0; n < NS; n++)
        for (int k = 0; k < 4; k++) a[n][k] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= I; i += 64) {
        _mm_prefetch((const char *)row + (size_t)i * esize + 1024, _MM_HINT_T0);
        for (int k = 0; k < 4; k++)
            fma_rows(load_w(fmt, row, i + 16 * k, 0xffff, 1), x, (size_t)i + 16 * k, N, a, k);
    }
    for (; i < I; i += 16) fma_rows(load_w(fmt, row, i, mask16((size_t)(I - i)), 0), x, (size_t)i, N, a, 0);
}

ALWAYS_INLINE void dot_plain_n(int fmt, const uint8_t *row, int I, float scale, const float *const *x,
                               int N, float *r) {
    __m512 a[NS][4];
    acc_plain_n(fmt, row, I, x, N, a);
    finish(a, N, scale, r);
}

static void dot_rows_1(const mm_job *j, int o, const float *const *x, float *r) {
    const colibri_weight *w = j->w;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
    switch (w->fmt) {
    case COLIBRI_FMT_F32: dot_plain_n(COLIBRI_FMT_F32, row, w->I, 1.0f, x, 1, r); break;
    case COLIBRI_FMT_BF16: dot_plain_n(COLIBRI_FMT_BF16, row, w->I, 1.0f, x, 1, r); break;
    case COLIBRI_FMT_Q8: dot_plain_n(COLIBRI_FMT_Q8, row, w->I, w->scales[o], x, 1, r); break;
    default: dot_q4_n(j, o, row, x, 1, r); break;
    }
}

static void dot_rows_4(const mm_job *j, int o, const float *const *x, float *r) {
    const colibri_weight *w = j->w;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
    switch (w->fmt) {
    case COLIBRI_FMT_F32: dot_plain_n(COLIBRI_FMT_F32, row, w->I, 1.0f, x, NS, r); break;
    case COLIBRI_FMT_BF16: dot_plain_n(COLIBRI_FMT_BF16, row, w->I, 1.0f, x, NS, r); break;
    case COLIBRI_FMT_Q8: dot_plain_n(COLIBRI_FMT_Q8, row, w->I, w->scales[o], x, NS, r); break;
    default: dot_q4_n(j, o, row, x, NS, r); break;
    }
}

/* The 16 row sums of t[0..15] (row r's partials in t[r]), each added in exactly the tree
 * of _mm512_reduce_add_ps (lanes i + 8, then i + 4, then i + 2, then i + 1), so a tile of
 * 16 rows reduced together gives the bits of 16 single-row reductions, in about a third
 * of the instructions (the per-row reduction was an eighth of a decode-sized matvec). */
ALWAYS_INLINE void reduce16(const __m512 t[16], float out[16]) {
    __m512 p[8], q[4], r[2];
    for (int k = 0; k < 8; k++) /* [row 2k: t_i + t_i+8 | row 2k+1: ...] */
        p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++) /* 128-bit lanes: rows 4k, 4k+1, 4k+2, 4k+3: u_i + u_i+4 */
        q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++) /* per lane: [row a: v0+v2, v1+v3, row b: v0+v2, v1+v3] */
        r[k] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(q[2 * k]), _mm512_castps_pd(q[2 * k + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(q[2 * k]), _mm512_castps_pd(q[2 * k + 1]))));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* element m of 128-bit lane l holds row 4m + l */
    static const int row_of[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    float tmp[16];
    _mm512_storeu_ps(tmp, sums);
    for (int k = 0; k < 16; k++) out[row_of[k]] = tmp[k];
}

/* Row o against n activation rows (n <= NS): each row's four accumulators pre-added
 * ((a0 + a1) + (a2 + a3)), as finish() reduces them, into t[0..n). */
ALWAYS_INLINE void partials_n(const mm_job *j, int o, const float *const *x, int n, __m512 t[NS],
                              float *scale) {
    const colibri_weight *w = j->w;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
    __m512 a[NS][4];
    *scale = 1.0f;
    switch (w->fmt) {
    case COLIBRI_FMT_F32: acc_plain_n(COLIBRI_FMT_F32, row, w->I, x, n, a); break;
    case COLIBRI_FMT_BF16: acc_plain_n(COLIBRI_FMT_BF16, row, w->I, x, n, a); break;
    case COLIBRI_FMT_Q8:
        acc_plain_n(COLIBRI_FMT_Q8, row, w->I, x, n, a);
        *scale = w->scales[o];
        break;
    default: acc_nibble_n(j, o, row, x, n, a); break;
    }
    for (int m = 0; m < n; m++)
        t[m] = _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));
}

/* Output rows o..o+15 against n activation rows (1 at decode, NS in prefill): the 16 rows'
 * partials of each activation row share one reduce16 (the per-output horizontal sum was
 * an eighth of a matvec); every output sees dot_rows_1/4's accumulation and finish()'s
 * reduction, so the bits are those of the row-at-a-time path. y[m] is activation row m's
 * output row. */
ALWAYS_INLINE void tile16_n(const mm_job *j, int o, const float *const *x, int n, float *const *y) {
    __m512 t[NS][16], p[NS];
    float scale[16], sum[16];
    for (int k = 0; k < 16; k++) {
        partials_n(j, o + k, x, n, p, &scale[k]);
        for (int m = 0; m < n; m++) t[m][k] = p[m];
    }
    for (int m = 0; m < n; m++) {
        reduce16(t[m], sum);
        for (int k = 0; k < 16; k++) y[m][o + k] = scale[k] * sum[k];
    }
}

/* Decode (S < NS): 16 output rows at a time share one reduction; the rest one by one. */
static void f32_rows_small(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    for (int s = 0; s < j->S; s++) {
        const float *x = j->xp + (size_t)s * j->ldx;
        float *y = j->y + (size_t)s * w->O;
        int o = o0;
        for (; o + 16 <= o1; o += 16) tile16_n(j, o, &x, 1, &y);
        for (; o < o1; o++) dot_rows_1(j, o, &x, y + o);
    }
}

/* Prefill, 16 output rows at a time over activation rows [s0, s1): NS rows per tile, the
 * rest one by one. */
static void f32_tile16(const mm_job *j, int o, int s0, int s1) {
    const colibri_weight *w = j->w;
    int s = s0;
    for (; s + NS <= s1; s += NS) {
        const float *x[NS];
        float *y[NS];
        for (int m = 0; m < NS; m++) {
            x[m] = j->xp + (size_t)(s + m) * j->ldx;
            y[m] = j->y + (size_t)(s + m) * w->O;
        }
        tile16_n(j, o, x, NS, y);
    }
    for (; s < s1; s++) {
        const float *x = j->xp + (size_t)s * j->ldx;
        for (int k = 0; k < 16; k++) dot_rows_1(j, o + k, &x, j->y + (size_t)s * w->O + o + k);
    }
}

static void f32_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (colibri_is_affine(w->fmt)) {
        colibri_affine_f32_rows_avx512(j, o0, o1);
        return;
    }
    if (j->xp == NULL || (colibri_is_nibble(w->fmt) && j->G > 1 && j->gsz % 32 != 0) ||
        (w->fmt == COLIBRI_FMT_FP4 && j->G > MAX_GROUPS)) {
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    if (j->S < NS) {
        f32_rows_small(j, o0, o1);
        return;
    }
    const int sb = colibri_x_block_rows(j, sizeof(float), NS);
    for (int s0 = 0; s0 < j->S; s0 += sb) {
        const int s1 = j->S - s0 < sb ? j->S : s0 + sb;
        int o = o0;
        for (; o + 16 <= o1; o += 16) f32_tile16(j, o, s0, s1);
        for (; o < o1; o++) {
            for (int s = s0; s < s1; s += NS) {
                const float *x[NS];
                float r[NS];
                const int n = s1 - s < NS ? s1 - s : NS;
                for (int k = 0; k < n; k++) x[k] = j->xp + (size_t)(s + k) * j->ldx;
                if (n == NS) dot_rows_4(j, o, x, r);
                else
                    for (int k = 0; k < n; k++) dot_rows_1(j, o, x + k, r + k);
                for (int k = 0; k < n; k++) j->y[(size_t)(s + k) * w->O + o] = r[k];
            }
        }
    }
}

const isa_ops colibri_avx512_ops = {"avx512vnni", f32_rows, i8_rows, prep_f32, prep_i8, 16, quant_row};
