#include "domain.h"

#include "proto.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

int kiln_domain_id_valid(const char *s, int cap)
{
    size_t n = strlen(s);
    if (!n || n >= (size_t)cap)
        return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              strchr("._:-", *s)))
            return 0;
    return 1;
}

static kiln_status ns_inode(const char *name, uint64_t *out, kiln_err *err)
{
    char path[64];
    struct stat st;
    snprintf(path, sizeof path, "/proc/self/ns/%s", name);
    if (stat(path, &st))
        return kiln_err_set(err, KILN_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    *out = (uint64_t)st.st_ino;
    return KILN_OK;
}

static kiln_status boot_id(char *out, size_t cap, kiln_err *err)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    char line[128] = "";
    int ok = f && fgets(line, sizeof line, f);
    if (f)
        fclose(f);
    line[strcspn(line, "\r\n")] = '\0';
    if (!ok || !kiln_domain_id_valid(line, (int)cap))
        return kiln_err_set(err, KILN_ERR_IO, "cannot read the kernel's boot id "
                            "(/proc/sys/kernel/random/boot_id)");
    snprintf(out, cap, "%s", line);
    return KILN_OK;
}

kiln_status kiln_domain_probe(kiln_domain *d, kiln_err *err)
{
    memset(d, 0, sizeof *d);
    d->gpu = -1;
    const char *host = getenv("KILN_DOMAIN_HOST");
    if (host) {
        if (!kiln_domain_id_valid(host, KILN_DOMAIN_ID_MAX))
            return kiln_err_set(err, KILN_ERR_INVALID, "KILN_DOMAIN_HOST must be 1..%d characters "
                                "of [A-Za-z0-9._:-]", KILN_DOMAIN_ID_MAX - 1);
        snprintf(d->host, sizeof d->host, "%s", host);
    } else if (boot_id(d->host, sizeof d->host, err)) {
        return err->code;
    }
    if (ns_inode("ipc", &d->ipc_ns, err) || ns_inode("mnt", &d->mnt_ns, err) ||
        ns_inode("pid", &d->pid_ns, err))
        return err->code;
    struct stat st;
    if (!stat("/dev/shm", &st) && S_ISDIR(st.st_mode))
        snprintf(d->shm, sizeof d->shm, "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
    return KILN_OK;
}

static int sees_gpu(const kiln_domain *d, const char *uuid)
{
    for (int i = 0; i < d->n_gpus; i++)
        if (!strcmp(d->gpus[i], uuid))
            return 1;
    return 0;
}

int kiln_domain_can_open(int kind, const kiln_domain *producer, const kiln_domain *consumer,
                         unsigned consumer_transports)
{
    if (!(consumer_transports & KILN_TRANSPORT_BIT(kind)))
        return 0;
    int same_kernel = !strcmp(producer->host, consumer->host);
    switch (kind) {
    case KILN_REF_INLINE: return 1;
    case KILN_REF_SHM:
        return same_kernel && producer->shm[0] && !strcmp(producer->shm, consumer->shm);
    case KILN_REF_CUDA_IPC:
        return same_kernel && producer->ipc_ns == consumer->ipc_ns &&
               producer->pid_ns == consumer->pid_ns && producer->gpu >= 0 &&
               producer->gpu < producer->n_gpus && sees_gpu(consumer, producer->gpus[producer->gpu]);
    default: return 0;
    }
}

int kiln_domain_fs_space(const char *dir, uint64_t *free_bytes, uint64_t *total_bytes,
                         kiln_err *err)
{
    struct statvfs v;
    if (statvfs(dir, &v)) {
        kiln_err_set(err, KILN_ERR_IO, "cannot read the size of %s: %s", dir, strerror(errno));
        return -1;
    }
    *free_bytes = (uint64_t)v.f_bavail * v.f_frsize;
    *total_bytes = (uint64_t)v.f_blocks * v.f_frsize;
    return 0;
}
