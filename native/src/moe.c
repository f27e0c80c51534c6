/* A MoE layer whose experts are all in memory, in one call: the router, every chosen
 * expert (and the shared one) on its rows, and the rank-ordered combine.
 *
 * Why: a resident decode step spent ~40 us a layer between these three native calls on a
 * small model (Python wrappers, planning which rows go to which expert, building the
 * pair lists), about a tenth of the step. Here the plan is made in C from the routed ids.
 *
 * Bits: each step is the library's own entry point on the arguments the Python MoE block
 * would build (colibri_route with n = K, colibri_experts over the chosen experts in
 * ascending id order with each expert's rows ascending and the shared expert last with
 * gate 1, colibri_rank_sum over K + 1 ranks), so the layer's output equals that block's,
 * bit for bit, and a layer streamed from disk (which takes the Python path) computes the
 * same numbers as this one. */
#include "internal.h"

#include <string.h>

enum { ARENA_MOE = 3 };

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

int colibri_moe(const colibri_weight *const *experts, int E, const colibri_weight *const *shared,
                int family, const float *x, int S, int D, const float *router,
                const float *bias, int n_group, int topk_group, int K, int softmax, int norm,
                float scaling, int32_t *ids, float *out) {
    if (!experts || !x || !router || !ids || !out || E < 1 || S < 1 || D < 1 || K < 1 || K > E)
        return -1;
    const int width = K + (shared != NULL); /* ranks per row: the shared expert last */
    const int pairs = S * width, used_max = E + 1;
    const size_t bytes = up64((size_t)S * K * sizeof(float)) + up64((size_t)pairs * D * sizeof(float)) +
                         up64((size_t)(used_max + 1) * sizeof(int)) + 3 * up64((size_t)pairs * sizeof(int)) +
                         up64((size_t)pairs * sizeof(float)) + up64((size_t)E * sizeof(int)) +
                         up64((size_t)3 * used_max * sizeof(colibri_weight *));
    uint8_t *mem = colibri_arena(ARENA_MOE, bytes);
    if (!mem) return -2;
    float *gates = (float *)mem;
    mem += up64((size_t)S * K * sizeof(float));
    float *parts = (float *)mem;
    mem += up64((size_t)pairs * D * sizeof(float));
    int *start = (int *)mem;
    mem += up64((size_t)(used_max + 1) * sizeof(int));
    int *rows = (int *)mem;
    mem += up64((size_t)pairs * sizeof(int));
    int *dest = (int *)mem;
    mem += up64((size_t)pairs * sizeof(int));
    int *count = (int *)mem; /* pairs per expert, then each expert's next free pair */
    mem += up64((size_t)pairs * sizeof(int));
    float *pgate = (float *)mem;
    mem += up64((size_t)pairs * sizeof(float));
    int *slot_of = (int *)mem; /* expert -> index among the used ones, or -1 */
    mem += up64((size_t)E * sizeof(int));
    const colibri_weight **w = (const colibri_weight **)mem;

    int rc = colibri_route(x, S, D, router, bias, E, n_group, topk_group, K, K, softmax, norm,
                           scaling, ids, gates);
    if (rc) return rc;

    /* the used experts in ascending id order, each with its pair count */
    for (int e = 0; e < E; e++) slot_of[e] = 0;
    for (int p = 0; p < S * K; p++) slot_of[ids[p]]++;
    int used = 0;
    start[0] = 0;
    for (int e = 0; e < E; e++) {
        if (!slot_of[e]) {
            slot_of[e] = -1;
            continue;
        }
        for (int m = 0; m < 3; m++) w[3 * used + m] = experts[3 * e + m];
        start[used + 1] = start[used] + slot_of[e];
        count[used] = start[used];
        slot_of[e] = used++;
    }
    /* each expert's pairs: its rows ascending; dest = the expert's rank in its row */
    for (int s = 0; s < S; s++) {
        const int32_t *r = ids + (size_t)s * K;
        for (int k = 0; k < K; k++) {
            int rank = 0;
            for (int j = 0; j < K; j++) rank += r[j] < r[k];
            const int p = count[slot_of[r[k]]]++;
            rows[p] = s;
            pgate[p] = gates[(size_t)s * K + k];
            dest[p] = s * width + rank;
        }
    }
    if (shared) { /* every row, gate 1, the last rank */
        for (int m = 0; m < 3; m++) w[3 * used + m] = shared[m];
        for (int s = 0; s < S; s++) {
            const int p = start[used] + s;
            rows[p] = s;
            pgate[p] = 1.0f;
            dest[p] = s * width + width - 1;
        }
        start[used + 1] = start[used] + S;
        used++;
    }
    rc = colibri_experts(w, used, family, x, S, D, start, rows, pgate, dest, pairs, parts);
    if (rc) return rc;
    return colibri_rank_sum(parts, S, width, D, out);
}
