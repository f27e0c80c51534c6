/* ISA selection (CPU detection once, COLIBRI_ISA override, runtime setter), activation
 * preparation, thread split and the public entry points of colibri.h. */
#include "internal.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static const char *const isa_names[] = {"ref", "avx2", "avx512vnni", "neon"};

static const isa_ops *isa_table(int isa) {
    switch (isa) {
    case COLIBRI_ISA_REF: return &colibri_ref_ops;
#if defined(__x86_64__) || defined(_M_X64)
    case COLIBRI_ISA_AVX2: return &colibri_avx2_ops;
    case COLIBRI_ISA_AVX512VNNI: return &colibri_avx512_ops;
#endif
#if defined(__aarch64__)
    case COLIBRI_ISA_NEON: return &colibri_neon_ops;
#endif
    default: return NULL;
    }
}

int colibri_isa_available(int isa) {
    if (isa_table(isa) == NULL) return 0;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (isa == COLIBRI_ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == COLIBRI_ISA_AVX512VNNI)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("fma");
#endif
    return 1;
}

static _Atomic int g_isa = -1;     /* the process ISA: forced, else the best available */
static _Atomic int g_best = -1;    /* the highest-ranked available ISA */
static _Atomic int g_forced = 0;   /* set_isa(k >= 0) or COLIBRI_ISA: choices are ignored */
static _Atomic int g_threads = 0;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_once(void) {
    int best = COLIBRI_ISA_REF;
    for (int k = 1; k < 4; k++)
        if (colibri_isa_available(k)) best = k;
    atomic_store(&g_best, best);
    int isa = best;
    const char *env = getenv("COLIBRI_ISA");
    if (env != NULL)
        for (int k = 0; k < 4; k++)
            if (strcmp(env, isa_names[k]) == 0 && colibri_isa_available(k)) {
                isa = k;
                atomic_store(&g_forced, 1);
            }
    atomic_store(&g_isa, isa);
    int nt = 1;
    const char *tenv = getenv("COLIBRI_THREADS");
    if (tenv != NULL && atoi(tenv) > 0) nt = atoi(tenv);
    else nt = colibri_pool_threads();
    atomic_store(&g_threads, nt);
}

int colibri_get_isa(void) {
    pthread_once(&g_once, init_once);
    return atomic_load(&g_isa);
}

int colibri_isa_forced(void) {
    pthread_once(&g_once, init_once);
    return atomic_load(&g_forced);
}

int colibri_set_isa(int isa) {
    pthread_once(&g_once, init_once);
    if (isa == -1) { /* automatic: calibrated choices per layout, else the best ISA */
        atomic_store(&g_isa, atomic_load(&g_best));
        atomic_store(&g_forced, 0);
        return 0;
    }
    if (isa < 0 || isa > 3 || !colibri_isa_available(isa)) return -1;
    atomic_store(&g_isa, isa);
    atomic_store(&g_forced, 1);
    return 0;
}

/* ---- per-layout kernel choices ----
 *
 * Why: which ISA's kernel streams a weight fastest depends on its layout (on one Zen 4
 * EPYC, AVX2 beat AVX-512 for int8 rows and int4 at I = 6144 while AVX-512 won int4 at
 * I = 2048), so ranking ISAs is not enough. The calibration (colibrid/backends/
 * calibrate.py) measures each layout a model uses once and registers the winner here.
 * The key is the layout (format, group, I) and the family, never O or S: equal layouts
 * share prepared activations, and S rows must run what S single rows run. Entries are
 * appended under a lock and published by the count, so readers need no lock. */
#define MAX_CHOICES 64
typedef struct {
    int fmt, group, I, family, isa;
} layout_choice;
static layout_choice g_choices[MAX_CHOICES];
static _Atomic int g_nchoices = 0;
static pthread_mutex_t g_choice_lock = PTHREAD_MUTEX_INITIALIZER;

