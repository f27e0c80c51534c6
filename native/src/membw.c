/* Memory read-bandwidth probe: the roofline every kernel benchmark is compared to.
 * The buffer is allocated and pre-faulted once (first-touch on a VM is far slower
 * than a read), then read by the same pool the kernels use. */
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t *probe_buf;
static size_t probe_n; /* in uint64 words */
static _Atomic uint64_t probe_sink; /* keeps the reads alive */

typedef struct {
    const uint64_t *p;
    size_t n;
} read_ctx;

#define PROBE_CHUNKS 256

/* Plain C read loop (portable fallback). */
static uint64_t read_plain(const uint64_t *p, size_t n) {
    uint64_t a[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) a[k] ^= p[i + k];
    for (; i < n; i++) a[0] ^= p[i];
    return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

#if defined(__x86_64__)
#include <immintrin.h>
/* 256-bit loads, four independent streams of XORs: as fast as the kernels can read. */
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint64_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(p + i + 4)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i *)(p + i + 8)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i *)(p + i + 12)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t r[4];
    _mm256_storeu_si256((__m256i *)r, a0);
    return r[0] ^ r[1] ^ r[2] ^ r[3] ^ read_plain(p + i, n - i);
}

__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint64_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 8));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 16));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 24));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t r[8];
    _mm512_storeu_si512(r, a0);
    return r[0] ^ r[1] ^ r[2] ^ r[3] ^ r[4] ^ r[5] ^ r[6] ^ r[7] ^ read_plain(p + i, n - i);
}
#endif

/* The widest loads this CPU has: the probe must not be slower than the kernels. */
static uint64_t read_range(const uint64_t *p, size_t n) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) return read_avx512(p, n);
    if (__builtin_cpu_supports("avx2")) return read_avx2(p, n);
#endif
    return read_plain(p, n);
}

static void read_chunk(void *ctx, int chunk) {
    const read_ctx *c = ctx;
    const size_t per = (c->n / PROBE_CHUNKS) & ~(size_t)7;
    const size_t i0 = per * chunk, i1 = chunk == PROBE_CHUNKS - 1 ? c->n : i0 + per;
    atomic_fetch_xor(&probe_sink, read_range(c->p + i0, i1 - i0));
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double colibri_membw_probe(size_t nbytes, int threads, int repeats) {
    if (nbytes < 4096) nbytes = 4096;
    if (repeats < 1) repeats = 1;
    if (threads < 1) threads = colibri_get_threads();
    const size_t n = nbytes / 8;
    pthread_mutex_lock(&probe_lock);
    if (probe_n != n) {
        free(probe_buf);
        probe_buf = aligned_alloc(4096, n * 8);
        probe_n = probe_buf ? n : 0;
        if (!probe_buf) {
            pthread_mutex_unlock(&probe_lock);
            return -1.0;
        }
        memset(probe_buf, 1, n * 8);
    }
    read_ctx c = {probe_buf, n};
    colibri_pool_for(PROBE_CHUNKS, threads, read_chunk, &c); /* warm-up pass */
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = now_s();
        colibri_pool_for(PROBE_CHUNKS, threads, read_chunk, &c);
        const double dt = now_s() - t0;
        if (dt > 0 && n * 8 / dt > best) best = n * 8 / dt;
    }
    pthread_mutex_unlock(&probe_lock);
    return best / 1e9;
}
