#include "soak_mem.h"

#include <ctype.h>
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 64

struct kiln_soak_mem {
    pid_t serve;
    double period_s, t0;
    int gpu_tool; /* nvidia-smi is on the PATH */
    int gpu_seen;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    kiln_soak_sample *s;
    size_t n, cap;
};

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The start of /proc/<pid>/<file> (at most cap - 1 bytes) as a string in
 * buf; 0 or -1 (no such process). */
static int read_proc(pid_t pid, const char *file, char *buf, size_t cap)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, file);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t k = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[k] = '\0';
    return 0;
}

/* pid's parent and command name from /proc/<pid>/stat; 0 or -1. */
static int proc_stat(pid_t pid, pid_t *ppid, char *comm, size_t cap)
{
    char buf[512];
    if (read_proc(pid, "stat", buf, sizeof buf))
        return -1;
    char *l = strchr(buf, '('), *r = strrchr(buf, ')');
    int pp;
    if (!l || !r || r < l || sscanf(r + 1, " %*c %d", &pp) != 1)
        return -1;
    snprintf(comm, cap, "%.*s", (int)(r - l - 1), l + 1);
    *ppid = pp;
    return 0;
}

static int cmp_pid(const void *a, const void *b)
{
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return (x > y) - (x < y);
}

int kiln_soak_children(pid_t parent, const char *comm, pid_t *out, int max)
{
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while (n < max && (e = readdir(d))) {
        if (!isdigit((unsigned char)e->d_name[0]))
            continue;
        pid_t pid = (pid_t)atoi(e->d_name), pp;
        char c[64];
        if (!proc_stat(pid, &pp, c, sizeof c) && pp == parent &&
            (comm ? !strcmp(c, comm) : !strncmp(c, "kiln", 4)))
            out[n++] = pid;
    }
    closedir(d);
    qsort(out, (size_t)n, sizeof *out, cmp_pid);
    return n;
}

/* A field of /proc/<pid>/status in kB, or -1. */
static long status_kb(const char *text, const char *field)
{
    size_t fl = strlen(field);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, field, fl) && p[fl] == ':')
            return strtol(p + fl + 1, NULL, 10);
    return -1;
}

static int read_status(pid_t pid, long *rss, long *anon)
{
    char buf[4096];
    if (read_proc(pid, "status", buf, sizeof buf))
        return -1;
    *rss = status_kb(buf, "VmRSS");
    *anon = status_kb(buf, "RssAnon");
    return *rss < 0 ? -1 : 0;
}

/* GPU memory per process from nvidia-smi: pid, executable's base name
 * and MiB; the number read. */
static int gpu_query(pid_t *pids, char (*names)[16], long *mib, int max)
{
    FILE *p = popen("nvidia-smi --query-compute-apps=pid,process_name,used_memory "
                    "--format=csv,noheader,nounits 2>/dev/null",
                    "r");
    if (!p)
        return 0;
    int n = 0, pid;
    long m;
    char line[512], name[256];
    while (fgets(line, sizeof line, p))
        if (n < max && sscanf(line, "%d , %255[^,] , %ld", &pid, name, &m) == 3) {
            const char *base = strrchr(name, '/');
            snprintf(names[n], sizeof names[n], "%.15s", base ? base + 1 : name);
            pids[n] = pid, mib[n++] = m;
        }
    pclose(p);
    return n;
}

static int on_path(const char *tool)
{
    const char *path = getenv("PATH");
    char buf[1024];
    while (path && *path) {
        size_t l = strcspn(path, ":");
        snprintf(buf, sizeof buf, "%.*s/%s", (int)l, path, tool);
        if (l && access(buf, X_OK) == 0)
            return 1;
        path += l + (path[l] == ':');
    }
    return 0;
}

static void push(kiln_soak_mem *m, const kiln_soak_sample *s)
{
    if (m->n == m->cap) {
        size_t cap = m->cap ? 2 * m->cap : 1024;
        kiln_soak_sample *ns = realloc(m->s, cap * sizeof *ns);
        if (!ns)
            return; /* fewer samples, not a failed run */
        m->s = ns, m->cap = cap;
    }
    m->s[m->n++] = *s;
}

