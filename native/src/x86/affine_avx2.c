/* Q2/Q3 (low-bit affine, docs/formats.md) on AVX2.
 *
 * I8 family.  Rows are read two groups (a "pair", 128 inputs) at a time, one 256-bit
 * register holding both low planes, 128-bit lane k = group k (Q3: the low planes from
 * two loads, the high planes qword-duplicated into a second register).  Shifting by 2c
 * and masking to two bits gives chunk c (inputs 16c..16c+15) of both groups; Q3 adds 4
 * where the high-plane bit (byte j: bit 2c + j / 8 of byte j % 8) is set.  prep_i8 lays
 * the int8 activations out to match (per whole pair, chunk c of group k at byte 32c + 16k),
 * the codes meet them through vpmaddubsw (|pair| <= 2 * 7 * 127) and the four chunks'
 * int16 sums are added before one vpmaddwd (4 * 1778 < 2^15: exact), so lane k of one
 * vector holds group k's four partial sums.  A tile of 8 rows (lane = row) is reduced in
 * registers (hadd), the tile's (s, m) pairs are converted from float16 (exact) and
 * transposed once, and the reference step
 *     acc = acc + ((float)isum * (s * xs) + (float)xsum * (m * xs))
 * runs eight rows an instruction, group by group: bit-identical to ref.c.  A row's odd
 * last group reads its block alone and its activations from the plain order.
 *
 * F32 family.  Each group's dequantised weights come from an 8-entry table (q * s + m,
 * Q2's 4 codes repeated) indexed by vpermps straight from the shifted code bytes: the
 * index uses only bits 0..2, so Q2 needs no masking; Q3's codes are first built as bytes
 * (as the I8 family does) and each dword's bytes index in turn after a shift, against x
 * laid out to match (prep_f32); the weights are FMA'd against the zero-padded x, up to four activation rows
 * sharing each unpacked row (each with its own accumulators: batching changes no bit).
 */
#pragma GCC target("avx2,fma,f16c")

#include "internal.h"
#include "avx2_lanes.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Largest group count of the tiled I8 path (per-thread scale buffers); more runs the
 * reference. */
#define MAX_GROUPS 1024
#define IT 8     /* rows per I8 tile, one float lane each */
#define PAIR 128 /* activation bytes per pair of groups */

/* ------------------------------------------------------------------ prep ---- */

int colibri_affine_prep_i8_avx2(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out) {
    const size_t whole = (size_t)((w->I + 63) / 64 / 2) * PAIR; /* bytes in whole pairs */
    for (size_t b = 0; b < whole; b += PAIR) {
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)(qx + b)); /* group 0, chunks 0 1 */
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)(qx + b + 32)); /* group 0, chunks 2 3 */
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(qx + b + 64));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(qx + b + 96));
        _mm256_storeu_si256((__m256i *)(out + b), _mm256_permute2x128_si256(a0, b0, 0x20));
        _mm256_storeu_si256((__m256i *)(out + b + 32), _mm256_permute2x128_si256(a0, b0, 0x31));
        _mm256_storeu_si256((__m256i *)(out + b + 64), _mm256_permute2x128_si256(a1, b1, 0x20));
        _mm256_storeu_si256((__m256i *)(out + b + 96), _mm256_permute2x128_si256(a1, b1, 0x31));
    }
    memcpy(out + whole, qx + whole, n - whole); /* an odd last group stays in plain order */
    return 1;
}

/* ------------------------------------------------------------- I8 family ---- */

/* The low planes (and Q3's high planes, qword-duplicated) of a pair of groups at p, lane
 * k = group k; one = 1 (the row's odd last group) reads one block, the other lane zero. */
ALWAYS_INLINE void load_pair(const uint8_t *p, int q3, int one, __m256i *low, __m256i *high) {
    if (!q3) {
        *low = one ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p))
                   : _mm256_loadu_si256((const __m256i *)p);
        return;
    }
    const __m128i l0 = _mm_loadu_si128((const __m128i *)p);
    long long h0;
    memcpy(&h0, p + 16, 8);
    if (one) {
        *low = _mm256_zextsi128_si256(l0);
        *high = _mm256_zextsi128_si256(_mm_set1_epi64x(h0));
        return;
    }
    *low = _mm256_inserti128_si256(_mm256_castsi128_si256(l0), _mm_loadu_si128((const __m128i *)(p + 24)), 1);
    /* bytes 16..47: qwords [h0, low1, low1', h1] */
    *high = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(p + 16)), _MM_SHUFFLE(3, 3, 0, 0));
}

