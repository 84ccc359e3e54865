#include "svc_util.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/bus.h"
#include "common/bus_keys.h"
#include "common/checkpoint.h"
#include "engine/family.h"
#include "common/domain.h"
#include "common/log.h"
#include "services/gateway/base64.h"

svc_env svc;

int svc_init(const char *name)
{
    svc.build_root = getenv("KILN_BUILD_ROOT");
    const char *shared = getenv("KILN_SHARED");
    if (!svc.build_root || !shared) {
        fprintf(stderr, "KILN_BUILD_ROOT and KILN_SHARED must be set (meson test sets them)\n");
        return -1;
    }
    snprintf(svc.model, sizeof svc.model, "%s/oracle/ckpt/klein-tiny", shared);
    snprintf(svc.tmpdir, sizeof svc.tmpdir, "/tmp/kiln-%.20s-XXXXXX", name);
    if (!mkdtemp(svc.tmpdir)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

void svc_cleanup(int keep)
{
    if (keep) {
        /* CI keeps only stderr: the logs' last lines say why a service did
         * not come up. */
        char cmd[PATH_MAX + 160];
        snprintf(cmd, sizeof cmd,
                 "for f in %s/*.log; do [ -f \"$f\" ] && echo \"--- $f\" && tail -n 12 \"$f\"; "
                 "done 1>&2",
                 svc.tmpdir);
        if (system(cmd))
            fprintf(stderr, "could not show the logs\n");
        fprintf(stderr, "logs kept in %s\n", svc.tmpdir);
        return;
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", svc.tmpdir);
    if (system(cmd))
        fprintf(stderr, "could not remove %s\n", svc.tmpdir);
}

const char *svc_exe(const char *rel)
{
    static char bufs[8][512];
    static int next;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof bufs[0], "%s/%s", svc.build_root, rel);
    return b;
}

const char *svc_tmp(const char *name)
{
    static char bufs[8][256];
    static int next;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof bufs[0], "%s/%s", svc.tmpdir, name);
    return b;
}

void svc_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
}

