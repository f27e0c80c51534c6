/* The NEON kernels against the portable reference, for an aarch64 build run under
 * emulation (tests/native/test_neon_emulated.py): every weight format and both kernel
 * families, 1 and 3 activation rows, several shapes and groups. The I8 family on
 * quantised weights must give the reference's bits exactly; float arithmetic (the F32
 * family, and float weights in either) must agree to 1e-4 relative.
 * Prints one line per failing case and exits 1 if there was any. */
#include "colibri.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned long long state = 88172645463325252ull;
static unsigned next(void) { /* xorshift64 */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (unsigned)(state >> 32);
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next() % 1000000) / 1e6f; }

int main(void) {
    static const int shapes[][2] = {{5, 16}, {17, 40}, {33, 64}, {19, 129}, {40, 300}, {24, 1024}, {8, 2880}};
    static const int formats[][2] = {{COLIBRI_FMT_F32, 0}, {COLIBRI_FMT_BF16, 0}, {COLIBRI_FMT_Q8, 0},
                                     {COLIBRI_FMT_Q4, 0},  {COLIBRI_FMT_Q4, 32},  {COLIBRI_FMT_Q4, 64},
                                     {COLIBRI_FMT_Q4, 6},  {COLIBRI_FMT_FP4, 32}, {COLIBRI_FMT_FP4, 6},
                                     {COLIBRI_FMT_Q2, 64},  {COLIBRI_FMT_Q3, 64}};
    if (!colibri_isa_available(COLIBRI_ISA_NEON)) {
        printf("neon not available\n");
        return 2;
    }
    int failures = 0, cases = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t fi = 0; fi < sizeof formats / sizeof formats[0]; fi++) {
            const int O = shapes[si][0], I = shapes[si][1], fmt = formats[fi][0], gs = formats[fi][1];
            const int nib = fmt == COLIBRI_FMT_Q4 || fmt == COLIBRI_FMT_FP4;
            const int affine = fmt == COLIBRI_FMT_Q2 || fmt == COLIBRI_FMT_Q3; /* 64-input blocks */
            const int G = nib ? (gs == 0 || gs >= I ? 1 : (I + gs - 1) / gs) : affine ? (I + 63) / 64 : 1;
            const size_t row = fmt == COLIBRI_FMT_F32 ? 4 * (size_t)I : fmt == COLIBRI_FMT_BF16 ? 2 * (size_t)I
                             : fmt == COLIBRI_FMT_Q8 ? (size_t)I
                             : affine ? (size_t)G * (fmt == COLIBRI_FMT_Q3 ? 24 : 16) : (size_t)(I + 1) / 2;
            uint8_t *data = malloc((size_t)O * row);
            for (size_t k = 0; k < (size_t)O * row; k++) data[k] = (uint8_t)next();
            if (fmt == COLIBRI_FMT_F32)
                for (size_t k = 0; k < (size_t)O * I; k++) ((float *)data)[k] = uniform(-1, 1);
            if (fmt == COLIBRI_FMT_BF16)
                for (size_t k = 0; k < (size_t)O * I; k++) {
                    const float f = uniform(-1, 1);
                    uint32_t u;
                    memcpy(&u, &f, 4);
                    ((uint16_t *)data)[k] = (uint16_t)(u >> 16);
                }
            if (nib && (I & 1)) /* the padding nibble: the code of zero */
                for (int o = 0; o < O; o++) {
                    uint8_t *last = data + (size_t)o * row + row - 1;
                    *last = (uint8_t)((*last & 15) | ((fmt == COLIBRI_FMT_Q4 ? 8 : 0) << 4));
                }
            void *scales = NULL;
            if (affine) { /* float16 (s, m) pairs: s in [2^-10, 2^-3), m of either sign */
                scales = malloc((size_t)O * G * 4);
                for (size_t k = 0; k < (size_t)O * G; k++) {
                    uint16_t *p = (uint16_t *)scales + 2 * k;
                    p[0] = (uint16_t)(((5 + next() % 7) << 10) | (next() & 0x3ff));
                    p[1] = (uint16_t)((next() & 0x8000) | ((5 + next() % 7) << 10) | (next() & 0x3ff));
                }
            } else if (fmt == COLIBRI_FMT_FP4) {
                scales = malloc((size_t)O * G);
                for (size_t k = 0; k < (size_t)O * G; k++) ((uint8_t *)scales)[k] = (uint8_t)(115 + next() % 10);
            } else if (fmt != COLIBRI_FMT_F32 && fmt != COLIBRI_FMT_BF16) {
                scales = malloc((size_t)O * G * sizeof(float));
                for (size_t k = 0; k < (size_t)O * G; k++) ((float *)scales)[k] = uniform(0.001f, 0.05f);
            }
            colibri_weight w = {fmt, O, I, nib || affine ? gs : 0, data, scales};
            for (int S = 1; S <= 3; S += 2) {
                float *x = malloc((size_t)S * I * sizeof(float));
                for (size_t k = 0; k < (size_t)S * I; k++) x[k] = uniform(-1, 1);
                for (int family = 0; family < 2; family++) {
                    float *want = malloc((size_t)S * O * sizeof(float)), *got = malloc((size_t)S * O * sizeof(float));
                    colibri_set_isa(COLIBRI_ISA_REF);
                    const int rc1 = colibri_matmul(&w, family, x, S, want);
                    colibri_set_isa(COLIBRI_ISA_NEON);
                    const int rc2 = colibri_matmul(&w, family, x, S, got);
                    cases++;
                    for (int k = 0; k < S * O; k++) {
                        const int exact = family == COLIBRI_FAM_I8 && fmt != COLIBRI_FMT_F32 && fmt != COLIBRI_FMT_BF16;
                        const int bad = rc1 || rc2 ||
                                        (exact ? memcmp(&got[k], &want[k], 4) != 0
                                               : fabsf(got[k] - want[k]) > 1e-4f * (1.0f + fabsf(want[k])));
                        if (bad) {
                            printf("FAIL fmt %d gs %d O %d I %d S %d family %d: row %d neon %.9g ref %.9g (rc %d %d)\n",
                                   fmt, gs, O, I, S, family, k, got[k], want[k], rc1, rc2);
                            failures++;
                            break;
                        }
                    }
                    free(want);
                    free(got);
                }
                free(x);
            }
            free(data);
            free(scales);
        }
    printf("%d cases, %d failures\n", cases, failures);
    return failures ? 1 : 0;
}
