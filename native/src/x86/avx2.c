/* AVX2 + FMA kernels (no VNNI).
 *
 * Every weight row is read as one sequential stream with a software prefetch ahead
 * of it (see PF_AHEAD); rows are not interleaved.
 *
 * I8 family: 32 weight bytes per step.  Q4 low/high nibbles (unsigned, q+8) meet a
 * permuted copy of the int8 activations through vpmaddubsw (pairs stay far below the
 * int16 limit: 2*15*127), Q8 uses the sign trick maddubs(|w|, sign(x, w))
 * (2*128*127 < 32767).  FP4 nibbles are first mapped (vpshufb) to their code's integer
 * plus 12 (0..24; pairs 2*24*127) and 12 * sum(x) is removed per group.  Group sums are
 * exact int32, reduced several groups at a time;
 * the float step per group is the reference's, done for a tile of 8 rows with one row
 * per lane, so results are bit-identical to ref.c.  Fast group sizes: per row,
 * multiples of 64, and 32 (each 128-bit half of a block is one group).
 *
 * F32 family: each Q4 nibble becomes an exact float through vpshufb + vcvtdq2ps (see
 * q4_top_byte), per-row formats are widened and converted; FMAs against x in short
 * independent chains (FMA latency, not throughput, bound the one-chain version), and
 * Q4 applies each group's scale once to the group's sum.  FP4 widens the same way, its
 * nibbles first mapped to their codes' integers (the int32 is then code * 2^24).
 */
#pragma GCC target("avx2,fma,bmi,bmi2")

#include "internal.h"
#include "avx2_lanes.h"

#include <immintrin.h>
#include <limits.h>
#include <string.h>

/* Q4 I8 layout: per 64 elements, the 32 even then the 32 odd ones (n is a multiple
 * of 64).  Each 128-bit lane gathers its even then odd bytes; qwords are then sorted. */
static int prep_i8(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out) {
    if (colibri_is_affine(w->fmt)) return colibri_affine_prep_i8_avx2(w, qx, n, out); /* its pair layout */
    if (!colibri_is_nibble(w->fmt)) return 0;
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (size_t b = 0; b < n; b += 64) {
        /* t0 = [even 0..15, even 16..31 | odd 0..15, odd 16..31] of bytes b..b+31 */
        const __m256i t0 = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(qx + b)), split), _MM_SHUFFLE(3, 1, 2, 0));
        const __m256i t1 = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(qx + b + 32)), split), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_si256((__m256i *)(out + b), _mm256_permute2x128_si256(t0, t1, 0x20));
        _mm256_storeu_si256((__m256i *)(out + b + 32), _mm256_permute2x128_si256(t0, t1, 0x31));
    }
    return 1;
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Weights are read in whole 32-byte blocks.  Past the end of a row that meets the next
 * row's bytes, which only ever multiply zero padding of x (harmless, and the same bytes
 * whatever the tiling); past the end of the whole buffer it must not read.  This returns
 * 32 readable bytes holding the last block of `row`, copied into tail (zero-filled) only
 * when the block would cross the buffer's end. */
static const uint8_t *last_block(const mm_job *j, const uint8_t *row, uint8_t tail[32]) {
    const uint8_t *base = (const uint8_t *)j->w->data;
    const size_t end = (size_t)j->w->O * j->wrow;
    const size_t off = (size_t)(row - base) + (j->wrow - 1) / 32 * 32;
    if (off + 32 <= end) return base + off;
    memset(tail, 0, 32);
    memcpy(tail, base + off, end - off);
    return tail;
}

/* Each weight row is read as one sequential stream, prefetched PF_AHEAD bytes ahead.
 * (Computing several rows together, sharing the loads of x, measured about half the
 * DRAM throughput here: the hardware prefetcher follows one stream far better.) */
#ifndef PF_AHEAD
#define PF_AHEAD 4096
#endif

/* ------------------------------------------------------------- I8 family ---- */

#define IT 8            /* rows per I8 tile: one float lane each in the group step */
#define MAX_GROUPS 1024 /* group sums kept on the stack per tile row; more falls back */

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Sums of the four int32 of each 128-bit half of v0..v3:
 * [v0.lo, v1.lo, v2.lo, v3.lo | v0.hi, v1.hi, v2.hi, v3.hi]. */
static inline __m256i halfsums4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
    const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

/* What each FP4 nibble stands for plus 12 (unsigned for vpmaddubsw), in both lanes. */
#define FP4_PLUS12                                                                                  \
    _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, \
                     18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)