pid_t svc_spawn(const char *const *argv, const char *const *env, const char *log)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        /* A test killed by its timeout takes its processes with it. */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        for (int i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

pid_t svc_spawn_service(const char *name, const char *bus, const char *const *extra,
                        const char *const *env)
{
    const char *argv[48];
    int n = 0, gateway = strcmp(name, "gateway") == 0;
    char exe[64], log[64];
    snprintf(exe, sizeof exe, gateway ? "services/gateway/kiln-%s" : "services/kiln-%s", name);
    snprintf(log, sizeof log, "%s.log", name);
    argv[n++] = svc_exe(exe);
    argv[n++] = "--model";
    argv[n++] = svc.model;
    argv[n++] = "--bus";
    argv[n++] = bus;
    if (gateway) {
        static const char *const net[] = {"--host", "127.0.0.1", "--port", "0", "--min-size", "64"};
        for (size_t i = 0; i < sizeof net / sizeof net[0]; i++)
            argv[n++] = net[i];
    } else if (strcmp(name, "encoder") == 0) {
        argv[n++] = "--text-encoder-out-layers";
        argv[n++] = "1,2,3";
    }
    for (int i = 0; extra && extra[i] && n < 47; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    return svc_spawn(argv, env, svc_tmp(log));
}

int svc_start_service(const char *const *const extra[4], const char *const *env, pid_t pids[4])
{
    static const char *const stages[] = {"encoder", "denoiser", "decoder"};
    char bus[128];
    snprintf(bus, sizeof bus, "ipc://%s/bus", svc.tmpdir);
    pids[0] = svc_spawn_service("gateway", bus, extra[0], env);
    int port = svc_log_port(svc_tmp("gateway.log"), 30000);
    for (int i = 0; i < 3; i++)
        pids[i + 1] = svc_spawn_service(stages[i], bus, extra[i + 1], env);
    return port > 0 && svc_wait_ready(port, 60000) == 0 ? port : -1;
}

static int exit_status(int st)
{
    return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
}

int svc_wait_exit(pid_t pid, int timeout_ms)
{
    double until = kiln_now_ms() + timeout_ms;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return exit_status(st);
        if (r < 0)
            return -1;
        if (kiln_now_ms() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        svc_sleep_ms(20);
    }
}

int svc_stop(pid_t pid, int timeout_ms)
{
    if (pid <= 0)
        return -1;
    kill(pid, SIGTERM);
    return svc_wait_exit(pid, timeout_ms);
}

int svc_read_file(const char *path, kiln_buf *out)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    char buf[65536];
    size_t n;
    int rc = 0;
    while (!rc && (n = fread(buf, 1, sizeof buf, f)) > 0)
        rc = kiln_buf_append(out, buf, n, NULL) ? -1 : 0;
    fclose(f);
    return rc;
}

int svc_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    int ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

void svc_read_log(const char *log, kiln_buf *out)
{
    kiln_buf_clear(out);
    svc_read_file(log, out);
    if (kiln_buf_append(out, "", 1, NULL) == KILN_OK)
        out->len--; /* the NUL stays past len */
}

int svc_log_count(const char *log, const char *needle)
{
    kiln_buf b = {0};
    svc_read_log(log, &b);
    int n = 0;
    for (const char *p = b.data ? (const char *)b.data : ""; (p = strstr(p, needle)); p++)
        n++;
    kiln_buf_free(&b);
    return n;
}

int svc_wait_log(const char *log, const char *needle, int times, int timeout_ms)
{
    double until = kiln_now_ms() + timeout_ms;
    while (svc_log_count(log, needle) < times) {
        if (kiln_now_ms() > until)
            return -1;
        svc_sleep_ms(20);
    }
    return 0;
}

size_t svc_log_size(const char *log)
{
    kiln_buf b = {0};
    svc_read_log(log, &b);
    size_t n = b.len;
    kiln_buf_free(&b);
    return n;
}

/* 1 when the replica id text [id, end) holds "-<pid>" followed by '-' or
 * its end: the pid part of "<stage>-<host>-<pid>[-<epoch>]". */
static int id_has_pid(const char *id, const char *end, pid_t pid)
{
    char mid[32];
    int n = snprintf(mid, sizeof mid, "-%ld", (long)pid);
    for (const char *at = id; (at = strstr(at, mid)) && at + n <= end; at++)
        if (at + n == end || at[n] == '-')
            return 1;
    return 0;
}

pid_t svc_batch_started(const char *log, size_t from, const pid_t *pids, int n, int timeout_ms)
{
    static const char key[] = "kiln-denoiser denoise-";
    double until = kiln_now_ms() + timeout_ms;
    for (;;) {
        kiln_buf b = {0};
        svc_read_log(log, &b);
        pid_t pid = -1;
        const char *p = b.len > from ? strstr((const char *)b.data + from, key) : NULL;
        for (; p && pid < 0; p = strstr(p + 1, key)) {
            const char *colon = strstr(p, ": batch of ");
            const char *nl = strchr(p, '\n');
            if (!colon || (nl && nl < colon))
                continue;
            for (int i = 0; i < n && pid < 0; i++)
                if (id_has_pid(p, colon, pids[i]))
                    pid = pids[i];
        }
        kiln_buf_free(&b);
        if (pid > 0 || kiln_now_ms() > until)
            return pid > 0 ? pid : -1;
        svc_sleep_ms(10);
    }
}

int svc_exit_reports(const char *log, char *bad, size_t cap)
{
    return svc_exit_reports_from(log, 0, bad, cap);
}

int svc_exit_reports_from(const char *log, size_t from, char *bad, size_t cap)
{
    static const char held[] = ": at exit: 0 job(s) held, shm ",
                      none[] = " with 0 range(s) in use, cuda_ipc 0 slab(s) with 0 range(s)";
    kiln_buf b = {0};
    svc_read_log(log, &b);
    int n = 0;
    bad[0] = '\0';
    const char *text = b.data && from < b.len ? (const char *)b.data + from : "";
    for (const char *p = text; (p = strstr(p, ": at exit: ")); p++) {
        size_t len = strcspn(p, "\n");
        if (!bad[0] && (strncmp(p, held, strlen(held)) || !memmem(p, len, none, strlen(none))))
            snprintf(bad, cap, "%.*s", (int)len, p);
        n++;
    }
    kiln_buf_free(&b);
    return n;
}

int svc_wait_registered(const char *log, pid_t pid, int timeout_ms)
{
    static const char key[] = "registered with the gateway as ";
    double until = kiln_now_ms() + timeout_ms;
    for (;;) {
        kiln_buf b = {0};
        svc_read_log(log, &b);
        int found = 0;
        for (const char *p = b.data ? (const char *)b.data : ""; !found && (p = strstr(p, key));) {
            p += strlen(key);
            const char *end = p + strcspn(p, " \n");
            found = id_has_pid(p, end, pid);
        }
        kiln_buf_free(&b);
        if (found)
            return 0;
        if (kiln_now_ms() > until)
            return -1;
        svc_sleep_ms(20);
    }
}

int svc_log_port(const char *log, int timeout_ms)
{
    static const char key[] = "on http://127.0.0.1:";
    double until = kiln_now_ms() + timeout_ms;
    for (;;) {
        kiln_buf b = {0};
        svc_read_log(log, &b);
        const char *p = b.data ? strstr((const char *)b.data, key) : NULL;
        int port = p ? atoi(p + strlen(key)) : 0;
        kiln_buf_free(&b);
        if (port > 0)
            return port;
        if (kiln_now_ms() > until)
            return -1;
        svc_sleep_ms(20);
    }
}

/* Binds 127.0.0.1:port (0: the kernel's pick); the socket or -1. */
static int bind_loopback(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

int svc_free_port(void)
{
    int fd = bind_loopback(0);
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int port = fd >= 0 && !getsockname(fd, (struct sockaddr *)&a, &len) ? ntohs(a.sin_port) : -1;
    if (fd >= 0)
        close(fd);
    return port;
}

/* Linux gives bind(0) odd ports and connect() even ones, so P + 1 is
 * exactly where other tests' client sockets land: check it is free too. */
int svc_free_port_pair(void)
{
    for (int tries = 0; tries < 200; tries++) {
        int port = svc_free_port();
        if (port <= 0 || port >= 65535)
            continue;
        int fd = bind_loopback(port + 1);
        if (fd >= 0) {
            close(fd);
            return port;
        }
    }
    return -1;
}

int svc_get_status(int port, const char *path)
{
    gwc_response r;
    int st = gwc_request(port, "GET", path, NULL, NULL, 0, &r, 5000) ? -1 : r.status;
    gwc_response_free(&r);
    return st;
}

pid_t svc_serve(int denoisers, const char *const *extra, const char *const *env, int *port)
{
    static char port_s[16], bus[160], n[16];
    *port = svc_free_port();
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(bus, sizeof bus, "ipc://%s/bus", svc.tmpdir);
    snprintf(n, sizeof n, "%d", denoisers);
    const char *argv[48] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                            "--bus", bus, "--min-size", "64", "--max-size", "128",
                            "--text-encoder-out-layers", "1,2,3", "--denoisers", n};
    int k = 16;
    for (int i = 0; extra && extra[i] && k < 47; i++)
        argv[k++] = extra[i];
    argv[k] = NULL;
    /* Its bus keys in our folder, where svc_fake_open finds them. */
    static char tmpdir[PATH_MAX + 8];
    snprintf(tmpdir, sizeof tmpdir, "TMPDIR=%s", svc.tmpdir);
    const char *envs[32] = {tmpdir};
    for (int i = 0; env && env[i] && i < 30; i++)
        envs[i + 1] = env[i];
    pid_t pid = svc_spawn(argv, envs, svc_tmp("serve.log"));
    double v;
    return pid > 0 && svc_wait_ready(*port, 90000) == 0 &&
                   svc_wait_metric(*port, "kiln_replicas{stage=\"denoise\"}", denoisers, 60000,
                                   &v) == 0
               ? pid
               : -1;
}

int svc_post_json(int port, const char *path, const char *json, gwc_response *r, int timeout_ms)
{
    return gwc_request(port, "POST", path, "application/json", json, strlen(json), r, timeout_ms);
}

int svc_wait_ready(int port, int timeout_ms)
{
    double until = kiln_now_ms() + timeout_ms;
    while (svc_get_status(port, "/readyz") != 200) {
        if (kiln_now_ms() > until)
            return -1;
        svc_sleep_ms(50);
    }
    return 0;
}

int svc_metrics(int port, kiln_buf *out)
{
    gwc_response r;
    kiln_buf_clear(out);
    if (gwc_request(port, "GET", "/metrics", NULL, NULL, 0, &r, 5000) || r.status != 200) {
        gwc_response_free(&r);
        return -1;
    }
    int rc = kiln_buf_append(out, r.body.data, r.body.len, NULL) ||
                     kiln_buf_append(out, "", 1, NULL)
                 ? -1
                 : 0;
    if (!rc)
        out->len--; /* the NUL stays past len */
    gwc_response_free(&r);
    return rc;
}

double svc_metric(const char *text, const char *prefix)
{
    double sum = 0;
    size_t pl = strlen(prefix);
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, prefix, pl)) {
            const char *sp = strchr(l + pl - 1, ' ');
            if (sp)
                sum += strtod(sp, NULL);
        }
    return sum;
}