static int layout_group(int fmt, int gs, int I) {
    if (!colibri_is_nibble(fmt) && !colibri_is_affine(fmt)) return 0;
    return gs > 0 && gs < I ? gs : I;
}

static int find_choice(int fmt, int group, int I, int family) {
    const int n = atomic_load_explicit(&g_nchoices, memory_order_acquire);
    for (int k = 0; k < n; k++) {
        const layout_choice *c = &g_choices[k];
        if (c->fmt == fmt && c->group == group && c->I == I && c->family == family) return k;
    }
    return -1;
}

/* A layout's first choice stands for the life of the process: a model loaded earlier
 * must keep computing what it computed, whatever a later load measures. */
int colibri_set_choice(int fmt, int gs, int I, int family, int isa) {
    pthread_once(&g_once, init_once);
    if (fmt < 0 || fmt > COLIBRI_FMT_Q3 || I < 1 || family < 0 || family > 1 || isa < 0 || isa > 3 ||
        !colibri_isa_available(isa))
        return -1;
    const int group = layout_group(fmt, gs, I);
    pthread_mutex_lock(&g_choice_lock);
    int rc = 0, k = find_choice(fmt, group, I, family);
    if (k >= 0) {
        rc = g_choices[k].isa == isa ? 0 : 1;
    } else if ((k = atomic_load(&g_nchoices)) < MAX_CHOICES) {
        g_choices[k] = (layout_choice){fmt, group, I, family, isa};
        atomic_store_explicit(&g_nchoices, k + 1, memory_order_release);
    } else {
        rc = -1; /* full: that layout keeps the process ISA */
    }
    pthread_mutex_unlock(&g_choice_lock);
    return rc;
}

int colibri_choice(int fmt, int gs, int I, int family) {
    pthread_once(&g_once, init_once);
    if (!atomic_load(&g_forced)) {
        const int k = find_choice(fmt, layout_group(fmt, gs, I), I, family);
        if (k >= 0) return g_choices[k].isa;
    }
    return atomic_load(&g_isa);
}

void colibri_set_threads(int n) {
    pthread_once(&g_once, init_once);
    atomic_store(&g_threads, n < 1 ? 1 : (n > 256 ? 256 : n));
}

int colibri_get_threads(void) {
    pthread_once(&g_once, init_once);
    return atomic_load(&g_threads);
}

/* ---- per-calling-thread scratch (no allocation on the hot path once warm) ---- */

enum { SLOT_PREP, SLOT_G, SLOT_U, SLOT_BX, SLOT_BY, SLOT_TASKS, SLOT_N };
static _Thread_local struct { void *p; size_t n; } tl_slot[SLOT_N];

static void *grow_slot(void **p, size_t *have, size_t n) {
    if (*have < n) {
        free(*p);
        size_t m = (n + 4095) & ~(size_t)4095;
        *p = aligned_alloc(64, m);
        *have = *p ? m : 0;
    }
    return *p;
}

static void *scratch(int k, size_t n) { return grow_slot(&tl_slot[k].p, &tl_slot[k].n, n); }

static _Thread_local struct { void *p; size_t n; } tl_arena[COLIBRI_ARENAS];

void *colibri_arena(int k, size_t n) { return grow_slot(&tl_arena[k].p, &tl_arena[k].n, n); }

/* ---- job preparation ---- */

int colibri_is_integer(const colibri_weight *w, int family) {
    return family == COLIBRI_FAM_I8 &&
           (w->fmt == COLIBRI_FMT_Q8 || colibri_is_nibble(w->fmt) || colibri_is_affine(w->fmt));
}

int colibri_check_weight(const colibri_weight *w) {
    if (w == NULL || w->data == NULL || w->O < 1 || w->I < 1 || w->fmt < 0 || w->fmt > COLIBRI_FMT_Q3)
        return -1;
    if (w->fmt >= COLIBRI_FMT_Q8 && w->scales == NULL) return -1;
    if (colibri_is_affine(w->fmt) && w->gs != COLIBRI_AFFINE_GROUP) return -1;
    if (w->fmt == COLIBRI_FMT_Q4 && (w->gs < 0 || (w->gs & 1))) return -1;
    if (w->fmt == COLIBRI_FMT_FP4 && (w->gs < 2 || (w->gs & 1))) return -1;
    return 0;
}

