/* bigalloc: keeps the big blocks that XLA:CPU allocates and frees at every step mapped for reuse.
 *
 * An LD_PRELOAD shim over glibc malloc, built and preloaded by tacl_jax/hostenv.py (read its module
 * doc for the measurements). Why: XLA:CPU mallocs a step's temporary buffer (1.1 GB at bert-base
 * fp32) on one of its own threads and frees it at the end of the step. A thread's glibc arena is
 * made of 64 MiB heaps, so glibc serves a block that big with a fresh mmap and frees it with munmap
 * (even with glibc.malloc.mmap_max=0): every step the kernel faults in and zeroes the whole buffer
 * again. Here every request of at least TACL_BIGALLOC_MIN_MB (default 64) made off the main thread
 * gets a mapping of its own that, when freed, is kept and handed to the next request it fits (best
 * fit, at most a quarter larger), so the steady state maps and faults nothing. XLA asks for the
 * next step's buffer at about the instant it frees the last one, so a request waits up to
 * TACL_BIGALLOC_WAIT_US (5000) for a fitting block in use rather than map a second one. A request
 * that nothing fits unmaps the free blocks (a new working set, e.g. the training step after the
 * initialisation); freed blocks beyond TACL_BIGALLOC_CACHE_MB (4096) are unmapped, least recently
 * freed first. Everything else (smaller blocks, the main thread's, alignments above a page) goes
 * to glibc unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

extern void *__libc_malloc(size_t size);
extern void __libc_free(void *ptr);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *ptr, size_t size);
extern void *__libc_memalign(size_t align, size_t size);

#define PAGE ((size_t)4096)
#define GRAIN ((size_t)2 << 20) /* mappings are whole 2 MiB huge pages */
#define MAX_BLOCKS 512

typedef struct {
    char *ptr;
    size_t size;
    int in_use;
    unsigned long freed_at; /* for least-recently-freed eviction */
} block_t;

static block_t blocks[MAX_BLOCKS];
static int nblocks;
static unsigned long clock_ticks;
static size_t min_size = (size_t)64 << 20;
static size_t cache_limit = (size_t)4096 << 20;
static long wait_us = 5000;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t freed = PTHREAD_COND_INITIALIZER;
/* Statistics, read by tacl_jax.hostenv through ctypes (tacl_bigalloc_stats). */
static unsigned long n_mapped, n_reused, n_unmapped, n_timeouts;

static size_t env_mb(const char *name, size_t fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    unsigned long long mb = strtoull(v, &end, 10);
    return *end ? fallback : (size_t)mb << 20;
}

/* fork() while another thread holds the lock (e.g. a data-loader process started mid-step): the
 * child has that one thread only, so its copy of the lock is taken before the fork and reset in it. */
static void fork_prepare(void) { pthread_mutex_lock(&lock); }
static void fork_parent(void) { pthread_mutex_unlock(&lock); }
static void fork_child(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&freed, NULL);
}

__attribute__((constructor)) static void bigalloc_init(void) {
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    min_size = env_mb("TACL_BIGALLOC_MIN_MB", min_size);
    if (min_size < GRAIN) min_size = GRAIN;
    cache_limit = env_mb("TACL_BIGALLOC_CACHE_MB", cache_limit);
    const char *w = getenv("TACL_BIGALLOC_WAIT_US");
    if (w && *w) wait_us = strtol(w, NULL, 10);
}

/* Our block starting at ptr, or -1. Caller holds the lock. */
static int find(const void *ptr) {
    for (int i = 0; i < nblocks; i++)
        if (blocks[i].ptr == ptr) return i;
    return -1;
}

static void drop(int i) { /* caller holds the lock */
    munmap(blocks[i].ptr, blocks[i].size);
    n_unmapped++;
    blocks[i] = blocks[--nblocks];
}

/* Per request size: how often waiting for a block in use paid off. A size whose blocks are long
 * lived (several arrays of one shape alive at once) stops waiting after two timeouts, and its
 * freed blocks are cached even while others of its size are in use. */
#define MAX_CLASSES 64
typedef struct {
    size_t need;
    unsigned long waits_ok, timeouts;
} class_t;
static class_t classes[MAX_CLASSES];
static int nclasses, next_class;