int svc_wait_metric(int port, const char *prefix, double want, int timeout_ms, double *last)
{
    double until = kiln_now_ms() + timeout_ms, v = -1;
    kiln_buf m = {0};
    int rc = -1;
    for (;;) {
        if (svc_metrics(port, &m) == 0 && (v = svc_metric((const char *)m.data, prefix)) == want) {
            rc = 0;
            break;
        }
        if (kiln_now_ms() > until)
            break;
        svc_sleep_ms(50);
    }
    kiln_buf_free(&m);
    if (last)
        *last = v;
    return rc;
}

int svc_wait_idle(int port, int timeout_ms, char *last, size_t cap)
{
    double until = kiln_now_ms() + timeout_ms;
    kiln_buf m = {0};
    int rc = -1;
    snprintf(last, cap, "no /metrics answer");
    for (;;) {
        if (svc_metrics(port, &m) == 0) {
            const char *t = (const char *)m.data;
            double jobs = svc_metric(t, "kiln_jobs "), q = svc_metric(t, "kiln_queue_depth{"),
                   in = svc_metric(t, "kiln_inflight{"), cancelling = svc_metric(t, "kiln_cancelling{"),
                   busy = svc_metric(t, "kiln_replicas_busy{");
            snprintf(last, cap, "kiln_jobs %g, queued %g, in flight %g, cancelling %g, busy %g", jobs,
                     q, in, cancelling, busy);
            if (jobs == 0 && q == 0 && in == 0 && cancelling == 0 && busy == 0) {
                rc = 0;
                break;
            }
        }
        if (kiln_now_ms() > until)
            break;
        svc_sleep_ms(50);
    }
    kiln_buf_free(&m);
    return rc;
}