/* 8 int32 partial sums of one 64-element Q4 block: unsigned nibbles (q + 8; FP4: its
 * code's integer + 12) against the permuted activations (low nibbles meet the even
 * elements, high ones the odd). */
ALWAYS_INLINE __m256i q4_block_dot(const uint8_t *p, const int8_t *x, const int FP4) {
    _mm_prefetch((const char *)p + PF_AHEAD, _MM_HINT_T0);
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(w, m0f);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m0f);
    if (FP4) {
        lo = _mm256_shuffle_epi8(FP4_PLUS12, lo);
        hi = _mm256_shuffle_epi8(FP4_PLUS12, hi);
    }
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* Stores the 8 sums of v[0..7] (one group each) to out[0..8). */
static inline void store_octet(const __m256i v[8], int32_t *out) {
    const __m256i h0 = halfsums4(v[0], v[1], v[2], v[3]), h1 = halfsums4(v[4], v[5], v[6], v[7]);
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                                         _mm256_permute2x128_si256(h0, h1, 0x31)));
}

/* Sum of the block dots of blocks [b0, b1) of a Q4 row (the last one read from `last`). */
ALWAYS_INLINE __m256i q4_blocks_dot(const uint8_t *row, const uint8_t *last, const int8_t *x, int nblk,
                                    int b0, int b1) {
    __m256i v = _mm256_setzero_si256();
    for (int b = b0; b < b1; b++)
        v = _mm256_add_epi32(v, q4_block_dot(b + 1 < nblk ? row + 32 * (size_t)b : last, x + 64 * (size_t)b, 0));
    return v;
}

/* Group sums for gsz = 64 * bpg, 8 groups (one vector each) at a time. */
static void q4_group_octets(const uint8_t *row, const uint8_t *last, const int8_t *x, int nblk, int G,
                            int bpg, int32_t *isum) {
    for (int g = 0; g < G; g += 8) {
        __m256i v[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const int b0 = (g + k) * bpg, b1 = b0 + bpg < nblk ? b0 + bpg : nblk;
            v[k] = q4_blocks_dot(row, last, x, nblk, b0, b1);
        }
        store_octet(v, isum + g);
    }
}

/* The 16 group sums of 4 blocks of 32-element groups (each 128-bit half of a block is a
 * group) of a row of 32-element groups, nblk blocks, into isum[0..2 nblk) (FP4: the
 * codes' integers + 12; Q4: q + 8). */
ALWAYS_INLINE void halves_group_sums(const uint8_t *row, const uint8_t *last, const int8_t *x, int nblk,
                                     int32_t *isum, const int FP4) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int b = 0;
    for (; b + 4 < nblk; b += 4) { /* 4 whole blocks, none of them the last */
        __m256i d[4];
        for (int k = 0; k < 4; k++)
            d[k] = q4_block_dot(row + 32 * (size_t)(b + k), x + 64 * (size_t)(b + k), FP4);
        const __m256i h = halfsums4(d[0], d[1], d[2], d[3]);
        _mm256_storeu_si256((__m256i *)(isum + 2 * b), _mm256_permutevar8x32_epi32(h, order));
    }
    __m256i d[4]; /* the last (partial) quartet, ending with the last block */
    for (int k = 0; k < 4; k++)
        d[k] = b + k < nblk ? q4_block_dot(b + k + 1 < nblk ? row + 32 * (size_t)(b + k) : last,
                                           x + 64 * (size_t)(b + k), FP4)
                            : _mm256_setzero_si256();
    const __m256i h = halfsums4(d[0], d[1], d[2], d[3]);
    _mm256_storeu_si256((__m256i *)(isum + 2 * b), _mm256_permutevar8x32_epi32(h, order));
}

/* Unsigned group sums dot(q + 8, x) of one Q4 row into isum[0..G) (room for G + 8).
 * Group sums of several blocks are reduced together rather than one horizontal sum
 * per group: 8 groups at a time (gsz a multiple of 64: one vector per group), or the
 * 16 halves of 4 blocks (gsz 32: each 128-bit half of a block is a group). */
