#include "supervisor.h"

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/transport.h"

#define BACKOFF_MIN_MS 250.0
#define BACKOFF_MAX_MS 30000.0
#define STABLE_MS 10000.0

typedef struct child {
    char *name;
    char **argv;
    kiln_child_role role;
    pid_t pid;          /* 0 when not running */
    double started_ms;  /* when the current process started */
    double restart_at;  /* when a dead child starts again */
    double backoff_ms;
} child;

struct kiln_supervisor {
    child *kids;
    int n, cap;
    double grace_s;
    int config_error; /* a child said restarting cannot help */
};

/* Exit statuses that mean "restarting cannot help": usage (2) and
 * sysexits' EX_CONFIG (78, KILN_WORKER_EXIT_CONFIG). */
#define EXIT_USAGE 2
#define EXIT_CONFIG 78

kiln_supervisor *kiln_supervisor_create(kiln_err *err)
{
    kiln_supervisor *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->grace_s = 60;
    return s;
}

static void free_argv(char **argv)
{
    for (char **a = argv; a && *a; a++)
        free(*a);
    free(argv);
}

void kiln_supervisor_destroy(kiln_supervisor *s)
{
    if (!s)
        return;
    for (int i = 0; i < s->n; i++) {
        free(s->kids[i].name);
        free_argv(s->kids[i].argv);
    }
    free(s->kids);
    free(s);
}

void kiln_supervisor_set_grace(kiln_supervisor *s, double grace_s) { s->grace_s = grace_s; }

kiln_status kiln_supervisor_add(kiln_supervisor *s, const char *name, kiln_child_role role,
                                const char *const *argv, kiln_err *err)
{
    if (!argv[0] || access(argv[0], X_OK))
        return kiln_err_set(err, KILN_ERR_NOT_FOUND, "%s: not an executable", name);
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 8;
        child *v = realloc(s->kids, (size_t)cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        s->kids = v, s->cap = cap;
    }
    int argc = 0;
    while (argv[argc])
        argc++;
    child c = {.role = role, .backoff_ms = BACKOFF_MIN_MS};
    c.name = strdup(name);
    c.argv = calloc((size_t)argc + 1, sizeof *c.argv);
    int ok = c.name && c.argv;
    for (int i = 0; ok && i < argc; i++)
        ok = (c.argv[i] = strdup(argv[i])) != NULL;
    if (!ok) {
        free(c.name);
        free_argv(c.argv);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    s->kids[s->n++] = c;
    return KILN_OK;
}

static void start_child(child *c, const sigset_t *child_mask)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        KILN_LOG_ERROR("kiln serve: cannot start %s: %s", c->name, strerror(errno));
        c->restart_at = kiln_now_ms() + c->backoff_ms;
        return;
    }
    if (pid == 0) {
        /* Own process group: Ctrl-C goes to the supervisor alone.  Die with
         * the supervisor, even if it is killed without a chance to stop us. */
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1);
        sigprocmask(SIG_SETMASK, child_mask, NULL);
        execv(c->argv[0], c->argv);
        fprintf(stderr, "kiln serve: exec %s: %s\n", c->argv[0], strerror(errno));
        _exit(127);
    }
    c->pid = pid;
    c->started_ms = kiln_now_ms();
    KILN_LOG_INFO("kiln serve: started %s (pid %ld)", c->name, (long)pid);
}

static void describe(int status, char *buf, size_t len)
{
    if (WIFEXITED(status))
        snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, len, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(buf, len, "stopped (status %d)", status);
}

/* Reaps every exited child; schedules restarts unless stopping. */
static void reap(kiln_supervisor *s, int stopping)
{
    int any = 0;
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            break;
        for (int i = 0; i < s->n; i++) {
            child *c = &s->kids[i];
            if (c->pid != pid)
                continue;
            any = 1;
            c->pid = 0;
            char why[96];
            describe(status, why, sizeof why);
            double now = kiln_now_ms();
            if (stopping) {
                KILN_LOG_INFO("kiln serve: %s (pid %ld) %s", c->name, (long)pid, why);
                break;
            }
            if (WIFEXITED(status) &&
                (WEXITSTATUS(status) == EXIT_USAGE || WEXITSTATUS(status) == EXIT_CONFIG)) {
                KILN_LOG_ERROR("kiln serve: %s (pid %ld) %s: a configuration error, not "
                               "restarting; stopping the service", c->name, (long)pid, why);
                s->config_error = 1;
                break;
            }
            /* A child that ran for a while starts over with a short delay;
             * one that keeps dying waits longer each time. */
            if (now - c->started_ms > STABLE_MS)
                c->backoff_ms = BACKOFF_MIN_MS;
            c->restart_at = now + c->backoff_ms;
            KILN_LOG_WARN("kiln serve: %s (pid %ld) %s after %.1f s; restarting in %.2f s",
                          c->name, (long)pid, why, (now - c->started_ms) / 1000,
                          c->backoff_ms / 1000);
            c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : c->backoff_ms * 2;
            break;
        }
    }
    if (any) {
        kiln_err err = {0};
        if (kiln_transport_shm_clean_stale(&err) < 0)
            KILN_LOG_WARN("kiln serve: %s", err.msg);
    }
}