/* ---- responses ---- */

void svc_images_free(svc_images *im)
{
    for (int i = 0; i < im->n; i++)
        kiln_buf_free(&im->files[i]);
    memset(im, 0, sizeof *im);
}

int svc_parse_images(const gwc_response *r, svc_images *im)
{
    memset(im, 0, sizeof *im);
    if (r->status != 200)
        return -1;
    cJSON *j = cJSON_ParseWithLength((const char *)r->body.data, r->body.len);
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(j, "data");
    int ok = j && cJSON_IsArray(data) && cJSON_GetArraySize(data) > 0;
    /* Seeds are exact in the text even past 2^53 (a double is not): read
     * them from the text, in order. */
    const char *at = (const char *)r->body.data, *end = at + r->body.len;
    const cJSON *it;
    cJSON_ArrayForEach(it, data)
    {
        const char *b64 = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "b64_json"));
        ok = ok && b64 && im->n < 16 &&
             cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(it, "seed")) &&
             (at = memmem(at, (size_t)(end - at), "\"seed\":", 7)) != NULL;
        if (!ok)
            break;
        at += 7;
        im->seeds[im->n] = strtoull(at, NULL, 10);
        ok = kiln_base64_decode(b64, strlen(b64), &im->files[im->n], NULL) == KILN_OK;
        im->n++;
    }
    cJSON_Delete(j);
    if (!ok)
        svc_images_free(im);
    return ok ? 0 : -1;
}