int colibri_same_layout(const colibri_weight *a, const colibri_weight *b) {
    return a->fmt == b->fmt && a->I == b->I && a->gs == b->gs;
}

void colibri_describe(mm_job *j, const colibri_weight *w, int family) {
    static const size_t elem[4] = {4, 2, 1, 0};
    memset(j, 0, sizeof *j);
    j->w = w;
    j->ops = isa_table(colibri_choice(w->fmt, w->gs, w->I, family));
    if (colibri_is_affine(w->fmt)) { /* whole blocks of 64, the last one padded */
        j->gsz = COLIBRI_AFFINE_GROUP;
        j->G = (w->I + COLIBRI_AFFINE_GROUP - 1) / COLIBRI_AFFINE_GROUP;
        j->wrow = (size_t)colibri_affine_block(w->fmt) * (size_t)j->G;
    } else {
        j->wrow = colibri_is_nibble(w->fmt) ? (size_t)(w->I + 1) / 2 : elem[w->fmt] * (size_t)w->I;
        j->gsz = (colibri_is_nibble(w->fmt) && w->gs > 0 && w->gs < w->I) ? w->gs : w->I;
        j->G = (w->I + j->gsz - 1) / j->gsz;
    }
    j->ldx = ((size_t)w->I + COLIBRI_XPAD - 1) / COLIBRI_XPAD * COLIBRI_XPAD;
}

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t colibri_prep_bytes(const mm_job *j, int family, int S) {
    if (colibri_is_integer(j->w, family))
        return 2 * up64((size_t)S * j->ldx) + up64((size_t)S * sizeof(float)) +
               up64((size_t)S * j->G * sizeof(int32_t));
    return up64((size_t)S * j->ldx * sizeof(float));
}

/* Fill the activation side of a job from `mem` (64-byte aligned, colibri_prep_bytes
 * long): int8 rows, scales and group sums (I8), or the ISA's preferred copy of x (F32). */
void colibri_prepare_into(mm_job *j, int family, const float *x, int S, void *mem) {
    const colibri_weight *w = j->w;
    const isa_ops *ops = j->ops;
    const int I = w->I;
    uint8_t *m = mem;
    j->x = x;
    j->S = S;
    if (colibri_is_integer(w, family)) {
        int8_t *qx = (int8_t *)m;
        int8_t *qp = (int8_t *)(m + up64((size_t)S * j->ldx));
        float *xs = (float *)(m + 2 * up64((size_t)S * j->ldx));
        int32_t *gsum = (int32_t *)((uint8_t *)xs + up64((size_t)S * sizeof(float)));
        for (int s = 0; s < S; s++) {
            int8_t *q = qx + (size_t)s * j->ldx;
            (ops->quant_row ? ops->quant_row : colibri_quant_row)(x + (size_t)s * I, I, q, j->ldx, xs + s);
            for (int g = 0; g < j->G; g++) {
                int32_t t = 0;
                const int i1 = (g + 1) * j->gsz < I ? (g + 1) * j->gsz : I;
                for (int i = g * j->gsz; i < i1; i++) t += q[i];
                gsum[(size_t)s * j->G + g] = t;
            }
        }
        j->qx = qx;
        j->xs = xs;
        j->gsum = gsum;
        if (ops->prep_i8) {
            int used = 0;
            for (int s = 0; s < S; s++)
                used = ops->prep_i8(w, qx + (size_t)s * j->ldx, j->ldx, qp + (size_t)s * j->ldx);
            j->qxp = used ? qp : NULL;
        }
    } else if (ops->prep_f32) {
        float *xp = (float *)m;
        int used = 0;
        for (int s = 0; s < S; s++)
            used = ops->prep_f32(w, x + (size_t)s * I, I, j->ldx, xp + (size_t)s * j->ldx);
        j->xp = used ? xp : NULL;
    }
}

