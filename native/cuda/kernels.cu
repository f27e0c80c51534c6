/* colibri's CUDA kernels: the weight products of the cuda backend (F32 kernel family),
 * on weights as the container stores them (docs/formats.md), never converted.
 *
 * Every thread is independent: no shared memory, no barriers, no warp shuffles. That
 * costs a second launch to reduce partial sums, and buys one source that runs on the GPU
 * and, compiled as C++ with emulate.h (COLIBRI_CUDA_EMULATE), on the CPU, where the test
 * suite holds it to the numpy reference on machines without a GPU.
 *
 * Launches are one-dimensional: thread t = blockIdx.x * blockDim.x + threadIdx.x, and
 * each kernel returns for t past its work. Signatures may use only pointers, int and
 * float: the host reads them from this file to pack the arguments (backends.cuda_device).
 */
#ifdef COLIBRI_CUDA_EMULATE
#include "emulate.h"
#endif

/* Weight formats, numbered as backends/cuda_weights.py FORMAT_CODES. */
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_Q8 2
#define FMT_Q4 3
#define FMT_FP4 4
#define FMT_Q2 5
#define FMT_Q3 6

/* Inputs one thread reads from a weight row at a time: 16 bytes of nibbles. */
#define CHUNK 32
/* Activation rows a thread keeps partial sums for at once. */
#define ROW_TILE 4

__device__ __forceinline__ float fp4_scale(unsigned e) {
    /* 2^(e - 128), exact (subnormal below e = 2); 255 is e8m0's NaN: as the C kernels. */
    unsigned u = e == 255u ? 0x7fc00000u : e >= 2u ? (e - 1u) << 23 : 0x00200000u << e;
    return __int_as_float((int)u);
}

__device__ __forceinline__ float bf16_value(unsigned short b) {
    return __int_as_float((int)((unsigned)b << 16));
}

/* The integer a nibble stands for: Q4's q = nibble - 8, FP4's doubled e2m1 value. */
__constant__ int FP4_CODES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

__device__ __forceinline__ int nibble_code(int fmt, unsigned nib) {
    return fmt == FMT_FP4 ? FP4_CODES[nib] : (int)nib - 8;
}

/* ---- Q2 / Q3, the low-bit affine formats (colibrid/formats/affine.py, docs/formats.md):
 * a block of AFFINE_BLOCK(fmt) bytes per group of 64 inputs, the last padded with code 0.
 * Bytes 0..15, the low plane: bits 2k, 2k + 1 of byte j are the low two bits of the code
 * of input 16k + j; Q3's bytes 16..23, the high plane: bit b of byte 16 + j is bit 2 of
 * the code of input 8b + j. Scales are float16 pairs, group g's scale s then its minimum
 * m, so a weight is (float)q * s + m. Blocks are 16 or 24 bytes and rows whole blocks, so
 * every block starts 8-byte aligned: its planes are read as 32-bit words. */
#define AFFINE_GROUP 64
#define AFFINE_BLOCK(fmt) ((fmt) == FMT_Q3 ? 24 : 16)

__device__ __forceinline__ bool is_affine(int fmt) { return fmt == FMT_Q2 || fmt == FMT_Q3; }

/* float16 bits as a float32, exactly (subnormals, infinities and NaN included). */
__device__ __forceinline__ float half_value(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 0u) { /* zero or subnormal: m * 2^-24, exact in float32 */
        const float v = __fmul_rn(__int2float_rn((int)m), 5.9604644775390625e-8f);
        return __int_as_float((int)(sign | (unsigned)__float_as_int(v)));
    }
    if (e == 31u) return __int_as_float((int)(sign | 0x7f800000u | (m << 13)));
    return __int_as_float((int)(sign | ((e + 112u) << 23) | (m << 13)));
}

/* Group g of row o's scale s and minimum m (scales: float16 pairs, `groups` a row). */
__device__ __forceinline__ void affine_sm(const void *scales, int o, int g, int groups, float *s,
                                          float *m) {
    const unsigned short *h = (const unsigned short *)scales + ((long long)o * groups + g) * 2;
    *s = half_value(h[0]);
    *m = half_value(h[1]);
}