int svc_error_body(const gwc_response *r, const char *code, char *why, size_t cap)
{
    cJSON *j = cJSON_ParseWithLength((const char *)r->body.data, r->body.len);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    const char *msg = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "message"));
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "type"));
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "code");
    int rc = -1;
    if (!msg || !msg[0] || !type || !cJSON_HasObjectItem(e, "param") || !c)
        snprintf(why, cap, "not an OpenAI error body: %.*s", (int)(r->body.len > 200 ? 200 : r->body.len),
                 r->body.data ? (const char *)r->body.data : "");
    else if (strstr(msg, "/tmp/") || strstr(msg, "/work/") || strstr(msg, "/dev/shm"))
        snprintf(why, cap, "the message leaks a path: %s", msg);
    else if (code && !(cJSON_IsString(c) && !strcmp(c->valuestring, code)))
        snprintf(why, cap, "code %s, want %s (%s)", cJSON_IsString(c) ? c->valuestring : "null",
                 code, msg);
    else
        rc = 0;
    cJSON_Delete(j);
    return rc;
}

/* ---- requests in flight ---- */

void svc_series_json(char *buf, size_t cap, const char *name, int base, int i, const char *steps)
{
    snprintf(buf, cap,
             "{\"prompt\":\"%s %d\",\"size\":\"64x64\",\"seed\":%d,"
             "\"num_inference_steps\":%s,\"max_sequence_length\":32}",
             name, i, base + i, steps);
}

/* Requests first..first+k-1 of a series in one CLI run (k <= 4, so that a
 * run stays within SVC_T_REQ on a loaded machine), renamed <name>-<i>.png. */
static int cli_chunk(const char *name, int base, int first, int k, const char *steps)
{
    char seed[16], out[64], prompts[4][32];
    const char *args[32];
    int a = 0;
    snprintf(seed, sizeof seed, "%d", base + first);
    for (int i = 0; i < k; i++) {
        snprintf(prompts[i], sizeof prompts[i], "%s %d", name, first + i);
        args[a++] = "--prompt", args[a++] = prompts[i];
    }
    const char *rest[] = {"--seed", seed, "--width", "64", "--height", "64", "--steps", steps,
                          "--max-sequence-length", "32", NULL};
    for (int i = 0; rest[i]; i++)
        args[a++] = rest[i];
    args[a] = NULL;
    snprintf(out, sizeof out, "%s-chunk%d.png", name, first);
    if (svc_cli("generate", args, svc_tmp(out)))
        return -1;
    for (int i = 0; i < k; i++) {
        char from[80], to[80], path[512];
        /* One image is written as named, several with -<row> added. */
        if (k == 1)
            snprintf(from, sizeof from, "%s", out);
        else
            snprintf(from, sizeof from, "%s-chunk%d-%d.png", name, first, i);
        snprintf(to, sizeof to, "%s-%d.png", name, first + i);
        snprintf(path, sizeof path, "%s", svc_tmp(from));
        if (rename(path, svc_tmp(to)))
            return -1;
    }
    return 0;
}

int svc_cli_series(const char *name, int base, int n, const char *steps)
{
    for (int first = 0; first < n; first += 4)
        if (cli_chunk(name, base, first, n - first < 4 ? n - first : 4, steps))
            return -1;
    return 0;
}

