/* Causal grouped-query attention over a sequence's cached keys and values, float32.
 *
 * Why native: at decode the work is tiny (H heads x T keys x d) and numpy spent ten times
 * the arithmetic in dispatch and strided batched matmuls (~180 us a layer on the demo).
 *
 * Each (row, head) is computed with a fixed operation order, so a result does not depend
 * on S, on the thread split or on the other rows: score_t = (q . k_t) * scale (eight
 * partial sums, reduced pairwise), the row's max subtracted, exp (exp_shifted), the sum
 * over t (eight partial sums), each weight divided by the sum, then out = sum_t p_t v_t
 * in t order. A job is one row's query heads that share a KV head. */
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

/* p[t] = exp(p[t] - top) for t < n, in plain float operations the compiler vectorises:
 * Cody-Waite reduction by ln 2 (two constants), a degree-6 polynomial on [-ln2/2, ln2/2]
 * and the power of two put into the exponent bits. Within 2 ulp of expf over the range a
 * softmax sees (x <= 0; below -87 the result is 0, as expf's would be within 1e-38).
 * glibc's expf is a call per score that cannot vectorise: it was a third of decode
 * attention. */
static void exp_shifted(float *p, int n, float top) {
    for (int t = 0; t < n; t++) {
        float x = p[t] - top;
        x = x < -87.0f ? -87.0f : x;
        const float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
        const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
        float y = 1.38888894e-3f;
        y = y * r + 8.33333377e-3f;
        y = y * r + 4.16666418e-2f;
        y = y * r + 1.66666672e-1f;
        y = y * r + 0.5f;
        y = y * r + 1.0f;
        y = y * r + 1.0f;
        int32_t bits;
        memcpy(&bits, &y, sizeof bits);
        bits += (int32_t)k * (1 << 23);
        memcpy(&y, &bits, sizeof y);
        p[t] = p[t] - top < -87.0f ? 0.0f : y;
    }
}

/* Eight partial sums (lane l takes elements l, l + 8, ...), reduced pairwise. */
static float sum8(const float *a, int n) {
    v4 lo = {0, 0, 0, 0}, hi = lo;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        lo += load4(a + i);
        hi += load4(a + i + 4);
    }
    float acc[8];
    store4(acc, lo);
    store4(acc + 4, hi);
    for (int l = 0; i < n; i++, l++) acc[l] += a[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* One job: the query heads of KV group g for row s. Each key is loaded once for all the
 * group's heads; every head's arithmetic is still its own, in a fixed order. */
static void attend_group(void *ctx, int job) {
    attn_ctx *c = ctx;
    const int per = c->H / c->G;
    const int s = job / c->G, g = job % c->G, d = c->d;
    const int visible = c->start + s + 1 < c->T ? c->start + s + 1 : c->T;
    const size_t kstride = (size_t)c->G * d;
    const float *k = c->k + (size_t)g * d;
    const float *v = c->v + (size_t)g * d;
    float *p = scores_buffer((size_t)visible * per);
    if (p == NULL) {
        atomic_store(&c->rc, -2);
        return;
    }
    for (int t = 0; t < visible; t++) {
        const float *kt = k + t * kstride;
        for (int i = 0; i < per; i++) {
            const float *q = c->q + ((size_t)s * c->H + g * per + i) * d;
            p[(size_t)i * visible + t] = dot(q, kt, d) * c->scale;
        }
    }
    for (int i = 0; i < per; i++) {
        float *pi = p + (size_t)i * visible;
        float top = -INFINITY;
        for (int t = 0; t < visible; t++) top = pi[t] > top ? pi[t] : top;
        exp_shifted(pi, visible, top);
        const float sum = sum8(pi, visible);
        for (int t = 0; t < visible; t++) pi[t] /= sum;
        float *out = c->out + ((size_t)s * c->H + g * per + i) * d;
        for (int e = 0; e < d; e++) out[e] = 0.0f;
        for (int t = 0; t < visible; t++) axpy(out, pi[t], v + t * kstride, d);
    }
}

int colibri_attend_gqa(const float *q, int S, int H, int d, const float *k, const float *v, int T,
                       int G, float scale, int start, float *out) {
    if (!q || !k || !v || !out || S < 1 || H < 1 || d < 1 || T < 1 || G < 1 || H % G ||
        start < 0 || start + S > T)
        return -1;
    attn_ctx c = {q, k, v, out, S, H, G, d, T, start, scale, 0};
    const double work = (double)S * H * T * d;
    colibri_pool_for(S * G, work < (double)(1 << 17) ? 1 : colibri_get_threads(), attend_group, &c);
    return atomic_load(&c.rc);
}
