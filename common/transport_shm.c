/* The shm transport: producer slabs with first-fit free lists, and a
 * consumer-side cache of read-only slab mappings. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "slab_ranges.h"
#include "transport.h"

#define DEFAULT_SLAB (64u << 20)
#define DEFAULT_MAX ((size_t)4 << 30)
#define SLAB_ROUND (1u << 20)
#define MAX_IDLE_MAPPINGS 64

typedef struct slab {
    char name[KILN_PROTO_SLAB_MAX];
    uint8_t *base;
    size_t size;
    kiln_slab_ranges ranges;
} slab;

typedef struct mapping {
    char name[KILN_PROTO_SLAB_MAX];
    const uint8_t *base;
    size_t size;
    int refs;
    uint64_t last_use;
} mapping;

typedef struct shm_impl {
    pthread_mutex_t mu;
    char owner[KILN_PROTO_ID_MAX];
    char stage[16];
    size_t slab_bytes, max_bytes, total;
    slab *slabs;
    int n_slabs, cap_slabs;
    mapping *maps;
    int n_maps, cap_maps, open;
    uint64_t tick;
} shm_impl;

/* Slab numbers are unique per process, so several transports of one
 * process (tests, a process running two stages) never collide. */
static atomic_uint next_slab_id;

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static kiln_status new_slab(shm_impl *im, size_t size, slab **out, kiln_err *err)
{
    if (im->total + size > im->max_bytes)
        return kiln_err_set(err, KILN_ERR_BUSY, "shm pool full (%zu of %zu bytes in slabs)",
                            im->total, im->max_bytes);
    if (im->n_slabs == im->cap_slabs) {
        int cap = im->cap_slabs ? 2 * im->cap_slabs : 4;
        slab *v = realloc(im->slabs, (size_t)cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        im->slabs = v, im->cap_slabs = cap;
    }
    slab *s = &im->slabs[im->n_slabs];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "/kiln-%s-%ld-%u", im->stage, (long)getpid(),
             atomic_fetch_add(&next_slab_id, 1));
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return kiln_err_set(err, KILN_ERR_IO, "shm_open %s: %s", s->name, strerror(errno));
    /* fallocate reserves the pages now: a full /dev/shm fails here instead
     * of raising SIGBUS on a later write. */
    int rc = ftruncate(fd, (off_t)size) ? errno : posix_fallocate(fd, 0, (off_t)size);
    void *base = rc ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!rc && base == MAP_FAILED)
        rc = errno;
    close(fd);
    if (rc) {
        shm_unlink(s->name);
        return kiln_err_set(err, rc == ENOSPC ? KILN_ERR_NOMEM : KILN_ERR_IO,
                            "shm slab of %zu bytes: %s", size, strerror(rc));
    }
    s->base = base;
    s->size = size;
    if (kiln_slab_ranges_init(&s->ranges, size)) {
        munmap(base, size);
        shm_unlink(s->name);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    im->n_slabs++;
    im->total += size;
    *out = s;
    return KILN_OK;
}