void svc_client_send(svc_client *c, int port, const char *json, const char *ref)
{
    memset(c, 0, sizeof *c);
    snprintf(c->ref, sizeof c->ref, "%s", ref);
    kiln_buf wire = {0};
    gwc_format(&wire, "POST", "/v1/images/generations", "application/json", json, strlen(json), 0);
    c->fd = gwc_connect(port);
    if (c->fd < 0 || gwc_send(c->fd, wire.data, wire.len, 5000)) {
        c->verdict = SVC_OTHER;
        snprintf(c->why, sizeof c->why, "not sent");
    }
    kiln_buf_free(&wire);
}

svc_verdict svc_client_poll(svc_client *c, int wait_ms)
{
    if (c->verdict != SVC_PENDING || c->fd < 0)
        return c->verdict;
    struct pollfd pf = {.fd = c->fd, .events = POLLIN};
    if (poll(&pf, 1, wait_ms) <= 0)
        return SVC_PENDING;
    gwc_response r = {0};
    if (gwc_read_response(c->fd, &c->in, &r, 10000)) {
        c->verdict = SVC_OTHER;
        snprintf(c->why, sizeof c->why, "no well-formed answer");
    } else if (r.status == 200) {
        svc_images im;
        int same = svc_parse_images(&r, &im) == 0 && im.n == 1 &&
                   svc_same_file(svc_tmp(c->ref), &im.files[0]);
        svc_images_free(&im);
        c->verdict = same ? SVC_IMAGE : SVC_WRONG_IMAGE;
        if (!same)
            snprintf(c->why, sizeof c->why, "a 200 whose image is not the CLI's %s", c->ref);
    } else if (r.status == 503 && svc_error_body(&r, "stage_unavailable", c->why, sizeof c->why) == 0) {
        c->verdict = SVC_UNAVAILABLE;
    } else {
        c->verdict = SVC_OTHER;
        snprintf(c->why, sizeof c->why, "status %d: %.*s", r.status,
                 (int)(r.body.len > 200 ? 200 : r.body.len), r.body.data ? (char *)r.body.data : "");
    }
    gwc_response_free(&r);
    kiln_buf_free(&c->in);
    close(c->fd);
    c->fd = -1;
    return c->verdict;
}

int svc_series_run(int port, const char *name, int base, int first, int n, const char *steps,
                   svc_client *cs)
{
    for (int i = 0; i < n; i++) {
        char json[256], ref[64];
        svc_series_json(json, sizeof json, name, base, first + i, steps);
        snprintf(ref, sizeof ref, "%s-%d.png", name, first + i);
        svc_client_send(&cs[i], port, json, ref);
    }
    svc_clients_wait(cs, n, SVC_T_REQ);
    int images = 0;
    for (int i = 0; i < n; i++) {
        images += cs[i].verdict == SVC_IMAGE;
        if (cs[i].fd >= 0)
            close(cs[i].fd), cs[i].fd = -1;
        if (cs[i].verdict == SVC_PENDING)
            snprintf(cs[i].why, sizeof cs[i].why, "no answer");
    }
    return images;
}

const svc_client *svc_series_bad(const svc_client *cs, int n, int allow_503)
{
    for (int i = 0; i < n; i++)
        if (cs[i].verdict != SVC_IMAGE && !(allow_503 && cs[i].verdict == SVC_UNAVAILABLE))
            return &cs[i];
    return NULL;
}

int svc_clients_wait(svc_client *cs, int n, int timeout_ms)
{
    double until = kiln_now_ms() + timeout_ms;
    int pending;
    do {
        pending = 0;
        for (int i = 0; i < n; i++)
            pending += svc_client_poll(&cs[i], 10) == SVC_PENDING;
    } while (pending && kiln_now_ms() < until);
    return pending;
}

/* ---- a replica on the bus ---- */