static void q4_group_sums(const mm_job *j, const uint8_t *row, const uint8_t *last, const int8_t *x,
                          int32_t *isum) {
    const int nblk = (int)((j->wrow + 31) / 32);
#define Q4_BLK(b) q4_block_dot((b) + 1 < nblk ? row + 32 * (size_t)(b) : last, x + 64 * (size_t)(b), 0)
    if (j->G == 1) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        int b = 0;
        for (; b + 2 < nblk; b += 2) { /* whole blocks, not the last */
            a0 = _mm256_add_epi32(a0, q4_block_dot(row + 32 * (size_t)b, x + 64 * (size_t)b, 0));
            a1 = _mm256_add_epi32(a1, q4_block_dot(row + 32 * (size_t)b + 32, x + 64 * (size_t)b + 64, 0));
        }
        for (; b < nblk; b++) a0 = _mm256_add_epi32(a0, Q4_BLK(b));
        isum[0] = hsum8_epi32(_mm256_add_epi32(a0, a1));
    } else if (j->gsz == 32) {
        halves_group_sums(row, last, x, nblk, isum, 0);
    } else if (j->gsz == 64) { /* the common case: one block per group */
        int b = 0;
        for (; b + 8 < nblk; b += 8) { /* 8 whole blocks, none of them the last */
            __m256i v[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) v[k] = q4_block_dot(row + 32 * (size_t)(b + k), x + 64 * (size_t)(b + k), 0);
            store_octet(v, isum + b);
        }
        __m256i v[8]; /* the last (partial) octet, ending with the last block */
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            v[k] = b + k >= nblk ? _mm256_setzero_si256()
                                 : q4_block_dot(b + k + 1 < nblk ? row + 32 * (size_t)(b + k) : last,
                                                x + 64 * (size_t)(b + k), 0);
        store_octet(v, isum + b);
    } else {
        q4_group_octets(row, last, x, nblk, j->G, j->gsz / 64, isum);
    }
#undef Q4_BLK
}

/* 8 int32 partial sums of a 32-element Q8 block: the sign trick maddubs(|w|, sign(x, w)). */
ALWAYS_INLINE __m256i q8_block_dot(const uint8_t *p, const int8_t *x) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}

/* Signed dot of one Q8 row with x, two blocks (one cache line) per step. */
static int32_t q8_row_sum(const mm_job *j, const uint8_t *row, const uint8_t *last, const int8_t *x) {
    const int nblk = (int)((j->wrow + 31) / 32);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    int b = 0;
    for (; b + 2 < nblk; b += 2) {
        _mm_prefetch((const char *)row + 32 * (size_t)b + PF_AHEAD, _MM_HINT_T0);
        a0 = _mm256_add_epi32(a0, q8_block_dot(row + 32 * (size_t)b, x + 32 * (size_t)b));
        a1 = _mm256_add_epi32(a1, q8_block_dot(row + 32 * (size_t)b + 32, x + 32 * (size_t)b + 32));
    }
    for (; b < nblk; b++)
        a0 = _mm256_add_epi32(a0, q8_block_dot(b + 1 < nblk ? row + 32 * (size_t)b : last, x + 32 * (size_t)b));
    return hsum8_epi32(_mm256_add_epi32(a0, a1));
}



/* The reference float step for a tile of IT rows, lane = row:
 *     acc = acc + (float)(isum[r][g] - k * gsum[g]) * (sc[r][g] * xs)   for g = 0, 1, ...
 * (k = 8 for Q4, 12 for FP4)
 * from acc = 0.0f: products are formed row-wise 8 groups at a time, transposed, then
 * added in group order, i.e. exactly each output's reference sequence. */
static __m256 group_step8(const int32_t *isum, size_t ld, const float *const sc[IT], const int32_t *gsum, int G,
                          float xs_s, int offset) {
    const __m256 xs = _mm256_set1_ps(xs_s);
    __m256 acc = _mm256_setzero_ps();
    for (int g0 = 0; g0 < G; g0 += 8) {
        const int n = G - g0 < 8 ? G - g0 : 8;
        const __m256i m = lanes_below(n);
        const __m256i gv = _mm256_mullo_epi32(_mm256_maskload_epi32(gsum + g0, m), _mm256_set1_epi32(offset));
        __m256 p[8], col[8];
        for (int r = 0; r < IT; r++) {
            const __m256i iv = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(isum + r * ld + g0)), gv);
            const __m256 t = _mm256_mul_ps(_mm256_maskload_ps(sc[r] + g0, m), xs);
            p[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(iv), t);
        }
        transpose8(p, col);
        for (int k = 0; k < n; k++) acc = _mm256_add_ps(acc, col[k]);
    }
    return acc;
}

