/* The MoE router: sigmoid scores (GLM-4.x, GLM-5.x, DeepSeek-V3; docs/architecture.md,
 * step 1) or softmax scores (Qwen3-MoE, Mixtral, OLMoE).
 *
 * Why native: routing a decode row is 16..256 dot products and a top-k, a few
 * microseconds of arithmetic, but numpy spent ~40 us a layer on its dozen dispatches.
 *
 * Per row, in a fixed order (so S rows equal S one-row calls): logit_e = h . w_e (eight
 * partial sums reduced pairwise); score = 1 / (1 + expf(-logit)), or with softmax
 * p_e = expf(logit_e - max) summed in expert order and score = p_e / sum;
 * choice = score + bias;
 * with groups, a group's score is the sum of its two best choices and only the best
 * topk_group groups compete; the n best choices are taken best first, ties to the lowest
 * index (losing groups' experts last, in index order); gates are the scores of the first
 * K, divided by their sum (+1e-20) when norm, times scaling. */
#include "dot8.h"
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Index of the largest v[i] not yet taken (ties: lowest index); -inf counts as a value. */
static int best_untaken(const float *v, const unsigned char *taken, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* score[e] = softmax of the E logits x . w_e: the maximum subtracted, expf, the sum taken in
 * expert order, each divided by it. */
static void softmax_scores(const float *x, const float *w, int D, int E, float *score) {
    float top = -INFINITY;
    for (int e = 0; e < E; e++) {
        score[e] = colibri_dot8(x, w + (size_t)e * D, D);
        top = score[e] > top ? score[e] : top;
    }
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
        score[e] = expf(score[e] - top);
        sum += score[e];
    }
    for (int e = 0; e < E; e++) score[e] /= sum;
}

static _Thread_local struct { void *p; size_t n; } tl_route;

int colibri_route(const float *h, int S, int D, const float *w, const float *bias, int E,
                  int n_group, int topk_group, int n, int K, int softmax, int norm,
                  float scaling, int32_t *ids, float *gates) {
    if (!h || !w || !ids || !gates || S < 1 || D < 1 || E < 1 || n < K || K < 1 || n > E ||
        n_group < 1 || E % n_group || topk_group < 1 || topk_group > n_group)
        return -1;
    const size_t need = (size_t)E * 2 * sizeof(float) + (size_t)E + (size_t)n_group * 5;
    if (tl_route.n < need) {
        free(tl_route.p);
        tl_route.p = malloc(need);
        tl_route.n = tl_route.p ? need : 0;
        if (!tl_route.p) return -2;
    }
    float *score = tl_route.p, *choice = score + E, *group = choice + E;
    unsigned char *taken = (unsigned char *)(group + n_group);
    const int per = E / n_group;
    for (int s = 0; s < S; s++) {
        const float *x = h + (size_t)s * D;
        if (softmax)
            softmax_scores(x, w, D, E, score);
        else
            for (int e = 0; e < E; e++)
                score[e] = 1.0f / (1.0f + expf(-colibri_dot8(x, w + (size_t)e * D, D)));
        for (int e = 0; e < E; e++) choice[e] = bias ? score[e] + bias[e] : score[e];
        if (n_group > 1 && topk_group < n_group) {
            for (int g = 0; g < n_group; g++) { /* sum of the group's two best choices */
                const float *c = choice + (size_t)g * per;
                memset(taken, 0, (size_t)per);
                const int a = best_untaken(c, taken, per);
                taken[a] = 1;
                const int b = per > 1 ? best_untaken(c, taken, per) : -1;
                group[g] = b >= 0 ? c[a] + c[b] : c[a];
            }
            memset(taken, 0, (size_t)n_group);
            for (int k = 0; k < topk_group; k++) taken[best_untaken(group, taken, n_group)] = 1;
            for (int g = 0; g < n_group; g++)
                if (!taken[g])
                    for (int e = 0; e < per; e++) choice[(size_t)g * per + e] = -INFINITY;
        }
        memset(taken, 0, (size_t)E);
        int32_t *row_ids = ids + (size_t)s * n;
        for (int k = 0; k < n; k++) {
            const int e = best_untaken(choice, taken, E);
            taken[e] = 1;
            row_ids[k] = e;
        }
        float *row_gates = gates + (size_t)s * K;
        float sum = 0.0f;
        for (int k = 0; k < K; k++) {
            row_gates[k] = score[row_ids[k]];
            sum += row_gates[k];
        }
        for (int k = 0; k < K; k++) {
            if (norm) row_gates[k] /= sum + 1e-20f;
            row_gates[k] *= scaling;
        }
    }
    return 0;
}