int svc_fake_send(svc_fake *f, kiln_msg *m)
{
    kiln_err err = {0};
    m->epoch = f->epoch;
    if (kiln_bus_send_msg(f->bus, NULL, m, &err) == KILN_OK)
        return 0;
    fprintf(stderr, "%s: %s\n", f->id, err.msg);
    return -1;
}

/* Loads the replica keys of the `kiln serve` svc_serve started (its key
 * folder under our tmpdir); 0 when there is none. */
static int serve_keys(kiln_bus_keys *k, kiln_err *err)
{
    DIR *d = opendir(svc.tmpdir);
    if (!d)
        return 0;
    int found = 0;
    for (struct dirent *e; !found && (e = readdir(d));) {
        if (strncmp(e->d_name, "kiln-serve-", 11))
            continue;
        char key[PATH_MAX], pub[PATH_MAX];
        snprintf(key, sizeof key, "%s/%s/replica.key", svc.tmpdir, e->d_name);
        snprintf(pub, sizeof pub, "%s/%s/gateway.pub", svc.tmpdir, e->d_name);
        found = !kiln_bus_keys_load_secret(k, key, err) && !kiln_bus_keys_load_server(k, pub, err)
                    ? 1
                    : -1;
    }
    closedir(d);
    return found;
}

int svc_fake_open(svc_fake *f, const char *endpoint, const char *id, uint64_t epoch)
{
    memset(f, 0, sizeof *f);
    snprintf(f->id, sizeof f->id, "%s", id);
    f->epoch = epoch;
    kiln_err err = {0};
    kiln_bus_keys keys = {0};
    int keyed = serve_keys(&keys, &err);
    f->bus = keyed >= 0 ? kiln_bus_connect(endpoint, id, keyed ? &keys : NULL, &err) : NULL;
    kiln_bus_keys_free(&keys);
    if (!f->bus)
        fprintf(stderr, "%s: %s\n", id, err.msg);
    return f->bus ? 0 : -1;
}

void svc_fake_hello(svc_fake *f, kiln_stage stage, int credits)
{
    /* Where the real replicas of the test are: it looks like one of them. */
    kiln_domain here;
    kiln_err err = {0};
    if (kiln_domain_probe(&here, &err))
        fprintf(stderr, "%s: %s\n", f->id, err.msg);
    /* ... serving the same model, with its traits (engine/family.h), as
     * the gateway refuses a replica announcing others. */
    kiln_checkpoint *ck = kiln_checkpoint_open(svc.model, &err);
    if (!ck)
        fprintf(stderr, "%s: %s\n", f->id, err.msg);
    kiln_msg m = {.type = KILN_MSG_HELLO,
                  .hello = {.stage = stage, .replica = f->id, .model = "klein-tiny",
                            .host = "mallory", .max_batch = 4,
                            .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM), .domain = here}};
    if (ck)
        m.hello.traits = kiln_model_traits_of(ck);
    kiln_checkpoint_close(ck);
    svc_fake_send(f, &m);
    if (credits) {
        m = (kiln_msg){.type = KILN_MSG_READY, .ready.credits = credits};
        svc_fake_send(f, &m);
    }
}

void svc_fake_pump(svc_fake *f, int ms)
{
    double until = kiln_now_ms() + ms;
    kiln_buf frame = {0};
    do {
        kiln_err err = {0};
        if (!f->fenced && kiln_now_ms() >= f->next_hb) {
            kiln_msg hb = {.type = KILN_MSG_HB};
            svc_fake_send(f, &hb);
            f->next_hb = kiln_now_ms() + 250;
        }
        kiln_bus_wait(f->bus, -1, 10, &err);
        while (kiln_bus_recv(f->bus, NULL, 0, &frame, &err) > 0) {
            kiln_msg *m = kiln_msg_decode(frame.data, frame.len, &err);
            if (m && m->type == KILN_MSG_JOB && f->n_jobs < 16) {
                f->jobs[f->n_jobs++] = m;
                continue;
            }
            if (m && m->type == KILN_MSG_FENCED && m->epoch == f->epoch)
                f->fenced = 1;
            if (m && m->type == KILN_MSG_CANCEL)
                f->cancels++;
            kiln_msg_free(m);
        }
    } while (kiln_now_ms() < until);
    kiln_buf_free(&frame);
}