/* colibri_fp4_scale of G scale bytes, eight at a time. */
static void fp4_scales(const uint8_t *e, int G, float *out) {
    int g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + g)));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
        __m256i bits = _mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(v, _mm256_set1_epi32(1)));
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255)));
        _mm256_storeu_ps(out + g, _mm256_castsi256_ps(bits));
    }
    for (; g < G; g++) out[g] = colibri_fp4_scale(e[g]);
}

static void i8_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (colibri_is_affine(w->fmt)) {
        colibri_affine_i8_rows_avx2(j, o0, o1);
        return;
    }
    const int q4 = w->fmt == COLIBRI_FMT_Q4, fp4 = w->fmt == COLIBRI_FMT_FP4;
    if (fp4 && !(j->G > 1 && j->gsz == 32 && j->G <= MAX_GROUPS)) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    if (!(fp4 || w->fmt == COLIBRI_FMT_Q8 || (q4 && (j->G == 1 || ((j->gsz % 64 == 0 || j->gsz == 32) && j->G <= MAX_GROUPS))))) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    uint8_t tail[IT][32];
    if (j->G == 1) { /* one group: row by row (it stays in L1 across s), the step in scalar */
        for (int o = o0; o < o1; o++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
            const uint8_t *last = last_block(j, row, tail[0]);
            for (int s = 0; s < j->S; s++) {
                int32_t isum;
                if (q4) {
                    q4_group_sums(j, row, last, j->qxp + (size_t)s * j->ldx, &isum);
                    isum -= 8 * j->gsum[s];
                } else {
                    isum = q8_row_sum(j, row, last, j->qx + (size_t)s * j->ldx);
                }
                float acc = 0.0f;
                acc = acc + (float)isum * (w->scales[o] * j->xs[s]);
                j->y[(size_t)s * w->O + o] = acc;
            }
        }
        return;
    }
    /* Group sums of the tile's rows, row r at isum + r * ld: room for 8 past G (sums are
     * stored 8 at a time), and rows not 4 KiB apart (loads would falsely alias stores). */
    int32_t isum[IT * (MAX_GROUPS + 16)];
    static _Thread_local float decoded[IT * MAX_GROUPS]; /* FP4's scales of a tile, as floats */
    const size_t ld = (size_t)((j->G + 7) & ~7) + 8;
    const int nblk = (int)((j->wrow + 31) / 32);
    for (int o = o0; o < o1; o += IT) {
        const int n = o1 - o < IT ? o1 - o : IT;
        const uint8_t *rows[IT], *last[IT];
        const float *sc[IT];
        for (int r = 0; r < IT; r++) { /* missing rows of a short tile: any valid row, unstored */
            rows[r] = (const uint8_t *)w->data + (size_t)(o + (r < n ? r : 0)) * j->wrow;
            last[r] = last_block(j, rows[r], tail[r]);
            if (fp4) {
                const uint8_t *e = (const uint8_t *)w->scales + (size_t)(o + (r < n ? r : 0)) * j->G;
                fp4_scales(e, j->G, decoded + (size_t)r * j->G);
                sc[r] = decoded + (size_t)r * j->G;
            } else {
                sc[r] = w->scales + (size_t)(o + (r < n ? r : 0)) * j->G;
            }
        }
        /* The tile's scales are read only by the step, in 8 short strided runs the
         * hardware prefetcher misses; fetched now they arrive during the group sums. */
        for (int r = 0; r < n; r++)
            for (size_t k = 0; k < (size_t)j->G * sizeof(float); k += 64) _mm_prefetch((const char *)sc[r] + k, _MM_HINT_T0);
        for (int s = 0; s < j->S; s++) {
            for (int r = 0; r < n; r++) {
                const int8_t *x = j->qxp + (size_t)s * j->ldx;
                if (fp4) halves_group_sums(rows[r], last[r], x, nblk, isum + r * ld, 1);
                else q4_group_sums(j, rows[r], last[r], x, isum + r * ld);
            }
            for (int r = n; r < IT; r++) memset(isum + r * ld, 0, (size_t)j->G * sizeof(int32_t));
            _mm256_maskstore_ps(j->y + (size_t)s * w->O + o, lanes_below(n),
                                group_step8(isum, ld, sc, j->gsum + (size_t)s * j->G, j->G, j->xs[s], fp4 ? 12 : 8));
        }
    }
}

/* ------------------------------------------------------------ F32 family ---- */


