/* Admission and input limits end to end (docs/API.md):
 * kiln-gateway and one replica of each stage on the tiny checkpoint.  Each
 * scenario first measures a well-behaved client alone (small generations,
 * one after another: its baseline latency), then lets an abusive client
 * try one limit while the well-behaved client keeps going, and checks
 * both that the limit holds and that every well-behaved request succeeded
 * within its normal latency (a bound relative to the baseline of the same
 * run, so a loaded CI machine moves both).
 * - strict HTTP/1.1 framing: every refused entry of the smuggling corpus
 *   (tests/fuzz/http_corpus) sent on its own connection gets its status
 *   (400, 501, 505) and the connection closes;
 * - body limits: a generation declaring more than a text request can need
 *   is 413 before its body is sent; JSON bodies past the node budget, with
 *   an escaped NUL or a raw control character are 400 naming the field,
 *   and the gateway's peak memory stays far below what parsing them would
 *   have cost. */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define GOOD_AUTH "Authorization: Bearer well-behaved\r\n"

static pid_t procs[4]; /* gateway, encoder, denoiser, decoder */
static const char *names[4] = {"gateway", "encoder", "denoiser", "decoder"};
static int port;

/* ---- the well-behaved client ---- */

static const char good_json[] = "{\"prompt\":\"a well-behaved request\",\"size\":\"64x64\","
                                "\"num_inference_steps\":1,\"max_sequence_length\":32,\"seed\":7}";

/* One small generation; its latency in ms, or -1 when it failed. */
static double good_request(void)
{
    gwc_response r;
    double t0 = kiln_now_ms();
    int rc = gwc_request_h(port, "POST", "/v1/images/generations", "application/json", GOOD_AUTH,
                           good_json, sizeof good_json - 1, &r, SVC_T_REQ);
    double ms = kiln_now_ms() - t0;
    int ok = rc == 0 && r.status == 200;
    if (!ok)
        fprintf(stderr, "well-behaved request: rc %d, status %d: %.200s\n", rc, r.status,
                r.body.data ? (const char *)r.body.data : "");
    gwc_response_free(&r);
    return ok ? ms : -1;
}

/* The median of three requests alone. */
static double baseline(void)
{
    double v[3];
    for (int i = 0; i < 3; i++)
        v[i] = good_request();
    for (int i = 0; i < 3; i++)
        for (int k = i + 1; k < 3; k++)
            if (v[k] < v[i]) {
                double t = v[i];
                v[i] = v[k], v[k] = t;
            }
    return v[0] < 0 ? -1 : v[1];
}

typedef struct good_client {
    pthread_t thread;
    atomic_int stop;
    int n, failed;
    double worst_ms;
} good_client;

static void *good_loop(void *arg)
{
    good_client *g = arg;
    /* At least two requests, so one overlaps the abuse whatever its pace. */
    while (!atomic_load(&g->stop) || g->n < 2) {
        double ms = good_request();
        g->n++;
        if (ms < 0)
            g->failed++;
        else if (ms > g->worst_ms)
            g->worst_ms = ms;
    }
    return NULL;
}

static void good_start(good_client *g)
{
    memset(g, 0, sizeof *g);
    if (pthread_create(&g->thread, NULL, good_loop, g))
        abort();
}

/* Stops the well-behaved client and checks it was served normally: no
 * failure, and no request slower than a few times the baseline (plus
 * slack for a busy two-core machine). */
static void good_check(good_client *g, double base, const char *what)
{
    atomic_store(&g->stop, 1);
    pthread_join(g->thread, NULL);
    double bound = 3 * base + 2000;
    KILN_LOG_INFO("admission: %s: well-behaved client %d requests, worst %.0f ms (baseline %.0f, "
                  "bound %.0f)", what, g->n, g->worst_ms, base, bound);
    CHECKF(g->failed == 0, "%s: %d of %d well-behaved requests failed", what, g->failed, g->n);
    CHECKF(g->worst_ms <= bound, "%s: a well-behaved request took %.0f ms (baseline %.0f ms)",
           what, g->worst_ms, base);
}