/* The code (0..7) of input i of a Q2/Q3 row. */
__device__ __forceinline__ int affine_code(const unsigned char *row, int fmt, int i) {
    const unsigned char *block = row + (long long)(i / AFFINE_GROUP) * AFFINE_BLOCK(fmt);
    const int k = i % AFFINE_GROUP;
    int code = (block[k & 15] >> (2 * (k >> 4))) & 3;
    if (fmt == FMT_Q3) code |= ((block[16 + (k & 7)] >> (k >> 3)) & 1) << 2;
    return code;
}

/* The codes of inputs 16k + 4t .. 16k + 4t + 3 of the group whose block is at `block`, one a
 * byte (t = 0..3): a shift and a mask of low-plane word t, and for Q3 bit 2k + t / 2 of
 * high-plane word t % 2 moved up to bit 2. */
__device__ __forceinline__ unsigned affine_word(const unsigned char *block, int fmt, int k,
                                                int t) {
    const unsigned *words = (const unsigned *)block;
    unsigned codes = (words[t] >> (2 * k)) & 0x03030303u;
    if (fmt == FMT_Q3) codes |= ((words[4 + (t & 1)] >> (2 * k + (t >> 1))) & 0x01010101u) << 2;
    return codes;
}

/* The scale of input i of row o: the row's (Q8, per-row Q4: groups == 1) or its group's. */
__device__ __forceinline__ float scale_at(const void *scales, int fmt, int o, int i, int gsz,
                                          int groups) {
    if (fmt == FMT_F32 || fmt == FMT_BF16) return 1.0f;
    const long long g = (long long)o * groups + (groups == 1 ? 0 : i / gsz);
    return fmt == FMT_FP4 ? fp4_scale(((const unsigned char *)scales)[g])
                          : ((const float *)scales)[g];
}

/* Weight (o, i) as a float given its scale sc: the code times the scale, as
 * formats.quant.dequantize computes it (f32 and bf16 as they are). */
__device__ __forceinline__ float weight_at(const unsigned char *row, int fmt, int i, float sc) {
    switch (fmt) {
    case FMT_F32:
        return ((const float *)row)[i];
    case FMT_BF16:
        return bf16_value(((const unsigned short *)row)[i]);
    case FMT_Q8:
        return (float)((const signed char *)row)[i] * sc;
    default:
        return (float)nibble_code(fmt, (row[i >> 1] >> ((i & 1) * 4)) & 15u) * sc;
    }
}

/* Thread (o, lane) of a product y = x @ W^T: sums the chunks lane, lane + lanes, ... of
 * row o against every row s of x, into part[(s * O + o) * lanes + lane]. Neighbouring
 * lanes read neighbouring chunks of one row, so a warp's loads are contiguous.
 * x: [S, I] float32; W: O rows of row_bytes bytes; gsz: the scale group (I when per row). */