/* Q4.  A 32-byte block holds 64 weights; dword lane j of the block holds bytes
 * 4j..4j+3.  With v = block ^ 0x88 each nibble n becomes n ^ 8, whose 4-bit two's
 * complement value is n - 8; moved to the top of a byte (hi = v & 0xf0, lo = (v << 4)
 * & 0xf0) and then by vpshufb to the top byte of a zeroed dword, it is the int32
 * (n - 8) * 2^28, which vcvtdq2ps converts exactly.  Output vector k = 2m + h (byte m
 * of each dword, nibble h) thus holds weights 8j + k in lane j: prep_f32 transposes
 * x to match and pre-multiplies it by 2^-28 (exact), so each FMA adds (q - 8) * x.
 * Each block is summed in two short FMA chains, and a group's sum is scaled once. */
static const int8_t q4_top_byte[4][32] = {
#define Q4_SEL(m) {-128, -128, -128, (m), -128, -128, -128, 4 + (m), -128, -128, -128, 8 + (m), \
                   -128, -128, -128, 12 + (m), -128, -128, -128, (m), -128, -128, -128, 4 + (m), \
                   -128, -128, -128, 8 + (m), -128, -128, -128, 12 + (m)}
    Q4_SEL(0), Q4_SEL(1), Q4_SEL(2), Q4_SEL(3)
#undef Q4_SEL
};

/* Q4 F32 layout: per 64 elements, xp[64b + 8k + j] = x[64b + 8j + k] * 2^-28 (FP4:
 * 2^-24), i.e. an 8x8 transpose of each block (whole blocks in registers, the last
 * partial one scalar). */
static int prep_f32(const colibri_weight *w, const float *x, int I, size_t n, float *out) {
    if (w->fmt == COLIBRI_FMT_Q3) return colibri_affine_prep_f32_avx2(w, x, I, n, out); /* its dword-byte order */
    memset(out + I, 0, (n - (size_t)I) * sizeof(float));
    if (!colibri_is_nibble(w->fmt)) {
        memcpy(out, x, (size_t)I * sizeof(float));
        return 1;
    }
    const float unit = w->fmt == COLIBRI_FMT_FP4 ? 0x1p-24f : 0x1p-28f;
    const __m256 k = _mm256_set1_ps(unit);
    int b = 0;
    for (; b + 64 <= I; b += 64) {
        __m256 in[8], t[8];
        for (int r = 0; r < 8; r++) in[r] = _mm256_loadu_ps(x + b + 8 * r);
        transpose8(in, t);
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + b + 8 * r, _mm256_mul_ps(t[r], k));
    }
    memset(out + b, 0, (size_t)(I - b) * sizeof(float));
    for (int i = b; i < I; i++) out[(i & ~63) + ((i & 7) << 3) + ((i >> 3) & 7)] = x[i] * unit;
    return 1;
}

/* The 64 weights of the block at p widened to f32 as (q - 8) * 2^28 (each code lands in
 * the top byte of an int32 lane; prep_f32 scales x by 2^-28 to match): w[2m] pairs with
 * xb + 16m, w[2m + 1] with xb + 16m + 8. */
ALWAYS_INLINE void q4_widen(const uint8_t *p, __m256 w[8], const int FP4) {
    __m256i hi, lo;
    if (FP4) { /* each nibble's code integer as a whole byte: the int32 is code * 2^24 */
        const __m256i tab = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3,
                                             4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        const __m256i m0f = _mm256_set1_epi8(0x0f), v = _mm256_loadu_si256((const __m256i *)p);
        lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, m0f));
        hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f));
    } else {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x88));
        const __m256i mf0 = _mm256_set1_epi8((char)0xf0);
        hi = _mm256_and_si256(v, mf0);
        lo = _mm256_and_si256(_mm256_slli_epi16(v, 4), mf0);
    }
    for (int m = 0; m < 4; m++) {
        const __m256i sel = _mm256_loadu_si256((const __m256i *)q4_top_byte[m]);
        w[2 * m] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, sel));
        w[2 * m + 1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, sel));
    }
}

/* sum over one widened block of w * x, as 8 lanes (lane j: weights 8j..): two FMA
 * chains, the one order every Q4 F32 path uses (single rows and prefill batches alike). */