void svc_fake_release(svc_fake *f, const kiln_ref_map *in)
{
    kiln_msg *m = calloc(1, sizeof *m);
    if (!m)
        return;
    m->type = KILN_MSG_RELEASE;
    for (int i = 0; i < in->n; i++)
        if (in->items[i].ref.kind == KILN_REF_SHM)
            m->refs.refs[m->refs.n++] = in->items[i].ref;
    if (m->refs.n)
        svc_fake_send(f, m);
    free(m);
}

void svc_fake_close(svc_fake *f)
{
    for (int i = 0; i < f->n_jobs; i++)
        kiln_msg_free(f->jobs[i]);
    kiln_bus_close(f->bus);
    f->bus = NULL;
}

/* ---- the CLI ---- */

int svc_cli(const char *cmd, const char *const *args, const char *out)
{
    const char *argv[64];
    int n = 0;
    argv[n++] = svc_exe("tools/kiln");
    argv[n++] = cmd;
    argv[n++] = "--model";
    argv[n++] = svc.model;
    argv[n++] = "--text-encoder-out-layers";
    argv[n++] = "1,2,3";
    argv[n++] = "--no-metadata"; /* the service's PNGs carry no text chunks */
    argv[n++] = "--out";
    argv[n++] = out;
    for (int i = 0; args[i] && n < 63; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = svc_spawn(argv, NULL, svc_tmp("cli.log"));
    return pid < 0 ? -1 : svc_wait_exit(pid, SVC_T_REQ);
}

int svc_same_file(const char *path, const kiln_buf *data)
{
    kiln_buf f = {0};
    int same = svc_read_file(path, &f) == 0 && f.len == data->len && f.len &&
               !memcmp(f.data, data->data, f.len);
    kiln_buf_free(&f);
    return same;
}

/* ---- processes ---- */

long svc_proc_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%ld/status", (long)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long v = -1;
    size_t fl = strlen(field);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, fl) && line[fl] == ':') {
            v = strtol(line + fl + 1, NULL, 10);
            break;
        }
    fclose(f);
    return v;
}

/* Counts (or unlinks, when `unlink_them`) /dev/shm/kiln-* holding `part`. */
static int shm_scan(const char *part, int unlink_them)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, "kiln-", 5) || !strstr(e->d_name, part))
            continue;
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name);
        n += !unlink_them || !shm_unlink(name);
    }
    closedir(d);
    return n;
}

int svc_shm_slabs(pid_t pid)
{
    char mid[32];
    snprintf(mid, sizeof mid, "-%ld-", (long)pid);
    return shm_scan(mid, 0);
}

int svc_shm_slabs_with(const char *part) { return shm_scan(part, 0); }

int svc_shm_unlink_of(pid_t pid)
{
    char mid[32];
    snprintf(mid, sizeof mid, "-%ld-", (long)pid);
    return shm_scan(mid, 1);
}

int svc_namespaces_required(void)
{
    const char *v = getenv("KILN_REQUIRE_NAMESPACES");
    return v && !strcmp(v, "1");
}

int svc_children(pid_t parent, const char *comm, pid_t *out, int max)
{
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < max;) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0)
            continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[len] = '\0';
        /* pid (comm) state ppid ...: comm may hold spaces, so from the
         * last ')'. */
        char *open = strchr(buf, '('), *close = strrchr(buf, ')');
        if (!open || !close || close < open)
            continue;
        char state;
        long ppid;
        if (sscanf(close + 1, " %c %ld", &state, &ppid) != 2 || ppid != (long)parent ||
            state == 'Z')
            continue;
        *close = '\0';
        if (!strcmp(open + 1, comm))
            out[n++] = (pid_t)pid;
    }
    closedir(d);
    return n;
}
