/* Q2/Q3 (low-bit affine, docs/formats.md) on AVX-512 + VNNI.
 *
 * I8 family.  Rows are read four groups (a "quad", 256 inputs) at a time, so one 512-bit
 * register holds the low planes of four groups, 128-bit lane k = group k: Q2's 64 bytes
 * as they lie; Q3's 96 bytes from two loads and two qword permutes (low planes are
 * qwords 3k, 3k+1, high planes qword 3k + 2, duplicated to both halves of lane k).
 * Shifting that register by 2c and masking to two bits gives chunk c (inputs 16c..16c+15)
 * of all four groups at once; Q3 adds 4 where the high-plane bit (byte j: bit 2c + j/8
 * of byte j % 8) is set.  prep_i8 lays the int8 activations out to match (per whole quad,
 * chunk c of group k at byte 64c + 16k), so four vpdpbusd per quad leave lane k holding
 * group k's four partial sums, and one in-register reduction of a 16-row tile (lane =
 * row) gives the exact int32 isum of 4 groups x 16 rows.  A row's last, partial quad
 * (G % 4 groups) reads its weights masked and its activations from the plain order.
 * The tile's (s, m) pairs are transposed and converted from float16 (exact) once, and the
 * reference step
 *     acc = acc + ((float)isum * (s * xs) + (float)xsum * (m * xs))
 * runs sixteen rows an instruction, group by group: bit-identical to ref.c.  Before this
 * layout a group cost a full 16-lane reduction and a gather of its scales, and the kernel
 * ran at half int4's speed although it reads fewer bytes (docs/performance.md).
 *
 * F32 family.  Each group's dequantised weights come from a 16-entry table (q * s + m for
 * the 4 or 8 codes, repeated) indexed by vpermps straight from the shifted code bytes: the
 * index uses only bits 0..3, so Q2 needs no masking; Q3's codes are first built as bytes
 * (as the I8 family does) and each dword's bytes index in turn after a shift, against x
 * laid out to match (prep_f32); the weights are FMA'd against the zero-padded x, up to four
 * activation rows sharing each unpacked row (each with its own accumulators, so batching
 * never changes a bit).
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,avx2,f16c")

#include "internal.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Largest group count of the tiled I8 path (its transposed scales are a per-thread
 * buffer); longer rows run the reference. */
#define MAX_GROUPS 1024

/* Bytes of activations per quad of groups. */
#define QUAD 256

/* ------------------------------------------------------------------ prep ---- */

/* The 4x4 transpose of 128-bit lanes: out[c] lane k = in[k] lane c. */
ALWAYS_INLINE void transpose_lanes4(const __m512i in[4], __m512i out[4]) {
    const __m512i t0 = _mm512_shuffle_i32x4(in[0], in[1], 0x44), t1 = _mm512_shuffle_i32x4(in[0], in[1], 0xee);
    const __m512i t2 = _mm512_shuffle_i32x4(in[2], in[3], 0x44), t3 = _mm512_shuffle_i32x4(in[2], in[3], 0xee);
    out[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    out[1] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
    out[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    out[3] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
}

int colibri_affine_prep_i8_avx512(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out) {
    const size_t whole = (size_t)((w->I + 63) / 64 / 4) * QUAD; /* bytes in whole quads */
    for (size_t b = 0; b < whole; b += QUAD) {
        __m512i v[4], t[4];
        for (int k = 0; k < 4; k++) v[k] = _mm512_loadu_si512(qx + b + 64 * k);
        transpose_lanes4(v, t);
        for (int c = 0; c < 4; c++) _mm512_storeu_si512(out + b + 64 * c, t[c]);
    }
    memcpy(out + whole, qx + whole, n - whole); /* the partial quad stays in plain order */
    return 1;
}

/* ------------------------------------------------------------- I8 family ---- */

/* The low planes (and Q3's high planes, qword-duplicated) of a quad of groups at p, lane k
 * = group k; ng < 4 (the row's last quad) reads only ng blocks, the rest zero. */
ALWAYS_INLINE void load_quad(const uint8_t *p, int q3, int ng, __m512i *low, __m512i *high) {
    if (!q3) {
        *low = ng == 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * ng)) - 1, p);
        return;
    }
    __m512i a, b;
    if (ng == 4) {
        a = _mm512_loadu_si512(p);
        b = _mm512_loadu_si512(p + 32);
    } else { /* 24 * ng bytes: the first 64 (or fewer), then what lies past byte 32 */
        const int nb = 24 * ng;
        a = _mm512_maskz_loadu_epi8(nb >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << nb) - 1, p);
        b = _mm512_maskz_loadu_epi8(nb > 32 ? ((__mmask64)1 << (nb - 32)) - 1 : 0, p + 32);
    }
    /* qword q of the 96 bytes: a holds 0..7, b holds 4..11 (as 8 + q - 4) */
    *low = _mm512_permutex2var_epi64(a, _mm512_set_epi64(8 + 6, 8 + 5, 7, 6, 4, 3, 1, 0), b);
    *high = _mm512_permutex2var_epi64(a, _mm512_set_epi64(8 + 7, 8 + 7, 8 + 4, 8 + 4, 5, 5, 2, 2), b);
}