__device__ void partial_sums(const unsigned char *w, const void *scales, int fmt, int O, int I,
                             int gsz, int groups, int row_bytes, const float *x, int S,
                             float *part, int lanes, int o, int lane) {
    const unsigned char *row = w + (long long)o * row_bytes;
    const int chunks = (I + CHUNK - 1) / CHUNK;
    /* whole chunks of nibbles may be read 16 bytes at a time: rows start 16-byte aligned */
    const bool nibbles = (fmt == FMT_Q4 || fmt == FMT_FP4) && row_bytes % 16 == 0;
    /* x's rows may be read 16 bytes at a time when they start 16-byte aligned */
    const bool x_vectors = ((unsigned long long)x % 16 == 0) && I % 4 == 0;
    /* one scale for a chunk when no group boundary falls inside it */
    const bool one_scale = groups == 1 || gsz % CHUNK == 0;
    for (int s0 = 0; s0 < S; s0 += ROW_TILE) {
        const int rows = S - s0 < ROW_TILE ? S - s0 : ROW_TILE;
        float acc[ROW_TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int c = lane; c < chunks; c += lanes) {
            const int i0 = c * CHUNK, i1 = i0 + CHUNK < I ? i0 + CHUNK : I;
            if (is_affine(fmt)) { /* half a group: its codes four a word, (float)q * s + m */
                const int g = i0 / AFFINE_GROUP, half = (i0 % AFFINE_GROUP) / CHUNK;
                const unsigned char *block = row + (long long)g * AFFINE_BLOCK(fmt);
                float s, m;
                affine_sm(scales, o, g, groups, &s, &m);
                for (int kk = 0; kk < 2; kk++) {
                    for (int t = 0; t < 4; t++) {
                        const int at = i0 + 16 * kk + 4 * t, n_in = i1 - at < 4 ? i1 - at : 4;
                        if (n_in <= 0) break;
                        const unsigned codes = affine_word(block, fmt, 2 * half + kk, t);
                        float wv[4];
                        for (int n = 0; n < 4; n++)
                            wv[n] = (float)((codes >> (8 * n)) & 0xffu) * s + m;
                        for (int r = 0; r < rows; r++) {
                            const float *xr = x + (long long)(s0 + r) * I + at;
                            for (int n = 0; n < n_in; n++) acc[r] += wv[n] * xr[n];
                        }
                    }
                }
                continue;
            }
            float sc = scale_at(scales, fmt, o, i0, gsz, groups);
            if (nibbles && one_scale && i1 - i0 == CHUNK) {
                /* the chunk's 32 codes in one 16-byte load; word k holds inputs 8k..8k+7,
                 * the lowest nibble first (the container's order, little-endian) */
                const uint4 words = *(const uint4 *)(row + i0 / 2);
                const unsigned word[4] = {words.x, words.y, words.z, words.w};
                for (int k = 0; k < 4; k++) {
                    float wv[8];
                    for (int n = 0; n < 8; n++)
                        wv[n] = (float)nibble_code(fmt, (word[k] >> (4 * n)) & 15u) * sc;
                    for (int r = 0; r < rows; r++) {
                        const float *xr = x + (long long)(s0 + r) * I + i0 + 8 * k;
                        float xv[8];
                        if (x_vectors) { /* the 8 inputs in two 16-byte loads */
                            const float4 a = ((const float4 *)xr)[0], b = ((const float4 *)xr)[1];
                            xv[0] = a.x, xv[1] = a.y, xv[2] = a.z, xv[3] = a.w;
                            xv[4] = b.x, xv[5] = b.y, xv[6] = b.z, xv[7] = b.w;
                        } else {
                            for (int n = 0; n < 8; n++) xv[n] = xr[n];
                        }
                        for (int n = 0; n < 8; n++) acc[r] += wv[n] * xv[n];
                    }
                }
                continue;
            }
            for (int i = i0; i < i1; i++) {
                if (!one_scale) sc = scale_at(scales, fmt, o, i, gsz, groups);
                const float wv = weight_at(row, fmt, i, sc);
                for (int r = 0; r < rows; r++) acc[r] += wv * x[(long long)(s0 + r) * I + i];
            }
        }
        for (int r = 0; r < rows; r++) part[((long long)(s0 + r) * O + o) * lanes + lane] = acc[r];
    }
}

/* Output n of a product: its lanes partial sums added in lane order (so a result never
 * depends on how many rows were in the batch). */
__device__ float lane_sum(const float *part, int lanes, long long n) {
    const float *p = part + n * lanes;
    float sum = 0.0f;
    for (int l = 0; l < lanes; l++) sum += p[l];
    return sum;
}

/* Products y = x @ W^T, any number in one launch (q/k/v together, every expert of a layer):
 * mm_partial over every job's O * lanes threads, then mm_reduce over every job's S * O
 * outputs. Job j is meta[j * JOB_INTS + J_*] and its four addresses ptrs[j * 4 + P_*]; its
 * threads start at J_THREADS and its outputs at J_OUTPUTS (running sums over the jobs),
 * its partial sums at part + J_PART. A job computes the same bits alone or with others. */
#define JOB_INTS 11
#define J_O 0
#define J_I 1
#define J_ROWS 2
#define J_LANES 3
#define J_FMT 4
#define J_GSZ 5
#define J_GROUPS 6
#define J_ROW_BYTES 7
#define J_THREADS 8
#define J_OUTPUTS 9
#define J_PART 10
#define P_DATA 0
#define P_SCALES 1
#define P_X 2
#define P_Y 3

/* Thread t's job in a launch over every job's threads (field J_THREADS) or outputs
 * (J_OUTPUTS): its meta row, its addresses (`stride` a job) and t's index within it. */
struct Job {
    const int *m;
    const unsigned long long *p;
    long long local;
};

__device__ Job job_at(const int *meta, const unsigned long long *ptrs, int stride, int jobs,
                      int field, long long t) {
    int j = 0;
    while (j + 1 < jobs && t >= meta[(j + 1) * JOB_INTS + field]) j++;
    const int *m = meta + j * JOB_INTS;
    return {m, ptrs + (long long)j * stride, t - m[field]};
}

