/* The kernels' thread pool: parallel loops whose items are claimed, a chunk at a time, from a shared
 * counter, so a thread the OS has descheduled never stalls a pass.
 *
 * OpenMP's `parallel for schedule(static)` splits a loop evenly and ends in a barrier every thread
 * of the team must reach. On a machine where another process keeps a core busy, the thread sharing
 * that core is descheduled for whole time slices (milliseconds, against a decode step's ~5 ms), and
 * every loop waits for it: `infer demo` then decoded at 0.4x the speed one thread gave. Here the
 * caller posts a job (a function over items 0 .. items - 1, in chunks) and takes chunks itself. Each
 * thread owns a run of consecutive chunks, which it takes from the front, in order: a weight streams
 * from memory as one sequence per thread, as under a static split (taking chunks in turn from one
 * counter made every thread jump between chunks, which cost most on small matrices and wide
 * verification passes: docs/cpu.md). A thread whose run is done takes chunks from the back of another
 * thread's run, so a helper that wakes late, or is descheduled, has its chunks done by the others:
 * only a helper descheduled while it holds a chunk still delays the job, by the rest of that chunk;
 * the chooser in infer.kernels.cpu notices the slower passes and runs fewer threads.
 *
 * Which thread computes an item never changes what it computes (every caller's items are
 * independent, each written by exactly one chunk), so results are bit-identical for any thread
 * count and any interleaving.
 *
 * Helpers spin on the job word for POOL_SPIN_NS after their last job, then sleep on a condition
 * variable: within a model pass the next loop is microseconds away and a wake-up would cost more
 * than it, while between steps (the engine's Python work) they yield the core to whoever needs it.
 *
 * One job at a time: a caller that finds the pool busy (another Python thread's pass, a job's item
 * calling into the pool) runs its loop alone, inline. After a fork the child has no helpers; its
 * jobs run on the caller alone until it asks for them, when they are started afresh.
 *
 * Both kernel libraries compile this header; the process shares one pool (infer.kernels.build hands
 * the first library's to the others: infer_pool_handle / infer_pool_adopt below), so two pools' helpers never
 * spin against each other.
 */
#ifndef INFER_THREAD_POOL_H
#define INFER_THREAD_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define POOL_MAX_THREADS 256 /* the caller and up to 255 helpers: the job word holds the helper count */
#define POOL_SPIN_NS 200000  /* a helper's polling after its last job before it sleeps */
#define POOL_CHUNKS_PER_THREAD 4 /* chunks per thread of a loop: claims stay rare, stragglers short */

typedef void (*pool_fn)(void *ctx, int64_t begin, int64_t end, int worker);

#define POOL_MAX_CHUNKS ((1 << 20) - 1) /* a run's bounds are 20-bit fields of its word */

/* One thread's run of chunks: (job sequence << 40) | (front << 20) | back, chunks front .. back - 1 left.
 * Its owner claims the front, others the back, each by a compare-and-swap that fails once the word
 * holds another job's tag, so a helper that slept through a job can never take a chunk of the next
 * one. One cache line each: the owner's claims do not bounce a line the other threads write. */
typedef struct {
    _Atomic uint64_t word;
    char pad[64 - sizeof(uint64_t)];
} PoolRun;

typedef struct {
    PoolRun runs[POOL_MAX_THREADS]; /* the current job's: worker w's chunks */
    _Atomic uint32_t job;     /* (sequence << 8) | helpers asked for: what helpers wait on */
    _Atomic int64_t done;     /* chunks finished of the current job */
    _Atomic int sleepers;     /* helpers asleep on `wake` */
    pthread_mutex_t busy;     /* held by the caller of a job (one job at a time) */
    pthread_mutex_t sleep;    /* guards `wake` */
    pthread_cond_t wake;
    int started;              /* helpers running */
    uint32_t sequence;
    /* The current job. Written before the runs publish it; read only by a thread holding a claimed,
     * unfinished chunk of it, so it cannot change under the reader. */
    pool_fn fn;
    void *ctx;
    int64_t items, chunk, chunks;
    _Atomic int workers; /* the caller and the helpers asked for: the runs in use */
} Pool;

typedef struct {
    Pool *pool;
    int id; /* 1 .. helpers; the caller is worker 0 */
} PoolHelper;

static Pool pool_own = {.busy = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER,
                        .wake = PTHREAD_COND_INITIALIZER};
static Pool *pool_used = &pool_own; /* this library's pool, or the one it adopted */

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint64_t pool_tag(uint32_t job) { return (uint64_t)(job >> 8) << 40; }

/* Claim one chunk of job `job` for `worker`: the front of its own run, else the back of another's
 * (the next workers' first); the chunk's index, or -1 where none is left (or the job is over). */
static inline int64_t pool_claim(Pool *p, uint32_t job, int worker) {
    const uint64_t tag = pool_tag(job);
    const int workers = atomic_load_explicit(&p->workers, memory_order_relaxed);
    for (int k = 0; k < workers; k++) {
        PoolRun *run = &p->runs[(worker + k) % workers];
        uint64_t v = atomic_load_explicit(&run->word, memory_order_acquire);
        for (;;) {
            const uint64_t front = v >> 20 & POOL_MAX_CHUNKS, back = v & POOL_MAX_CHUNKS;
            if ((v & ~(((uint64_t)1 << 40) - 1)) != tag || front >= back) break;
            const uint64_t taken = k == 0 ? v + ((uint64_t)1 << 20) : v - 1;
            if (atomic_compare_exchange_weak_explicit(&run->word, &v, taken, memory_order_acq_rel, memory_order_acquire))
                return (int64_t)(k == 0 ? front : back - 1);
        }
    }
    return -1;
}

