/* The shm transport: POSIX shared-memory slabs (the bookkeeping around
 * them is common/slab_table's), and the cleanup of slabs nobody owns.
 *
 * Identity: a slab is named /kiln-<stage>-<epoch>-<pid>-<n>, the epoch
 * (16 hex digits) being the owner's random incarnation, so two processes
 * never make the same name even when they share a pid (PID namespaces:
 * every container's stage is PID 1) or a restart reuses one; the pid is
 * there for people reading /dev/shm.  Ownership: the owner holds an flock
 * on each slab for its whole life.  flock lives on the file itself, so it
 * is seen across PID namespaces where a pid means nothing, and it dies
 * with the process however that ends: the cleanup removes exactly the
 * slabs of this form whose lock it can take, and nothing else (a name of
 * another form, as older kiln versions made, proves nothing about its
 * owner, so it is left alone). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "log.h"
#include "slab_table.h"
#include "transport.h"

/* Where glibc's shm_open keeps "/name" (it is "/dev/shm/name" on Linux). */
#define SHM_DIR "/dev/shm"

/* Slab numbers are unique per process, so several transports of one
 * process (tests, a process running two stages) never collide. */
static atomic_uint next_slab_id;

/* 1 when the path of shm object `name` still leads to the file open at fd. */
static int same_file(int fd, const char *name)
{
    char path[sizeof SHM_DIR + KILN_PROTO_SLAB_MAX];
    snprintf(path, sizeof path, SHM_DIR "%s", name);
    struct stat a, b;
    return !fstat(fd, &a) && !stat(path, &b) && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* Creates, locks and sizes a new slab file.  Between O_EXCL creation and
 * the lock a cleaner may take the unlocked file for a dead owner's and
 * remove it; the name check after locking notices, and another name is
 * tried. */
static kiln_status create_locked(kiln_slab *s, const char *stage, uint64_t epoch, kiln_err *err)
{
    for (int tries = 0; tries < 8; tries++) {
        snprintf(s->name, sizeof s->name, "/kiln-%s-%016llx-%ld-%u", stage,
                 (unsigned long long)epoch, (long)getpid(), atomic_fetch_add(&next_slab_id, 1));
        int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST)
            continue;
        if (fd < 0)
            return kiln_err_set(err, KILN_ERR_IO, "shm_open %s: %s", s->name, strerror(errno));
        if (flock(fd, LOCK_EX)) {
            int e = errno;
            shm_unlink(s->name);
            close(fd);
            return kiln_err_set(err, KILN_ERR_IO, "flock %s: %s", s->name, strerror(e));
        }
        if (same_file(fd, s->name)) {
            s->fd = fd;
            return KILN_OK;
        }
        close(fd);
    }
    return kiln_err_set(err, KILN_ERR_IO, "shm slab of stage %s: no name could be kept", stage);
}

static kiln_status shm_make(kiln_slab *s, const char *stage, uint64_t epoch, int device,
                            kiln_err *err)
{
    (void)device;
    kiln_status st = create_locked(s, stage, epoch, err);
    if (st)
        return st;
    /* fallocate reserves the pages now: a full /dev/shm fails here instead
     * of raising SIGBUS on a later write. */
    int rc = ftruncate(s->fd, (off_t)s->size) ? errno : posix_fallocate(s->fd, 0, (off_t)s->size);
    void *base =
        rc ? MAP_FAILED : mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (!rc && base == MAP_FAILED)
        rc = errno;
    if (rc == ENOSPC) {
        /* What the operator must act on, said as such (issue 13: a small
         * /dev/shm used to fail every request with a bare ENOSPC). */
        struct statvfs v;
        unsigned long long avail = 0, total = 0;
        if (!fstatvfs(s->fd, &v))
            avail = (unsigned long long)v.f_bavail * v.f_frsize >> 20,
            total = (unsigned long long)v.f_blocks * v.f_frsize >> 20;
        shm_unlink(s->name);
        close(s->fd);
        s->fd = -1;
        return kiln_err_set(err, KILN_ERR_NOMEM,
                            SHM_DIR " is full: no room for a slab of %.1f MiB (%llu MiB free of "
                            "%llu MiB); give the stages a bigger " SHM_DIR,
                            (double)s->size / (1 << 20), avail, total);
    }
    if (rc) {
        shm_unlink(s->name);
        close(s->fd);
        s->fd = -1;
        return kiln_err_set(err, KILN_ERR_IO, "shm slab of %zu bytes: %s", s->size, strerror(rc));
    }
    s->base = base;
    return KILN_OK;
}

