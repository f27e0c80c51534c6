/* Q2/Q3 (low-bit affine, docs/formats.md) on NEON (aarch64 only).
 *
 * A group's codes come 16 at a time: the low plane shifted by 2k and masked gives inputs
 * 16k..16k+15; Q3's 8-byte high plane doubled to 16 lanes and tested with vtstq_u8 (lane
 * L: bit 2k + L/8) adds 4 where set.
 *
 * I8 family: codes (0..7, so signed bytes as they are) times the int8 activations with
 * vmull_s8, pairwise-accumulated into int32 (exact), reduced per group, then the reference
 * step acc = acc + ((float)isum * (s * xs) + (float)xsum * (m * xs)): bit-identical to
 * ref.c. The activation rows are zero padded past I, so the padded last block needs no
 * tail.
 *
 * Each row's float16 (s, m) pairs are converted once, four an instruction (vcvt_f32_f16,
 * exact), not per group in scalar code.
 *
 * F32 family: codes widened to f32 and dequantised in registers (q * s + m) against the
 * plain x; a last group shorter than 64 inputs runs the reference arithmetic (this ISA
 * keeps no padded copy of x).
 */
#include "internal.h"

#if defined(__aarch64__)
#include <arm_neon.h>

/* Chunk k (inputs 16k..16k+15) of the block's codes. */
static inline uint8x16_t chunk16(uint8x16_t low, uint8x16_t high, int k, int q3) {
    uint8x16_t q;
    switch (k) { /* the shift must be an immediate */
    case 0: q = low; break;
    case 1: q = vshrq_n_u8(low, 2); break;
    case 2: q = vshrq_n_u8(low, 4); break;
    default: q = vshrq_n_u8(low, 6); break;
    }
    q = vandq_u8(q, vdupq_n_u8(3));
    if (q3) {
        const uint8_t b0 = (uint8_t)(1u << (2 * k)), b1 = (uint8_t)(1u << (2 * k + 1));
        const uint8x16_t bits = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
        q = vorrq_u8(q, vandq_u8(vtstq_u8(high, bits), vdupq_n_u8(4)));
    }
    return q;
}

/* A row's G (s, m) float16 pairs as floats, four halves an instruction (exact). */
static void row_scales(const uint16_t *sm, int G, float *out) {
    int i = 0;
    for (; i + 4 <= 2 * G; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sm + i))));
    for (; i < 2 * G; i++) out[i] = colibri_f16(sm[i]);
}

/* Largest group count converted ahead per row (stack); longer rows convert per group. */
#define MAX_GROUPS 1024

static inline uint8x16_t high16(const uint8_t *p, int q3) {
    if (!q3) return vdupq_n_u8(0);
    const uint8x8_t h = vld1_u8(p + 16);
    return vcombine_u8(h, h);
}

void colibri_affine_i8_rows_neon(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q3 = w->fmt == COLIBRI_FMT_Q3, B = colibri_affine_block(w->fmt), G = j->G;
    float smf[2 * MAX_GROUPS];
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        const uint16_t *sm = (const uint16_t *)w->scales + (size_t)o * 2 * G;
        if (G <= MAX_GROUPS) row_scales(sm, G, smf);
        for (int s = 0; s < j->S; s++) {
            const int8_t *x = j->qx + (size_t)s * j->ldx;
            const int32_t *gsum = j->gsum + (size_t)s * G;
            float acc = 0.0f;
            for (int g = 0; g < G; g++) {
                const uint8_t *p = row + (size_t)g * B;
                const uint8x16_t low = vld1q_u8(p), high = high16(p, q3);
                int32x4_t d = vdupq_n_s32(0);
                for (int k = 0; k < 4; k++) {
                    const int8x16_t c = vreinterpretq_s8_u8(chunk16(low, high, k, q3));
                    const int8x16_t xv = vld1q_s8(x + (size_t)g * 64 + 16 * k);
                    d = vpadalq_s16(d, vmull_s8(vget_low_s8(c), vget_low_s8(xv)));
                    d = vpadalq_s16(d, vmull_high_s8(c, xv));
                }
                const float sc = G <= MAX_GROUPS ? smf[2 * g] : colibri_f16(sm[2 * g]);
                const float mn = G <= MAX_GROUPS ? smf[2 * g + 1] : colibri_f16(sm[2 * g + 1]);
                acc = colibri_affine_step(acc, vaddvq_s32(d), gsum[g], sc, mn, j->xs[s]);
            }
            j->y[(size_t)s * w->O + o] = acc;
        }
    }
}

/* ------------------------------------------------------------ F32 family ---- */

static float f32_row(const mm_job *j, const uint8_t *row, const uint16_t *sm, const float *smf, const float *x,
                     int q3) {
    const int B = colibri_affine_block(j->w->fmt), I = j->w->I;
    const int full = I / 64; /* whole groups; a shorter last one below */
    float32x4_t a[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    for (int g = 0; g < full; g++) {
        const uint8_t *p = row + (size_t)g * B;
        const float32x4_t s = vdupq_n_f32(smf[2 * g]), m = vdupq_n_f32(smf[2 * g + 1]);
        const uint8x16_t low = vld1q_u8(p), high = high16(p, q3);
        for (int k = 0; k < 4; k++) {
            const uint8x16_t c = chunk16(low, high, k, q3);
            const uint16x8_t h0 = vmovl_u8(vget_low_u8(c)), h1 = vmovl_high_u8(c);
            const uint32x4_t u[4] = {vmovl_u16(vget_low_u16(h0)), vmovl_high_u16(h0), vmovl_u16(vget_low_u16(h1)),
                                     vmovl_high_u16(h1)};
            const float *xk = x + (size_t)g * 64 + 16 * k;
            for (int q = 0; q < 4; q++) {
                const float32x4_t wv = vfmaq_f32(m, vcvtq_f32_u32(u[q]), s);
                a[q] = vfmaq_f32(a[q], wv, vld1q_f32(xk + 4 * q));
            }
        }
    }
    float r = vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])));
    if (full * 64 < I) { /* the last, shorter group */
        const float s = colibri_f16(sm[2 * full]), m = colibri_f16(sm[2 * full + 1]);
        for (int i = full * 64; i < I; i++) r += ((float)colibri_affine_at(j->w->fmt, row, i) * s + m) * x[i];
    }
    return r;
}

void colibri_affine_f32_rows_neon(const mm_job *j, int o0, int o1) {
    const colibri_weight *w = j->w;
    const int q3 = w->fmt == COLIBRI_FMT_Q3;
    if (j->G > MAX_GROUPS) {
        colibri_ref_f32_rows(j, o0, o1);
        return;
    }
    float smf[2 * MAX_GROUPS];
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
        const uint16_t *sm = (const uint16_t *)w->scales + (size_t)o * 2 * j->G;
        row_scales(sm, j->G, smf);
        for (int s = 0; s < j->S; s++)
            j->y[(size_t)s * w->O + o] = f32_row(j, row, sm, smf, j->x + (size_t)s * w->I, q3);
    }
}
#endif
