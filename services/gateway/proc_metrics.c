#include "proc_metrics.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* Fields 22 (starttime, clock ticks after boot), 23 (vsize, bytes), 24
 * (rss, pages) of /proc/self/stat (proc(5)); the command name (field 2)
 * may hold spaces, so parsing starts after its ')'. */
static int read_stat(double *start_ticks, double *vsize, double *rss_pages)
{
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f)
        return -1;
    char buf[1024];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (!p)
        return -1;
    unsigned long long start, vs;
    long long rss;
    /* after ")": state(3) ppid pgrp session tty tpgid flags minflt cminflt
     * majflt cmajflt utime(14) stime cutime cstime priority nice threads
     * itrealvalue starttime(22) vsize rss */
    if (sscanf(p + 1,
               " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d "
               "%*d %llu %llu %lld",
               &start, &vs, &rss) != 3)
        return -1;
    long hz = sysconf(_SC_CLK_TCK);
    *start_ticks = (double)start / (double)(hz > 0 ? hz : 100);
    *vsize = (double)vs;
    *rss_pages = (double)rss;
    return 0;
}

/* The boot time (unix seconds), /proc/stat's btime. */
static double boot_time(void)
{
    FILE *f = fopen("/proc/stat", "r");
    if (!f)
        return -1;
    char line[256];
    double bt = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "btime %lf", &bt) == 1)
            break;
    fclose(f);
    return bt;
}

static double open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    double n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory stream's own descriptor */
}

static kiln_status put(kiln_buf *out, const char *name, const char *type, const char *help,
                       double v, kiln_err *err)
{
    char line[320];
    int n = snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help,
                     name, type, name, v);
    return kiln_buf_append(out, line, (size_t)n, err);
}

kiln_status kiln_proc_metrics_render(kiln_buf *out, kiln_err *err)
{
    size_t start = out->len;
    kiln_status st = KILN_OK;
    /* User and system time of all threads, in nanoseconds: /proc/self/stat's
     * utime and stime count clock ticks (10 ms), so a gateway that has done
     * little would read 0. */
    struct timespec cpu;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu) == 0)
        st = put(out, "process_cpu_seconds_total", "counter",
                 "Total user and system CPU time spent in seconds.",
                 (double)cpu.tv_sec + (double)cpu.tv_nsec * 1e-9, err);
    double start_s, vsize, rss;
    if (!st && read_stat(&start_s, &vsize, &rss) == 0) {
        long page = sysconf(_SC_PAGESIZE);
        double bt = boot_time();
        st = put(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
                 rss * (double)(page > 0 ? page : 4096), err);
        if (!st)
            st = put(out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
                     vsize, err);
        if (!st && bt >= 0)
            st = put(out, "process_start_time_seconds", "gauge",
                     "Start time of the process since unix epoch in seconds.", bt + start_s, err);
    }
    double fds = open_fds();
    if (!st && fds >= 0)
        st = put(out, "process_open_fds", "gauge", "Number of open file descriptors.", fds, err);
    struct rlimit rl;
    if (!st && getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        st = put(out, "process_max_fds", "gauge", "Maximum number of open file descriptors.",
                 (double)rl.rlim_cur, err);
    if (st)
        out->len = start;
    return st;
}