/* Chunk c of a pair's codes: two bits of the low plane, plus 4 where Q3's bit is set. */
ALWAYS_INLINE __m256i pair_chunk(__m256i low, __m256i high, int c, int q3) {
    __m256i q = _mm256_and_si256(c ? _mm256_srli_epi16(low, 2 * c) : low, _mm256_set1_epi8(3));
    if (q3) { /* qword 0 of a lane wants bit 2c, qword 1 bit 2c + 1: both moved to bit 2 */
        const __m256i h = c == 0 ? _mm256_sllv_epi64(high, _mm256_setr_epi64x(2, 1, 2, 1))
                                 : _mm256_srlv_epi64(high, _mm256_setr_epi64x(2 * c - 2, 2 * c - 1, 2 * c - 2,
                                                                              2 * c - 1));
        q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(4)));
    }
    return q;
}

/* One row's dot vector of a pair: lanes 4k..4k+3 hold group k's partial sums. */
ALWAYS_INLINE __m256i pair_dot(const uint8_t *p, int q3, int one, const __m256i X[4]) {
    __m256i low, high = _mm256_setzero_si256();
    load_pair(p, q3, one, &low, &high);
    __m256i d = _mm256_maddubs_epi16(pair_chunk(low, high, 0, q3), X[0]);
#pragma GCC unroll 3
    for (int c = 1; c < 4; c++) d = _mm256_add_epi16(d, _mm256_maddubs_epi16(pair_chunk(low, high, c, q3), X[c]));
    return _mm256_madd_epi16(d, _mm256_set1_epi16(1));
}

/* 8 rows' pair vectors to group sums, lane = row: A (the pair's first group), B. */
ALWAYS_INLINE void pair_sums8(const __m256i v[8], __m256i *A, __m256i *B) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67); /* [r0..3 A | r0..3 B] */
    *A = _mm256_permute2x128_si256(q0, q1, 0x20);
    *B = _mm256_permute2x128_si256(q0, q1, 0x31);
}


/* The tile's (s, m) as f32, lane = row: smT[2g] = s, smT[2g + 1] = m (8 floats each).
 * Each row's float16 pairs are converted four groups (8 halves) at a time and the 8
 * rows transposed, so column 2k is group g0 + k's s and column 2k + 1 its m. */
static void tile_scales(const uint16_t *const sm[IT], int G, float *smT) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int n = G - g0 < 4 ? G - g0 : 4;
        __m256 in[IT], col[IT];
        for (int r = 0; r < IT; r++) {
            uint16_t h[8] = {0};
            const uint16_t *src = sm[r] + 2 * (size_t)g0;
            __m128i v;
            if (n == 4) v = _mm_loadu_si128((const __m128i *)src);
            else {
                memcpy(h, src, (size_t)n * 2 * sizeof(uint16_t));
                v = _mm_loadu_si128((const __m128i *)h);
            }
            in[r] = _mm256_cvtph_ps(v);
        }
        transpose8(in, col);
        for (int k = 0; k < 2 * n; k++) _mm256_storeu_ps(smT + 8 * (2 * (size_t)g0 + k), col[k]);
    }
}

/* The reference float step of group g for 8 rows (lane = row). */
ALWAYS_INLINE __m256 step8(__m256 acc, __m256i isum, const float *smT, int g, int32_t xsum, __m256 xs) {
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_loadu_ps(smT + 16 * (size_t)g), xs));
    const __m256 b =
        _mm256_mul_ps(_mm256_set1_ps((float)xsum), _mm256_mul_ps(_mm256_loadu_ps(smT + 16 * (size_t)g + 8), xs));
    return _mm256_add_ps(acc, _mm256_add_ps(a, b));
}