static kiln_status shm_alloc(kiln_transport *t, size_t bytes, kiln_tensor_ref *ref, void **ptr,
                             kiln_err *err)
{
    shm_impl *im = t->impl;
    uint64_t len = round_up(bytes ? bytes : 1, KILN_PROTO_ALIGN), off = 0;
    pthread_mutex_lock(&im->mu);
    slab *s = NULL;
    for (int i = 0; i < im->n_slabs && !s; i++)
        if (!kiln_slab_ranges_take(&im->slabs[i].ranges, len, &off))
            s = &im->slabs[i];
    kiln_status st = KILN_OK;
    if (!s) {
        size_t size = len > im->slab_bytes ? round_up(len, SLAB_ROUND) : im->slab_bytes;
        st = new_slab(im, size, &s, err);
        if (!st && kiln_slab_ranges_take(&s->ranges, len, &off))
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    if (!st) {
        snprintf(ref->owner, sizeof ref->owner, "%s", im->owner);
        snprintf(ref->slab, sizeof ref->slab, "%s", s->name);
        ref->off = off;
        *ptr = s->base + off;
    }
    pthread_mutex_unlock(&im->mu);
    return st;
}

static kiln_status shm_free(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    shm_impl *im = t->impl;
    uint64_t len = round_up(ref->len ? ref->len : 1, KILN_PROTO_ALIGN);
    if (strcmp(ref->owner, im->owner))
        return kiln_err_set(err, KILN_ERR_INVALID, "shm free: owned by %s, not %s", ref->owner,
                            im->owner);
    int rc = 1;
    pthread_mutex_lock(&im->mu);
    for (int i = 0; i < im->n_slabs; i++)
        if (!strcmp(im->slabs[i].name, ref->slab)) {
            rc = kiln_slab_ranges_give(&im->slabs[i].ranges, ref->off, len);
            break;
        }
    pthread_mutex_unlock(&im->mu);
    if (rc < 0)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (rc)
        return kiln_err_set(err, KILN_ERR_INVALID, "shm free: %s+%llu is not a live range",
                            ref->slab, (unsigned long long)ref->off);
    return KILN_OK;
}

static mapping *find_map(shm_impl *im, const char *name)
{
    for (int i = 0; i < im->n_maps; i++)
        if (!strcmp(im->maps[i].name, name))
            return &im->maps[i];
    return NULL;
}

/* Unmaps the least recently used idle mapping once there are too many. */
static void evict(shm_impl *im)
{
    int idle = 0, lru = -1;
    for (int i = 0; i < im->n_maps; i++)
        if (!im->maps[i].refs) {
            idle++;
            if (lru < 0 || im->maps[i].last_use < im->maps[lru].last_use)
                lru = i;
        }
    if (idle <= MAX_IDLE_MAPPINGS)
        return;
    munmap((void *)im->maps[lru].base, im->maps[lru].size);
    im->maps[lru] = im->maps[--im->n_maps];
}

static kiln_status map_slab(shm_impl *im, const char *name, mapping **out, kiln_err *err)
{
    if (im->n_maps == im->cap_maps) {
        int cap = im->cap_maps ? 2 * im->cap_maps : 8;
        mapping *v = realloc(im->maps, (size_t)cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        im->maps = v, im->cap_maps = cap;
    }
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0)
        return kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "shm slab %s: %s", name, strerror(errno));
    struct stat stt;
    void *base = MAP_FAILED;
    int rc = fstat(fd, &stt) ? errno : 0;
    if (!rc && stt.st_size > 0)
        base = mmap(NULL, (size_t)stt.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (!rc && base == MAP_FAILED)
        rc = stt.st_size > 0 ? errno : EINVAL;
    close(fd);
    if (rc)
        return kiln_err_set(err, KILN_ERR_IO, "shm slab %s: %s", name, strerror(rc));
    mapping *m = &im->maps[im->n_maps++];
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    m->base = base;
    m->size = (size_t)stt.st_size;
    *out = m;
    return KILN_OK;
}

static kiln_status shm_open_ref(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                                kiln_err *err)
{
    shm_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    mapping *m = find_map(im, ref->slab);
    kiln_status st = m ? KILN_OK : map_slab(im, ref->slab, &m, err);
    if (!st && (ref->off > m->size || ref->len > m->size - ref->off))
        st = kiln_err_set(err, KILN_ERR_INVALID, "shm ref %s+%llu (%llu bytes) outside its slab",
                          ref->slab, (unsigned long long)ref->off, (unsigned long long)ref->len);
    if (!st) {
        m->refs++;
        m->last_use = ++im->tick;
        im->open++;
        *ptr = m->base + ref->off;
    }
    pthread_mutex_unlock(&im->mu);
    return st;
}

static void shm_close_ref(kiln_transport *t, const kiln_tensor_ref *ref)
{
    shm_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    mapping *m = find_map(im, ref->slab);
    if (m && m->refs > 0) {
        m->refs--;
        im->open--;
        evict(im);
    }
    pthread_mutex_unlock(&im->mu);
}

static void shm_stats(kiln_transport *t, kiln_transport_stats *st)
{
    shm_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    st->slabs = im->n_slabs;
    st->slab_bytes = im->total;
    for (int i = 0; i < im->n_slabs; i++) {
        int live;
        st->used_bytes += kiln_slab_ranges_used(&im->slabs[i].ranges, &live);
        st->live += live;
    }
    st->mapped = im->n_maps;
    st->open = im->open;
    pthread_mutex_unlock(&im->mu);
}

static void shm_destroy(kiln_transport *t)
{
    shm_impl *im = t->impl;
    for (int i = 0; i < im->n_slabs; i++) {
        slab *s = &im->slabs[i];
        munmap(s->base, s->size);
        if (shm_unlink(s->name))
            KILN_LOG_WARN("shm_unlink %s: %s", s->name, strerror(errno));
        kiln_slab_ranges_release(&s->ranges);
    }
    for (int i = 0; i < im->n_maps; i++)
        munmap((void *)im->maps[i].base, im->maps[i].size);
    free(im->slabs), free(im->maps);
    pthread_mutex_destroy(&im->mu);
    free(im);
    free(t);
}

static const kiln_transport_ops shm_ops = {
    .alloc = shm_alloc, .free = shm_free, .open = shm_open_ref,
    .close = shm_close_ref, .stats = shm_stats, .destroy = shm_destroy,
};

kiln_transport *kiln_transport_shm_create(const char *owner, const char *stage, size_t slab_bytes,
                                          size_t max_bytes, kiln_err *err)
{
    if (!owner || !*owner || strlen(owner) >= KILN_PROTO_ID_MAX || !stage || !*stage ||
        strlen(stage) >= sizeof(((shm_impl *)0)->stage)) {
        kiln_err_set(err, KILN_ERR_INVALID, "shm transport: bad owner or stage name");
        return NULL;
    }
    for (const char *p = stage; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9'))) {
            kiln_err_set(err, KILN_ERR_INVALID, "shm transport: stage must be [a-z0-9]");
            return NULL;
        }
    kiln_transport *t = calloc(1, sizeof *t);
    shm_impl *im = calloc(1, sizeof *im);
    if (!t || !im || pthread_mutex_init(&im->mu, NULL)) {
        free(t), free(im);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    snprintf(im->owner, sizeof im->owner, "%s", owner);
    snprintf(im->stage, sizeof im->stage, "%s", stage);
    im->slab_bytes = round_up(slab_bytes ? slab_bytes : DEFAULT_SLAB, KILN_PROTO_ALIGN);
    im->max_bytes = max_bytes ? max_bytes : DEFAULT_MAX;
    t->ops = &shm_ops;
    t->kind = KILN_REF_SHM;
    t->impl = im;
    return t;
}

/* "kiln-<stage>-<pid>-<n>": the pid, or -1 when the name is not ours. */
static long slab_pid(const char *name)
{
    if (strncmp(name, "kiln-", 5))
        return -1;
    const char *last = strrchr(name, '-');
    if (!last || last == name + 4 || !last[1])
        return -1;
    for (const char *p = last + 1; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    const char *pid_end = last, *pid_start = last;
    while (pid_start > name + 5 && pid_start[-1] >= '0' && pid_start[-1] <= '9')
        pid_start--;
    if (pid_start == pid_end || pid_start[-1] != '-' || pid_start - 1 == name + 4)
        return -1;
    return strtol(pid_start, NULL, 10);
}

int kiln_transport_shm_clean_stale(kiln_err *err)
{
    DIR *d = opendir("/dev/shm");
    if (!d) {
        kiln_err_set(err, KILN_ERR_IO, "/dev/shm: %s", strerror(errno));
        return -1;
    }
    int removed = 0;
    for (struct dirent *e; (e = readdir(d));) {
        long pid = slab_pid(e->d_name);
        if (pid <= 0 || pid == (long)getpid())
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        char name[sizeof e->d_name + 1];
        snprintf(name, sizeof name, "/%s", e->d_name);
        if (!shm_unlink(name)) {
            KILN_LOG_INFO("removed stale shm slab %s of dead pid %ld", name, pid);
            removed++;
        }
    }
    closedir(d);
    return removed;
}
