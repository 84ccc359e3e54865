#include "soak_verify.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_JOBS 2 /* CLI processes at once: the service under test shares the machine */

struct kiln_soak_verify {
    const kiln_soak_opts *o;
    const kiln_soak_traffic *t;
    uint64_t *key; /* per pool entry */
    double prepare_s;
    int runs;
};

static const char *ext_of(kiln_image_format f)
{
    return f == KILN_IMAGE_JPEG ? "jpg" : f == KILN_IMAGE_WEBP ? "webp" : "png";
}

static uint64_t hash_str(uint64_t h, const char *s) { return kiln_soak_fnv(h, s, strlen(s) + 1); }

static uint64_t entry_key(const kiln_soak_verify *v, const kiln_soak_req *r)
{
    const kiln_soak_opts *o = v->o;
    char line[256];
    uint64_t h = hash_str(KILN_SOAK_FNV, o->verify_model);
    h = hash_str(h, "--no-metadata"); /* a cache made with metadata is not reused */
    for (int i = 0; i < o->n_verify_args; i++)
        h = hash_str(h, o->verify_args[i]);
    snprintf(line, sizeof line, "%d %dx%d n%d s%llu %s steps%d seq%d", r->edit, r->width,
             r->height, r->n, (unsigned long long)r->seed, ext_of(r->format), o->steps, o->max_seq);
    h = hash_str(h, line);
    h = hash_str(h, v->t->prompts->v[r->prompt]);
    for (int i = 0; i < r->n_refs; i++)
        h = kiln_soak_fnv(h, &v->t->refs[r->refs[i]].hash, sizeof(uint64_t));
    return h;
}

/* <cache>/<key>[-i].<ext>: the file `kiln --out <cache>/<key>.<ext>` names
 * image i (tools/cli_pipeline.c: FILE-i.ext when there are several). */
static void image_path(const kiln_soak_verify *v, uint64_t key, const kiln_soak_req *r, int i,
                       char *buf, size_t cap)
{
    if (r->n == 1)
        snprintf(buf, cap, "%s/%016llx.%s", v->o->verify_cache, (unsigned long long)key,
                 ext_of(r->format));
    else
        snprintf(buf, cap, "%s/%016llx-%d.%s", v->o->verify_cache, (unsigned long long)key, i,
                 ext_of(r->format));
}

static void ref_path(const kiln_soak_verify *v, const kiln_soak_ref *ref, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/ref-%016llx.%s", v->o->verify_cache, (unsigned long long)ref->hash,
             ext_of(ref->format));
}

static int exists(const char *path)
{
    struct stat s;
    return stat(path, &s) == 0;
}

static kiln_status write_file(const char *path, const kiln_buf *b, kiln_err *err)
{
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    int bad = !f || fwrite(b->data, 1, b->len, f) != b->len;
    if (f)
        bad |= fclose(f) != 0;
    if (bad || rename(tmp, path))
        return kiln_err_set(err, KILN_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    return KILN_OK;
}

kiln_soak_verify *kiln_soak_verify_create(const kiln_soak_opts *o, const kiln_soak_traffic *t,
                                          kiln_err *err)
{
    kiln_soak_verify *v = calloc(1, sizeof *v);
    if (!v || !(v->key = calloc((size_t)o->pool, sizeof *v->key))) {
        free(v);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    v->o = o;
    v->t = t;
    if (mkdir(o->verify_cache, 0755) && errno != EEXIST) {
        kiln_err_set(err, KILN_ERR_IO, "cannot make %s: %s", o->verify_cache, strerror(errno));
        kiln_soak_verify_destroy(v);
        return NULL;
    }
    return v;
}

void kiln_soak_verify_destroy(kiln_soak_verify *v)
{
    if (!v)
        return;
    free(v->key);
    free(v);
}

static void entry(const kiln_soak_verify *v, int p, kiln_soak_req *r)
{
    kiln_soak_traffic_pool_entry(v->t, p, r);
}

static int cached(const kiln_soak_verify *v, uint64_t key, const kiln_soak_req *r)
{
    char path[1024];
    for (int i = 0; i < r->n; i++) {
        image_path(v, key, r, i, path, sizeof path);
        if (!exists(path))
            return 0;
    }
    return 1;
}

/* Starts the CLI for entry r, writing to <cache>/<key>.run.<ext> (renamed
 * when it succeeds).  The pid, or -1. */
static pid_t start_cli(const kiln_soak_verify *v, uint64_t key, const kiln_soak_req *r,
                       kiln_err *err)
{
    const kiln_soak_opts *o = v->o;
    char num[6][32], out[1024], refs[8][1024], log[1024];
    const char *argv[64];
    int n = 0;
    argv[n++] = o->verify_kiln;
    argv[n++] = r->edit ? "edit" : "generate";
    argv[n++] = "--model", argv[n++] = o->verify_model;
    argv[n++] = "--no-metadata"; /* the service's PNGs carry no text chunks */
    for (int i = 0; i < o->n_verify_args; i++)
        argv[n++] = o->verify_args[i];
    argv[n++] = "--prompt", argv[n++] = v->t->prompts->v[r->prompt];
    snprintf(num[0], 32, "%llu", (unsigned long long)r->seed);
    snprintf(num[1], 32, "%d", r->width);
    snprintf(num[2], 32, "%d", r->height);
    snprintf(num[3], 32, "%d", r->n);
    snprintf(num[4], 32, "%d", o->steps);
    snprintf(num[5], 32, "%d", o->max_seq);
    argv[n++] = "--seed", argv[n++] = num[0];
    argv[n++] = "--width", argv[n++] = num[1];
    argv[n++] = "--height", argv[n++] = num[2];
    argv[n++] = "-n", argv[n++] = num[3];
    if (o->steps)
        argv[n++] = "--steps", argv[n++] = num[4];
    if (o->max_seq)
        argv[n++] = "--max-sequence-length", argv[n++] = num[5];
    for (int i = 0; i < r->n_refs; i++) {
        const kiln_soak_ref *ref = &v->t->refs[r->refs[i]];
        ref_path(v, ref, refs[i], sizeof refs[i]);
        if (!exists(refs[i]) && write_file(refs[i], &ref->bytes, err))
            return -1;
        argv[n++] = "--image", argv[n++] = refs[i];
    }
    snprintf(out, sizeof out, "%s/%016llx.run.%s", o->verify_cache, (unsigned long long)key,
             ext_of(r->format));
    argv[n++] = "--out", argv[n++] = out;
    argv[n] = NULL;
    snprintf(log, sizeof log, "%s/cli.log", o->verify_cache);
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        kiln_err_set(err, KILN_ERR_IO, "cannot open %s: %s", log, strerror(errno));
        return -1;
    }
    dprintf(fd, "== pool entry %d (%016llx): %s %dx%d n=%d seed %llu, %d reference(s)\n",
            r->pool_index, (unsigned long long)key, argv[1], r->width, r->height, r->n,
            (unsigned long long)r->seed, r->n_refs);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fd);
    if (pid < 0)
        kiln_err_set(err, KILN_ERR_IO, "fork: %s", strerror(errno));
    return pid;
}

