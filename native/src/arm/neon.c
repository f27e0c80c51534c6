/* NEON kernels (aarch64 only; not compiled on x86).
 *
 * Deliberately simple: one output row at a time, plain activation layout.
 * I8 family: int8 x int8 products widened with vmull_s8 and pairwise-accumulated
 * into int32 (vpadalq_s16) — exact — per scale group, then the reference float
 * step, so results are bit-identical to ref.c.  Q4 and FP4 nibbles are unpacked with
 * vand/vshr, turned into their integers by a table lookup (vqtbl1q_s8: n - 8 for Q4,
 * the e2m1 code's integer for FP4) and interleaved with vzip to restore element order.
 * F32 family: F32/BF16/Q8 weights widened to f32 with vfmaq; Q4 and FP4 the same way
 * from their integers, scaled per group (groups of a multiple of 32; others use the
 * reference).
 */
#include "internal.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <limits.h>
#include <string.h>

/* 16 bytes at p, zero-filled past n. */
static inline uint8x16_t load16(const uint8_t *p, size_t n) {
    if (n >= 16) return vld1q_u8(p);
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, n);
    return vld1q_u8(tmp);
}

/* What each nibble of a Q4 (n - 8) or FP4 (its code's integer) weight stands for. */
static inline int8x16_t nibble_table(int fmt) {
    static const int8_t q4[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
    return vld1q_s8(fmt == COLIBRI_FMT_FP4 ? colibri_fp4_values : q4);
}

/* The 32 integers of 16 bytes of nibbles, in element order (low nibble first). */
static inline int8x16x2_t nibbles32(uint8x16_t v, int8x16_t tab) {
    const int8x16_t lo = vqtbl1q_s8(tab, vandq_u8(v, vdupq_n_u8(15)));
    const int8x16_t hi = vqtbl1q_s8(tab, vshrq_n_u8(v, 4));
    return vzipq_s8(lo, hi);
}

static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}

static float i8_one(const mm_job *j, const uint8_t *row, int o, int s) {
    const colibri_weight *w = j->w;
    const int8_t *x = j->qx + (size_t)s * j->ldx;
    const float xs = j->xs[s];
    const int q4 = colibri_is_nibble(w->fmt);
    const int8x16_t tab = nibble_table(w->fmt);
    const int E = q4 ? 32 : 16; /* elements per 16-byte step */
    const size_t nbytes = j->wrow;
    const int nsteps = (int)((nbytes + 15) / 16);
    const int cpg = j->G == 1 ? INT_MAX : j->gsz / E;
    float acc = 0.0f;
    int32x4_t gacc = vdupq_n_s32(0);
    for (int k = 0, g = 0, cnt = 0; k < nsteps; k++) {
        const uint8x16_t v = load16(row + 16 * (size_t)k, nbytes - 16 * (size_t)k);
        if (q4) {
            const int8x16x2_t z = nibbles32(v, tab); /* element order 0..31 */
            gacc = dot16(gacc, z.val[0], vld1q_s8(x + 32 * (size_t)k));
            gacc = dot16(gacc, z.val[1], vld1q_s8(x + 32 * (size_t)k + 16));
        } else {
            gacc = dot16(gacc, vreinterpretq_s8_u8(v), vld1q_s8(x + 16 * (size_t)k));
        }
        if (++cnt == cpg || k == nsteps - 1) {
            const int32_t isum = vaddvq_s32(gacc);
            acc = acc + (float)isum * (colibri_group_scale(w, (size_t)o, j->G, g) * xs);
            gacc = vdupq_n_s32(0);
            cnt = 0;
            g++;
        }
    }
    return acc;
}

static void i8_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (colibri_is_affine(w->fmt)) {
        colibri_affine_i8_rows_neon(j, o0, o1);
        return;
    }
    const int q4 = colibri_is_nibble(w->fmt);
    if (!(w->fmt == COLIBRI_FMT_Q8 || (q4 && (j->G == 1 || j->gsz % 32 == 0)))) {
        colibri_ref_i8_rows(j, o0, o1);
        return;
    }
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        for (int s = 0; s < j->S; s++) j->y[(size_t)s * w->O + o] = i8_one(j, row, o, s);
    }
}

