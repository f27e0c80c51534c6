/* Portable C reference kernels.
 *
 * For the I8 family this file *defines* the arithmetic every ISA must reproduce bit
 * for bit: per output, per scale group in increasing order,
 *     isum = exact int32 dot(q_w, q_x) over the group
 *     acc  = acc + (float)isum * (wscale[o, g] * xs)
 * starting from acc = 0.0f, with no contraction (-ffp-contract=off).
 * Q2/Q3 (unsigned codes with a minimum) add the minimum's share per group:
 *     acc  = acc + ((float)isum * (s * xs) + (float)xsum * (m * xs))
 * with xsum the exact int32 sum of q_x over the group (colibri_affine_step).
 * The F32 family only has to be accurate (and batch independent), not bit-exact.
 */
#include "internal.h"

#include <math.h>
#include <string.h>

/* Round half to even for |v| <= 2^22 without libm, so the loop vectorises and gives
 * the same bits on every compiler/ISA (plain IEEE add and subtract). */
static inline float rint_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

void colibri_quant_row(const float *x, int I, int8_t *q, size_t ldq, float *xs) {
    float amax = 0.0f;
    for (int i = 0; i < I; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    *xs = s;
    if (!(s > 0.0f) || isinf(s)) { /* zero row (or non-finite): all-zero codes */
        *xs = (s > 0.0f) ? s : 0.0f;
        memset(q, 0, ldq);
        return;
    }
    for (int i = 0; i < I; i++) {
        float v = x[i] / s;
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        v = (v == v) ? v : 0.0f;
        q[i] = (int8_t)rint_even(v);
    }
    memset(q + I, 0, ldq - (size_t)I);
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

const int8_t colibri_fp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int nibble_at(const uint8_t *row, int i) { return (row[i >> 1] >> ((i & 1) * 4)) & 15; }

static inline int q4_at(const uint8_t *row, int i) { return nibble_at(row, i) - 8; }

/* The integer code i of a nibble row of format fmt stands for (Q4 or FP4). */
static inline int code_at(int fmt, const uint8_t *row, int i) {
    return fmt == COLIBRI_FMT_FP4 ? colibri_fp4_values[nibble_at(row, i)] : q4_at(row, i);
}

float colibri_ref_f32_one(const mm_job *j, int o, int s) {
    const colibri_weight *w = j->w;
    const int I = w->I;
    const float *x = j->x + (size_t)s * I;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
    float acc[8] = {0};
    switch (w->fmt) {
    case COLIBRI_FMT_F32: {
        const float *r = (const float *)row;
        for (int i = 0; i < I; i++) acc[i & 7] += r[i] * x[i];
        break;
    }
    case COLIBRI_FMT_BF16: {
        const uint16_t *r = (const uint16_t *)row;
        for (int i = 0; i < I; i++) acc[i & 7] += bf16_to_f32(r[i]) * x[i];
        break;
    }
    case COLIBRI_FMT_Q8: {
        const int8_t *r = (const int8_t *)row;
        const float sc = w->scales[o];
        for (int i = 0; i < I; i++) acc[i & 7] += ((float)r[i] * sc) * x[i];
        break;
    }
    case COLIBRI_FMT_Q2:
    case COLIBRI_FMT_Q3: { /* the dequantised weight q * s + m, as formats/affine.py */
        for (int g = 0; g < j->G; g++) {
            const int i0 = g * j->gsz;
            const int i1 = i0 + j->gsz < I ? i0 + j->gsz : I;
            float sc, mn;
            colibri_affine_sm(w, (size_t)o, j->G, g, &sc, &mn);
            for (int i = i0; i < i1; i++) acc[i & 7] += ((float)colibri_affine_at(w->fmt, row, i) * sc + mn) * x[i];
        }
        break;
    }
    default: { /* Q4 and FP4: the code's integer times the group's scale */
        for (int g = 0; g < j->G; g++) {
            const int i0 = g * j->gsz;
            const int i1 = i0 + j->gsz < I ? i0 + j->gsz : I;
            const float sc = colibri_group_scale(w, (size_t)o, j->G, g);
            for (int i = i0; i < i1; i++)
                acc[i & 7] += ((float)code_at(w->fmt, row, i) * sc) * x[i];
        }
        break;
    }
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float colibri_ref_i8_one(const mm_job *j, int o, int s) {
    const colibri_weight *w = j->w;
    if (w->fmt == COLIBRI_FMT_F32 || w->fmt == COLIBRI_FMT_BF16) return colibri_ref_f32_one(j, o, s);
    const int I = w->I;
    const int8_t *q = j->qx + (size_t)s * j->ldx;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)o * j->wrow;
    const float xs = j->xs[s];
    float acc = 0.0f;
    if (colibri_is_affine(w->fmt)) { /* the defining arithmetic of Q2/Q3's I8 family */
        for (int g = 0; g < j->G; g++) {
            const int i0 = g * j->gsz;
            const int i1 = i0 + j->gsz < I ? i0 + j->gsz : I;
            int32_t isum = 0;
            for (int i = i0; i < i1; i++) isum += colibri_affine_at(w->fmt, row, i) * q[i];
            float sc, mn;
            colibri_affine_sm(w, (size_t)o, j->G, g, &sc, &mn);
            acc = colibri_affine_step(acc, isum, j->gsum[(size_t)s * j->G + g], sc, mn, xs);
        }
        return acc;
    }
    for (int g = 0; g < j->G; g++) {
        const int i0 = g * j->gsz;
        const int i1 = i0 + j->gsz < I ? i0 + j->gsz : I;
        int32_t isum = 0;
        if (w->fmt == COLIBRI_FMT_Q8) {
            const int8_t *r = (const int8_t *)row;
            for (int i = i0; i < i1; i++) isum += (int32_t)r[i] * q[i];
        } else if (w->fmt == COLIBRI_FMT_FP4) {
            for (int i = i0; i < i1; i++) isum += colibri_fp4_values[nibble_at(row, i)] * q[i];
        } else {
            for (int i = i0; i < i1; i++) isum += q4_at(row, i) * q[i];
        }
        acc = acc + (float)isum * (colibri_group_scale(w, (size_t)o, j->G, g) * xs);
    }
    return acc;
}

void colibri_ref_f32_rows(const mm_job *j, int o0, int o1) {
    const int O = j->w->O;
    for (int o = o0; o < o1; o++)
        for (int s = 0; s < j->S; s++) j->y[(size_t)s * O + o] = colibri_ref_f32_one(j, o, s);
}

void colibri_ref_i8_rows(const mm_job *j, int o0, int o1) {
    const int O = j->w->O;
    for (int o = o0; o < o1; o++)
        for (int s = 0; s < j->S; s++) j->y[(size_t)s * O + o] = colibri_ref_i8_one(j, o, s);
}

const isa_ops colibri_ref_ops = {
    "ref", colibri_ref_f32_rows, colibri_ref_i8_rows, NULL, NULL, 1,
};
