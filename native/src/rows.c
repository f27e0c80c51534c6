/* Row-wise float32 operations of a decoder layer: RMSNorm and rotate_half RoPE.
 *
 * Why native: a decode step normalises one row of D floats twice per layer, and numpy
 * spent ~8 ufunc dispatches (~10 us) on what is a microsecond of arithmetic.
 *
 * Each row is computed alone with a fixed operation order, so S rows equal S one-row
 * calls: the sum of squares in eight partial sums (lane l takes elements l, l + 8, ...)
 * reduced pairwise, divided by D, plus eps, scale = 1 / sqrt, then w * (x * scale); a
 * residual add before it (add_rms_norm) is one float add per element.
 * RoPE is the reference's own arithmetic (two products, then their difference or sum),
 * so it equals numpy's bit for bit. */
#include "dot8.h"
#include "internal.h"

#include <math.h>
#include <string.h>

int colibri_add_rms_norm(const float *h, const float *delta, int S, int D, const float *w,
                         float eps, float *sum, float *out) {
    if (!h || !delta || !sum || !w || !out || S < 1 || D < 1) return -1;
    for (size_t k = 0; k < (size_t)S * D; k++) sum[k] = h[k] + delta[k];
    return colibri_rms_norm(sum, S, D, w, eps, out);
}

int colibri_rms_norm(const float *x, int S, int D, const float *w, float eps, float *out) {
    if (!x || !w || !out || S < 1 || D < 1) return -1;
    for (int s = 0; s < S; s++) {
        const float *xs = x + (size_t)s * D;
        float *o = out + (size_t)s * D;
        float var = colibri_dot8(xs, xs, D) / (float)D;
        var += eps;
        const float scale = 1.0f / sqrtf(var);
        for (int i = 0; i < D; i++) o[i] = w[i] * (xs[i] * scale);
    }
    return 0;
}

int colibri_rope_half(const float *x, int S, int H, int d, const float *cos, const float *sin,
                      int half, float *out) {
    if (!x || !cos || !sin || !out || S < 1 || H < 1 || half < 1 || 2 * half > d) return -1;
    for (int s = 0; s < S; s++) {
        const float *c = cos + (size_t)s * half, *sn = sin + (size_t)s * half;
        for (int h = 0; h < H; h++) {
            const float *xi = x + ((size_t)s * H + h) * d;
            float *o = out + ((size_t)s * H + h) * d;
            for (int i = 0; i < half; i++) {
                const float x1 = xi[i], x2 = xi[half + i];
                const float a = x1 * c[i], b = x2 * sn[i], e = x2 * c[i], f = x1 * sn[i];
                o[i] = a - b;
                o[half + i] = e + f;
            }
            if (o != xi) memcpy(o + 2 * half, xi + 2 * half, (size_t)(d - 2 * half) * sizeof(float));
        }
    }
    return 0;
}