static int prepare(mm_job *j, int family, const float *x, int S) {
    void *mem = scratch(SLOT_PREP, colibri_prep_bytes(j, family, S));
    if (!mem) return -2;
    colibri_prepare_into(j, family, x, S, mem);
    return 0;
}

/* ---- parallel run: chunks of whole tiles of output rows ---- */

typedef struct {
    const mm_job *j;
    rows_fn fn;
    int o0, o1;
} run_task;

static void run_chunk(void *ctx, int c) {
    const run_task *t = (const run_task *)ctx + c;
    t->fn(t->j, t->o0, t->o1);
}

/* Split the output rows of every job into tile-aligned chunks, ~8 per thread over all
 * jobs so a late or slow thread costs little and no thread idles between jobs; each
 * output is still computed by exactly one call, so the split changes no bit. */
int colibri_run_jobs(const mm_job *jobs, int n, int family) {
    double work = 0;
    size_t tiles = 0;
    for (int k = 0; k < n; k++) {
        work += (double)jobs[k].w->O * jobs[k].w->I * jobs[k].S;
        tiles += (size_t)(jobs[k].w->O + jobs[k].ops->tile - 1) / jobs[k].ops->tile;
    }
    run_task *tasks = scratch(SLOT_TASKS, tiles * sizeof(run_task)); /* at most one a tile */
    if (!tasks) return -2;
    int nt = colibri_get_threads();
    if (work < (double)(1 << 18)) nt = 1; /* not worth waking anyone */
    size_t per = nt > 1 ? tiles / ((size_t)nt * 8) : tiles;
    if (per < 1) per = 1;
    int count = 0;
    for (int k = 0; k < n; k++) {
        const mm_job *j = &jobs[k];
        const int rows = (int)per * j->ops->tile;
        const rows_fn fn = colibri_is_integer(j->w, family) ? j->ops->i8_rows : j->ops->f32_rows;
        for (int o = 0; o < j->w->O; o += rows)
            tasks[count++] = (run_task){j, fn, o, o + rows < j->w->O ? o + rows : j->w->O};
    }
    colibri_pool_for(count, nt, run_chunk, tasks);
    return 0;
}

int colibri_matmul(const colibri_weight *w, int family, const float *x, int S, float *y) {
    if (colibri_check_weight(w) || x == NULL || y == NULL || S < 1) return -1;
    mm_job j;
    colibri_describe(&j, w, family);
    j.y = y;
    int rc = prepare(&j, family, x, S);
    if (rc) return rc;
    return colibri_run_jobs(&j, 1, family);
}

int colibri_expert_swiglu(const colibri_weight *gate, const colibri_weight *up,
                          const colibri_weight *down, int family, const float *x, int S,
                          float *y) {
    if (colibri_check_weight(gate) || colibri_check_weight(up) || colibri_check_weight(down) || !x || !y || S < 1)
        return -1;
    const int F = gate->O, D = gate->I;
    if (up->O != F || up->I != D || down->O != D || down->I != F) return -1;
    float *g = scratch(SLOT_G, (size_t)S * F * sizeof(float));
    float *u = scratch(SLOT_U, (size_t)S * F * sizeof(float));
    if (!g || !u) return -2;
    mm_job j;
    colibri_describe(&j, gate, family);
    j.y = g;
    int rc = prepare(&j, family, x, S);
    if (rc) return rc;
    if ((rc = colibri_run_jobs(&j, 1, family))) return rc;
    if (colibri_same_layout(gate, up)) { /* reuse the prepared (quantised) activation */
        j.w = up;
        j.y = u;
    } else {
        colibri_describe(&j, up, family);
        j.y = u;
        if ((rc = prepare(&j, family, x, S))) return rc;
    }
    if ((rc = colibri_run_jobs(&j, 1, family))) return rc;
    colibri_silu_mul(g, u, (size_t)S * F);
    colibri_describe(&j, down, family);
    j.y = y;
    if ((rc = prepare(&j, family, g, S))) return rc;
    return colibri_run_jobs(&j, 1, family);
}

