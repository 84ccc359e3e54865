/* Liveness on progress, and a gateway that stalls (docs/ARCHITECTURE.md,
 * "Fencing"): `kiln serve` with two denoisers on the tiny klein checkpoint
 * (CPU backend), --progress-timeout-s 15 (a step of these tests takes well
 * under a second, but a loaded CI machine under sanitizers stretches it
 * many times), under traffic:
 * - one denoiser's backend thread stops for good at its 3rd step
 *   (KILN_FAULT_INJECT=denoise:stall_after_steps=3, claimed by one
 *   process only) while its bus thread goes on heartbeating: the gateway
 *   fences it for making no progress with work, its jobs run again on the
 *   other, it exits with 75 although its backend thread never returns, and
 *   kiln serve restarts it (not faulty this time);
 * - the gateway is paused (SIGSTOP) for 8 s with requests in flight:
 *   nobody is fenced for the silence it caused, every request completes.
 * Every 200 is byte-identical to `kiln generate` for that request, any
 * other answer a 503 OpenAI error; every worker ends with no range in use. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define STEPS "6"
#define STALL_SEED 1300
#define PAUSE_SEED 1400
#define N_REQ 4
#define GATEWAY_PAUSE_MS 8000
/* From the stall to both denoisers serving again: no progress for 15 s,
 * the halt's 10 s exit bound, 250 ms before the restart, a model load;
 * with room for a loaded CI machine under sanitizers. */
#define HEALED_MS 90000

static pid_t serve = -1;
static int port;
static char fault_env[300];

static double metric_now(const char *prefix)
{
    kiln_buf m = {0};
    double v = svc_metrics(port, &m) == 0 ? svc_metric((const char *)m.data, prefix) : -1;
    kiln_buf_free(&m);
    return v;
}

/* Requests first..first+n-1 of series `name` at once; every answer the
 * CLI's image, or a 503 OpenAI error when `allow_503`.  The images. */
static int series(const char *name, int base, int first, int n, int allow_503)
{
    svc_client cs[16];
    int images = svc_series_run(port, name, base, first, n, STEPS, cs);
    const svc_client *bad = svc_series_bad(cs, n, allow_503);
    CHECKF(!bad, "%s: %s", bad ? bad->ref : "", bad ? bad->why : "");
    return images;
}

static int start_serve(void)
{
    snprintf(fault_env, sizeof fault_env,
             "KILN_FAULT_INJECT=denoise:stall_after_steps=3,once=%s", svc_tmp("stall-claim"));
    const char *env[] = {"KILN_LOG=debug", "OMP_NUM_THREADS=1", fault_env, NULL};
    const char *extra[] = {"--progress-timeout-s", "15", NULL};
    serve = svc_serve(2, extra, env, &port);
    return serve > 0 ? 0 : -1;
}

static void test_stalled_backend(void)
{
    const char *log = svc_tmp("serve.log");
    double t0 = kiln_now_ms();
    int images = series("stall", STALL_SEED, 0, N_REQ, 0);
    CHECK(images == N_REQ);
    CHECKF(svc_log_count(log, "KILN_FAULT_INJECT: backend thread stalled at step 3") == 1,
           "no denoiser stalled (the fault was not injected)");
    CHECKF(svc_log_count(log, "made no progress for") >= 1,
           "the gateway did not fence the stalled denoiser");
    CHECKF(svc_wait_log(log, "exited with status 75", 1, HEALED_MS) == 0,
           "the stalled denoiser did not exit with 75");
    double v;
    CHECKF(svc_wait_metric(port, "kiln_replicas{stage=\"denoise\"}", 2, HEALED_MS, &v) == 0 &&
               svc_wait_ready(port, 1000) == 0,
           "%g denoisers live after the stall", v);
    double healed = kiln_now_ms() - t0;
    CHECK(series("stall", STALL_SEED, N_REQ, N_REQ, 0) == N_REQ);
    KILN_LOG_INFO("stalls: a stalled denoiser fenced and replaced; %d + %d images; both denoisers "
                  "ready %.1f s after the traffic began", images, N_REQ, healed / 1000);
}

static void test_gateway_pause(void)
{
    pid_t gw = -1;
    CHECK(svc_children(serve, "kiln-gateway", &gw, 1) == 1);
    double lost = metric_now("kiln_events_total{event=\"replica_lost\"}");
    svc_client cs[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        char json[256], ref[64];
        svc_series_json(json, sizeof json, "pause", PAUSE_SEED, i, STEPS);
        snprintf(ref, sizeof ref, "pause-%d.png", i);
        svc_client_send(&cs[i], port, json, ref);
    }
    svc_sleep_ms(300); /* under way */
    kill(gw, SIGSTOP);
    svc_sleep_ms(GATEWAY_PAUSE_MS);
    kill(gw, SIGCONT);
    svc_clients_wait(cs, N_REQ, SVC_T_REQ);
    const svc_client *bad = svc_series_bad(cs, N_REQ, 0);
    CHECKF(!bad, "%s: %s", bad ? bad->ref : "", bad ? bad->why : "");
    for (int i = 0; i < N_REQ; i++)
        if (cs[i].fd >= 0)
            close(cs[i].fd);
    CHECKF(metric_now("kiln_events_total{event=\"replica_lost\"}") == lost,
           "the gateway fenced replicas for its own stall");
    CHECKF(svc_log_count(svc_tmp("serve.log"), "nobody is judged on it") >= 1,
           "the gateway did not notice its own late tick");
    char last[128];
    CHECKF(svc_wait_idle(port, 30000, last, sizeof last) == 0, "jobs left: %s", last);
    CHECK(svc_get_status(port, "/readyz") == 200);
}

int main(void)
{
    if (svc_init("stalls"))
        return 1;
    if (svc_cli_series("stall", STALL_SEED, 2 * N_REQ, STEPS) ||
        svc_cli_series("pause", PAUSE_SEED, N_REQ, STEPS) || start_serve()) {
        fprintf(stderr, "kiln generate or kiln serve failed (logs in %s)\n", svc.tmpdir);
        svc_stop(serve, 60000);
        svc_cleanup(1);
        return 1;
    }
    RUN(test_stalled_backend);
    RUN(test_gateway_pause);
    CHECKF(svc_stop(serve, 60000) == 0, "kiln serve did not stop cleanly");
    /* Every worker that exited reported no job held and no range in use;
     * the stalled one, ended from its bus thread, reports nothing. */
    char bad[512];
    int reports = svc_exit_reports(svc_tmp("serve.log"), bad, sizeof bad);
    CHECKF(!bad[0], "a worker held something at exit: %s", bad);
    CHECKF(reports >= 4, "%d at-exit reports", reports);
    int rc = test_finish();
    svc_cleanup(rc != 0);
    return rc;
}