/* Chunk c of a quad's codes: two bits of the low plane, plus 4 where Q3's bit is set. */
ALWAYS_INLINE __m512i quad_chunk(__m512i low, __m512i high, int c, int q3) {
    const __m512i three = _mm512_set1_epi8(3);
    __m512i q = _mm512_and_si512(c ? _mm512_srli_epi16(low, 2 * c) : low, three);
    if (q3) { /* byte j of each lane: bit 2c + j / 8 of high byte j % 8 */
        const long long lo = 0x0101010101010101LL << (2 * c), hi = 0x0101010101010101LL << (2 * c + 1);
        const __mmask64 k = _mm512_test_epi8_mask(high, _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo));
        q = _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(4));
    }
    return q;
}

/* 16 rows' quad dot vectors to group sums with lane = row: C[k] lane r = lanes 4k..4k+3 of
 * v[r] added, i.e. row r's isum of the quad's group k.  Pairs of rows, then quads, are
 * merged in registers and a final 4x4 transpose moves whole 128-bit lanes. */
ALWAYS_INLINE void group_sums16(const __m512i v[16], __m512i C[4]) {
    __m512i a[8], b[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [r0 s02, r1 s02, r0 s13, r1 s13] */
        a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                                _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    for (int h = 0; h < 4; h++) /* b[h] 128-bit lane c: group c of rows 4h..4h+3 */
        b[h] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * h], a[2 * h + 1]),
                                _mm512_unpackhi_epi64(a[2 * h], a[2 * h + 1]));
    transpose_lanes4(b, C);
}

/* Row r's dot vector of one quad: four chunks into one accumulator, lane k = group k. */
ALWAYS_INLINE __m512i quad_dot(const uint8_t *p, int q3, int ng, const __m512i X[4]) {
    __m512i low, high = _mm512_setzero_si512();
    load_quad(p, q3, ng, &low, &high);
    __m512i d = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) d = _mm512_dpbusd_epi32(d, quad_chunk(low, high, c, q3), X[c]);
    return d;
}

/* The tile's (s, m) pairs as f32 vectors, lane = row: sT[g], mT[g] for g < G.  Transposed
 * sixteen groups at a time from the rows' float16 pairs (read as 32-bit words). */
static void tile_scales(const uint16_t *const sm[16], int G, float *sT, float *mT) {
    for (int g0 = 0; g0 < G; g0 += 16) {
        const int n = G - g0 < 16 ? G - g0 : 16;
        const __mmask16 m = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
        __m512i in[16], t[16], u[16];
        for (int r = 0; r < 16; r++) in[r] = _mm512_maskz_loadu_epi32(m, sm[r] + 2 * (size_t)g0);
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) {
            u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int c = 0; c < 4; c++) { /* u[4i + c] lane l: rows 4i..4i+3 of group 4l + c */
            __m512i q[4], col[4];
            for (int i = 0; i < 4; i++) q[i] = u[4 * i + c];
            transpose_lanes4(q, col);
            for (int l = 0; l < 4; l++) {
                const int k = 4 * l + c;
                if (k >= n) continue;
                const __m512i pair = col[l]; /* lane r: row r's (s, m) of group g0 + k */
                _mm512_storeu_ps(sT + 16 * (size_t)(g0 + k), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair)));
                _mm512_storeu_ps(mT + 16 * (size_t)(g0 + k),
                                 _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16))));
            }
        }
    }
}

/* The reference float step of group g for 16 rows (lane = row). */
ALWAYS_INLINE __m512 step16(__m512 acc, __m512i isum, const float *sT, const float *mT, int g, int32_t xsum,
                            __m512 xs) {
    const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_loadu_ps(sT + 16 * (size_t)g), xs));
    const __m512 b =
        _mm512_mul_ps(_mm512_set1_ps((float)xsum), _mm512_mul_ps(_mm512_loadu_ps(mT + 16 * (size_t)g), xs));
    return _mm512_add_ps(acc, _mm512_add_ps(a, b));
}

