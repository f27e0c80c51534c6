/* The dot product every row-wise float kernel shares: eight partial sums (lane l takes
 * elements l, l + 8, ...) reduced pairwise. One definition so the norms and the router
 * add in the same order; attention_body.h has the same shape at a chosen vector width. */
#ifndef COLIBRI_DOT8_H
#define COLIBRI_DOT8_H

#include <string.h>

typedef float colibri_v4 __attribute__((vector_size(16)));

static inline colibri_v4 colibri_load4(const float *p) {
    colibri_v4 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline float colibri_dot8(const float *a, const float *b, int n) {
    colibri_v4 lo = {0, 0, 0, 0}, hi = lo;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        lo += colibri_load4(a + i) * colibri_load4(b + i);
        hi += colibri_load4(a + i + 4) * colibri_load4(b + i + 4);
    }
    float acc[8];
    memcpy(acc, &lo, sizeof lo);
    memcpy(acc + 4, &hi, sizeof hi);
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#endif
