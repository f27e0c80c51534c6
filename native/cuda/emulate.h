/* What kernels.cu needs of CUDA, for compiling it as C++ on the CPU: the launch indices
 * as globals a host loop sets (backends/cuda_device.py writes one launcher per kernel),
 * the qualifiers as nothing, and CUDA's bit casts. Threads run one after another, which
 * is exact for kernels whose threads never talk to each other, as all of colibri's do. */
#ifndef COLIBRI_CUDA_EMULATE_H
#define COLIBRI_CUDA_EMULATE_H

#include <math.h>
#include <string.h>

#define __global__
#define __device__
#define __constant__ static const
#define __forceinline__ inline

struct colibri_dim3 {
    unsigned x, y, z;
};
static colibri_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct float4 {
    float x, y, z, w;
};

struct uint4 {
    unsigned x, y, z, w;
};

static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

static inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, sizeof i);
    return i;
}

/* The rounding intrinsics: one IEEE operation each (the emulation is built with
 * -ffp-contract=off, so none is fused, as on the device). */
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __int2float_rn(int i) { return (float)i; }

/* c plus the four products of a's and b's signed bytes. */
static inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++)
        c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    return c;
}

/* Byte n of the result: byte (s >> 4n) & 7 of the eight bytes of y:x (x's first). */
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; n++)
        r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
    return r;
}

#endif