/* One 16-row tile on activation row s: whole quads, then the partial one. */
ALWAYS_INLINE __m512 tile16(const mm_job *j, const uint8_t *const rows[16], const uint16_t *next_sm, int s,
                            const float *sT, const float *mT, int q3) {
    const int G = j->G, B = q3 ? 96 : 64, quads = G / 4, rest = G % 4;
    const size_t pf = 16 * j->wrow, sm_lines = (size_t)G; /* the next tile's scales: 16 rows x 4G bytes */
    const int8_t *xp = j->qxp + (size_t)s * j->ldx;
    const int32_t *gsum = j->gsum + (size_t)s * G;
    const __m512 xs = _mm512_set1_ps(j->xs[s]);
    __m512 acc = _mm512_setzero_ps();
    for (int qd = 0; qd < quads; qd++) {
        __m512i X[4], v[16], C[4];
        for (int c = 0; c < 4; c++) X[c] = _mm512_loadu_si512(xp + (size_t)qd * QUAD + 64 * c);
        for (int r = 0; r < 16; r++) {
            const uint8_t *p = rows[r] + (size_t)qd * B;
            _mm_prefetch((const char *)p + pf, _MM_HINT_T1);
            if (q3) _mm_prefetch((const char *)p + pf + 64, _MM_HINT_T1);
            v[r] = quad_dot(p, q3, 4, X);
        }
        for (size_t l = 4 * (size_t)qd; l < 4 * (size_t)qd + 4 && l < sm_lines; l++)
            _mm_prefetch((const char *)next_sm + 64 * l, _MM_HINT_T1);
        group_sums16(v, C);
        for (int k = 0; k < 4; k++) {
            const int g = 4 * qd + k;
            acc = step16(acc, C[k], sT, mT, g, gsum[g], xs);
        }
    }
    if (rest) { /* the partial quad: activations from the plain order, lanes past it zero */
        const int g0 = 4 * quads;
        __m512i V[4], X[4], v[16], C[4];
        for (int k = 0; k < 4; k++)
            V[k] = k < rest ? _mm512_loadu_si512(xp + (size_t)(g0 + k) * 64) : _mm512_setzero_si512();
        transpose_lanes4(V, X);
        for (int r = 0; r < 16; r++) v[r] = quad_dot(rows[r] + (size_t)quads * B, q3, rest, X);
        group_sums16(v, C);
        for (int k = 0; k < rest; k++) acc = step16(acc, C[k], sT, mT, g0 + k, gsum[g0 + k], xs);
    }
    return acc;
}

void colibri_affine_i8_rows_avx512(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q3 = w->fmt == COLIBRI_FMT_Q3, G = j->G;
    if (G > MAX_GROUPS || j->qxp == NULL) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    static _Thread_local float sT[16 * MAX_GROUPS], mT[16 * MAX_GROUPS];
    const uint16_t *scales = (const uint16_t *)w->scales;
    for (int o = o0; o < o1; o += 16) {
        const int n = o1 - o < 16 ? o1 - o : 16;
        const __mmask16 keep = (__mmask16)((1u << n) - 1);
        const uint8_t *rows[16];
        const uint16_t *sm[16];
        for (int r = 0; r < 16; r++) { /* lanes past the tile repeat its first row */
            const size_t row = (size_t)(o + (r < n ? r : 0));
            rows[r] = (const uint8_t *)w->data + row * j->wrow;
            sm[r] = scales + row * 2 * G;
        }
        tile_scales(sm, G, sT, mT);
        const uint16_t *next_sm = o + 16 < w->O ? sm[0] + 32 * (size_t)G : sm[0];
        for (int s = 0; s < j->S; s++) {
            const __m512 acc = q3 ? tile16(j, rows, next_sm, s, sT, mT, 1) : tile16(j, rows, next_sm, s, sT, mT, 0);
            _mm512_mask_storeu_ps(j->y + (size_t)s * w->O + o, keep, acc);
        }
    }
}

/* ------------------------------------------------------------ F32 family ---- */

/* Activation rows sharing one pass over a weight row (prefill). */
#define NS 4

/* Group g's 16-entry dequantisation table: entry i = (i mod 4 or 8) * s + m. */
ALWAYS_INLINE __m512 group_table(const float *smf, int g, int q3) {
    const __m512 base = q3 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7)
                           : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    return _mm512_fmadd_ps(base, _mm512_set1_ps(smf[2 * g]), _mm512_set1_ps(smf[2 * g + 1]));
}

/* Q3's 64 codes of the block at p as bytes, 128-bit lane k = inputs 16k..16k+15: the low
 * plane broadcast to the four lanes and shifted by 2k, masked to two bits, plus 4 where the
 * high-plane bit (byte L: bit L / 8 of byte L % 8) is set. */
