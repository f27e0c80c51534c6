/* Persistent worker pool.
 *
 * Workers are created lazily (up to the largest thread count ever asked for) and
 * live for the process.  After a job they spin briefly, because decode issues
 * kernels back to back, then sleep on a condition variable so an idle engine burns
 * no CPU.  One job runs at a time; a caller that finds the pool busy (another
 * Python thread) simply computes its job alone, which gives the same bits.
 */
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <unistd.h>

#define POOL_MAX 256
#define SPIN_ITERS 200000

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sleep_mtx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;

static int n_workers; /* guarded by run_lock */
static _Atomic unsigned job_gen;
static _Atomic int job_pending;
static pool_fn job_fn;
static void *job_ctx;
static int job_nt;
static unsigned start_gen[POOL_MAX]; /* job_gen when each worker was created */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static unsigned wait_for_job(unsigned seen) {
    unsigned g;
    for (int i = 0; i < SPIN_ITERS; i++) {
        if ((g = atomic_load(&job_gen)) != seen) return g;
        cpu_relax();
    }
    pthread_mutex_lock(&sleep_mtx);
    while ((g = atomic_load(&job_gen)) == seen) pthread_cond_wait(&sleep_cv, &sleep_mtx);
    pthread_mutex_unlock(&sleep_mtx);
    return g;
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned seen = start_gen[id];
    for (;;) {
        seen = wait_for_job(seen);
        if (id < job_nt) job_fn(job_ctx, id, job_nt);
        atomic_fetch_sub(&job_pending, 1);
    }
    return NULL;
}

/* Grow the pool to nt-1 workers; returns how many exist. Caller holds run_lock. */
static int grow(int nt) {
    while (n_workers < nt - 1 && n_workers < POOL_MAX - 1) {
        pthread_t t;
        start_gen[n_workers + 1] = atomic_load(&job_gen);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        n_workers++;
    }
    return n_workers;
}

int colibri_pool_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > POOL_MAX ? POOL_MAX : (int)n);
}

void colibri_pool_run(int nt, pool_fn fn, void *ctx) {
    if (nt <= 1 || pthread_mutex_trylock(&run_lock) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    const int nw = grow(nt);
    if (nt > nw + 1) nt = nw + 1;
    job_fn = fn;
    job_ctx = ctx;
    job_nt = nt;
    atomic_store(&job_pending, nw);
    pthread_mutex_lock(&sleep_mtx);
    atomic_fetch_add(&job_gen, 1);
    pthread_cond_broadcast(&sleep_cv);
    pthread_mutex_unlock(&sleep_mtx);
    fn(ctx, 0, nt);
    for (long i = 0; atomic_load(&job_pending) > 0; i++) {
        if (i < SPIN_ITERS) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&run_lock);
}
