/* What attention.c shares with its per-width kernel builds (attention_body.h). */
#ifndef COLIBRI_ATTENTION_H
#define COLIBRI_ATTENTION_H

#include "internal.h"

#include <stdatomic.h>

typedef struct {
    const float *q; /* [S, H, d] */
    const float *k; /* [T, G, d] */
    const float *v; /* [T, G, d] */
    float *out;     /* [S, H, d] */
    int S, H, G, d, T, start;
    int window; /* > 0: the row at position p sees keys t > p - window only */
    float scale;
    const float *sinks; /* [H] or NULL: a logit per head that joins the softmax's denominator */
    int heads_per_job;  /* query heads of one KV head computed together (they share its keys) */
    _Atomic int rc;
} attn_ctx;

/* The calling thread's score buffer of at least n floats (NULL when out of memory). */
float *colibri_scores_buffer(size_t n);

void colibri_attend_one_v4(void *ctx, int job);
#if defined(__x86_64__) || defined(_M_X64)
void colibri_attend_one_avx2(void *ctx, int job);
void colibri_attend_one_avx512(void *ctx, int job);
#endif

#endif