static void sample(kiln_soak_mem *m)
{
    pid_t pids[MAX_PROCS], gp[MAX_PROCS];
    long gm[MAX_PROCS];
    char gn[MAX_PROCS][16];
    int n = 0, ng = 0, gmatched[MAX_PROCS] = {0};
    pids[n++] = m->serve;
    n += kiln_soak_children(m->serve, NULL, pids + n, MAX_PROCS - n);
    if (m->gpu_tool)
        ng = gpu_query(gp, gn, gm, MAX_PROCS);
    double t = now_s() - m->t0;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < n; i++) {
        kiln_soak_sample s = {.t = t, .pid = pids[i], .gpu_mib = -1};
        pid_t pp;
        if (proc_stat(pids[i], &pp, s.name, sizeof s.name) ||
            read_status(pids[i], &s.rss_kb, &s.anon_kb))
            continue; /* gone meanwhile */
        for (int j = 0; j < ng; j++)
            if (gp[j] == pids[i])
                s.gpu_mib = gm[j], m->gpu_seen = 1, gmatched[j] = 1;
        push(m, &s);
    }
    /* In a container nvidia-smi may name processes by the host's pids,
     * which are not ours: those of kiln's executables become samples of
     * their own (GPU memory only, under nvidia-smi's pid). */
    for (int j = 0; j < ng; j++)
        if (!gmatched[j] && !strncmp(gn[j], "kiln", 4)) {
            kiln_soak_sample s = {.t = t, .pid = gp[j], .rss_kb = -1, .anon_kb = -1,
                                  .gpu_mib = gm[j]};
            snprintf(s.name, sizeof s.name, "%s", gn[j]);
            m->gpu_seen = 1;
            push(m, &s);
        }
    pthread_mutex_unlock(&m->mu);
}

static void *sampler(void *arg)
{
    kiln_soak_mem *m = arg;
    double next = now_s();
    pthread_mutex_lock(&m->mu);
    while (!m->stop) {
        pthread_mutex_unlock(&m->mu);
        sample(m);
        next += m->period_s;
        pthread_mutex_lock(&m->mu);
        double wait = next - now_s();
        if (wait > 0 && !m->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double at = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + wait;
            ts.tv_sec = (time_t)at;
            ts.tv_nsec = (long)((at - (double)ts.tv_sec) * 1e9);
            pthread_cond_timedwait(&m->cv, &m->mu, &ts);
        }
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

kiln_soak_mem *kiln_soak_mem_start(pid_t serve, double period_s, kiln_err *err)
{
    kiln_soak_mem *m = calloc(1, sizeof *m);
    if (!m) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    m->serve = serve;
    m->period_s = period_s;
    m->t0 = now_s();
    m->gpu_tool = on_path("nvidia-smi");
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    int rc = pthread_create(&m->th, NULL, sampler, m);
    if (rc) {
        kiln_err_set(err, KILN_ERR_NOMEM, "pthread_create: %s", strerror(rc));
        kiln_soak_mem_free(m);
        return NULL;
    }
    return m;
}

void kiln_soak_mem_stop(kiln_soak_mem *m)
{
    if (!m || m->stop)
        return;
    pthread_mutex_lock(&m->mu);
    m->stop = 1;
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->mu);
    pthread_join(m->th, NULL);
}

void kiln_soak_mem_free(kiln_soak_mem *m)
{
    if (!m)
        return;
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m->s);
    free(m);
}

const kiln_soak_sample *kiln_soak_mem_samples(const kiln_soak_mem *m, size_t *n)
{
    *n = m->n;
    return m->s;
}

int kiln_soak_mem_has_gpu(const kiln_soak_mem *m) { return m->gpu_seen; }

/* --- growth -------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of pid's values (RssAnon MB, or GPU MB when gpu) in [t0, t1]; -1
 * when none.  v is scratch of n doubles. */
static double window_median(const kiln_soak_sample *s, size_t n, pid_t pid, double t0, double t1,
                            int gpu, double *v)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i].pid == pid && s[i].t >= t0 && s[i].t <= t1 &&
            (gpu ? s[i].gpu_mib >= 0 : s[i].anon_kb >= 0))
            v[k++] = gpu ? (double)s[i].gpu_mib : (double)s[i].anon_kb / 1024.0;
    if (!k)
        return -1;
    qsort(v, k, sizeof *v, cmp_double);
    return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