ALWAYS_INLINE __m256 q4_dot_widened(const __m256 w[8], const float *xb) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int m = 0; m < 4; m++) {
        a0 = _mm256_fmadd_ps(w[2 * m], _mm256_loadu_ps(xb + 16 * m), a0);
        a1 = _mm256_fmadd_ps(w[2 * m + 1], _mm256_loadu_ps(xb + 16 * m + 8), a1);
    }
    return _mm256_add_ps(a0, a1);
}

/* sum over one 64-weight block at p of (q - 8) * x (FP4: code * x), as 8 lanes. */
ALWAYS_INLINE __m256 q4_block_f32(const uint8_t *p, const float *xb, const int FP4) {
    __m256 w[8];
    q4_widen(p, w, FP4);
    return q4_dot_widened(w, xb);
}

/* Where a Q4 weight's scale groups fall on its 64-element blocks (q4_row's MODE). */
enum {
    Q4_WHOLE,  /* groups of bpg whole blocks (gsz a multiple of 64; one group per row) */
    Q4_SPREAD, /* gsz 8, 16 or 32 (8 << lsh): a scale per 8-element lane, loaded and spread */
    Q4_GATHER  /* other multiples of 8: lane_g[8b + j] is the group of lane j of block b */
};

typedef struct {
    int mode, bpg, lsh;
    const int32_t *lane_g;
} q4_plan;

/* Adds block b's sum blk, scaled, to tot (whole-block groups of bpg > 1 blocks are
 * summed in *gacc first, *cnt blocks so far). */
ALWAYS_INLINE __m256 q4_scale_block(const mm_job *j, const int MODE, const q4_plan *qp, const float *sc, int b,
                                    int nblk, __m256 blk, __m256 tot, __m256 *gacc, int *cnt) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (MODE == Q4_SPREAD) {
        const int g0 = b << (3 - qp->lsh);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(j->G - g0), lane); /* no scale read past G */
        const __m256 sv = _mm256_permutevar8x32_ps(_mm256_maskload_ps(sc + g0, m), _mm256_srli_epi32(lane, qp->lsh));
        return _mm256_fmadd_ps(blk, sv, tot);
    }
    if (MODE == Q4_GATHER) {
        const __m256i idx = _mm256_loadu_si256((const __m256i *)(qp->lane_g + 8 * (size_t)b));
        return _mm256_fmadd_ps(blk, _mm256_i32gather_ps(sc, idx, 4), tot);
    }
    if (qp->bpg == 1) return _mm256_fmadd_ps(blk, _mm256_broadcast_ss(sc + b), tot);
    *gacc = _mm256_add_ps(*gacc, blk);
    if (++*cnt < qp->bpg && b + 1 < nblk) return tot;
    tot = _mm256_fmadd_ps(*gacc, _mm256_broadcast_ss(sc + b / qp->bpg), tot);
    *gacc = _mm256_setzero_ps();
    *cnt = 0;
    return tot;
}

/* One Q4 row (data at row, last block readable at last, scales sc) against x.  Two
 * blocks per step give the out-of-order core more independent work (a few % faster). */
ALWAYS_INLINE float q4_row(const mm_job *j, const int MODE, const uint8_t *row, const uint8_t *last,
                           const float *sc, const float *x, const q4_plan *qp, const int FP4) {
    const int nblk = (int)((j->wrow + 31) / 32);
    __m256 tot = _mm256_setzero_ps(), gacc = tot;
    int b = 0, cnt = 0;
    for (; b + 2 < nblk; b += 2) { /* whole blocks, not the last */
        _mm_prefetch((const char *)row + 32 * (size_t)b + PF_AHEAD, _MM_HINT_T0);
        const __m256 b0 = q4_block_f32(row + 32 * (size_t)b, x + 64 * (size_t)b, FP4);
        const __m256 b1 = q4_block_f32(row + 32 * (size_t)b + 32, x + 64 * (size_t)b + 64, FP4);
        tot = q4_scale_block(j, MODE, qp, sc, b, nblk, b0, tot, &gacc, &cnt);
        tot = q4_scale_block(j, MODE, qp, sc, b + 1, nblk, b1, tot, &gacc, &cnt);
    }
    for (; b < nblk; b++) {
        const __m256 blk = q4_block_f32(b + 1 < nblk ? row + 32 * (size_t)b : last, x + 64 * (size_t)b, FP4);
        tot = q4_scale_block(j, MODE, qp, sc, b, nblk, blk, tot, &gacc, &cnt);
    }
    return hsum_ps(tot);
}

