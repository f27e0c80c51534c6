/* A grouped-query attention block in one call: q/k/v projections (one dispatch), biases,
 * qk RMSNorm (per head, or over the whole projection), rotate_half RoPE, the cache update, attention and the output
 * projection.
 *
 * Why: at decode each of these is microseconds of arithmetic, and composing them from
 * Python paid a wrapper, argument checks and a numpy temporary per step, a dozen times a
 * layer. Each step is the library's own entry point (colibri_matmul_many, rms_norm,
 * rope_half, attend_gqa, matmul), so the block computes exactly what those calls would
 * in sequence, bit for bit. */
#include "internal.h"

#include <string.h>

enum { ARENA_BLOCK = 2 };

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

int colibri_gqa_attention(const colibri_weight *wq, const colibri_weight *wk,
                          const colibri_weight *wv, const colibri_weight *wo, int family,
                          const float *bq, const float *bk, const float *bv,
                          const float *q_norm, const float *k_norm, int norm_whole, float eps,
                          const float *cos, const float *sin, int half, const float *x, int S,
                          int H, int G, int d, float *kcache, float *vcache, int start,
                          int window, const float *sinks, float scale, float *out) {
    if (!wq || !wk || !wv || !wo || !x || !kcache || !vcache || !out || !cos || !sin || S < 1 ||
        H < 1 || G < 1 || d < 1 || H % G || start < 0 || half < 1 || 2 * half > d ||
        (!q_norm) != (!k_norm) || window < 0)
        return -1;
    const int D = wq->I;
    if (wq->O != H * d || wk->O != G * d || wv->O != G * d || wk->I != D || wv->I != D ||
        wo->I != H * d)
        return -1;
    const size_t nq = (size_t)S * H * d, nk = (size_t)S * G * d;
    uint8_t *mem = colibri_arena(ARENA_BLOCK, up64(nq * 4) * 2 + up64(nk * 4) * 2);
    if (!mem) return -2;
    float *q = (float *)mem, *attn = (float *)(mem + up64(nq * 4));
    float *k = (float *)(mem + 2 * up64(nq * 4)), *v = (float *)((uint8_t *)k + up64(nk * 4));
    const colibri_weight *w3[3] = {wq, wk, wv};
    float *y3[3] = {q, k, v};
    int rc = colibri_matmul_many(w3, 3, family, x, S, y3);
    if (rc) return rc;
    const float *bias[3] = {bq, bk, bv};
    for (int m = 0; m < 3; m++) {
        if (!bias[m]) continue;
        const int O = w3[m]->O;
        for (int s = 0; s < S; s++)
            for (int o = 0; o < O; o++) y3[m][(size_t)s * O + o] += bias[m][o];
    }
    if (q_norm && norm_whole) { /* OLMoE: over each row's whole projection */
        if ((rc = colibri_rms_norm(q, S, H * d, q_norm, eps, q))) return rc;
        if ((rc = colibri_rms_norm(k, S, G * d, k_norm, eps, k))) return rc;
    } else if (q_norm) { /* per head */
        if ((rc = colibri_rms_norm(q, S * H, d, q_norm, eps, q))) return rc;
        if ((rc = colibri_rms_norm(k, S * G, d, k_norm, eps, k))) return rc;
    }
    float *krows = kcache + (size_t)start * G * d, *vrows = vcache + (size_t)start * G * d;
    if ((rc = colibri_rope_half(q, S, H, d, cos, sin, half, q))) return rc;
    if ((rc = colibri_rope_half(k, S, G, d, cos, sin, half, krows))) return rc;
    memcpy(vrows, v, nk * sizeof(float));
    rc = colibri_attend_gqa(q, S, H, d, kcache, vcache, start + S, G, scale, start, window,
                            sinks, attn);
    if (rc) return rc;
    return colibri_matmul(wo, family, attn, S, out);
}