/* Run every chunk of job `job` this thread can claim. */
static inline void pool_work(Pool *p, uint32_t job, int worker) {
    for (int64_t c; (c = pool_claim(p, job, worker)) >= 0;) {
        const int64_t begin = c * p->chunk, end = begin + p->chunk < p->items ? begin + p->chunk : p->items;
        p->fn(p->ctx, begin, end, worker);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

static void *pool_helper(void *arg) {
    PoolHelper *h = arg;
    Pool *p = h->pool;
    const int id = h->id;
    free(h);
    uint32_t seen = atomic_load(&p->job);
    for (;;) {
        uint32_t job = atomic_load_explicit(&p->job, memory_order_acquire);
        if (job == seen) {
            const int64_t until = pool_now_ns() + POOL_SPIN_NS;
            for (int i = 1; (job = atomic_load_explicit(&p->job, memory_order_acquire)) == seen; i++) {
                pool_relax();
                if (i % 64 == 0 && pool_now_ns() > until) break;
            }
        }
        if (job == seen) { /* asleep until the next job (a sequentially consistent pair with pool_run's) */
            pthread_mutex_lock(&p->sleep);
            atomic_fetch_add(&p->sleepers, 1);
            while ((job = atomic_load(&p->job)) == seen) pthread_cond_wait(&p->wake, &p->sleep);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->sleep);
        }
        seen = job;
        if (id <= (int)(job & 0xff)) pool_work(p, job, id);
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child: no helpers, no job in flight */
    Pool *p = pool_used;
    pthread_mutex_init(&p->busy, NULL);
    pthread_mutex_init(&p->sleep, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->started = 0;
    atomic_store(&p->sleepers, 0);
}

/* Start helpers up to `helpers` (the caller holds `busy`); fewer where the OS refuses a thread. */
static void pool_start(Pool *p, int helpers) {
    static int fork_handler;
    if (!fork_handler) {
        fork_handler = 1;
        pthread_atfork(NULL, NULL, pool_after_fork);
    }
    while (p->started < helpers) {
        PoolHelper *h = malloc(sizeof(PoolHelper));
        pthread_t thread;
        pthread_attr_t attr;
        if (!h) return;
        h->pool = p;
        h->id = p->started + 1;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, pool_helper, h);
        pthread_attr_destroy(&attr);
        if (failed) {
            free(h);
            return;
        }
        p->started++;
    }
}

/* fn(ctx, begin, end, worker) over items 0 .. items - 1 in chunks, on up to `threads` threads (the
 * caller among them, as worker 0; helpers are 1 .. threads - 1). `chunk` items per claim (0: about
 * POOL_CHUNKS_PER_THREAD chunks per thread). Returns once every item is done. */
static void pool_run(pool_fn fn, void *ctx, int64_t items, int64_t chunk, int threads) {
    Pool *p = pool_used;
    if (items <= 0) return;
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    if (chunk <= 0) {
        const int64_t want = (int64_t)(threads > 1 ? threads : 1) * POOL_CHUNKS_PER_THREAD;
        chunk = (items + want - 1) / want;
    }
    if ((items + chunk - 1) / chunk > POOL_MAX_CHUNKS) chunk = (items + POOL_MAX_CHUNKS - 1) / POOL_MAX_CHUNKS;
    const int64_t chunks = (items + chunk - 1) / chunk;
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&p->busy) != 0) {
        fn(ctx, 0, items, 0);
        return;
    }
    const int helpers = threads - 1 < chunks - 1 ? threads - 1 : (int)(chunks - 1);
    pool_start(p, helpers);
    p->fn = fn;
    p->ctx = ctx;
    p->items = items;
    p->chunk = chunk;
    p->chunks = chunks;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->workers, helpers + 1, memory_order_relaxed);
    p->sequence = (p->sequence + 1) & 0xffffff;
    const uint32_t job = p->sequence << 8 | (uint32_t)helpers;
    for (int w = 0; w <= helpers; w++) { /* worker w's run: its share of the chunks, in order */
        const uint64_t front = (uint64_t)(chunks * w / (helpers + 1)), back = (uint64_t)(chunks * (w + 1) / (helpers + 1));
        atomic_store_explicit(&p->runs[w].word, pool_tag(job) | front << 20 | back, memory_order_release);
    }
    atomic_store(&p->job, job);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->sleep);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->sleep);
    }
    pool_work(p, job, 0);
    /* Only claimed chunks are waited for: the caller leaves pool_work once every run is empty. */
    for (int i = 1; atomic_load_explicit(&p->done, memory_order_acquire) < chunks; i++) {
        pool_relax();
        if (i % 1024 == 0) sched_yield(); /* a helper holding a chunk may need this core */
    }
    pthread_mutex_unlock(&p->busy);
}

/* The process's one pool: a library hands its own (infer_pool_handle) to the others
 * (infer_pool_adopt) before either runs a job. */
void *infer_pool_handle(void) { return pool_used; }
void infer_pool_adopt(void *pool) { pool_used = pool ? (Pool *)pool : &pool_own; }

#endif
