/* Device faults heal, and 5xx answers name the request and nothing else
 * (docs/ARCHITECTURE.md, "Fencing"; docs/API.md), on the tiny klein
 * checkpoint (CPU backend), with `kiln serve` and two denoisers:
 * - one denoiser's backend is lost at its 3rd step
 *   (KILN_FAULT_INJECT=denoise:device_lost_after_steps=3, claimed by one
 *   process only), as after a sticky CUDA error: it says bye, answers
 *   nothing, exits with 75 and is restarted; its jobs run again on the
 *   other, and every client gets its image, not a 500;
 * - a stage answering a job with an internal error (a replica on the bus
 *   driven from here, whose message names a path): the client gets a 500
 *   saying "internal error" and the request id of its X-Request-Id header,
 *   and the gateway's log holds the detail under that id;
 * - every denoiser's backend lost at its first step: a request fails on
 *   one, runs again on the other, fails again, and ends in a 503 naming
 *   its request id.
 * - the real device fault (illegal_address_after_steps) is refused on the
 *   CPU backend with a message saying why (tools/gpu/check.sh devicefault
 *   runs it on a GPU).
 * Every 200 is byte-identical to `kiln generate` for that request. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define STEPS "6"
#define LOST_SEED 1500
#define N_REQ 4
/* From the traffic's start to both denoisers serving again: a few steps,
 * the faulted one's drain (<= 5 s) and exit, 250 ms, a model load; with
 * room for a loaded CI machine under sanitizers. */
#define HEALED_MS 90000

static pid_t serve = -1;
static int port;
static char env_fault[300];

static int series(const char *name, int base, int first, int n)
{
    svc_client cs[16];
    int images = svc_series_run(port, name, base, first, n, STEPS, cs);
    const svc_client *bad = svc_series_bad(cs, n, 0);
    CHECKF(!bad, "%s: %s", bad ? bad->ref : "", bad ? bad->why : "");
    return images;
}

static pid_t start(const char *fault)
{
    snprintf(env_fault, sizeof env_fault, "KILN_FAULT_INJECT=%s", fault);
    const char *env[] = {"KILN_LOG=debug", "OMP_NUM_THREADS=1", env_fault, NULL};
    return svc_serve(2, NULL, env, &port);
}

static void test_device_lost_heals(void)
{
    const char *log = svc_tmp("serve.log");
    double t0 = kiln_now_ms();
    CHECK(series("lost", LOST_SEED, 0, N_REQ) == N_REQ);
    CHECKF(svc_log_count(log, "device lost: KILN_FAULT_INJECT at step 3") >= 1,
           "no denoiser lost its device (the fault was not injected)");
    CHECKF(svc_log_count(log, "said bye (") >= 1, "the faulted denoiser did not say bye");
    CHECKF(svc_wait_log(log, "exited with status 75", 1, HEALED_MS) == 0,
           "the faulted denoiser did not exit with 75");
    double v;
    CHECKF(svc_wait_metric(port, "kiln_replicas{stage=\"denoise\"}", 2, HEALED_MS, &v) == 0 &&
               svc_wait_ready(port, 1000) == 0,
           "%g denoisers live after the fault", v);
    double healed = kiln_now_ms() - t0;
    CHECK(series("lost", LOST_SEED, N_REQ, N_REQ) == N_REQ);
    kiln_buf m = {0};
    CHECK(svc_metrics(port, &m) == 0);
    CHECKF(svc_metric((const char *)m.data, "kiln_http_requests_total{route=\"/v1/images/generations\",status=\"500\"}") == 0,
           "a client got a 500");
    kiln_buf_free(&m);
    KILN_LOG_INFO("device: a denoiser lost its device; %d images, none lost; both ready %.1f s "
                  "after the traffic began", 2 * N_REQ, healed / 1000);
}

/* The id in a 5xx message "... (request req_...)", or "". */
static void message_id(const gwc_response *r, char *id, size_t cap)
{
    const char *at = r->body.data ? memmem(r->body.data, r->body.len, "(request ", 9) : NULL;
    id[0] = '\0';
    if (at)
        sscanf(at + 9, "%23[a-z0-9_]", id);
    (void)cap;
}

