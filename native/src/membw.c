/* Memory read-bandwidth probe: the roofline every kernel benchmark is compared to.
 * The buffer is allocated and pre-faulted once (first-touch on a VM is far slower
 * than a read), then read by the same pool the kernels use. */
#include "internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t *probe_buf;
static size_t probe_n; /* in uint64 words */
static volatile uint64_t probe_sink;

typedef struct {
    const uint64_t *p;
    size_t n;
} read_ctx;

static void read_worker(void *ctx, int tid, int nt) {
    const read_ctx *c = ctx;
    const size_t per = (c->n / nt) & ~(size_t)7;
    const size_t i0 = per * tid, i1 = tid == nt - 1 ? c->n : i0 + per;
    uint64_t a[8] = {0};
    size_t i = i0;
    for (; i + 8 <= i1; i += 8)
        for (int k = 0; k < 8; k++) a[k] ^= c->p[i + k];
    for (; i < i1; i++) a[0] ^= c->p[i];
    probe_sink ^= a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
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
    colibri_pool_run(threads, read_worker, &c); /* warm-up pass */
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = now_s();
        colibri_pool_run(threads, read_worker, &c);
        const double dt = now_s() - t0;
        if (dt > 0 && n * 8 / dt > best) best = n * 8 / dt;
    }
    pthread_mutex_unlock(&probe_lock);
    return best / 1e9;
}