/* ---- strict HTTP framing ---- */

/* Sends raw bytes on a new connection; the status of the answer (-1 when
 * none came), and whether the gateway then closed the connection. */
static int raw_exchange(const void *data, size_t len, int *closed)
{
    int fd = gwc_connect(port);
    if (fd < 0)
        return -1;
    gwc_response r = {0};
    kiln_buf in = {0};
    int st = gwc_send(fd, data, len, 5000) == 0 && gwc_read_response(fd, &in, &r, 10000) == 0
                 ? r.status
                 : -1;
    *closed = gwc_wait_closed(fd, 5000);
    gwc_response_free(&r);
    kiln_buf_free(&in);
    close(fd);
    return st;
}

static void test_strict_framing(void)
{
    double base = baseline();
    CHECK(base > 0);
    good_client g;
    good_start(&g);
    const char *src = getenv("KILN_SOURCE_ROOT");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tests/fuzz/http_corpus", src ? src : ".");
    int sent = 0;
    for (int round = 0; round < 2; round++) {
        DIR *d = opendir(dir);
        CHECKF(d != NULL, "cannot open %s", dir);
        if (!d)
            break;
        struct dirent *e;
        while ((e = readdir(d))) {
            int want;
            /* r0_<status>_<what>.http: refused before any request. */
            if (sscanf(e->d_name, "r0_%d_", &want) != 1)
                continue;
            char path[1024];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            kiln_buf data = {0};
            CHECK(svc_read_file(path, &data) == 0);
            int closed = 0;
            int st = raw_exchange(data.data, data.len, &closed);
            CHECKF(st == want && closed, "%s: status %d (want %d), closed %d", e->d_name, st, want,
                   closed);
            kiln_buf_free(&data);
            sent++;
        }
        closedir(d);
    }
    CHECKF(sent >= 120, "only %d corpus entries sent", sent);
    good_check(&g, base, "smuggling corpus");
}

/* ---- body limits ---- */

/* The gateway's peak resident memory since the last reset, in kB. */
static long gateway_peak_kb(int reset)
{
    if (reset) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%ld/clear_refs", (long)procs[0]);
        int fd = open(path, O_WRONLY);
        if (fd < 0 || write(fd, "5", 1) != 1) /* resets VmHWM */
            fprintf(stderr, "cannot reset the gateway's peak RSS\n");
        if (fd >= 0)
            close(fd);
    }
    return svc_proc_kb(procs[0], "VmHWM");
}

typedef struct junk_post {
    pthread_t thread;
    size_t values;
    int status;
    char param[64];
} junk_post;

/* An edit whose ignored field "junk" holds `values` numbers: cheap to send,
 * about 64 bytes of cJSON tree per two bytes of body if it were parsed. */
static void *junk_run(void *arg)
{
    junk_post *j = arg;
    kiln_buf body = {0};
    kiln_buf_append(&body, "{\"prompt\":\"x\",\"image\":\"aGk=\",\"junk\":[", 37, NULL);
    kiln_buf_reserve(&body, 2 * j->values + 4, NULL);
    for (size_t i = 0; i < j->values; i++)
        kiln_buf_append(&body, i ? ",1" : "1", i ? 2 : 1, NULL);
    kiln_buf_append(&body, "]}", 2, NULL);
    gwc_response r;
    j->status = gwc_request(port, "POST", "/v1/images/edits", "application/json", body.data,
                            body.len, &r, 60000)
                    ? -1
                    : r.status;
    const char *p = r.body.data ? strstr((const char *)r.body.data, "\"param\":\"") : NULL;
    snprintf(j->param, sizeof j->param, "%.*s", p ? (int)strcspn(p + 9, "\"") : 0, p ? p + 9 : "");
    gwc_response_free(&r);
    kiln_buf_free(&body);
    return NULL;
}