ALWAYS_INLINE __m512i q3_codes64(const uint8_t *p) {
    const __m512i shifts = _mm512_set_epi64(6 * 0x0001000100010001LL, 6 * 0x0001000100010001LL,
                                            4 * 0x0001000100010001LL, 4 * 0x0001000100010001LL,
                                            2 * 0x0001000100010001LL, 2 * 0x0001000100010001LL, 0, 0);
    const __m512i low = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(low, shifts), _mm512_set1_epi8(3));
    long long h;
    memcpy(&h, p + 16, 8);
    const __m512i bits = _mm512_set_epi64(0x8080808080808080LL, 0x4040404040404040LL, 0x2020202020202020LL,
                                          0x1010101010101010LL, 0x0808080808080808LL, 0x0404040404040404LL,
                                          0x0202020202020202LL, 0x0101010101010101LL);
    const __mmask64 k = _mm512_test_epi8_mask(_mm512_set1_epi64(h), bits);
    return _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(4));
}

/* Q3's F32 layout of x: per group, xp[64b + 16m + d] = x[64b + 4d + m], so that byte m of
 * every dword of the code vector (vpermps reads its low 4 bits after a shift by 8m) meets
 * its input. */
int colibri_affine_prep_f32_avx512(const colibri_weight *w, const float *x, int I, size_t n, float *out) {
    (void)w;
    memset(out, 0, n * sizeof(float));
    for (int i = 0; i < I; i++) out[(i & ~63) + 16 * (i & 3) + ((i & 63) >> 2)] = x[i];
    return 1;
}

/* Row `row` against N activation rows x[n] (zero padded to whole groups): a[n][c] sums
 * the products of every quarter-group c. Q2: quarter c = the low plane shifted by 2c
 * (bits 2..3 of the index, the next code, ignored by the period-4 table); Q3: quarter m =
 * byte m of each dword of the code vector (prep_f32's layout). */
ALWAYS_INLINE void f32_acc(const mm_job *j, const uint8_t *row, const float *smf, const float *const *x, int N,
                           int q3, __m512 a[NS][4]) {
    const int B = q3 ? 24 : 16;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < 4; c++) a[n][c] = _mm512_setzero_ps();
    for (int g = 0; g < j->G; g++) {
        const uint8_t *p = row + (size_t)g * B;
        _mm_prefetch((const char *)p + 1024, _MM_HINT_T0);
        const __m512 t = group_table(smf, g, q3);
        const __m512i v = q3 ? q3_codes64(p) : _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const float *xg[NS];
        for (int n = 0; n < N; n++) xg[n] = x[n] + (size_t)g * 64;
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const int sh = q3 ? 8 * c : 2 * c;
            const __m512 wv = _mm512_permutexvar_ps(sh ? _mm512_srli_epi32(v, sh) : v, t);
            for (int n = 0; n < N; n++) a[n][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xg[n] + 16 * c), a[n][c]);
        }
    }
}

/* Row o's (s, m) pairs as floats (G pairs, interleaved). */
static void row_scales(const uint16_t *sm, int G, float *out) {
    int i = 0;
    for (; i + 16 <= 2 * G; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + i))));
    if (i < 2 * G) {
        const __mmask16 m = (__mmask16)((1u << (2 * G - i)) - 1);
        _mm512_mask_storeu_ps(out + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, sm + i)));
    }
}

/* Row o against activation rows [s0, s0 + N). */
ALWAYS_INLINE void f32_row_n(const mm_job *j, int o, const float *smf, int s0, int N, int q3) {
    const colibri_weight *w = j->w;
    const float *x[NS];
    for (int n = 0; n < N; n++) x[n] = j->xp + (size_t)(s0 + n) * j->ldx;
    __m512 a[NS][4];
    f32_acc(j, (const uint8_t *)w->data + (size_t)o * j->wrow, smf, x, N, q3, a);
    for (int n = 0; n < N; n++)
        j->y[(size_t)(s0 + n) * w->O + o] =
            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[n][0], a[n][1]), _mm512_add_ps(a[n][2], a[n][3])));
}

/* Each row once, against every activation row: NS at a time while they last (the row
 * stays in L1 between blocks), then one by one. */
ALWAYS_INLINE void f32_rows_q(const mm_job *j, int o0, int o1, int q3) {
    float smf[2 * MAX_GROUPS];
    for (int o = o0; o < o1; o++) {
        row_scales((const uint16_t *)j->w->scales + (size_t)o * 2 * j->G, j->G, smf);
        int s = 0;
        for (; s + NS <= j->S; s += NS) f32_row_n(j, o, smf, s, NS, q3);
        for (; s < j->S; s++) f32_row_n(j, o, smf, s, 1, q3);
    }
}

void colibri_affine_f32_rows_avx512(const mm_job *j, int o0, int o1) {
    if (j->xp == NULL || j->G > MAX_GROUPS) { /* no padded copy of x: whole-group reads would run past it */
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    if (j->w->fmt == COLIBRI_FMT_Q3) f32_rows_q(j, o0, o1, 1);
    else f32_rows_q(j, o0, o1, 0);
}