/* Moves <key>.run[-i].<ext> to <key>[-i].<ext>. */
static kiln_status finish(const kiln_soak_verify *v, uint64_t key, const kiln_soak_req *r,
                          kiln_err *err)
{
    char from[1024], to[1024];
    for (int i = 0; i < r->n; i++) {
        if (r->n == 1)
            snprintf(from, sizeof from, "%s/%016llx.run.%s", v->o->verify_cache,
                     (unsigned long long)key, ext_of(r->format));
        else
            snprintf(from, sizeof from, "%s/%016llx.run-%d.%s", v->o->verify_cache,
                     (unsigned long long)key, i, ext_of(r->format));
        image_path(v, key, r, i, to, sizeof to);
        if (rename(from, to))
            return kiln_err_set(err, KILN_ERR_IO, "the CLI wrote no %s: %s", from,
                                strerror(errno));
    }
    return KILN_OK;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

kiln_status kiln_soak_verify_prepare(kiln_soak_verify *v, kiln_err *err)
{
    double t0 = now_s();
    struct {
        pid_t pid;
        int p;
    } run[MAX_JOBS];
    int running = 0, p = 0;
    kiln_status st = KILN_OK;
    kiln_soak_req r;
    while (p < v->o->pool || running) {
        if (!st && p < v->o->pool && running < MAX_JOBS) {
            entry(v, p, &r);
            v->key[p] = entry_key(v, &r);
            if (!cached(v, v->key[p], &r)) {
                pid_t pid = start_cli(v, v->key[p], &r, err);
                if (pid < 0)
                    st = err->code;
                else
                    run[running].pid = pid, run[running++].p = p, v->runs++;
            }
            p++;
            continue;
        }
        if (!running)
            break;
        int ws;
        pid_t pid = waitpid(-1, &ws, 0);
        if (pid < 0 && errno == EINTR)
            continue;
        for (int i = 0; i < running; i++) {
            if (run[i].pid != pid)
                continue;
            int q = run[i].p;
            run[i] = run[--running];
            entry(v, q, &r);
            if (st)
                break;
            if (!WIFEXITED(ws) || WEXITSTATUS(ws))
                st = kiln_err_set(err, KILN_ERR_IO,
                                  "the CLI failed (status %d) for pool entry %d: see %s/cli.log",
                                  WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws), q,
                                  v->o->verify_cache);
            else
                st = finish(v, v->key[q], &r, err);
            break;
        }
        if (pid < 0)
            break;
    }
    v->prepare_s = now_s() - t0;
    return st;
}

double kiln_soak_verify_prepare_s(const kiln_soak_verify *v, int *runs)
{
    *runs = v->runs;
    return v->prepare_s;
}

int kiln_soak_verify_image(const kiln_soak_verify *v, const kiln_soak_req *r, int i,
                           const kiln_buf *file)
{
    if (r->pool_index < 0 || r->pool_index >= v->o->pool)
        return -1;
    char path[1024];
    image_path(v, v->key[r->pool_index], r, i, path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    int same = 1;
    unsigned char buf[65536];
    size_t off = 0, k;
    while (same && (k = fread(buf, 1, sizeof buf, f)) > 0) {
        same = off + k <= file->len && !memcmp(buf, file->data + off, k);
        off += k;
    }
    same = same && !ferror(f) && off == file->len;
    fclose(f);
    return same;
}