static void test_internal_error(void)
{
    char bus[160];
    snprintf(bus, sizeof bus, "ipc://%s/bus", svc.tmpdir);
    svc_fake dec;
    if (svc_fake_open(&dec, bus, "decode-broken-1", 0x6272306b656e3031ull))
        return;
    svc_fake_hello(&dec, KILN_STAGE_DECODE, 100); /* it takes the next decode job */
    svc_fake_pump(&dec, 300);
    char json[256];
    svc_series_json(json, sizeof json, "lost", LOST_SEED, 0, STEPS);
    kiln_buf wire = {0};
    gwc_format(&wire, "POST", "/v1/images/generations", "application/json", json, strlen(json), 0);
    int fd = gwc_connect(port);
    CHECK(fd >= 0 && gwc_send(fd, wire.data, wire.len, 5000) == 0);
    kiln_buf_free(&wire);
    double until = kiln_now_ms() + SVC_T_REQ;
    while (!dec.n_jobs && kiln_now_ms() < until)
        svc_fake_pump(&dec, 20);
    CHECKF(dec.n_jobs == 1, "the broken decoder got no job");
    if (dec.n_jobs) {
        kiln_msg *d = calloc(1, sizeof *d);
        d->type = KILN_MSG_DONE;
        d->done = (kiln_msg_done){.job = dec.jobs[0]->job.job, .ok = 0, .code = KILN_ERR_INTERNAL,
                                  .message = "vae: cudaStreamSynchronize(upload) in /opt/kiln/x.cu"};
        svc_fake_send(&dec, d);
        free(d);
    }
    kiln_buf in = {0};
    gwc_response r = {0};
    CHECK(fd >= 0 && gwc_read_response(fd, &in, &r, SVC_T_REQ) == 0);
    char header_id[64] = "", body_id[32], why[256] = "";
    gwc_header(&r, "X-Request-Id", header_id, sizeof header_id);
    message_id(&r, body_id, sizeof body_id);
    CHECKF(r.status == 500 && svc_error_body(&r, "server_error", why, sizeof why) == 0, "%d %s",
           r.status, why);
    CHECKF(r.body.data && memmem(r.body.data, r.body.len, "internal error (request ", 24) &&
               !memmem(r.body.data, r.body.len, "cuda", 4) &&
               !memmem(r.body.data, r.body.len, "/opt", 4),
           "500 body: %.*s", (int)r.body.len, r.body.data ? (char *)r.body.data : "");
    CHECKF(header_id[0] && !strcmp(header_id, body_id), "X-Request-Id %s, message names %s",
           header_id, body_id);
    char detail[128];
    snprintf(detail, sizeof detail, "request %s (job", header_id);
    CHECKF(svc_log_count(svc_tmp("serve.log"), detail) >= 1 &&
               svc_log_count(svc_tmp("serve.log"), "cudaStreamSynchronize(upload) in /opt") >= 1,
           "the log does not hold the detail under %s", header_id);
    gwc_response_free(&r);
    kiln_buf_free(&in);
    if (fd >= 0)
        close(fd);
    svc_fake_close(&dec); /* silent from now: fenced within the heartbeat timeout */
    double v;
    CHECK(svc_wait_metric(port, "kiln_replicas{stage=\"decode\"}", 1, 30000, &v) == 0);
    CHECK(series("lost", LOST_SEED, 1, 1) == 1);
}

static void test_fault_every_retry(void)
{
    char json[256];
    svc_series_json(json, sizeof json, "lost", LOST_SEED, 0, STEPS);
    gwc_response r;
    CHECK(svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0);
    char header_id[64] = "", body_id[32], why[256] = "";
    gwc_header(&r, "X-Request-Id", header_id, sizeof header_id);
    message_id(&r, body_id, sizeof body_id);
    CHECKF(r.status == 503 && svc_error_body(&r, "stage_unavailable", why, sizeof why) == 0,
           "status %d %s: %.*s", r.status, why, (int)r.body.len,
           r.body.data ? (char *)r.body.data : "");
    CHECKF(header_id[0] && !strcmp(header_id, body_id), "X-Request-Id %s, message names %s",
           header_id, body_id);
    gwc_response_free(&r);
    CHECK(svc_log_count(svc_tmp("serve.log"), "said bye (") >= 2);
}

/* A CPU replica refuses the CUDA-only fault at start (exit 2: a bad
 * option, not to be restarted), naming it. */
static void test_illegal_address_refused_on_cpu(void)
{
    char bus[160];
    snprintf(bus, sizeof bus, "ipc://%s/bus-cpu", svc.tmpdir);
    const char *env[] = {"KILN_FAULT_INJECT=denoise:illegal_address_after_steps=3", NULL};
    pid_t pid = svc_spawn_service("denoiser", bus, NULL, env);
    CHECK(pid > 0);
    int st = pid > 0 ? svc_wait_exit(pid, 60000) : -1;
    CHECKF(st == 2, "kiln-denoiser exit status %d", st);
    CHECKF(svc_log_count(svc_tmp("denoiser.log"),
                         "illegal_address_after_steps needs the CUDA backend") == 1,
           "no message about the CUDA-only fault");
}

int main(void)
{
    if (svc_init("device"))
        return 1;
    RUN(test_illegal_address_refused_on_cpu);
    char once[320];
    snprintf(once, sizeof once, "denoise:device_lost_after_steps=3,once=%s", svc_tmp("lost-claim"));
    if (svc_cli_series("lost", LOST_SEED, 2 * N_REQ, STEPS) || (serve = start(once)) < 0) {
        fprintf(stderr, "kiln generate or kiln serve failed (logs in %s)\n", svc.tmpdir);
        svc_stop(serve, 60000);
        svc_cleanup(1);
        return 1;
    }
    RUN(test_device_lost_heals);
    RUN(test_internal_error);
    CHECKF(svc_stop(serve, 60000) == 0, "kiln serve did not stop cleanly");
    /* Every worker that exited, the one whose device was lost included,
     * reported no job held and no range in use. */
    char bad[512];
    int reports = svc_exit_reports(svc_tmp("serve.log"), bad, sizeof bad);
    CHECKF(!bad[0], "a worker held something at exit: %s", bad);
    CHECKF(reports >= 5, "%d at-exit reports (want the 4 workers and the restarted one)", reports);
    /* Every denoiser faulty: a second service. */
    rename(svc_tmp("serve.log"), svc_tmp("serve-1.log"));
    serve = start("denoise:device_lost_after_steps=1");
    CHECKF(serve > 0, "the second service did not come up");
    if (serve > 0) {
        RUN(test_fault_every_retry);
        CHECKF(svc_stop(serve, 60000) == 0, "kiln serve did not stop cleanly");
    }
    int rc = test_finish();
    svc_cleanup(rc != 0);
    return rc;
}
