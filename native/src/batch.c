/* Many matmuls per pool dispatch: the projections that read one activation, and every
 * expert of a MoE layer, with the per-expert gating and the rank-ordered combine.
 *
 * Why: a decode step's matrices are small (a demo expert is 0.75 MB, a GLM-5 expert
 * 21 MB split over three projections), so one call per matrix paid Python, cffi and a
 * pool wake-up per matrix, and left the pool idle between them. Here a layer's experts
 * cost two dispatches: gate and up of all experts, then all downs.
 *
 * Bits: every job is prepared and computed exactly as colibri_matmul or
 * colibri_expert_swiglu would on the same rows (the same preparation, the same rows
 * function, each output by one call), so batching changes no result. */
#include "internal.h"

#include <math.h>
#include <string.h>

enum { ARENA_JOBS = 0, ARENA_DATA = 1 };

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

int colibri_matmul_many(const colibri_weight *const *w, int n, int family, const float *x, int S,
                        float *const *y) {
    if (w == NULL || y == NULL || x == NULL || n < 1 || S < 1) return -1;
    for (int k = 0; k < n; k++)
        if (colibri_check_weight(w[k]) || y[k] == NULL || w[k]->I != w[0]->I) return -1;
    mm_job *jobs = colibri_arena(ARENA_JOBS, (size_t)n * sizeof(mm_job));
    if (!jobs) return -2;
    size_t bytes = 0;
    for (int k = 0; k < n; k++) {
        colibri_describe(&jobs[k], w[k], family);
        jobs[k].y = y[k];
        bytes += up64(colibri_prep_bytes(&jobs[k], family, S));
    }
    uint8_t *mem = colibri_arena(ARENA_DATA, bytes);
    if (!mem) return -2;
    for (int k = 0; k < n; k++) {
        int shared = -1; /* an earlier job with the same layout: same prepared activation */
        for (int e = 0; e < k && shared < 0; e++)
            if (colibri_same_layout(w[e], w[k])) shared = e;
        if (shared >= 0) {
            float *yk = jobs[k].y;
            const colibri_weight *wk = jobs[k].w;
            jobs[k] = jobs[shared];
            jobs[k].y = yk;
            jobs[k].w = wk;
            continue;
        }
        colibri_prepare_into(&jobs[k], family, x, S, mem);
        mem += up64(colibri_prep_bytes(&jobs[k], family, S));
    }
    return colibri_run_jobs(jobs, n, family);
}

/* ---- a MoE layer's experts ---- */

static int check_expert(const colibri_weight *const *w, int D) {
    const colibri_weight *g = w[0], *u = w[1], *d = w[2];
    if (colibri_check_weight(g) || colibri_check_weight(u) || colibri_check_weight(d)) return -1;
    const int F = g->O;
    return (g->I != D || u->O != F || u->I != D || d->O != D || d->I != F) ? -1 : 0;
}

/* Whether expert e's pairs are rows 0..S-1 in order: then x is its input as it is. */
static int all_rows(const int *rows, int n, int S) {
    if (n != S) return 0;
    for (int i = 0; i < n; i++)
        if (rows[i] != i) return 0;
    return 1;
}