static void test_body_limits(void)
{
    double base = baseline();
    CHECK(base > 0);
    good_client g;
    good_start(&g);

    /* A generation declaring 60 MiB: refused from its head alone. */
    int fd = gwc_connect(port);
    const char head[] = "POST /v1/images/generations HTTP/1.1\r\nHost: a\r\n"
                        "Content-Type: application/json\r\nContent-Length: 62914560\r\n\r\n";
    gwc_response r = {0};
    kiln_buf in = {0};
    CHECK(gwc_send(fd, head, sizeof head - 1, 5000) == 0 &&
          gwc_read_response(fd, &in, &r, 10000) == 0);
    CHECKF(r.status == 413 && r.body.data && strstr((const char *)r.body.data, "at most"),
           "60 MiB generation: status %d", r.status);
    gwc_response_free(&r);
    kiln_buf_free(&in);
    close(fd);

    /* Four edits at once, each with 3 million ignored JSON values (6 MiB):
     * parsed, that would be ~190 MiB of cJSON tree each. */
    long before = gateway_peak_kb(1);
    junk_post j[4];
    for (int i = 0; i < 4; i++) {
        memset(&j[i], 0, sizeof j[i]);
        j[i].values = 3u << 20;
        CHECK(pthread_create(&j[i].thread, NULL, junk_run, &j[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(j[i].thread, NULL);
        CHECKF(j[i].status == 400 && strcmp(j[i].param, "junk") == 0,
               "junk edit %d: status %d, param '%s'", i, j[i].status, j[i].param);
    }
    long peak = gateway_peak_kb(0);
    KILN_LOG_INFO("admission: gateway peak RSS %ld kB before, %ld kB with 4 x 6 MiB JSON bodies",
                  before, peak);
    CHECKF(before > 0 && peak - before < 160 * 1024, "the gateway's peak RSS grew by %ld kB",
           peak - before);

    /* NUL and raw control characters in strings, named. */
    static const struct {
        const char *json, *param;
    } bad[] = {
        {"{\"prompt\":\"a\\u0000b\",\"size\":\"64x64\"}", "prompt"},
        {"{\"prompt\":\"a\x01z\",\"size\":\"64x64\"}", "prompt"},
        {"{\"prompt\":\"a\",\"negative_prompt\":\"\\u0000\"}", "negative_prompt"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char want[64];
        snprintf(want, sizeof want, "\"param\":\"%s\"", bad[i].param);
        CHECK(svc_post_json(port, "/v1/images/generations", bad[i].json, &r, 30000) == 0);
        CHECKF(r.status == 400 && r.body.data && strstr((const char *)r.body.data, want),
               "case %zu: status %d: %.200s", i, r.status, r.body.data ? (char *)r.body.data : "");
        gwc_response_free(&r);
    }
    good_check(&g, base, "body limits");
}

/* ---- set-up ---- */

static int start(void)
{
    const char *const env[] = {"OMP_NUM_THREADS=1", NULL};
    const char *const gw[] = {"--max-size", "256", NULL};
    if ((port = svc_start_service(gw, env, procs)) < 0)
        return -1;
    /* The first request warms the replicas up; it is not a baseline. */
    return good_request() < 0 ? -1 : 0;
}

int main(void)
{
    if (svc_init("admission"))
        return 1;
    if (start()) {
        fprintf(stderr, "the service did not come up (logs in %s)\n", svc.tmpdir);
        for (int i = 0; i < 4; i++)
            svc_stop(procs[i], 30000);
        svc_cleanup(1);
        return 1;
    }
    RUN(test_strict_framing);
    RUN(test_body_limits);
    for (int i = 3; i >= 0; i--) {
        int st = svc_stop(procs[i], 30000);
        CHECKF(st == 0, "%s exit status %d", names[i], st);
    }
    int rc = test_finish();
    svc_cleanup(rc != 0);
    return rc;
}
