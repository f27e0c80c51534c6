/* Internal contract between dispatch.c and the per-ISA kernel files.
 *
 * A matmul is described once (mm_job) with the activations already prepared: for the
 * F32 family the plain x plus an optional ISA-specific permuted copy, for the I8
 * family the int8 quantised rows, their scales and per-group sums.  Kernels compute
 * output rows [o0, o1) for every activation row s; each output y[s, o] is produced
 * by exactly one call with a fixed operation sequence, which is what makes results
 * independent of batch size, thread split and (for I8) the ISA.
 */
#ifndef COLIBRI_INTERNAL_H
#define COLIBRI_INTERNAL_H

#include "colibri.h"

#include <stddef.h>
#include <stdint.h>

/* The integer each FP4 code (a nibble: sign bit 3, two exponent bits, one mantissa bit)
 * stands for: e2m1's value doubled, {0, 0.5, 1, 1.5, 2, 3, 4, 6} -> {0, 1, 2, 3, 4, 6, 8,
 * 12} with the sign; the weight is that times its group's scale (2^(e - 128) for MXFP4's
 * 2^(e - 127)), so FP4 computes as Q4 does with another code table. */
extern const int8_t colibri_fp4_values[16];

/* An FP4 group's factor from its e8m0 byte: 2^(e - 128), exact (subnormal for e < 2);
 * e = 255 is e8m0's NaN. */
static inline float colibri_fp4_scale(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e == 255 ? 0x7fc00000u : e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    return v.f;
}

/* Group g's factor of row o (Q4: the float scales; FP4: decoded from the e8m0 bytes). */
static inline float colibri_group_scale(const colibri_weight *w, size_t o, int G, int g) {
    if (w->fmt == COLIBRI_FMT_FP4) return colibri_fp4_scale(((const uint8_t *)w->scales)[o * G + g]);
    return w->scales[o * G + g];
}

/* A nibble weight format (Q4 or FP4): packed two codes a byte, one scale per group. */
static inline int colibri_is_nibble(int fmt) { return fmt == COLIBRI_FMT_Q4 || fmt == COLIBRI_FMT_FP4; }

/* ---- low-bit affine formats (Q2, Q3; docs/formats.md) ----
 * A row is one block per group of 64 inputs: 16 bytes of low plane (bits 2k..2k+1 of
 * byte j: the low code bits of input 16k + j), and for Q3 8 bytes of high plane (bit b of
 * byte 16 + j: bit 2 of input 8b + j); the scales are float16 (s, m) pairs per group. */
#define COLIBRI_AFFINE_GROUP 64
static inline int colibri_is_affine(int fmt) { return fmt == COLIBRI_FMT_Q2 || fmt == COLIBRI_FMT_Q3; }
static inline int colibri_affine_block(int fmt) { return fmt == COLIBRI_FMT_Q3 ? 24 : 16; }

/* The code of input i of a Q2/Q3 row: its block's low plane, plus Q3's high-plane bit. */
static inline int colibri_affine_at(int fmt, const uint8_t *row, int i) {
    const uint8_t *blk = row + (size_t)(i >> 6) * (size_t)colibri_affine_block(fmt);
    const int k = i & 63;
    int q = (blk[k & 15] >> (2 * (k >> 4))) & 3;
    if (fmt == COLIBRI_FMT_Q3) q |= ((blk[16 + (k & 7)] >> (k >> 3)) & 1) << 2;
    return q;
}

/* float16 bits to float32, exact (subnormals through one exact multiply by 2^112). */
static inline float colibri_f16(uint16_t h) {
    union { uint32_t u; float f; } v, scale;
    const uint32_t mag = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    if (mag >= 0x7c00u) { /* inf or NaN */
        v.u = sign | 0x7f800000u | (uint32_t)(mag & 0x3ffu) << 13;
        return v.f;
    }
    scale.u = 0x77800000u; /* 2^112 */
    v.u = mag << 13;
    v.f = v.f * scale.f;
    v.u |= sign;
    return v.f;
}

/* Group g's scale and minimum of row o (G groups a row). */
static inline void colibri_affine_sm(const colibri_weight *w, size_t o, int G, int g, float *s, float *m) {
    const uint16_t *p = (const uint16_t *)w->scales + (o * (size_t)G + (size_t)g) * 2;
    *s = colibri_f16(p[0]);
    *m = colibri_f16(p[1]);
}

/* The I8 family's float step for one group, the same expression on every ISA (built with
 * -ffp-contract=off): both products, their sum, then the add to the running value. */
static inline float colibri_affine_step(float acc, int32_t isum, int32_t xsum, float s, float m, float xs) {
    return acc + ((float)isum * (s * xs) + (float)xsum * (m * xs));
}

/* Activation copies are zero padded to a multiple of this many elements so SIMD
 * kernels may read whole blocks of x; weights are never over-read. */
#define COLIBRI_XPAD 128

struct isa_ops;

typedef struct mm_job {
    const colibri_weight *w;
    const struct isa_ops *ops; /* the kernel set this weight's layout runs on (pick_ops) */
    int G;           /* scale groups per row: 1 for per-row formats */
    int gsz;         /* elements per group (I for per-row formats) */
    size_t wrow;     /* bytes per weight row */
    int S;
    float *y;        /* [S, O] */
    const float *x;  /* [S, I] plain */
    const float *xp; /* [S, ldx] ISA-specific copy or NULL */
    size_t ldx;
    const int8_t *qx;  /* [S, ldx] plain int8 rows, zero padded */
    const int8_t *qxp; /* [S, ldx] ISA-specific copy or NULL */
    const float *xs;   /* [S] activation scales */
    const int32_t *gsum; /* [S, G] sums of qx over each group */
} mm_job;

