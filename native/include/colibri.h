/* colibri native kernel catalogue.
 *
 * This header is also the cffi cdef: the Python builder strips the preprocessor
 * lines (#...) and feeds the rest to cffi, so keep it to plain declarations.
 *
 * Weights are [O, I] row-major; activations x are float32 [S, I]; outputs y are
 * float32 [S, O] = x @ W^T.  Formats follow colibrid/formats/weights.py, kernel families
 * colibrid/backends/base.py.
 * Every function that runs a kernel returns 0 on success, a negative code on error
 * (-1 bad argument, -2 out of memory).
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

/* FP4: MXFP4's e2m1 codes packed as Q4's nibbles, each code standing for an integer of
 * the doubled e2m1 grid, and one e8m0 scale byte e per group of gs (32) inputs whose factor
 * is 2^(e - 128): `scales` then points at those bytes (uint8 [O, G]), not at floats.
 * Q2/Q3: unsigned 2-/3-bit codes in blocks of 16/24 bytes per group of 64 inputs
 * (docs/formats.md), w = q * s + m; `scales` points at float16 pairs (uint16 [O, 2G]:
 * s then m per group) and gs is 64. */
enum colibri_fmt {
    COLIBRI_FMT_F32 = 0,
    COLIBRI_FMT_BF16 = 1,
    COLIBRI_FMT_Q8 = 2,
    COLIBRI_FMT_Q4 = 3,
    COLIBRI_FMT_FP4 = 4,
    COLIBRI_FMT_Q2 = 5,
    COLIBRI_FMT_Q3 = 6
};
enum colibri_family { COLIBRI_FAM_F32 = 0, COLIBRI_FAM_I8 = 1 };
enum colibri_isa {
    COLIBRI_ISA_REF = 0,
    COLIBRI_ISA_AVX2 = 1,
    COLIBRI_ISA_AVX512VNNI = 2,
    COLIBRI_ISA_NEON = 3
};

/* A weight as the kernels see it.  gs: Q4 group size (0 = one scale per row); FP4's
 * group size (> 0). */
typedef struct colibri_weight {
    int fmt;
    int O;
    int I;
    int gs;
    const void *data;
    const float *scales;
} colibri_weight;

/* ISA selection: available() says whether this CPU (and this build) can run it.
 * set_isa(k) forces ISA k for every kernel; set_isa(-1) returns to automatic: each
 * weight layout runs on its registered choice, else on the best available ISA. */
int colibri_isa_available(int isa);
int colibri_get_isa(void);
int colibri_set_isa(int isa);
int colibri_isa_forced(void);

/* Per-layout choices (format, Q4 group size, I, family) measured by the calibration.
 * The first choice for a layout stands: set_choice returns 0 (registered or already
 * the same), 1 (an earlier, different choice stands) or -1 (ISA unavailable, table
 * full); choice() says which ISA a layout runs on now. */
int colibri_set_choice(int fmt, int gs, int I, int family, int isa);
int colibri_choice(int fmt, int gs, int I, int family);

/* Thread pool size (calling thread included). */
void colibri_set_threads(int n);
int colibri_get_threads(void);

/* What the pool's parallel jobs cost the calling thread since the last reset: jobs run,
 * nanoseconds inside them, and of those the nanoseconds spent waiting for chunks other
 * threads were still computing (the spin-wait `bench decode` and `bench peer` report). */
void colibri_pool_stats(unsigned long long *jobs, unsigned long long *total_ns,
                        unsigned long long *wait_ns);
void colibri_pool_stats_reset(void);

/* y[S, O] = x[S, I] @ W^T in the given family. */
int colibri_matmul(const colibri_weight *w, int family, const float *x, int S, float *y);

/* Block-diagonal: O rows in B equal blocks; block b uses x[s, b, :] (x is [S, B, I]). */
int colibri_matmul_blocks(const colibri_weight *w, int family, const float *x, int S, int B,
                          float *y);

/* y[S, D] = down(silu(gate x) * (up x)); gate/up [F, D], down [D, F]. */
int colibri_expert_swiglu(const colibri_weight *gate, const colibri_weight *up,
                          const colibri_weight *down, int family, const float *x, int S,
                          float *y);

/* g[k] = silu(g[k]) * u[k] = g / (1 + expf(-g)) * u for n values: the SwiGLU step of every
 * expert path (C and the cuda backend's), one definition so they give the same bits. */
int colibri_silu_mul(float *g, const float *u, size_t n);

/* The I8 family's activation rows: each of the S rows of x [S, I] as the integer kernels
 * quantise it (absmax / 127, round half to even): codes q [S, I] and scales xs [S]. */
int colibri_quant_rows(const float *x, int S, int I, int8_t *q, float *xs);

/* Several products of one activation in one dispatch: y[k][S, O_k] = x[S, I] @ W_k^T for
 * n weights of the same I. Bit-identical to n colibri_matmul calls. */
int colibri_matmul_many(const colibri_weight *const *w, int n, int family, const float *x, int S,
                        float *const *y);