/* q4_row for QN activation rows at once (prefill): each block's weights are widened once
 * and applied to every row, and each row keeps its own accumulators through exactly
 * q4_block_f32's and q4_scale_block's operations in q4_row's order, so every output is
 * bit-identical to a one-row call. */
#define QN 4
ALWAYS_INLINE void q4_rows_n(const mm_job *j, const int MODE, const uint8_t *row, const uint8_t *last,
                             const float *sc, const float *const *x, const q4_plan *qp, float *r, const int FP4) {
    const int nblk = (int)((j->wrow + 31) / 32);
    __m256 tot[QN], gacc[QN];
    int cnt[QN];
    for (int n = 0; n < QN; n++) {
        tot[n] = gacc[n] = _mm256_setzero_ps();
        cnt[n] = 0;
    }
    for (int b = 0; b < nblk; b++) {
        if ((b & 1) == 0) _mm_prefetch((const char *)row + 32 * (size_t)b + PF_AHEAD, _MM_HINT_T0);
        __m256 w[8];
        q4_widen(b + 1 < nblk ? row + 32 * (size_t)b : last, w, FP4);
        for (int n = 0; n < QN; n++)
            tot[n] = q4_scale_block(j, MODE, qp, sc, b, nblk, q4_dot_widened(w, x[n] + 64 * (size_t)b), tot[n],
                                    &gacc[n], &cnt[n]);
    }
    for (int n = 0; n < QN; n++) r[n] = hsum_ps(tot[n]);
}

/* 8 weights of an F32/BF16/Q8 row at element i as f32. */
ALWAYS_INLINE __m256 load_w8(int fmt, const uint8_t *row, int i) {
    if (fmt == COLIBRI_FMT_Q8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
    if (fmt == COLIBRI_FMT_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * (size_t)i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)(row + 4 * (size_t)i));
}

/* The last n (< 8) weights of a row at element i, zero-filled, reading nothing past
 * them (no memcpy: a call in the kernel would make GCC keep accumulators in memory). */