/* Prefill blocking: activation rows are taken in blocks that stay in L1 while every
 * weight row of a chunk passes over them (looping over all S rows per weight row
 * streamed a prefill's whole activation matrix from L2/L3 once per output).  Rows per
 * block: a multiple of `step` (the kernel's row batch), at least one step.  Each output
 * is computed exactly as without blocking, so the block size changes no bit. */
#define COLIBRI_X_BLOCK_BYTES (16 * 1024)
static inline int colibri_x_block_rows(const mm_job *j, size_t elem, int step) {
    const int rows = (int)(COLIBRI_X_BLOCK_BYTES / (j->ldx * elem)) / step * step;
    return rows < step ? step : rows;
}

typedef void (*rows_fn)(const mm_job *j, int o0, int o1);
/* Write an ISA-specific layout of one activation row into out[n] (n = ldx, zero
 * padded past I); return 0 when this ISA wants the plain layout for that format. */
typedef int (*prep_f32_fn)(const colibri_weight *w, const float *x, int I, size_t n, float *out);
typedef int (*prep_i8_fn)(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out);

typedef struct isa_ops {
    const char *name;
    rows_fn f32_rows;
    rows_fn i8_rows;
    prep_f32_fn prep_f32;
    prep_i8_fn prep_i8;
    int tile; /* output rows per tile: thread chunks are aligned to it */
    /* The ISA's activation quantiser, or NULL for colibri_quant_row: it must give that
     * function's bits exactly (the cross-ISA bit-exact tests compare them through the
     * matmuls), only faster. */
    void (*quant_row)(const float *x, int I, int8_t *q, size_t ldq, float *xs);
} isa_ops;

extern const isa_ops colibri_ref_ops;
#if defined(__x86_64__) || defined(_M_X64)
extern const isa_ops colibri_avx2_ops;
extern const isa_ops colibri_avx512_ops;
#endif
#if defined(__aarch64__)
extern const isa_ops colibri_neon_ops;
#endif

/* Job description and activation preparation (dispatch.c), shared with batch.c.
 * describe() picks the job's kernel set from the weight's layout and the family (the
 * calibrated choice, else the process ISA), so equal layouts always share one set. */
int colibri_is_integer(const colibri_weight *w, int family);
int colibri_check_weight(const colibri_weight *w);
int colibri_same_layout(const colibri_weight *a, const colibri_weight *b);
void colibri_describe(mm_job *j, const colibri_weight *w, int family);
size_t colibri_prep_bytes(const mm_job *j, int family, int S);
void colibri_prepare_into(mm_job *j, int family, const float *x, int S, void *mem);
/* Run prepared jobs in one pool dispatch (0, or -2 when out of memory). */
int colibri_run_jobs(const mm_job *jobs, int n, int family);
/* Per-calling-thread buffer k (< COLIBRI_ARENAS) of at least n bytes, 64-byte aligned,
 * reused by the next call from the same thread: what a batched call carves its job
 * descriptions (0) and work buffers (1) from, and a composed block (gqa.c) its
 * activations (2) and a resident MoE layer (moe.c) its plan and partial sums (3), so a
 * warm decode allocates nothing. */
#define COLIBRI_ARENAS 4
void *colibri_arena(int k, size_t n);

/* The ISA kernels of Q2/Q3 (x86/affine_*.c, arm/affine_neon.c): whole groups, x (and qx)
 * read from the zero-padded copies, so the last, padded block needs no tail. */
#if defined(__x86_64__) || defined(_M_X64)
void colibri_affine_i8_rows_avx512(const mm_job *j, int o0, int o1);
int colibri_affine_prep_i8_avx512(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out);
int colibri_affine_prep_f32_avx512(const colibri_weight *w, const float *x, int I, size_t n, float *out);
void colibri_affine_f32_rows_avx512(const mm_job *j, int o0, int o1);
void colibri_affine_i8_rows_avx2(const mm_job *j, int o0, int o1);
int colibri_affine_prep_i8_avx2(const colibri_weight *w, const int8_t *qx, size_t n, int8_t *out);
int colibri_affine_prep_f32_avx2(const colibri_weight *w, const float *x, int I, size_t n, float *out);
void colibri_affine_f32_rows_avx2(const mm_job *j, int o0, int o1);
#endif
#if defined(__aarch64__)
void colibri_affine_i8_rows_neon(const mm_job *j, int o0, int o1);
void colibri_affine_f32_rows_neon(const mm_job *j, int o0, int o1);
#endif

/* Reference single-output kernels: the bit-exact oracle for the integer paths and
 * the fallback every ISA uses for formats or group sizes it does not specialise. */
float colibri_ref_f32_one(const mm_job *j, int o, int s);
float colibri_ref_i8_one(const mm_job *j, int o, int s);
void colibri_ref_f32_rows(const mm_job *j, int o0, int o1);
void colibri_ref_i8_rows(const mm_job *j, int o0, int o1);

/* Activation quantisation shared by every ISA (identical by construction). */
void colibri_quant_row(const float *x, int I, int8_t *q, size_t ldq, float *xs);

/* Thread pool: run fn(ctx, c) for every chunk c < nchunks on up to nt threads (the
 * caller included); returns when all chunks are done.  Chunk order is unspecified. */
typedef void (*chunk_fn)(void *ctx, int chunk);
void colibri_pool_for(int nchunks, int nt, chunk_fn fn, void *ctx);
int colibri_pool_threads(void);

#endif