static int running(const kiln_supervisor *s, int role)
{
    int n = 0;
    for (int i = 0; i < s->n; i++)
        n += s->kids[i].pid > 0 && (role < 0 || (int)s->kids[i].role == role);
    return n;
}

static void signal_all(kiln_supervisor *s, int role, int sig)
{
    for (int i = 0; i < s->n; i++)
        if (s->kids[i].pid > 0 && (role < 0 || (int)s->kids[i].role == role))
            kill(s->kids[i].pid, sig);
}

int kiln_supervisor_run(kiln_supervisor *s)
{
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &set, &old)) {
        KILN_LOG_ERROR("kiln serve: cannot block signals: %s", strerror(errno));
        return 1;
    }
    for (int i = 0; i < s->n; i++)
        start_child(&s->kids[i], &old);
    /* stage 0: serving; 1: front children stopping; 2: everyone stopping */
    int stage = 0;
    double kill_at = 0;
    while (stage == 0 || running(s, -1)) {
        double now = kiln_now_ms(), wait_ms = 1000;
        for (int i = 0; stage == 0 && i < s->n; i++) {
            child *c = &s->kids[i];
            if (c->pid > 0)
                continue;
            if (c->restart_at <= now)
                start_child(c, &old);
            else if (c->restart_at - now < wait_ms)
                wait_ms = c->restart_at - now;
        }
        struct timespec ts = {(time_t)(wait_ms / 1000), (long)(((long long)wait_ms % 1000) * 1000000)};
        siginfo_t info;
        int sig = sigtimedwait(&set, &info, &ts);
        if (sig == SIGCHLD || sig < 0)
            reap(s, stage > 0);
        if (s->config_error && stage == 0)
            sig = SIGTERM; /* stop as if asked to */
        if (sig == SIGINT || sig == SIGTERM) {
            stage++;
            KILN_LOG_INFO("kiln serve: %s: %s",
                          s->config_error ? "configuration error" : strsignal(sig),
                          stage == 1 ? "stopping the gateway, then the replicas"
                                     : "stopping everything now");
            if (stage == 1) {
                kill_at = kiln_now_ms() + s->grace_s * 1000;
                signal_all(s, KILN_CHILD_FRONT, SIGTERM);
            } else {
                signal_all(s, -1, SIGTERM);
            }
        }
        if (stage == 1 && !running(s, KILN_CHILD_FRONT)) {
            stage = 2;
            signal_all(s, KILN_CHILD_BACK, SIGTERM);
        }
        if (stage > 0 && kiln_now_ms() > kill_at && running(s, -1)) {
            KILN_LOG_WARN("kiln serve: %d child(ren) still running after %.0f s; killing them",
                          running(s, -1), s->grace_s);
            signal_all(s, -1, SIGKILL);
            kill_at = kiln_now_ms() + 1e9;
        }
    }
    kiln_err err = {0};
    if (kiln_transport_shm_clean_stale(&err) < 0)
        KILN_LOG_WARN("kiln serve: %s", err.msg);
    sigprocmask(SIG_SETMASK, &old, NULL);
    KILN_LOG_INFO("kiln serve: all children stopped");
    return s->config_error ? 1 : 0;
}

kiln_status kiln_supervisor_find_exe(const char *name, char *out, size_t cap, kiln_err *err)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return kiln_err_set(err, KILN_ERR_IO, "cannot locate the kiln binary: %s", strerror(errno));
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    *slash = '\0';
    static const char *const dirs[] = {"", "/../services", "/../services/gateway"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
        int len = snprintf(out, cap, "%s%s/%s", self, dirs[i], name);
        if (len > 0 && (size_t)len < cap && !access(out, X_OK))
            return KILN_OK;
    }
    return kiln_err_set(err, KILN_ERR_NOT_FOUND,
                        "%s not found next to the kiln binary (or in the build tree)", name);
}