static class_t *class_of(size_t need) { /* caller holds the lock */
    for (int i = 0; i < nclasses; i++)
        if (classes[i].need == need) return &classes[i];
    int i = nclasses < MAX_CLASSES ? nclasses++ : (next_class++ % MAX_CLASSES); /* full: overwrite */
    classes[i] = (class_t){need, 0, 0};
    return &classes[i];
}

static int waitable(const class_t *c) { return wait_us > 0 && c->timeouts <= c->waits_ok + 1; }

static int fits(int i, size_t need) { /* block i could serve need bytes without much waste */
    return blocks[i].size >= need && blocks[i].size - need <= need / 4;
}

/* A page-aligned block of at least size bytes, or NULL when the table is full of blocks in use.
 * XLA starts the next step (and mallocs its buffer) at about the moment it frees the last step's:
 * when a fitting block is in use, wait up to wait_us for it to come free rather than map a second
 * one (which would then stay resident beside it). */
static void *big_alloc(size_t size, int *reused) {
    size_t need = (size + GRAIN - 1) / GRAIN * GRAIN;
    if (need < size) return NULL; /* overflow */
    pthread_mutex_lock(&lock);
    struct timespec deadline;
    class_t *cls = class_of(need);
    for (int started = 0, timed_out = 0;;) {
        int best = -1, busy = 0;
        for (int i = 0; i < nblocks; i++) {
            if (!fits(i, need)) continue;
            if (blocks[i].in_use) busy = 1;
            else if (best < 0 || blocks[i].size < blocks[best].size) best = i;
        }
        if (best >= 0) {
            blocks[best].in_use = 1;
            n_reused++;
            if (started && !timed_out) cls->waits_ok++;
            pthread_mutex_unlock(&lock);
            *reused = 1;
            return blocks[best].ptr;
        }
        if (!busy || !waitable(cls) || timed_out) break;
        if (!started) {
            clock_gettime(CLOCK_REALTIME, &deadline);
            deadline.tv_nsec += (wait_us % 1000000) * 1000;
            deadline.tv_sec += wait_us / 1000000 + deadline.tv_nsec / 1000000000;
            deadline.tv_nsec %= 1000000000;
            started = 1;
        }
        if (pthread_cond_timedwait(&freed, &lock, &deadline) == ETIMEDOUT) { /* look once more, then map */
            n_timeouts++;
            cls->timeouts++;
            timed_out = 1;
        }
    }
    /* A request that no free block fits starts a new working set (e.g. the training step after the
     * initialisation's buffers): unmap the free blocks, which would otherwise stay resident. */
    for (int i = nblocks - 1; i >= 0; i--)
        if (!blocks[i].in_use) drop(i);
    if (nblocks == MAX_BLOCKS) { /* all in use */
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    void *p = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    madvise(p, need, MADV_HUGEPAGE); /* 2 MiB faults on first touch where THP is 'madvise' */
    blocks[nblocks++] = (block_t){(char *)p, need, 1, 0};
    n_mapped++;
    pthread_mutex_unlock(&lock);
    *reused = 0;
    return p;
}

/* 1 when ptr was ours (now kept for reuse or unmapped), 0 when it belongs to glibc. */
static int big_free(void *ptr) {
    if (((uintptr_t)ptr & (PAGE - 1)) != 0) return 0; /* ours are page-aligned: a cheap filter */
    pthread_mutex_lock(&lock);
    int i = find(ptr);
    if (i < 0) {
        pthread_mutex_unlock(&lock);
        return 0;
    }
    blocks[i].in_use = 0;
    blocks[i].freed_at = ++clock_ticks;
    /* Another block of this size still in use (two were live at once, e.g. after a wait timed
     * out): unmap this one, so that steps go back to sharing one resident block. Not for sizes
     * that gave up waiting (long-lived blocks): there the freed one is cached for the next. */
    int one_at_a_time = waitable(class_of(blocks[i].size));
    for (int j = 0; j < nblocks && one_at_a_time; j++)
        if (j != i && blocks[j].in_use && fits(j, blocks[i].size) && fits(i, blocks[j].size)) {
            drop(i);
            pthread_mutex_unlock(&lock);
            return 1;
        }
    pthread_cond_broadcast(&freed);
    size_t cached = 0;
    for (int j = 0; j < nblocks; j++)
        if (!blocks[j].in_use) cached += blocks[j].size;
    while (cached > cache_limit) {
        int old = -1;
        for (int j = 0; j < nblocks; j++)
            if (!blocks[j].in_use && (old < 0 || blocks[j].freed_at < blocks[old].freed_at)) old = j;
        cached -= blocks[old].size;
        drop(old);
    }
    pthread_mutex_unlock(&lock);
    return 1;
}

static size_t big_size(void *ptr) { /* 0 when not ours */
    if (((uintptr_t)ptr & (PAGE - 1)) != 0) return 0;
    pthread_mutex_lock(&lock);
    int i = find(ptr);
    size_t size = i < 0 ? 0 : blocks[i].size;
    pthread_mutex_unlock(&lock);
    return size;
}

/* Only other threads' requests are ours: the main thread's big blocks come from glibc's main heap,
 * which the tunables already keep and reuse, coalescing blocks of mixed sizes (a per-size cache of
 * maps would churn there, e.g. under PyTorch's autograd). A syscall, but only for big requests. */
static int off_main_thread(void) { return syscall(SYS_gettid) != getpid(); }

void *malloc(size_t size) {
    if (size >= min_size && off_main_thread()) {
        int reused;
        void *p = big_alloc(size, &reused);
        if (p) return p;
    }
    return __libc_malloc(size);
}

void free(void *ptr) {
    if (ptr && !big_free(ptr)) __libc_free(ptr);
}

void *calloc(size_t n, size_t size) {
    size_t total;
    if (__builtin_mul_overflow(n, size, &total)) {
        errno = ENOMEM;
        return NULL;
    }
    if (total >= min_size && off_main_thread()) {
        int reused;
        void *p = big_alloc(total, &reused);
        if (p) {
            if (reused) memset(p, 0, total); /* a fresh mapping is already zero */
            return p;
        }
    }
    return __libc_calloc(n, size);
}

void *realloc(void *ptr, size_t size) {
    size_t old = ptr ? big_size(ptr) : 0;
    if (!old) {
        if (ptr && size >= min_size && off_main_thread()) { /* a glibc block grown big: move it to us */
            void *p = malloc(size);
            if (!p) return NULL;
            size_t have = malloc_usable_size(ptr);
            memcpy(p, ptr, have < size ? have : size);
            __libc_free(ptr);
            return p;
        }
        return __libc_realloc(ptr, size);
    }
    if (size == 0) {
        free(ptr);
        return NULL;
    }
    if (size <= old && size >= min_size) return ptr;
    void *p = malloc(size);
    if (!p) return NULL;
    memcpy(p, ptr, old < size ? old : size);
    free(ptr);
    return p;
}

static void *aligned(size_t align, size_t size) {
    if (size >= min_size && align <= PAGE && off_main_thread()) {
        int reused;
        void *p = big_alloc(size, &reused);
        if (p) return p;
    }
    return __libc_memalign(align, size);
}

int posix_memalign(void **out, size_t align, size_t size) {
    if (align < sizeof(void *) || (align & (align - 1)) != 0) return EINVAL;
    void *p = aligned(align, size);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t align, size_t size) {
    if (align == 0 || (align & (align - 1)) != 0) {
        errno = EINVAL;
        return NULL;
    }
    return aligned(align, size);
}

void *memalign(size_t align, size_t size) { return aligned(align, size); }

size_t malloc_usable_size(void *ptr) {
    static size_t (*real)(void *);
    if (!ptr) return 0;
    size_t size = big_size(ptr);
    if (size) return size;
    if (!real) real = (size_t(*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
    return real ? real(ptr) : 0;
}

/* For tests and the log: blocks mapped, requests served by reuse, blocks unmapped, waits timed out. */
void tacl_bigalloc_stats(unsigned long *mapped, unsigned long *reused, unsigned long *unmapped,
                         unsigned long *timeouts) {
    pthread_mutex_lock(&lock);
    *timeouts = n_timeouts;
    *mapped = n_mapped;
    *reused = n_reused;
    *unmapped = n_unmapped;
    pthread_mutex_unlock(&lock);
}