static void shm_unmake(kiln_slab *s, int device)
{
    (void)device;
    munmap(s->base, s->size);
    /* A lost slab's name is gone (or, by someone's doing, another file's). */
    if (same_file(s->fd, s->name) && shm_unlink(s->name))
        KILN_LOG_WARN("shm_unlink %s: %s", s->name, strerror(errno));
    close(s->fd); /* and with it the owner lock */
}

static int shm_alive(const kiln_slab *s) { return same_file(s->fd, s->name); }

/* Read-only: a consumer cannot scribble over the producer's tensors. */
static kiln_status shm_map(kiln_slab_map *m, int device, kiln_err *err)
{
    (void)device;
    int fd = shm_open(m->name, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "shm slab %s: %s", m->name, strerror(errno));
    struct stat stt;
    void *base = MAP_FAILED;
    int rc = fstat(fd, &stt) ? errno : 0;
    if (!rc && stt.st_size > 0)
        base = mmap(NULL, (size_t)stt.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (!rc && base == MAP_FAILED)
        rc = stt.st_size > 0 ? errno : EINVAL;
    close(fd);
    if (rc)
        return kiln_err_set(err, KILN_ERR_IO, "shm slab %s: %s", m->name, strerror(rc));
    m->base = base;
    m->size = (size_t)stt.st_size;
    return KILN_OK;
}

static void shm_unmap(const kiln_slab_map *m, int device)
{
    (void)device;
    munmap((void *)m->base, m->size);
}

static const kiln_slab_kind shm_kind = {
    .ref_kind = KILN_REF_SHM,
    .slab_round = KILN_PROTO_ALIGN,
    .default_max = (size_t)4 << 30,
    .max_idle_maps = 64,
    .make = shm_make, .unmake = shm_unmake, .map = shm_map, .unmap = shm_unmap,
    .alive = shm_alive,
};

kiln_transport *kiln_transport_shm_create(const char *owner, uint64_t epoch, const char *stage,
                                          size_t slab_bytes, size_t max_bytes, kiln_err *err)
{
    return kiln_slab_table_create(&shm_kind, owner, epoch, stage, 0, slab_bytes, max_bytes, err);
}

/* 1 when the field at `at` (up to the next '-' or the end) is min..max
 * characters of `set`; *next is past it and its '-'. */
static int field(const char *at, const char *set, size_t min, size_t max, const char **next)
{
    size_t n = strspn(at, set);
    if (n < min || n > max || (at[n] && at[n] != '-'))
        return 0;
    *next = at + n + (at[n] == '-');
    return 1;
}

/* 1 for "kiln-<stage>-<16 hex>-<pid>-<n>" (a /dev/shm entry, no '/'),
 * the form whose owners hold its lock. */
static int lockable_name(const char *name)
{
    static const char dec[] = "0123456789", hex[] = "0123456789abcdef";
    const char *p = name + 5, *end = NULL;
    return !strncmp(name, "kiln-", 5) &&
           field(p, "abcdefghijklmnopqrstuvwxyz0123456789", 1, 15, &p) && *p &&
           field(p, hex, 16, 16, &p) && *p && field(p, dec, 1, 10, &p) && *p &&
           field(p, dec, 1, 10, &end) && !*end;
}

int kiln_transport_shm_clean_stale(kiln_err *err)
{
    DIR *d = opendir(SHM_DIR);
    if (!d) {
        kiln_err_set(err, KILN_ERR_IO, SHM_DIR ": %s", strerror(errno));
        return -1;
    }
    int removed = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (strlen(e->d_name) >= KILN_PROTO_SLAB_MAX - 1 || !lockable_name(e->d_name))
            continue;
        char name[KILN_PROTO_SLAB_MAX];
        snprintf(name, sizeof name, "/%s", e->d_name);
        /* Not ours to judge when we may not even open it (another user's). */
        int fd = shm_open(name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
        if (fd < 0)
            continue;
        /* Held: its owner lives, in whatever PID namespace. */
        if (flock(fd, LOCK_EX | LOCK_NB)) {
            close(fd);
            continue;
        }
        if (same_file(fd, name) && !shm_unlink(name)) {
            KILN_LOG_INFO("removed stale shm slab %s (no process holds it)", name);
            removed++;
        }
        close(fd);
    }
    closedir(d);
    return removed;
}