extern "C" __global__ void mm_partial(const int *meta, const unsigned long long *ptrs,
                                      int jobs, int threads, float *part) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= threads) return;
    const Job job = job_at(meta, ptrs, 4, jobs, J_THREADS, t);
    const int *m = job.m, lanes = m[J_LANES], local = (int)job.local;
    partial_sums((const unsigned char *)job.p[P_DATA], (const void *)job.p[P_SCALES], m[J_FMT],
                 m[J_O], m[J_I], m[J_GSZ], m[J_GROUPS], m[J_ROW_BYTES],
                 (const float *)job.p[P_X], m[J_ROWS], part + m[J_PART], lanes, local / lanes,
                 local % lanes);
}

extern "C" __global__ void mm_reduce(const int *meta, const unsigned long long *ptrs,
                                     int jobs, int outputs, const float *part) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= outputs) return;
    const Job job = job_at(meta, ptrs, 4, jobs, J_OUTPUTS, t);
    ((float *)job.p[P_Y])[job.local] = lane_sum(part + job.m[J_PART], job.m[J_LANES], job.local);
}

/* ---- The I8 family: int8 activations, exact integer dots (native/src/ref/ref.c defines
 * the arithmetic; every CPU ISA reproduces it bit for bit, and so do these kernels):
 * per output, per scale group in increasing order, isum = the exact int32 dot of the
 * weight codes and the row's int8 codes over the group, then
 *     acc = acc + (float)isum * (wscale[o, g] * xs[s]),   acc starting at 0.0f,
 * (Q2/Q3, whose weights are q * s + m: with xsum the sum of the row's codes over the group,
 *     acc = acc + ((float)isum * (s * xs[s]) + (float)xsum * (m * xs[s])) )
 * each operation rounded alone (the _rn intrinsics are never contracted into an FMA).
 * mm_i8_partial writes the integer sum of each 32-input chunk (a chunk never crosses a
 * scale group: the host sends only weights whose groups are whole chunks, or one group a
 * row), mm_i8_reduce adds a group's chunks (integers: exact in any order) and takes the
 * float steps in group order. Job j's addresses are ptrs[j * I8_PTRS + P_*] plus its
 * activation scales at P_XS; its partial sums start at part + J_PART, `chunks` a row. */
#define I8_PTRS 5
#define P_XS 4

/* The exact integer dot of one whole 32-input chunk from input i0 of a weight row (int4:
 * its 16 bytes of nibbles; int8: its 32 bytes) with q's 32 codes there (8 ints). Word k
 * of int4 holds inputs 8k..8k+7, the even ones in the low nibbles: the nibbles (q + 8, so
 * 0..15) against q's even and odd bytes, less 8 times the sum of q. */
__device__ __forceinline__ int chunk_dot(const unsigned char *row, int fmt, const int *q, int i0) {
    int acc = 0;
    if (fmt == FMT_Q8) {
        const uint4 a = *(const uint4 *)(row + i0), b = *(const uint4 *)(row + i0 + 16);
        const unsigned wv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        for (int k = 0; k < 8; k++) acc = __dp4a((int)wv[k], q[k], acc);
        return acc;
    }
    const uint4 v = *(const uint4 *)(row + i0 / 2);
    const unsigned wv[4] = {v.x, v.y, v.z, v.w};
    int sum_q = 0;
    for (int k = 0; k < 4; k++) {
        const int qa = q[2 * k], qb = q[2 * k + 1];
        const int even = (int)__byte_perm((unsigned)qa, (unsigned)qb, 0x6420);
        const int odd = (int)__byte_perm((unsigned)qa, (unsigned)qb, 0x7531);
        acc = __dp4a((int)(wv[k] & 0x0F0F0F0Fu), even, acc);
        acc = __dp4a((int)((wv[k] >> 4) & 0x0F0F0F0Fu), odd, acc);
        sum_q = __dp4a(0x01010101, qa, sum_q);
        sum_q = __dp4a(0x01010101, qb, sum_q);
    }
    return acc - 8 * sum_q;
}

/* Q2/Q3 (affine: w = q * s + m, so a group's share is s * sum(q x) + m * sum(x)): the exact
 * integer dot of one whole chunk of codes with q's 32 codes there (8 ints) into *dot, and
 * the sum of those 32 codes into *xsum. Chunk half (0 or 1) of a group covers its inputs
 * 16k + 4t + n for k = 2 half, 2 half + 1: q's word 4 (k - 2 half) + t. */