static float f32_one(const colibri_weight *w, const uint8_t *row, const float *x) {
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
    const int I = w->I;
    int i = 0;
    for (; i + 8 <= I; i += 8) {
        float32x4_t w0, w1;
        if (w->fmt == COLIBRI_FMT_F32) {
            w0 = vld1q_f32((const float *)row + i);
            w1 = vld1q_f32((const float *)row + i + 4);
        } else if (w->fmt == COLIBRI_FMT_BF16) {
            const uint16x8_t h = vld1q_u16((const uint16_t *)row + i);
            w0 = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
            w1 = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
        } else { /* Q8 */
            const int16x8_t h = vmovl_s8(vld1_s8((const int8_t *)row + i));
            w0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
            w1 = vcvtq_f32_s32(vmovl_high_s16(h));
        }
        a0 = vfmaq_f32(a0, w0, vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, w1, vld1q_f32(x + i + 4));
    }
    float acc = vaddvq_f32(vaddq_f32(a0, a1));
    for (; i < I; i++) {
        float wv;
        if (w->fmt == COLIBRI_FMT_F32) wv = ((const float *)row)[i];
        else if (w->fmt == COLIBRI_FMT_BF16) {
            uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
            memcpy(&wv, &u, sizeof wv);
        } else wv = (float)((const int8_t *)row)[i];
        acc += wv * x[i];
    }
    return acc;
}

/* One Q4/FP4 row (groups of a multiple of 32) against x: 32 weights a step, their
 * integers widened to f32 and scaled by the group's factor, four FMA chains; the last
 * partial step element by element (x is not padded). */
static float nibble_f32_one(const mm_job *j, const uint8_t *row, int o, const float *x) {
    const colibri_weight *w = j->w;
    const int I = w->I, full = I / 32, cps = j->gsz / 32; /* steps per group */
    const int8x16_t tab = nibble_table(w->fmt);
    float32x4_t a[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    float sc = 0.0f;
    for (int k = 0; k < full; k++) {
        if (k % cps == 0) sc = colibri_group_scale(w, (size_t)o, j->G, k / cps);
        const int8x16x2_t z = nibbles32(vld1q_u8(row + 16 * (size_t)k), tab);
        for (int h = 0; h < 2; h++) {
            const int16x8_t lo = vmovl_s8(vget_low_s8(z.val[h])), hi = vmovl_high_s8(z.val[h]);
            const float *xk = x + 32 * (size_t)k + 16 * h;
            const float32x4_t w0 = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), sc);
            const float32x4_t w1 = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), sc);
            const float32x4_t w2 = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), sc);
            const float32x4_t w3 = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), sc);
            a[0] = vfmaq_f32(a[0], w0, vld1q_f32(xk));
            a[1] = vfmaq_f32(a[1], w1, vld1q_f32(xk + 4));
            a[2] = vfmaq_f32(a[2], w2, vld1q_f32(xk + 8));
            a[3] = vfmaq_f32(a[3], w3, vld1q_f32(xk + 12));
        }
    }
    float acc = vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])));
    int8_t vals[16];
    vst1q_s8(vals, tab);
    for (int i = 32 * full; i < I; i++) {
        const int n = (row[i >> 1] >> ((i & 1) * 4)) & 15;
        acc += ((float)vals[n] * colibri_group_scale(w, (size_t)o, j->G, i / j->gsz)) * x[i];
    }
    return acc;
}

static void f32_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (colibri_is_affine(w->fmt)) {
        colibri_affine_f32_rows_neon(j, o0, o1);
        return;
    }
    if (colibri_is_nibble(w->fmt)) {
        if (j->gsz % 32 != 0) {
            colibri_ref_f32_rows(j, o0, o1);
            return;
        }
        for (int o = o0; o < o1; o++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
            for (int s = 0; s < j->S; s++) j->y[(size_t)s * w->O + o] = nibble_f32_one(j, row, o, j->x + (size_t)s * w->I);
        }
        return;
    }
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        for (int s = 0; s < j->S; s++) {
            float r = f32_one(w, row, j->x + (size_t)s * w->I);
            if (w->fmt == COLIBRI_FMT_Q8) r *= w->scales[o];
            j->y[(size_t)s * w->O + o] = r;
        }
    }
}

const isa_ops colibri_neon_ops = {"neon", f32_rows, i8_rows, NULL, NULL, 4};
#endif
