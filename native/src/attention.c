/* Causal grouped-query attention over a sequence's cached keys and values, float32.
 *
 * Why native: at decode the work is tiny (H heads x T keys x d) and numpy spent ten times
 * the arithmetic in dispatch and strided batched matmuls (~180 us a layer on the demo).
 *
 * Each (row, head) is computed with a fixed operation order, so a result does not depend
 * on S, on the thread split or on the other rows: score_t = (q . k_t) * scale (eight
 * partial sums, reduced pairwise), the row's max subtracted, exp (exp_shifted), the sum
 * over t (eight partial sums), each weight divided by the sum, then out = sum_t p_t v_t
 * in t order. A job is one row and a run of heads sharing a KV head: the scores of the run
 * are taken key block by key block (each key loaded once for all of them), each head's
 * still with exactly that arithmetic. With a sliding window the row's keys simply start
 * later: the same arithmetic over the keys it may see. A sink (gpt-oss) is one more logit
 * in the row's maximum and in the sum, with no value: exp(sink - max) added last. */
#include "attention.h"

#include <stdlib.h>

static _Thread_local struct { float *p; size_t n; } tl_scores;

float *colibri_scores_buffer(size_t n) {
    if (tl_scores.n < n) {
        free(tl_scores.p);
        tl_scores.p = malloc(n * sizeof(float));
        tl_scores.n = tl_scores.p ? n : 0;
    }
    return tl_scores.p;
}

#define VW 4
#define ATTEND_ONE colibri_attend_one_v4
#include "attention_body.h"

int colibri_attend_gqa(const float *q, int S, int H, int d, const float *k, const float *v, int T,
                       int G, float scale, int start, int window, const float *sinks,
                       float *out) {
    if (!q || !k || !v || !out || S < 1 || H < 1 || d < 1 || T < 1 || G < 1 || H % G ||
        start < 0 || start + S > T || window < 0)
        return -1;
    /* A job is one row and a run of query heads of one KV head, so each key is loaded once
     * for all of them; runs are shortened (to a divisor of the group) only where the
     * jobs would be too few to keep the threads busy. */
    const int nt = colibri_get_threads(), group = H / G;
    int per = group;
    while (per > 1 && (long)S * (H / per) < 2L * nt) {
        do per--;
        while (group % per);
    }
    attn_ctx c = {q, k, v, out, S, H, G, d, T, start, window, scale, sinks, per, 0};
    const double work = (double)S * H * T * d;
    chunk_fn one = colibri_attend_one_v4;
#if defined(__x86_64__) || defined(_M_X64)
    if (colibri_get_isa() == COLIBRI_ISA_AVX2)
        one = colibri_attend_one_avx2; /* the same arithmetic, eight lanes at a time */
    if (colibri_get_isa() == COLIBRI_ISA_AVX512VNNI)
        one = colibri_attend_one_avx512; /* and sixteen where lanes never meet */
#endif
    colibri_pool_for(S * (H / per), work < (double)(1 << 17) ? 1 : nt, one, &c);
    return atomic_load(&c.rc);
}
