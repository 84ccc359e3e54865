/* The shm transport: POSIX shared-memory slabs (the bookkeeping around
 * them is common/slab_table's), and the cleanup of crashed processes'
 * slabs. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "slab_table.h"
#include "transport.h"

/* Slab numbers are unique per process, so several transports of one
 * process (tests, a process running two stages) never collide. */
static atomic_uint next_slab_id;

static kiln_status shm_make(kiln_slab *s, const char *stage, int device, kiln_err *err)
{
    (void)device;
    snprintf(s->name, sizeof s->name, "/kiln-%s-%ld-%u", stage, (long)getpid(),
             atomic_fetch_add(&next_slab_id, 1));
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return kiln_err_set(err, KILN_ERR_IO, "shm_open %s: %s", s->name, strerror(errno));
    /* fallocate reserves the pages now: a full /dev/shm fails here instead
     * of raising SIGBUS on a later write. */
    int rc = ftruncate(fd, (off_t)s->size) ? errno : posix_fallocate(fd, 0, (off_t)s->size);
    void *base = rc ? MAP_FAILED : mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!rc && base == MAP_FAILED)
        rc = errno;
    close(fd);
    if (rc) {
        shm_unlink(s->name);
        return kiln_err_set(err, rc == ENOSPC ? KILN_ERR_NOMEM : KILN_ERR_IO,
                            "shm slab of %zu bytes: %s", s->size, strerror(rc));
    }
    s->base = base;
    return KILN_OK;
}

static void shm_unmake(kiln_slab *s, int device)
{
    (void)device;
    munmap(s->base, s->size);
    if (shm_unlink(s->name))
        KILN_LOG_WARN("shm_unlink %s: %s", s->name, strerror(errno));
}

/* Read-only: a consumer cannot scribble over the producer's tensors. */
static kiln_status shm_map(kiln_slab_map *m, int device, kiln_err *err)
{
    (void)device;
    int fd = shm_open(m->name, O_RDONLY, 0);
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
};

kiln_transport *kiln_transport_shm_create(const char *owner, uint64_t epoch, const char *stage,
                                          size_t slab_bytes, size_t max_bytes, kiln_err *err)
{
    return kiln_slab_table_create(&shm_kind, owner, epoch, stage, 0, slab_bytes, max_bytes, err);
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
