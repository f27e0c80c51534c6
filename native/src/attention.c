/* Causal grouped-query attention over a sequence's cached keys and values, float32.
 *
 * Why native: at decode the work is tiny (H heads x T keys x d) and numpy spent ten times
 * the arithmetic in dispatch and strided batched matmuls (~180 us a layer on the demo).
 *
 * Each (row, head) is computed by one call with a fixed operation order, so a result does
 * not depend on S, on the thread split or on the other rows: score_t = (q . k_t) * scale
 * (eight partial sums, reduced pairwise), the row's max subtracted, expf, the sum over t
 * in order, each weight divided by the sum, then out = sum_t p_t v_t in t order. */
#include "internal.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q; /* [S, H, d] */
    const float *k; /* [T, G, d] */
    const float *v; /* [T, G, d] */
    float *out;     /* [S, H, d] */
    int S, H, G, d, T, start;
    float scale;
    _Atomic int rc;
} attn_ctx;

/* Four-float vectors (SSE on x86-64's baseline, NEON on arm64) through the compiler's
 * vector extension: portable, and each lane's arithmetic is the plain float one. */
typedef float v4 __attribute__((vector_size(16)));

static inline v4 load4(const float *p) {
    v4 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void store4(float *p, v4 x) { memcpy(p, &x, sizeof x); }

/* Eight partial sums (lane l takes elements l, l + 8, ...), reduced pairwise. */
static float dot(const float *a, const float *b, int n) {
    v4 lo = {0, 0, 0, 0}, hi = lo;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        lo += load4(a + i) * load4(b + i);
        hi += load4(a + i + 4) * load4(b + i + 4);
    }
    float acc[8];
    store4(acc, lo);
    store4(acc + 4, hi);
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* out[0, n) += w * v[0, n) */
static void axpy(float *out, float w, const float *v, int n) {
    const v4 wv = {w, w, w, w};
    int i = 0;
    for (; i + 4 <= n; i += 4) store4(out + i, load4(out + i) + wv * load4(v + i));
    for (; i < n; i++) out[i] += w * v[i];
}

static _Thread_local struct { float *p; size_t n; } tl_scores;

static float *scores_buffer(size_t n) {
    if (tl_scores.n < n) {
        free(tl_scores.p);
        tl_scores.p = malloc(n * sizeof(float));
        tl_scores.n = tl_scores.p ? n : 0;
    }
    return tl_scores.p;
}

static void attend_one(void *ctx, int job) {
    attn_ctx *c = ctx;
    const int s = job / c->H, h = job % c->H, g = h / (c->H / c->G), d = c->d;
    const int visible = c->start + s + 1 < c->T ? c->start + s + 1 : c->T;
    const size_t kstride = (size_t)c->G * d;
    const float *q = c->q + ((size_t)s * c->H + h) * d;
    const float *k = c->k + (size_t)g * d;
    const float *v = c->v + (size_t)g * d;
    float *out = c->out + ((size_t)s * c->H + h) * d;
    float *p = scores_buffer((size_t)visible);
    if (p == NULL) {
        atomic_store(&c->rc, -2);
        return;
    }
    float top = -INFINITY;
    for (int t = 0; t < visible; t++) {
        p[t] = dot(q, k + t * kstride, d) * c->scale;
        if (p[t] > top) top = p[t];
    }
    float sum = 0.0f;
    for (int t = 0; t < visible; t++) {
        p[t] = expf(p[t] - top);
        sum += p[t];
    }
    for (int t = 0; t < visible; t++) p[t] /= sum;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int t = 0; t < visible; t++) axpy(out, p[t], v + t * kstride, d);
}

int colibri_attend_gqa(const float *q, int S, int H, int d, const float *k, const float *v, int T,
                       int G, float scale, int start, float *out) {
    if (!q || !k || !v || !out || S < 1 || H < 1 || d < 1 || T < 1 || G < 1 || H % G ||
        start < 0 || start + S > T)
        return -1;
    attn_ctx c = {q, k, v, out, S, H, G, d, T, start, scale, 0};
    const double work = (double)S * H * T * d;
    colibri_pool_for(S * H, work < (double)(1 << 17) ? 1 : colibri_get_threads(), attend_one, &c);
    return atomic_load(&c.rc);
}