int colibri_experts(const colibri_weight *const *w, int E, int family, const float *x, int S,
                    int D, const int *start, const int *rows, const float *gates,
                    const int *dest, int R, float *out) {
    if (!w || !x || !start || !rows || !gates || !dest || !out || E < 1 || S < 1 || D < 1 ||
        R < 1 || start[0] != 0)
        return -1;
    for (int e = 0; e < E; e++) {
        if (start[e + 1] < start[e] || check_expert(w + 3 * e, D)) return -1;
        for (int p = start[e]; p < start[e + 1]; p++)
            if (rows[p] < 0 || rows[p] >= S || dest[p] < 0 || dest[p] >= R) return -1;
    }
    /* jobs: [0, 2E) gate and up of expert e at 2e, 2e+1; [2E, 3E) the downs */
    mm_job *jobs = colibri_arena(ARENA_JOBS, (size_t)3 * E * sizeof(mm_job));
    if (!jobs) return -2;
    size_t bytes = 0;
    for (int e = 0; e < E; e++) {
        const int n = start[e + 1] - start[e];
        mm_job *g = &jobs[2 * e], *u = g + 1, *d = &jobs[2 * E + e];
        colibri_describe(g, w[3 * e], family);
        colibri_describe(u, w[3 * e + 1], family);
        colibri_describe(d, w[3 * e + 2], family);
        if (n == 0) continue;
        const size_t F = (size_t)w[3 * e]->O;
        if (!all_rows(rows + start[e], n, S)) bytes += up64((size_t)n * D * sizeof(float));
        bytes += up64(colibri_prep_bytes(g, family, n)) + up64(colibri_prep_bytes(u, family, n));
        bytes += 2 * up64((size_t)n * F * sizeof(float)) + up64(colibri_prep_bytes(d, family, n));
        bytes += up64((size_t)n * D * sizeof(float));
    }
    uint8_t *mem = colibri_arena(ARENA_DATA, bytes);
    if (!mem) return -2;

    /* phase A: gate and up of every expert on its rows */
    int na = 0, first_all = -1;
    for (int e = 0; e < E; e++) {
        const int n = start[e + 1] - start[e];
        if (n == 0) continue;
        const size_t F = (size_t)w[3 * e]->O;
        mm_job g = jobs[2 * e], u = jobs[2 * e + 1];
        const float *xin = x;
        const int whole = all_rows(rows + start[e], n, S);
        if (!whole) {
            float *xg = (float *)mem;
            mem += up64((size_t)n * D * sizeof(float));
            for (int i = 0; i < n; i++)
                memcpy(xg + (size_t)i * D, x + (size_t)rows[start[e] + i] * D,
                       (size_t)D * sizeof(float));
            xin = xg;
        }
        if (whole && first_all >= 0 && colibri_same_layout(jobs[first_all].w, g.w)) {
            const mm_job *src = &jobs[first_all]; /* same input, same layout: same prep */
            const colibri_weight *gw = g.w;
            g = *src;
            g.w = gw;
        } else {
            colibri_prepare_into(&g, family, xin, n, mem);
            mem += up64(colibri_prep_bytes(&g, family, n));
        }
        if (colibri_same_layout(g.w, u.w)) { /* reuse the prepared (quantised) activation */
            const colibri_weight *uw = u.w;
            u = g;
            u.w = uw;
        } else {
            colibri_prepare_into(&u, family, xin, n, mem);
            mem += up64(colibri_prep_bytes(&u, family, n));
        }
        g.y = (float *)mem;
        mem += up64((size_t)n * F * sizeof(float));
        u.y = (float *)mem;
        mem += up64((size_t)n * F * sizeof(float));
        if (whole && first_all < 0) first_all = na;
        jobs[na++] = g;
        jobs[na++] = u;
    }
    if (na == 0) return 0;
    int rc = colibri_run_jobs(jobs, na, family);
    if (rc) return rc;

    /* h = silu(g) * u, then phase B: every down on its expert's h */
    int nb = 0;
    mm_job *downs = &jobs[2 * E];
    for (int e = 0, a = 0; e < E; e++) {
        const int n = start[e + 1] - start[e];
        if (n == 0) continue;
        float *gy = jobs[a].y;
        const float *uy = jobs[a + 1].y;
        a += 2;
        const size_t nf = (size_t)n * w[3 * e]->O;
        colibri_silu_mul(gy, uy, nf);
        mm_job d = downs[e];
        colibri_prepare_into(&d, family, gy, n, mem);
        mem += up64(colibri_prep_bytes(&d, family, n));
        d.y = (float *)mem;
        mem += up64((size_t)n * D * sizeof(float));
        downs[nb++] = d;
    }
    if ((rc = colibri_run_jobs(downs, nb, family))) return rc;

    /* out[dest] = gate * y, row by row (the gate is one float multiply, as before) */
    for (int e = 0, b = 0; e < E; e++) {
        const int n = start[e + 1] - start[e];
        if (n == 0) continue;
        const float *y = downs[b++].y;
        for (int i = 0; i < n; i++) {
            const int p = start[e] + i;
            const float gv = gates[p];
            float *o = out + (size_t)dest[p] * D;
            const float *yi = y + (size_t)i * D;
            for (int k = 0; k < D; k++) o[k] = yi[k] * gv;
        }
    }
    return 0;
}

int colibri_rank_sum(const float *parts, int S, int R, int D, float *out) {
    if (!parts || !out || S < 1 || R < 1 || D < 1) return -1;
    for (int s = 0; s < S; s++) {
        float *o = out + (size_t)s * D;
        for (int k = 0; k < D; k++) o[k] = 0.0f;
        for (int r = 0; r < R; r++) {
            const float *p = parts + ((size_t)s * R + r) * D;
            for (int k = 0; k < D; k++) o[k] += p[k];
        }
    }
    return 0;
}
