/* NEON kernels (aarch64 only; not compiled on x86).
 *
 * Deliberately simple: one output row at a time, plain activation layout.
 * I8 family: int8 x int8 products widened with vmull_s8 and pairwise-accumulated
 * into int32 (vpadalq_s16) — exact — per scale group, then the reference float
 * step, so results are bit-identical to ref.c.  Q4 nibbles are unpacked with
 * vand/vshr and interleaved with vzip to restore element order.
 * F32 family: F32/BF16/Q8 weights widened to f32 with vfmaq; Q4 uses the reference.
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

static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}

static float i8_one(const mm_job *j, const uint8_t *row, int o, int s) {
    const colibri_weight *w = j->w;
    const int8_t *x = j->qx + (size_t)s * j->ldx;
    const float *sc = w->scales + (size_t)o * j->G;
    const float xs = j->xs[s];
    const int q4 = w->fmt == COLIBRI_FMT_Q4;
    const int E = q4 ? 32 : 16; /* elements per 16-byte step */
    const size_t nbytes = j->wrow;
    const int nsteps = (int)((nbytes + 15) / 16);
    const int cpg = j->G == 1 ? INT_MAX : j->gsz / E;
    float acc = 0.0f;
    int32x4_t gacc = vdupq_n_s32(0);
    for (int k = 0, g = 0, cnt = 0; k < nsteps; k++) {
        const uint8x16_t v = load16(row + 16 * (size_t)k, nbytes - 16 * (size_t)k);
        if (q4) {
            const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), vdupq_n_s8(8));
            const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(8));
            const int8x16x2_t z = vzipq_s8(lo, hi); /* element order 0..31 */
            gacc = dot16(gacc, z.val[0], vld1q_s8(x + 32 * (size_t)k));
            gacc = dot16(gacc, z.val[1], vld1q_s8(x + 32 * (size_t)k + 16));
        } else {
            gacc = dot16(gacc, vreinterpretq_s8_u8(v), vld1q_s8(x + 16 * (size_t)k));
        }
        if (++cnt == cpg || k == nsteps - 1) {
            const int32_t isum = vaddvq_s32(gacc);
            acc = acc + (float)isum * (sc[g] * xs);
            gacc = vdupq_n_s32(0);
            cnt = 0;
            g++;
        }
    }
    return acc;
}

static void i8_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q4 = w->fmt == COLIBRI_FMT_Q4;
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

static void f32_rows(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    if (w->fmt == COLIBRI_FMT_Q4) {
        colibri_ref_f32_rows(j, o0, o1);
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