/* ---- block-diagonal matmul: each block of output rows has its own activation ----
 *
 * Why: absorbed MLA attention multiplies every head's slice of kv_b_proj by that head's
 * own vector (64 small matvecs per layer). One call keeps the weight in its checkpoint
 * format (int8/int4 instead of a 4x larger float copy) and spreads the blocks over the
 * pool. Block b is computed exactly as colibri_matmul on its rows with x[:, b, :], so
 * the bits cannot depend on the block count, the thread split or S. */

typedef struct {
    const colibri_weight *w;
    int family, S, B, Ob;
    const float *x; /* [S, B, I] */
    float *y;       /* [S, O] */
    _Atomic int rc;
} blocks_ctx;

static void block_chunk(void *ctx, int b) {
    blocks_ctx *c = ctx;
    const colibri_weight *w = c->w;
    const int I = w->I, S = c->S;
    colibri_weight sub = *w;
    mm_job j;
    colibri_describe(&j, w, c->family);
    const size_t G = (size_t)j.G;
    sub.O = c->Ob;
    sub.data = (const uint8_t *)w->data + (size_t)b * c->Ob * j.wrow;
    if (w->scales) /* FP4's scales are bytes, Q2/Q3's float16 pairs */
        sub.scales = w->fmt == COLIBRI_FMT_FP4 ? (const float *)((const uint8_t *)w->scales + (size_t)b * c->Ob * G)
                     : colibri_is_affine(w->fmt)
                         ? (const float *)((const uint16_t *)w->scales + (size_t)b * c->Ob * G * 2)
                         : w->scales + (size_t)b * c->Ob * G;
    colibri_describe(&j, &sub, c->family);
    float *xb = scratch(SLOT_BX, (size_t)S * I * sizeof(float));
    float *yb = S == 1 ? c->y + (size_t)b * c->Ob : scratch(SLOT_BY, (size_t)S * c->Ob * sizeof(float));
    if (!xb || !yb) {
        atomic_store(&c->rc, -2);
        return;
    }
    for (int s = 0; s < S; s++)
        memcpy(xb + (size_t)s * I, c->x + ((size_t)s * c->B + b) * I, (size_t)I * sizeof(float));
    j.y = yb;
    const int rc = prepare(&j, c->family, xb, S);
    if (rc) {
        atomic_store(&c->rc, rc);
        return;
    }
    (colibri_is_integer(&sub, c->family) ? j.ops->i8_rows : j.ops->f32_rows)(&j, 0, c->Ob);
    if (S > 1)
        for (int s = 0; s < S; s++)
            memcpy(c->y + (size_t)s * w->O + (size_t)b * c->Ob, yb + (size_t)s * c->Ob,
                   (size_t)c->Ob * sizeof(float));
}

int colibri_matmul_blocks(const colibri_weight *w, int family, const float *x, int S, int B,
                          float *y) {
    if (colibri_check_weight(w) || x == NULL || y == NULL || S < 1 || B < 1 || w->O % B) return -1;
    blocks_ctx c = {w, family, S, B, w->O / B, x, y, 0};
    const double work = (double)w->O * w->I * S;
    colibri_pool_for(B, work < (double)(1 << 18) ? 1 : colibri_get_threads(), block_chunk, &c);
    return atomic_load(&c.rc);
}

int colibri_silu_mul(float *g, const float *u, size_t n) {
    if ((!g || !u) && n) return -1;
    for (size_t k = 0; k < n; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    return 0;
}

int colibri_quant_rows(const float *x, int S, int I, int8_t *q, float *xs) {
    if (!x || !q || !xs || S < 0 || I < 1) return -1;
    for (int s = 0; s < S; s++) colibri_quant_row(x + (size_t)s * I, I, q + (size_t)s * I, (size_t)I, xs + s);
    return 0;
}
