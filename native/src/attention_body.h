/* The body of the GQA attention kernel, compiled once per vector width.
 *
 * Included by attention.c (VW 4: SSE on x86-64's baseline, NEON on arm64) and by
 * x86/attention_avx2.c (VW 8, under an AVX2 target pragma) with ATTEND_ONE naming the
 * entry. Lane arithmetic is the plain float one and every reduction has the same shape
 * at both widths (eight partial sums, lane l taking elements l, l + 8, ..., reduced
 * pairwise), so both builds give the same bits; the wider one just does it in half the
 * instructions. */
#include "attention.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* WVW: the width of the loops whose lanes never meet (the weighted sums over values, the
 * division by the softmax sum), which may be wider than the reductions' VW: a lane's
 * arithmetic is the same at any width. */
#ifndef WVW
#define WVW VW
#endif

typedef float vf __attribute__((vector_size(4 * VW)));
typedef float wf __attribute__((vector_size(4 * WVW)));
#define NV8 (8 / VW) /* vectors per eight floats */

/* Load, store and broadcast for a vector type T (memcpy: no alignment assumed; a scalar
 * operand of + is broadcast to every lane). */
#define VECTOR_HELPERS(T, load, store, splat_)                                                    \
    static inline T load(const float *p) {                                                        \
        T r;                                                                                      \
        memcpy(&r, p, sizeof r);                                                                  \
        return r;                                                                                 \
    }                                                                                             \
    static inline void store(float *p, T x) { memcpy(p, &x, sizeof x); }                         \
    static inline T splat_(float w) {                                                             \
        const T zero = {0};                                                                       \
        return zero + w;                                                                          \
    }

VECTOR_HELPERS(vf, loadv, storev, splat)
VECTOR_HELPERS(wf, loadw, storew, splatw)

static inline float reduce8(const float acc[8]) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* Eight partial sums (lane l takes elements l, l + 8, ...), reduced pairwise. */
static float dot(const float *a, const float *b, int n) {
    vf acc[NV8];
    for (int j = 0; j < NV8; j++) acc[j] = splat(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < NV8; j++) acc[j] += loadv(a + i + VW * j) * loadv(b + i + VW * j);
    float s[8];
    memcpy(s, acc, sizeof s);
    for (int l = 0; i < n; i++, l++) s[l] += a[i] * b[i];
    return reduce8(s);
}

/* Four dots of q with consecutive keys k0, k0 + stride, ...: each exactly dot()'s
 * arithmetic, interleaved so four add chains run at once. */
static void dot4(const float *q, const float *k0, size_t stride, int n, float *r) {
    vf acc[4][NV8];
    for (int t = 0; t < 4; t++)
        for (int j = 0; j < NV8; j++) acc[t][j] = splat(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < NV8; j++) {
            const vf qv = loadv(q + i + VW * j);
            for (int t = 0; t < 4; t++) acc[t][j] += qv * loadv(k0 + t * stride + i + VW * j);
        }
    for (int t = 0; t < 4; t++) {
        float s[8];
        memcpy(s, acc[t], sizeof s);
        const float *kt = k0 + t * stride;
        for (int l = 0, e = i; e < n; e++, l++) s[l] += q[e] * kt[e];
        r[t] = reduce8(s);
    }
}

/* Eight partial sums of p[0, n), reduced pairwise. */
static float sum8(const float *p, int n) {
    vf acc[NV8];
    for (int j = 0; j < NV8; j++) acc[j] = splat(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < NV8; j++) acc[j] += loadv(p + i + VW * j);
    float s[8];
    memcpy(s, acc, sizeof s);
    for (int l = 0; i < n; i++, l++) s[l] += p[i];
    return reduce8(s);
}

typedef int32_t vi __attribute__((vector_size(4 * VW)));

/* One lane's exp(x0) as exp_shifted's vector body computes it (the loop's tail). */
static inline float exp_one(float x0) {
    const float x = x0 < -87.0f ? -87.0f : x0;
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
    return x0 < -87.0f ? 0.0f : y;
}

/* p[t] = exp(p[t] - top) for t < n, VW lanes at a time:
 * Cody-Waite reduction by ln 2 (two constants), a degree-6 polynomial on [-ln2/2, ln2/2]
 * and the power of two put into the exponent bits. Within 2 ulp of expf over the range a
 * softmax sees (x <= 0; below -87 the result is 0, as expf's would be within 1e-38).
 * glibc's expf is a call per score that cannot vectorise: it was a third of decode
 * attention. */
static void exp_shifted(float *p, int n, float top) {
    const vf lo = splat(-87.0f);
    int t = 0;
    for (; t + VW <= n; t += VW) {
        const vf x0 = loadv(p + t) - splat(top);
        const vi keep = x0 >= lo; /* all ones where x0 >= -87 */
        const vf x = (vf)(((vi)x0 & keep) | ((vi)lo & ~keep));
        const vf k = (x * splat(1.44269504f) + splat(12582912.0f)) - splat(12582912.0f);
        const vf r = (x - k * splat(0.693145752f)) - k * splat(1.42860677e-6f);
        vf y = splat(1.38888894e-3f);
        y = y * r + splat(8.33333377e-3f);
        y = y * r + splat(4.16666418e-2f);
        y = y * r + splat(1.66666672e-1f);
        y = y * r + splat(0.5f);
        y = y * r + splat(1.0f);
        y = y * r + splat(1.0f);
        const vi bits = (vi)y + __builtin_convertvector(k, vi) * (1 << 23);
        storev(p + t, (vf)(bits & keep));
    }
    for (; t < n; t++) p[t] = exp_one(p[t] - top);
}