/* A MoE layer's experts in two dispatches. Expert e has projections w[3e..3e+2] (gate [F, D],
 * up [F, D], down [D, F]; F may differ per expert) and the pairs p in [start[e], start[e+1]):
 * it is applied to row rows[p] of x [S, D] and out[dest[p], :] = gates[p] * y, out being
 * [R, D]. Each y is bit-identical to colibri_expert_swiglu on that row. */
int colibri_experts(const colibri_weight *const *w, int E, int family, const float *x, int S,
                    int D, const int *start, const int *rows, const float *gates,
                    const int *dest, int R, float *out);

/* A MoE layer whose routed experts are all in memory: experts[3e..3e+2] are expert e's gate,
 * up and down (e < E), shared (3 pointers) or NULL. Routes the S rows of x [S, D] with
 * router [E, D] and bias as colibri_route (n = K), writes the chosen ids [S, K] (best
 * first), applies each chosen expert to its rows and the shared expert to every row as
 * colibri_experts, and sums each row's results in ascending expert order, the shared one
 * last, as colibri_rank_sum: out [S, D]. Bit-identical to those three calls. */
int colibri_moe(const colibri_weight *const *experts, int E, const colibri_weight *const *shared,
                int family, const float *x, int S, int D, const float *router,
                const float *bias, int n_group, int topk_group, int K, int softmax, int norm,
                float scaling, int32_t *ids, float *out);

/* out[s, :] = ((0 + parts[s, 0, :]) + parts[s, 1, :]) + ... over r < R, parts [S, R, D]:
 * the rank-ordered sum that makes a MoE result independent of expert arrival order. */
int colibri_rank_sum(const float *parts, int S, int R, int D, float *out);

/* RMSNorm of S rows of D floats: out = w * (x / sqrt(mean(x^2) + eps)), each row alone
 * with a fixed operation order (out may equal x). */
int colibri_rms_norm(const float *x, int S, int D, const float *w, float eps, float *out);

/* sum = h + delta, then out = RMSNorm(sum): a residual add and the next norm in one call. */
int colibri_add_rms_norm(const float *h, const float *delta, int S, int D, const float *w,
                         float eps, float *sum, float *out);

/* rotate_half RoPE of x [S, H, d]: dims j < half pair with half + j, rotated by cos/sin
 * [S, half]; dims from 2 * half on are copied. Equals the two-products-then-sum formula. */
int colibri_rope_half(const float *x, int S, int H, int d, const float *cos, const float *sin,
                      int half, float *out);

/* The MoE router for S rows of h [S, D] with router weights w [E, D] f32 and an optional
 * selection bias [E]. Scores are sigmoid(logit) per expert (GLM-4.x/5.x, DeepSeek-V3), or
 * with softmax set the softmax of the row's E logits (Qwen3-MoE, Mixtral, OLMoE: max
 * subtracted, expf, summed in expert order, each divided by the sum). ids [S, n] the n best
 * experts by selection score (score + bias; group-limited when topk_group < n_group), best
 * first, ties to the lowest index; gates [S, K] the scores of the first K, normalised when
 * norm, times scaling. n >= K. */
int colibri_route(const float *h, int S, int D, const float *w, const float *bias, int E,
                  int n_group, int topk_group, int n, int K, int softmax, int norm,
                  float scaling, int32_t *ids, float *gates);

/* Causal grouped-query attention, float32: q [S, H, d] (rows at positions start..start+S-1)
 * over keys and values [T, G, d] (a sequence's cache, T >= start + S); query head h reads
 * KV head h / (H / G); out [S, H, d]. window > 0 limits the row at position p to the keys
 * t > p - window (a sliding window of `window` keys, its own included); 0 means all causal
 * keys. sinks [H] (or NULL): a logit per query head that joins the row's softmax (its
 * maximum and its sum) and attends to nothing (gpt-oss). Each (row, head) is computed
 * alone, in a fixed order. */
int colibri_attend_gqa(const float *q, int S, int H, int d, const float *k, const float *v, int T,
                       int G, float scale, int start, int window, const float *sinks,
                       float *out);

/* A GQA attention block: q = x Wq^T (+bq), k, v likewise (one dispatch); RMSNorm of q and k
 * when q_norm/k_norm are given (both or neither): per head over d, or with norm_whole over
 * each row's whole projection (H * d for q, G * d for k, weights of those lengths);
 * rotate_half RoPE of q and k by cos/sin [S, half]; k and v written to rows
 * [start, start + S) of the caches [*, G, d]; attention of q over rows [0, start + S)
 * (within `window` keys when > 0, with the per-head `sinks` when not NULL, as
 * colibri_attend_gqa); out [S, O] = attn Wo^T. Bit-identical to those calls made one by
 * one. */
int colibri_gqa_attention(const colibri_weight *wq, const colibri_weight *wk,
                          const colibri_weight *wv, const colibri_weight *wo, int family,
                          const float *bq, const float *bk, const float *bv,
                          const float *q_norm, const float *k_norm, int norm_whole, float eps,
                          const float *cos, const float *sin, int half, const float *x, int S,
                          int H, int G, int d, float *kcache, float *vcache, int start,
                          int window, const float *sinks, float scale, float *out);

/* Best read bandwidth in GB/s over `repeats` passes of a buffer of nbytes. */
double colibri_membw_probe(size_t nbytes, int threads, int repeats);

#endif