/* One 8-row tile on activation row s: whole pairs, then an odd last group. */
ALWAYS_INLINE __m256 tile8(const mm_job *j, const uint8_t *const rows[IT], int s, const float *smT, int q3) {
    const int G = j->G, B = q3 ? 48 : 32, pairs = G / 2;
    const size_t pf = IT * j->wrow; /* the next tile's same position */
    const int8_t *xp = j->qxp + (size_t)s * j->ldx;
    const int32_t *gsum = j->gsum + (size_t)s * G;
    const __m256 xs = _mm256_set1_ps(j->xs[s]);
    __m256 acc = _mm256_setzero_ps();
    for (int pr = 0; pr < pairs; pr++) {
        __m256i X[4], v[IT], A, Bv;
        for (int c = 0; c < 4; c++) X[c] = _mm256_loadu_si256((const __m256i *)(xp + (size_t)pr * PAIR + 32 * c));
        for (int r = 0; r < IT; r++) {
            const uint8_t *p = rows[r] + (size_t)pr * B;
            _mm_prefetch((const char *)p + pf, _MM_HINT_T1);
            if (q3) _mm_prefetch((const char *)p + pf + 47, _MM_HINT_T1);
            v[r] = pair_dot(p, q3, 0, X);
        }
        pair_sums8(v, &A, &Bv);
        acc = step8(acc, A, smT, 2 * pr, gsum[2 * pr], xs);
        acc = step8(acc, Bv, smT, 2 * pr + 1, gsum[2 * pr + 1], xs);
    }
    if (G & 1) { /* the odd last group: activations from the plain order, lane 1 zero */
        const int g = G - 1;
        __m256i X[4], v[IT], A, Bv;
        for (int c = 0; c < 4; c++)
            X[c] = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(xp + (size_t)g * 64 + 16 * c)));
        for (int r = 0; r < IT; r++) v[r] = pair_dot(rows[r] + (size_t)pairs * B, q3, 1, X);
        pair_sums8(v, &A, &Bv);
        acc = step8(acc, A, smT, g, gsum[g], xs);
    }
    return acc;
}


void colibri_affine_i8_rows_avx2(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q3 = w->fmt == COLIBRI_FMT_Q3, G = j->G;
    if (G > MAX_GROUPS || j->qxp == NULL) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    static _Thread_local float tile_sm[2 * IT * MAX_GROUPS];
    float *smT = tile_sm; /* the thread's buffer, looked up once */
    const uint16_t *scales = (const uint16_t *)w->scales;
    for (int o = o0; o < o1; o += IT) {
        const int n = o1 - o < IT ? o1 - o : IT;
        const uint8_t *rows[IT];
        const uint16_t *sm[IT];
        for (int r = 0; r < IT; r++) { /* lanes past the tile repeat its first row */
            const size_t row = (size_t)(o + (r < n ? r : 0));
            rows[r] = (const uint8_t *)w->data + row * j->wrow;
            sm[r] = scales + row * 2 * G;
        }
        tile_scales(sm, G, smT);
        for (int s = 0; s < j->S; s++) {
            const __m256 acc = q3 ? tile8(j, rows, s, smT, 1) : tile8(j, rows, s, smT, 0);
            _mm256_maskstore_ps(j->y + (size_t)s * w->O + o, lanes_below(n), acc);
        }
    }
}

/* ------------------------------------------------------------ F32 family ---- */

#define NS 4 /* activation rows sharing one pass over a weight row (prefill) */

/* Q3's 64 codes of the block at p as bytes, c[0] inputs 0..31 and c[1] 32..63 (one
 * 128-bit lane a chunk of 16): the low plane broadcast and shifted per lane, masked to two
 * bits, plus 4 where the high-plane bit (byte j of chunk c: bit 2c + j / 8 of byte j % 8)
 * is set. */
ALWAYS_INLINE void q3_codes(const uint8_t *p, __m256i c[2]) {
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i low = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    long long h;
    memcpy(&h, p + 16, 8);
    const __m256i hv = _mm256_set1_epi64x(h);
    const __m256i b01 = _mm256_setr_epi64x(0x0101010101010101LL, 0x0202020202020202LL, 0x0404040404040404LL,
                                           0x0808080808080808LL);
    const __m256i b23 = _mm256_slli_epi64(b01, 4);
    c[0] = _mm256_and_si256(_mm256_srlv_epi32(low, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), three);
    c[1] = _mm256_and_si256(_mm256_srlv_epi32(low, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), three);
    c[0] = _mm256_or_si256(c[0], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, b01), b01), four));
    c[1] = _mm256_or_si256(c[1], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, b23), b23), four));
}

