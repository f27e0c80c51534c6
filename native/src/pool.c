/* Persistent worker pool with dynamic chunk claiming.
 *
 * Workers are created lazily (up to the largest thread count ever asked for) and live
 * for the process.  After a job they spin briefly, because decode issues kernels back
 * to back, then sleep on a condition variable so an idle engine burns no CPU.
 *
 * A job is split into chunks that threads claim from one atomic ticket holding
 * (generation, next chunk, chunk count).  The caller claims chunks too and returns
 * when every chunk is *finished*, so a worker the OS has not scheduled yet (a busy
 * machine) never holds a call up: the caller simply does its share.  A late worker
 * fails its claim (wrong generation or nothing left) and never touches a finished
 * job's context.  One job runs at a time; a caller finding the pool busy (another
 * Python thread) runs its job alone, which gives the same bits.
 */
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX 256
#define SPIN_ITERS 100000

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sleep_mtx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;

static int n_workers;             /* guarded by run_lock */
static _Atomic uint64_t ticket;   /* gen:24 | next:20 | count:20 */
static _Atomic int chunks_done;
static _Atomic int sleepers;
static chunk_fn job_fn;
static void *job_ctx;
/* The caller's side of parallel jobs (colibri_pool_stats); written under run_lock. */
static uint64_t stat_jobs, stat_total_ns, stat_wait_ns;

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#define T_GEN(t) ((uint32_t)((t) >> 40))
#define T_NEXT(t) ((int)(((t) >> 20) & 0xfffff))
#define T_COUNT(t) ((int)((t) & 0xfffff))

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim and run chunks of generation gen until none are left. */
static void work(uint32_t gen) {
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        if (T_GEN(t) != gen || T_NEXT(t) >= T_COUNT(t)) return;
        if (!atomic_compare_exchange_weak(&ticket, &t, t + ((uint64_t)1 << 20))) continue;
        job_fn(job_ctx, T_NEXT(t));
        atomic_fetch_add(&chunks_done, 1);
        t = atomic_load(&ticket);
    }
}

static uint32_t wait_for_job(uint32_t seen) {
    uint32_t g;
    for (int i = 0; i < SPIN_ITERS; i++) {
        if ((g = T_GEN(atomic_load(&ticket))) != seen) return g;
        cpu_relax();
    }
    pthread_mutex_lock(&sleep_mtx);
    atomic_fetch_add(&sleepers, 1);
    while ((g = T_GEN(atomic_load(&ticket))) == seen) pthread_cond_wait(&sleep_cv, &sleep_mtx);
    atomic_fetch_sub(&sleepers, 1);
    pthread_mutex_unlock(&sleep_mtx);
    return g;
}

static void *worker_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        seen = wait_for_job(seen);
        work(seen);
    }
    return NULL;
}

/* Grow the pool to nt-1 workers; returns how many exist. Caller holds run_lock. */
static int grow(int nt) {
    while (n_workers < nt - 1 && n_workers < POOL_MAX - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t gen = T_GEN(atomic_load(&ticket));
        const int rc = pthread_create(&th, &attr, worker_main, (void *)gen);
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

void colibri_pool_for(int nchunks, int nt, chunk_fn fn, void *ctx) {
    if (nchunks <= 0) return;
    if (nt <= 1 || nchunks == 1 || nchunks > 0xfffff || pthread_mutex_trylock(&run_lock) != 0) {
        for (int c = 0; c < nchunks; c++) fn(ctx, c);
        return;
    }
    const uint64_t start = now_ns();
    grow(nt);
    job_fn = fn;
    job_ctx = ctx;
    atomic_store(&chunks_done, 0);
    const uint32_t gen = (T_GEN(atomic_load(&ticket)) + 1) & 0xffffff;
    atomic_store(&ticket, ((uint64_t)gen << 40) | (uint64_t)nchunks);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_mtx);
        pthread_cond_broadcast(&sleep_cv);
        pthread_mutex_unlock(&sleep_mtx);
    }
    work(gen);
    const uint64_t mine = now_ns();
    for (long i = 0; atomic_load(&chunks_done) < nchunks; i++) {
        if (i < SPIN_ITERS) cpu_relax();
        else sched_yield();
    }
    const uint64_t end = now_ns();
    stat_jobs++;
    stat_total_ns += end - start;
    stat_wait_ns += end - mine;
    pthread_mutex_unlock(&run_lock);
}

void colibri_pool_stats(unsigned long long *jobs, unsigned long long *total_ns,
                        unsigned long long *wait_ns) {
    pthread_mutex_lock(&run_lock);
    *jobs = stat_jobs;
    *total_ns = stat_total_ns;
    *wait_ns = stat_wait_ns;
    pthread_mutex_unlock(&run_lock);
}

void colibri_pool_stats_reset(void) {
    pthread_mutex_lock(&run_lock);
    stat_jobs = stat_total_ns = stat_wait_ns = 0;
    pthread_mutex_unlock(&run_lock);
}