__device__ __forceinline__ void affine_chunk_dot(const unsigned char *row, int fmt, const int *q,
                                                 int i0, int *dot, int *xsum) {
    const unsigned char *block = row + (long long)(i0 / AFFINE_GROUP) * AFFINE_BLOCK(fmt);
    const int half = (i0 % AFFINE_GROUP) / CHUNK;
    int acc = 0, sum_q = 0;
    for (int kk = 0; kk < 2; kk++) {
        for (int t = 0; t < 4; t++) {
            const int qw = q[4 * kk + t];
            acc = __dp4a((int)affine_word(block, fmt, 2 * half + kk, t), qw, acc);
            sum_q = __dp4a(0x01010101, qw, sum_q);
        }
    }
    *dot = acc;
    *xsum = sum_q;
}

/* int_partials for Q2/Q3: two integers a chunk, its dot at part[2 n] and the sum of q's
 * codes over it at part[2 n + 1] (n = (s * O + o) * chunks + c). */
__device__ void affine_partials(const unsigned char *w, int fmt, int O, int I, int row_bytes,
                                const signed char *q, int S, int *part, int lanes, int o,
                                int lane) {
    const unsigned char *row = w + (long long)o * row_bytes;
    const int chunks = (I + CHUNK - 1) / CHUNK;
    /* whole chunks a word of codes at a time where q's rows start 4-byte aligned */
    const bool words = (unsigned long long)q % 4 == 0 && I % 4 == 0;
    for (int c = lane; c < chunks; c += lanes) {
        const int i0 = c * CHUNK, i1 = i0 + CHUNK < I ? i0 + CHUNK : I;
        for (int s = 0; s < S; s++) {
            const signed char *qr = q + (long long)s * I;
            int *out = part + (((long long)s * O + o) * chunks + c) * 2;
            if (words && i1 - i0 == CHUNK) {
                affine_chunk_dot(row, fmt, (const int *)(qr + i0), i0, out, out + 1);
                continue;
            }
            int acc = 0, sum_q = 0;
            for (int i = i0; i < i1; i++) {
                acc += affine_code(row, fmt, i) * (int)qr[i];
                sum_q += (int)qr[i];
            }
            out[0] = acc;
            out[1] = sum_q;
        }
    }
}

/* Thread (o, lane): for each chunk c = lane, lane + lanes, ... and each activation row s,
 * the chunk's exact integer dot into part[(s * O + o) * chunks + c]. q: [S, I] int8. */
__device__ void int_partials(const unsigned char *w, int fmt, int O, int I, int row_bytes,
                             const signed char *q, int S, int *part, int lanes, int o,
                             int lane) {
    if (is_affine(fmt)) {
        affine_partials(w, fmt, O, I, row_bytes, q, S, part, lanes, o, lane);
        return;
    }
    const unsigned char *row = w + (long long)o * row_bytes;
    const int chunks = (I + CHUNK - 1) / CHUNK;
    /* whole chunks four codes at a time (dp4a) where the weight rows and q's rows start
     * 16-byte aligned: int4 as 16 bytes of nibbles, int8 as 32 bytes */
    const bool words = (fmt == FMT_Q4 || fmt == FMT_Q8) && row_bytes % 16 == 0 &&
                       (unsigned long long)q % 16 == 0 && I % 16 == 0;
    for (int c = lane; c < chunks; c += lanes) {
        const int i0 = c * CHUNK, i1 = i0 + CHUNK < I ? i0 + CHUNK : I;
        for (int s0 = 0; s0 < S; s0 += ROW_TILE) {
            const int rows = S - s0 < ROW_TILE ? S - s0 : ROW_TILE;
            int acc[ROW_TILE] = {0, 0, 0, 0};
            if (words && i1 - i0 == CHUNK) {
                for (int r = 0; r < rows; r++) {
                    const signed char *qr = q + (long long)(s0 + r) * I + i0;
                    part[((long long)(s0 + r) * O + o) * chunks + c] =
                        chunk_dot(row, fmt, (const int *)qr, i0);
                }
                continue;
            }
            for (int i = i0; i < i1; i++) {
                const unsigned nib = (row[i >> 1] >> ((i & 1) * 4)) & 15u;
                const int code =
                    fmt == FMT_Q8 ? (int)((const signed char *)row)[i] : nibble_code(fmt, nib);
                for (int r = 0; r < rows; r++)
                    acc[r] += code * (int)q[(long long)(s0 + r) * I + i];
            }
            for (int r = 0; r < rows; r++)
                part[((long long)(s0 + r) * O + o) * chunks + c] = acc[r];
        }
    }
}

