/* The kernels' own threads: medusa_parallel(tasks, threads, fn, ctx) runs fn(ctx, t) for every
 * t < tasks on the calling thread and up to threads - 1 persistent workers.
 *
 * Why not OpenMP: libgomp runs a parallel region from any thread but the process's initial one
 * at about twice the cost on a small machine (a one-row gemv of 576 x 3072: 45 us from the main
 * thread, 80-110 us from any other, in C alone). A server decodes on its scheduler thread, a
 * chat or an application on whatever thread it likes, so the kernels bring their own pool,
 * which costs the same from every thread.
 *
 * On the process's initial thread jobs go to OpenMP, whose team torch's own operations use too:
 * two pools spinning for the same cores after each other's work cost more there than OpenMP's
 * regions do (measured: plain decoding 38 against 36 tokens/s on the main thread).
 *
 * How: a job is published as one 64-bit word (generation, next task, task count); workers
 * spin on it for a while after each job (the next kernel call of a pass comes microseconds
 * later), then sleep on a condition variable. A thread claims task t by moving "next task"
 * from t to t + 1 in that word, so a worker late for one job can never claim a task of the
 * next. The caller claims tasks too and returns when every task has finished. One job at a
 * time: a second thread calling meanwhile runs its tasks alone (same results: the kernels'
 * tasks never depend on which thread runs them). After fork() the child starts without
 * workers, and large jobs use the pool too.
 *
 * Large jobs (a prompt's rows: medusa_parallel_large) go to OpenMP instead, whose threads torch's
 * own operations share: two pools spinning for the same two cores after each other's work
 * doubled a prefill's time where measured; a large job amortises OpenMP's cost per region. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

typedef void (*medusa_task)(void* ctx, int task);

#define MAX_WORKERS 255
#define SPIN 30000 /* pauses a worker waits for the next job before it sleeps (a few hundred microseconds) */

static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t word;   /* generation << 32 | next task << 16 | tasks */
static _Atomic int finished;    /* tasks of the current job done */
static _Atomic int sleepers;
static medusa_task job_fn;
static void* job_ctx;
static int started;             /* workers running */
static int forked;              /* in a fork's child: OpenMP's threads are gone, its regions hang */

static inline uint32_t gen_of(uint64_t w) { return (uint32_t)(w >> 32); }

/* claim and run tasks of generation g until none is left */
static void work(uint32_t g) {
  for (;;) {
    uint64_t w = atomic_load(&word);
    if (gen_of(w) != g) return;
    int next = (int)((w >> 16) & 0xffff), tasks = (int)(w & 0xffff);
    if (next >= tasks) return;
    if (!atomic_compare_exchange_weak(&word, &w, w + (1u << 16))) continue;
    job_fn(job_ctx, next);
    atomic_fetch_add(&finished, 1);
  }
}

static void* worker(void* unused) {
  (void)unused;
  uint32_t seen = gen_of(atomic_load(&word));
  for (;;) {
    uint32_t g;
    int spins = 0;
    while ((g = gen_of(atomic_load(&word))) == seen) {
      if (++spins < SPIN) {
        PAUSE();
        continue;
      }
      pthread_mutex_lock(&sleep_lock);
      atomic_fetch_add(&sleepers, 1);
      while ((g = gen_of(atomic_load(&word))) == seen) pthread_cond_wait(&wake, &sleep_lock);
      atomic_fetch_sub(&sleepers, 1);
      pthread_mutex_unlock(&sleep_lock);
      break;
    }
    seen = g;
    work(g);
  }
  return 0;
}

static void forked_child(void) { /* the child has none of the parent's threads */
  started = 0;
  forked = 1;
  pthread_mutex_init(&job_lock, 0);
  pthread_mutex_init(&sleep_lock, 0);
  pthread_cond_init(&wake, 0);
  atomic_store(&sleepers, 0);
}

__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(0, 0, forked_child); }

void medusa_parallel_large(int tasks, int threads, medusa_task fn, void* ctx);

static int initial_thread(void) { /* the process's first thread, where OpenMP costs least */
  static _Thread_local int known = -1;
  if (known < 0) known = syscall(SYS_gettid) == getpid();
  return known;
}

void medusa_parallel(int tasks, int threads, medusa_task fn, void* ctx) {
  if (tasks <= 0) return;
  if (initial_thread() && !forked) { /* torch's own team: no second pool spinning beside it */
    medusa_parallel_large(tasks, threads, fn, ctx);
    return;
  }
  if (threads <= 1 || tasks == 1 || tasks > 0xffff || pthread_mutex_trylock(&job_lock) != 0) {
    for (int t = 0; t < tasks; t++) fn(ctx, t);
    return;
  }
  int want = threads - 1 < MAX_WORKERS ? threads - 1 : MAX_WORKERS;
  while (started < want) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&t, &attr, worker, 0);
    pthread_attr_destroy(&attr);
    if (failed) break;
    started++;
  }
  job_fn = fn;
  job_ctx = ctx;
  atomic_store(&finished, 0);
  uint32_t g = gen_of(atomic_load(&word)) + 1;
  atomic_store(&word, (uint64_t)g << 32 | (uint64_t)tasks);
  if (atomic_load(&sleepers) > 0) {
    pthread_mutex_lock(&sleep_lock);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
  }
  work(g);
  while (atomic_load(&finished) < tasks) PAUSE();
  pthread_mutex_unlock(&job_lock);
}

void medusa_parallel_large(int tasks, int threads, medusa_task fn, void* ctx) {
  if (forked) { /* libgomp does not survive fork(): the pool does */
    medusa_parallel(tasks, threads, fn, ctx);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int t = 0; t < tasks; t++) fn(ctx, t);
}