/* The highest levels that processes of p's stage born before p reached
 * (-1 when none): a replacement's arenas fill again up to what its
 * predecessor or sibling held, on the shapes that now come to it
 * (2026-12-06, H100 soak: a restarted denoiser rose 1168 MiB when the
 * other one was stopped, to 11224 MiB, under its predecessor's 12252). */
static void earlier_reach(const kiln_soak_growth *g, size_t ng, kiln_soak_growth *p)
{
    p->reach_mb = p->gpu_reach_mb = -1;
    for (size_t k = 0; k < ng; k++) {
        if (g[k].pid == p->pid || g[k].first_t >= p->first_t || strcmp(g[k].name, p->name))
            continue;
        p->reach_mb = g[k].peak_mb > p->reach_mb ? g[k].peak_mb : p->reach_mb;
        p->gpu_reach_mb = g[k].gpu_peak_mb > p->gpu_reach_mb ? g[k].gpu_peak_mb : p->gpu_reach_mb;
    }
}

/* Growth past a bound that also passes the stage's earlier reach (when
 * there is one) is a leak; growth back up to that reach is warm-up. */
static int past_reach(double end, double reach)
{
    return reach < 0 || end > reach;
}

size_t kiln_soak_mem_growth(const kiln_soak_sample *s, size_t n, double warmup_s, double end_s,
                            double max_rss_mb, double max_gpu_mb, kiln_soak_growth **out)
{
    *out = NULL;
    kiln_soak_growth *g = calloc(MAX_PROCS * 4, sizeof *g);
    double *v = malloc((n ? n : 1) * sizeof *v);
    if (!g || !v) {
        free(g);
        free(v);
        return 0;
    }
    size_t ng = 0;
    for (size_t i = 0; i < n && ng < MAX_PROCS * 4; i++) {
        size_t j = 0;
        while (j < ng && g[j].pid != s[i].pid)
            j++;
        if (j == ng) {
            g[ng] = (kiln_soak_growth){.pid = s[i].pid, .first_t = s[i].t, .gpu_base_mb = -1,
                                       .gpu_end_mb = -1, .gpu_peak_mb = -1};
            snprintf(g[ng].name, sizeof g[ng].name, "%s", s[i].name);
            ng++;
        }
        kiln_soak_growth *p = &g[j];
        p->last_t = s[i].t;
        double mb = (double)s[i].anon_kb / 1024.0;
        p->peak_mb = s[i].anon_kb >= 0 && mb > p->peak_mb ? mb : p->peak_mb;
        if (s[i].gpu_mib >= 0 && (double)s[i].gpu_mib > p->gpu_peak_mb)
            p->gpu_peak_mb = (double)s[i].gpu_mib;
    }
    double last = 0;
    for (size_t i = 0; i < n; i++)
        last = s[i].t > last ? s[i].t : last;
    for (size_t j = 0; j < ng; j++) {
        kiln_soak_growth *p = &g[j];
        double w = p->first_t + warmup_s > warmup_s ? p->first_t + warmup_s : warmup_s;
        double span = (end_s < last ? end_s : last) - w;
        /* Alive at the end: seen in the last sampling round (one time for all). */
        if (span < 10 || p->last_t < last)
            continue;
        double fifth = span / 5;
        p->base_mb = window_median(s, n, p->pid, w, w + fifth, 0, v);
        p->end_mb = window_median(s, n, p->pid, w + span - fifth, w + span, 0, v);
        p->gpu_base_mb = window_median(s, n, p->pid, w, w + fifth, 1, v);
        p->gpu_end_mb = window_median(s, n, p->pid, w + span - fifth, w + span, 1, v);
        int rss = p->base_mb >= 0 && p->end_mb >= 0;
        int gpu = p->gpu_base_mb >= 0 && p->gpu_end_mb >= 0;
        p->judged = rss || gpu;
        int rss_grew = rss && p->end_mb - p->base_mb > max_rss_mb;
        int gpu_grew = gpu && p->gpu_end_mb - p->gpu_base_mb > max_gpu_mb;
        earlier_reach(g, ng, p);
        p->over = (rss_grew && past_reach(p->end_mb, p->reach_mb)) ||
                  (gpu_grew && past_reach(p->gpu_end_mb, p->gpu_reach_mb));
        p->refilled = !p->over && (rss_grew || gpu_grew);
    }
    free(v);
    *out = g;
    return ng;
}