extern "C" __global__ void mm_i8_partial(const int *meta, const unsigned long long *ptrs,
                                         int jobs, int threads, int *part) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= threads) return;
    const Job job = job_at(meta, ptrs, I8_PTRS, jobs, J_THREADS, t);
    const int *m = job.m, lanes = m[J_LANES], local = (int)job.local;
    int_partials((const unsigned char *)job.p[P_DATA], m[J_FMT], m[J_O], m[J_I], m[J_ROW_BYTES],
                 (const signed char *)job.p[P_X], m[J_ROWS], part + m[J_PART], lanes,
                 local / lanes, local % lanes);
}

extern "C" __global__ void mm_i8_reduce(const int *meta, const unsigned long long *ptrs,
                                        int jobs, int outputs, const int *part) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= outputs) return;
    const Job job = job_at(meta, ptrs, I8_PTRS, jobs, J_OUTPUTS, t);
    const int *m = job.m;
    const unsigned long long *p = job.p;
    const int O = m[J_O], I = m[J_I], gsz = m[J_GSZ], groups = m[J_GROUPS];
    const long long n = job.local;
    const int s = (int)(n / O), o = (int)(n % O), chunks = (I + CHUNK - 1) / CHUNK;
    const float xs = ((const float *)p[P_XS])[s];
    float acc = 0.0f;
    int c = 0;
    if (is_affine(m[J_FMT])) { /* acc + ((float)isum * (s * xs) + (float)xsum * (m * xs)) */
        const int *sums = part + m[J_PART] + n * chunks * 2;
        for (int g = 0; g < groups; g++) {
            const int end = g + 1 == groups ? I : (g + 1) * AFFINE_GROUP;
            int isum = 0, xsum = 0;
            for (; c < chunks && c * CHUNK < end; c++) isum += sums[2 * c], xsum += sums[2 * c + 1];
            float sc, mn;
            affine_sm((const void *)p[P_SCALES], o, g, groups, &sc, &mn);
            const float scaled = __fmul_rn(__int2float_rn(isum), __fmul_rn(sc, xs));
            const float offset = __fmul_rn(__int2float_rn(xsum), __fmul_rn(mn, xs));
            acc = __fadd_rn(acc, __fadd_rn(scaled, offset));
        }
        ((float *)p[P_Y])[n] = acc;
        return;
    }
    const int *sums = part + m[J_PART] + n * chunks;
    for (int g = 0; g < groups; g++) {
        const int end = g + 1 == groups ? I : (g + 1) * gsz;
        int isum = 0;
        for (; c < chunks && c * CHUNK < end; c++) isum += sums[c];
        const float sc = scale_at((const void *)p[P_SCALES], m[J_FMT], o, g * gsz, gsz, groups);
        acc = __fadd_rn(acc, __fmul_rn(__int2float_rn(isum), __fmul_rn(sc, xs)));
    }
    ((float *)p[P_Y])[n] = acc;
}

/* h = silu(g) * u, elementwise over n values. */
extern "C" __global__ void swiglu(const float *g, const float *u, float *h, int n) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float v = g[t];
    h[t] = v / (1.0f + expf(-v)) * u[t];
}

/* out[p, :] = x[rows[p], :] for the n pairs of an expert batch; width floats a row. */
extern "C" __global__ void gather_rows(const float *x, int width, const int *rows, int n,
                                       float *out) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * width) return;
    const long long p = t / width, d = t % width;
    out[t] = x[(long long)rows[p] * width + d];
}

/* y[p, :] *= gates[p]: each pair's expert output times its gate. */
extern "C" __global__ void scale_rows(float *y, int width, const float *gates, int n) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * width) return;
    y[t] = y[t] * gates[t / width];
}

/* The device's read bandwidth probe (backends.cuda_device.read_probe): thread t sums the
 * 16-byte words t, t + threads, ... of n words, so each pass of the grid reads one
 * contiguous stretch; one float a thread is written, so nothing is optimised away. */
extern "C" __global__ void read_sum(const float4 *a, int n, int threads, float *out) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= threads) return;
    float sum = 0.0f;
    for (long long k = t; k < n; k += threads) {
        const float4 v = a[k];
        sum += (v.x + v.y) + (v.z + v.w);
    }
    out[t] = sum;
}