/* The softmax of one head's scores p[0, n) in place: scaled, maximum subtracted, exp,
 * divided by the sum, a sink joining the maximum and the sum. */
static void softmax_scores(const attn_ctx *c, int h, float *p, int n) {
    float top = c->sinks ? c->sinks[h] : -INFINITY;
    for (int t = 0; t < n; t++) {
        p[t] *= c->scale;
        top = p[t] > top ? p[t] : top;
    }
    exp_shifted(p, n, top);
    float sum = sum8(p, n);
    if (c->sinks) sum += exp_one(c->sinks[h] - top); /* the sink's share is dropped */
    int t = 0;
    for (; t + WVW <= n; t += WVW) storew(p + t, loadw(p + t) / splatw(sum));
    for (; t < n; t++) p[t] /= sum;
}

#define RUN_MAX 8 /* heads whose weighted sums share one pass over the values */

/* out_j[0, d) = sum_t p_j[t] v_t for `heads` heads at once (p_j = p + j * n, out_j = out
 * + j * d), each value vector loaded once for all of them. Per output element: from zero,
 * in t order, one multiply and one add (no fused multiply-add), whatever the width. */
static void weighted_sums(float *out, const float *p, int heads, const float *v, size_t stride,
                          int n, int d) {
    int e0 = 0;
    if (heads == 1) /* one head: four vectors of outputs a pass, four add chains in flight */
        for (; e0 + 4 * WVW <= d; e0 += 4 * WVW) {
            wf acc[4];
            for (int b = 0; b < 4; b++) acc[b] = splatw(0.0f);
            for (int t = 0; t < n; t++) {
                const wf w = splatw(p[t]);
                const float *vt = v + t * stride + e0;
                for (int b = 0; b < 4; b++) acc[b] += w * loadw(vt + WVW * b);
            }
            for (int b = 0; b < 4; b++) storew(out + e0 + WVW * b, acc[b]);
        }
    for (; e0 + WVW <= d; e0 += WVW) { /* a run (or what one head has left): one vector of
                                           outputs a pass for each head, values loaded once */
        wf acc[RUN_MAX];
        for (int j = 0; j < heads; j++) acc[j] = splatw(0.0f);
        for (int t = 0; t < n; t++) {
            const wf vt = loadw(v + t * stride + e0);
            for (int j = 0; j < heads; j++) acc[j] += splatw(p[(size_t)j * n + t]) * vt;
        }
        for (int j = 0; j < heads; j++) storew(out + (size_t)j * d + e0, acc[j]);
    }
    for (int j = 0; j < heads; j++)
        for (int e = e0; e < d; e++) {
            float acc = 0.0f;
            for (int t = 0; t < n; t++) acc += p[(size_t)j * n + t] * v[t * stride + e];
            out[(size_t)j * d + e] = acc;
        }
}

/* One job: a run of heads_per_job query heads (of one KV head) of one row. */
void ATTEND_ONE(void *ctx, int job) {
    attn_ctx *c = ctx;
    const int per = c->heads_per_job, runs = c->H / per, d = c->d;
    const int s = job / runs, h0 = (job % runs) * per, g = h0 / (c->H / c->G);
    const int end = c->start + s + 1 < c->T ? c->start + s + 1 : c->T;
    const int first = c->window > 0 && end > c->window ? end - c->window : 0;
    const int visible = end - first; /* keys [first, end) */
    const size_t kstride = (size_t)c->G * d;
    const float *q = c->q + ((size_t)s * c->H + h0) * d;
    const float *k = c->k + (size_t)first * kstride + (size_t)g * d;
    const float *v = c->v + (size_t)first * kstride + (size_t)g * d;
    float *p = colibri_scores_buffer((size_t)visible * per);
    if (p == NULL) {
        atomic_store(&c->rc, -2);
        return;
    }
    int t = 0;
    for (; t + 4 <= visible; t += 4)
        for (int j = 0; j < per; j++)
            dot4(q + (size_t)j * d, k + t * kstride, kstride, d, p + (size_t)j * visible + t);
    for (; t < visible; t++)
        for (int j = 0; j < per; j++)
            p[(size_t)j * visible + t] = dot(q + (size_t)j * d, k + t * kstride, d);
    for (int j = 0; j < per; j++) softmax_scores(c, h0 + j, p + (size_t)j * visible, visible);
    float *out = c->out + ((size_t)s * c->H + h0) * d; /* the run's heads are adjacent */
    for (int j = 0; j < per; j += RUN_MAX) {
        const int heads = per - j < RUN_MAX ? per - j : RUN_MAX;
        weighted_sums(out + (size_t)j * d, p + (size_t)j * visible, heads, v, kstride, visible, d);
    }
}