/* Q3's F32 layout of x: per 32 inputs, xp[32b + 8m + d] = x[32b + 4d + m], so that byte m
 * of every dword of a code vector (vpermps reads its low 3 bits after a shift by 8m)
 * meets its input. */
int colibri_affine_prep_f32_avx2(const colibri_weight *w, const float *x, int I, size_t n, float *out) {
    (void)w;
    memset(out, 0, n * sizeof(float));
    for (int i = 0; i < I; i++) out[(i & ~31) + 8 * (i & 3) + ((i & 31) >> 2)] = x[i];
    return 1;
}

/* Row `row` against N activation rows x[n] (zero padded to whole groups): a[n][k] sums
 * the products of every eighth-of-a-group k % 4. */
ALWAYS_INLINE void f32_acc(const mm_job *j, const uint8_t *row, const float *smf, const float *const *x, int N,
                           int q3, __m256 a[NS][4]) {
    const int B = q3 ? 24 : 16;
    const __m256 base = q3 ? _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7) : _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < 4; k++) a[n][k] = _mm256_setzero_ps();
    for (int g = 0; g < j->G; g++) {
        const uint8_t *p = row + (size_t)g * B;
        _mm_prefetch((const char *)p + 1024, _MM_HINT_T0);
        const __m256 t = _mm256_fmadd_ps(base, _mm256_set1_ps(smf[2 * g]), _mm256_set1_ps(smf[2 * g + 1]));
        /* Q2: eighth e (inputs 8e..8e+7) = low-plane bytes 8(e % 2).. widened and shifted by
         * 2(e / 2), the next code in the index's bit 2 ignored by the period-4 table.
         * Q3: eighth e = byte e % 4 of each dword of c[e / 4] (the prep_f32 layout). */
        __m256i v[2];
        if (q3) q3_codes(p, v);
        else {
            v[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
            v[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
        }
#pragma GCC unroll 8
        for (int e = 0; e < 8; e++) {
            const int sh = q3 ? 8 * (e & 3) : 2 * (e >> 1);
            const __m256i src = q3 ? v[e >> 2] : v[e & 1];
            const __m256i idx = sh ? _mm256_srli_epi32(src, sh) : src;
            const __m256 wv = _mm256_permutevar8x32_ps(t, idx);
            for (int n = 0; n < N; n++)
                a[n][e & 3] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[n] + (size_t)g * 64 + 8 * e), a[n][e & 3]);
        }
    }
}


/* Row o's (s, m) pairs as floats (G pairs, interleaved). */
static void row_scales(const uint16_t *sm, int G, float *out) {
    int i = 0;
    for (; i + 8 <= 2 * G; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + i))));
    if (i < 2 * G) {
        uint16_t h[8] = {0};
        memcpy(h, sm + i, (size_t)(2 * G - i) * sizeof(uint16_t));
        float f[8];
        _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
        memcpy(out + i, f, (size_t)(2 * G - i) * sizeof(float));
    }
}

/* Row o against activation rows [s0, s0 + N). */
ALWAYS_INLINE void f32_row_n(const mm_job *j, int o, const float *smf, int s0, int N, int q3) {
    const colibri_weight *w = j->w;
    const float *x[NS];
    for (int n = 0; n < N; n++) x[n] = j->xp + (size_t)(s0 + n) * j->ldx;
    __m256 a[NS][4];
    f32_acc(j, (const uint8_t *)w->data + (size_t)o * j->wrow, smf, x, N, q3, a);
    for (int n = 0; n < N; n++)
        j->y[(size_t)(s0 + n) * w->O + o] =
            hsum_ps(_mm256_add_ps(_mm256_add_ps(a[n][0], a[n][1]), _mm256_add_ps(a[n][2], a[n][3])));
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

void colibri_affine_f32_rows_avx2(const mm_job *j, int o0, int o1) {
    if (j->xp == NULL || j->G > MAX_GROUPS) { /* no padded copy of x: whole-group reads would run past it */
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    if (j->w->fmt == COLIBRI_FMT_Q3) f32_rows_q(j, o0, o1, 1);
    else f32_rows_q(j, o0, o1, 0);
}