ALWAYS_INLINE __m256 load_w8_tail(int fmt, const uint8_t *row, int i, int n) {
    const int esize = fmt == COLIBRI_FMT_F32 ? 4 : fmt == COLIBRI_FMT_BF16 ? 2 : 1;
    const uint8_t *p = row + (size_t)esize * i;
    uint64_t t[4] = {0, 0, 0, 0};
    for (int k = 0; k < n * esize; k++) t[k >> 3] |= (uint64_t)p[k] << (8 * (k & 7));
    const __m256i v = _mm256_setr_epi64x((long long)t[0], (long long)t[1], (long long)t[2], (long long)t[3]);
    if (fmt == COLIBRI_FMT_Q8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    if (fmt == COLIBRI_FMT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
    return _mm256_castsi256_ps(v);
}

/* One row of a per-row format (F32, BF16, Q8) against x: four FMA chains, taking 8
 * elements each in turn (the partial tail goes to the first). */
ALWAYS_INLINE float plain_row(int fmt, const uint8_t *row, int I, const float *x) {
    const int esize = fmt == COLIBRI_FMT_F32 ? 4 : fmt == COLIBRI_FMT_BF16 ? 2 : 1;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int i = 0;
    for (; i + 32 <= I; i += 32) {
        _mm_prefetch((const char *)row + (size_t)esize * i + PF_AHEAD, _MM_HINT_T0);
        for (int k = 0; k < 4; k++)
            a[k] = _mm256_fmadd_ps(load_w8(fmt, row, i + 8 * k), _mm256_loadu_ps(x + i + 8 * k), a[k]);
    }
    for (int k = 0; i < I; i += 8, k++)
        a[k] = _mm256_fmadd_ps(I - i >= 8 ? load_w8(fmt, row, i) : load_w8_tail(fmt, row, i, I - i),
                               _mm256_loadu_ps(x + i), a[k]);
    return hsum_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}

/* Largest row (in 8-element lanes) whose per-lane group table fits on the stack. */
#define MAX_LANES 8192

static void f32_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (colibri_is_affine(w->fmt)) {
        colibri_affine_f32_rows_avx2(j, o0, o1);
        return;
    }
    const int fp4 = w->fmt == COLIBRI_FMT_FP4, q4 = w->fmt == COLIBRI_FMT_Q4 || fp4;
    const int whole = j->G == 1 || j->gsz % 64 == 0;
    const size_t nblk = (j->wrow + 31) / 32; /* Q4 blocks per row */
    if (j->xp == NULL || (q4 && !whole && (j->gsz % 8 != 0 || 8 * nblk > MAX_LANES)) ||
        (fp4 && (j->G < 2 || j->gsz != 32 || j->G > MAX_GROUPS))) { /* FP4: 32-element groups */
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    const int lsh = j->gsz == 8 ? 0 : j->gsz == 16 ? 1 : j->gsz == 32 ? 2 : -1;
    q4_plan qp = {whole ? Q4_WHOLE : lsh >= 0 ? Q4_SPREAD : Q4_GATHER, j->G == 1 ? INT_MAX : j->gsz / 64, lsh,
                  NULL};
    int32_t lane_g[q4 && qp.mode == Q4_GATHER ? MAX_LANES : 1];
    if (q4 && qp.mode == Q4_GATHER) { /* lanes past the row take any valid scale: they meet zeros */
        for (size_t l = 0; l < 8 * nblk; l++) {
            const size_t g = 8 * l / (size_t)j->gsz;
            lane_g[l] = (int32_t)(g < (size_t)j->G ? g : (size_t)j->G - 1);
        }
        qp.lane_g = lane_g;
    }
    const int sb = colibri_x_block_rows(j, sizeof(float), QN);
    for (int s0 = 0; s0 < j->S; s0 += sb) {
        const int s1 = j->S - s0 < sb ? j->S : s0 + sb;
        for (int o = o0; o < o1; o++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
            uint8_t tail[32];
            const uint8_t *last = q4 ? last_block(j, row, tail) : NULL;
            int s = s0;
            if (q4 && !fp4)
                for (; s + QN <= s1; s += QN) {
                    const float *xs[QN];
                    float rs[QN];
                    for (int n = 0; n < QN; n++) xs[n] = j->xp + (size_t)(s + n) * j->ldx;
                    const float *sc = w->scales + (size_t)o * j->G;
                    if (qp.mode == Q4_WHOLE) q4_rows_n(j, Q4_WHOLE, row, last, sc, xs, &qp, rs, 0);
                    else if (qp.mode == Q4_SPREAD) q4_rows_n(j, Q4_SPREAD, row, last, sc, xs, &qp, rs, 0);
                    else q4_rows_n(j, Q4_GATHER, row, last, sc, xs, &qp, rs, 0);
                    for (int n = 0; n < QN; n++) j->y[(size_t)(s + n) * w->O + o] = rs[n];
                }
            float decoded[fp4 ? MAX_GROUPS : 1]; /* FP4: the row's scales as floats */
            if (fp4) fp4_scales((const uint8_t *)w->scales + (size_t)o * j->G, j->G, decoded);
            if (fp4)
                for (; s + QN <= s1; s += QN) {
                    const float *xs[QN];
                    float rs[QN];
                    for (int n = 0; n < QN; n++) xs[n] = j->xp + (size_t)(s + n) * j->ldx;
                    q4_rows_n(j, Q4_SPREAD, row, last, decoded, xs, &qp, rs, 1);
                    for (int n = 0; n < QN; n++) j->y[(size_t)(s + n) * w->O + o] = rs[n];
                }
            for (; s < s1; s++) {
                const float *x = j->xp + (size_t)s * j->ldx;
                float r;
                switch (w->fmt) {
                case COLIBRI_FMT_F32: r = plain_row(COLIBRI_FMT_F32, row, w->I, x); break;
                case COLIBRI_FMT_BF16: r = plain_row(COLIBRI_FMT_BF16, row, w->I, x); break;
                case COLIBRI_FMT_Q8: r = w->scales[o] * plain_row(COLIBRI_FMT_Q8, row, w->I, x); break;
                case COLIBRI_FMT_FP4: r = q4_row(j, Q4_SPREAD, row, last, decoded, x, &qp, 1); break;
                default: {
                    const float *sc = w->scales + (size_t)o * j->G;
                    if (qp.mode == Q4_WHOLE) r = q4_row(j, Q4_WHOLE, row, last, sc, x, &qp, 0);
                    else if (qp.mode == Q4_SPREAD) r = q4_row(j, Q4_SPREAD, row, last, sc, x, &qp, 0);
                    else r = q4_row(j, Q4_GATHER, row, last, sc, x, &qp, 0);
                }
                }
                j->y[(size_t)s * w->O + o] = r;
            }
        }
    }
}

const isa_ops colibri_avx2_ops = {"avx2", f32_rows, i8_rows, prep_f32, prep_i8, 8};
