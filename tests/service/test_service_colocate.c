/* Stages as threads of one process (kiln-stages, kiln serve --colocate),
 * on the tiny klein checkpoint (CPU backend):
 * - kiln-stages whose denoiser cannot load (a cut checkpoint) exits 78
 *   with none of its stages registered, though its decoder loaded.
 * - kiln-stages alone beside kiln-gateway: its three stages register as
 *   three replicas (--replica-id ID becomes ID-encode, ID-denoise,
 *   ID-decode), --data-port P is the encoder's and P + 1 the denoiser's,
 *   its one --health-port answers for all of them, a request
 *   gets exactly the CLI's image, and SIGTERM ends it with 0, every stage
 *   having left with nothing held and no slab left behind.
 * - kiln serve --colocate with two replicas of each stage, one stage of
 *   one process losing its device (KILN_FAULT_INJECT, once): the other
 *   two stages of that process halt with it, the process exits 75 and is
 *   restarted; every request in flight gets its image or a 503.  Then
 *   kiln serve runs two kiln-stages children and no single-stage ones,
 *   and serves every request with the CLI's image.
 * - One process is killed (SIGKILL) mid-batch, then one is stopped
 *   (SIGSTOP) past the heartbeat timeout and resumed: each time its three
 *   replicas are replaced, the requests in flight get their image or a
 *   503, and the next requests all get their image. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define STEPS "12"
#define SEED 700
#define N_ROUND 4
#define N_SERIES (2 * N_ROUND) /* two rounds of distinct requests, alternating */
#define HB_TIMEOUT_MS "3000"
#define PAUSE_MS 6000
/* From a process's end until its restart serves: the halted stages drain
 * (at most 5 s), kiln serve restarts it after 250 ms and its three stages
 * load.  Generous for a loaded 2-core CI machine under sanitizers. */
#define READY_AGAIN_MS 60000

static pid_t serve = -1;
static int port, round_no;

static void send_round(svc_client *cs)
{
    int first = (round_no++ % 2) * N_ROUND;
    for (int i = 0; i < N_ROUND; i++) {
        char json[256], ref[64];
        svc_series_json(json, sizeof json, "colo", SEED, first + i, STEPS);
        snprintf(ref, sizeof ref, "colo-%d.png", first + i);
        svc_client_send(&cs[i], port, json, ref);
    }
}

/* Waits for a round; each answer must be its image, or a 503 OpenAI
 * error where allowed.  The number of images. */
static int finish_round(svc_client *cs, int allow_503, const char *what)
{
    int pending = svc_clients_wait(cs, N_ROUND, SVC_T_REQ), images = 0;
    CHECKF(pending == 0, "%s: %d request(s) unanswered", what, pending);
    for (int i = 0; i < N_ROUND; i++) {
        int ok = cs[i].verdict == SVC_IMAGE || (allow_503 && cs[i].verdict == SVC_UNAVAILABLE);
        CHECKF(ok, "%s: %s: %s", what, cs[i].ref,
               cs[i].verdict == SVC_PENDING ? "no answer" : cs[i].why);
        images += cs[i].verdict == SVC_IMAGE;
        if (cs[i].fd >= 0)
            close(cs[i].fd);
        kiln_buf_free(&cs[i].in);
    }
    return images;
}

static void expect_full_round(const char *what)
{
    svc_client cs[N_ROUND];
    int images = finish_round((send_round(cs), cs), 0, what);
    CHECKF(images == N_ROUND, "%s: %d of %d images", what, images, N_ROUND);
}

static int stage_processes(pid_t *pids, int max)
{
    return svc_children(serve, "kiln-stages", pids, max);
}

/* Waits until kiln serve runs two kiln-stages children other than `gone`
 * and the gateway counts two replicas of each stage again. */
static void expect_replaced(pid_t gone, const char *what)
{
    double until = kiln_now_ms() + READY_AGAIN_MS, v = 0;
    pid_t kids[4];
    int n = 0;
    while (kiln_now_ms() < until) {
        n = stage_processes(kids, 4);
        if (n == 2 && kids[0] != gone && kids[1] != gone)
            break;
        svc_sleep_ms(100);
    }
    CHECKF(n == 2 && kids[0] != gone && kids[1] != gone, "%s: %d kiln-stages children, pid %ld "
           "among them", what, n, (long)gone);
    static const char *const stages[] = {"encode", "denoise", "decode"};
    for (int i = 0; i < 3; i++) {
        char m[64];
        snprintf(m, sizeof m, "kiln_replicas{stage=\"%s\"}", stages[i]);
        CHECKF(svc_wait_metric(port, m, 2, READY_AGAIN_MS, &v) == 0, "%s: %g %s replicas", what,
               v, stages[i]);
    }
}

/* ---- kiln-stages beside kiln-gateway ---- */

static void test_one_process(void)
{
    char bus[160], hp[16], dp[16], enc_ep[96], den_ep[96];
    snprintf(bus, sizeof bus, "ipc://%s/bus-direct", svc.tmpdir);
    snprintf(hp, sizeof hp, "%d", svc_free_port());
    int data_port = svc_free_port_pair();
    snprintf(dp, sizeof dp, "%d", data_port);
    snprintf(enc_ep, sizeof enc_ep, "kiln-encoder: serving by-value hand-offs at tcp://127.0.0.1:%d\n",
             data_port);
    snprintf(den_ep, sizeof den_ep, "kiln-denoiser: serving by-value hand-offs at tcp://127.0.0.1:%d\n",
             data_port + 1);
    const char *env[] = {"OMP_NUM_THREADS=1", NULL};
    pid_t gw = svc_spawn_service("gateway", bus, NULL, env);
    int gw_port = gw > 0 ? svc_log_port(svc_tmp("gateway.log"), 30000) : -1;
    /* First with a checkpoint whose transformer is cut short: the decoder
     * loads, the denoiser cannot (nor the encoder: the oracle's tokenizer
     * files point to data/ by relative paths, which a copy breaks), so
     * none registers and the process exits 78 (a configuration error, not
     * to be restarted). */
    char bad_model[160], cmd[2048];
    snprintf(bad_model, sizeof bad_model, "%s/bad-model", svc.tmpdir);
    snprintf(cmd, sizeof cmd, "cp -rL '%s' '%s' && truncate -s 1000 "
             "'%s/transformer/diffusion_pytorch_model.safetensors'", svc.model, bad_model, bad_model);
    CHECK(system(cmd) == 0);
    const char *bad_argv[] = {svc_exe("services/kiln-stages"), "--model", bad_model, "--bus", bus,
                              "--text-encoder-out-layers", "1,2,3", NULL};
    const char *bad_log = svc_tmp("stages-bad.log");
    pid_t broken = svc_spawn(bad_argv, env, bad_log);
    int bad_rc = svc_wait_exit(broken, 60000);
    CHECKF(bad_rc == 78, "kiln-stages with a broken transformer exited with %d (want 78)", bad_rc);
    CHECKF(svc_log_count(bad_log, "kiln-decoder: bad-model loaded") == 1 &&
               svc_log_count(bad_log, "kiln-denoiser: transformer:") == 1,
           "want the decoder loaded and the denoiser's load refused");
    CHECKF(svc_log_count(svc_tmp("gateway.log"), " registered (epoch") == 0,
           "a stage of the process whose denoiser could not load registered");
    const char *argv[] = {svc_exe("services/kiln-stages"), "--model", svc.model, "--bus", bus,
                          "--text-encoder-out-layers", "1,2,3", "--health-port", hp,
                          "--replica-id", "pod-7", "--drain-s", "10", "--data-port", dp,
                          "--data-host", "127.0.0.1", NULL};
    const char *log = svc_tmp("stages.log");
    pid_t st = svc_spawn(argv, env, log);
    CHECK(gw > 0 && gw_port > 0 && st > 0);
    if (gw <= 0 || gw_port <= 0 || st <= 0)
        goto out;
    CHECKF(svc_wait_ready(gw_port, 90000) == 0, "the gateway is not ready with kiln-stages alone");
    static const char *const ids[] = {"as pod-7-encode ", "as pod-7-denoise ", "as pod-7-decode "};
    for (int i = 0; i < 3; i++)
        CHECKF(svc_wait_log(log, ids[i], 1, 30000) == 0, "no stage registered %s", ids[i]);
    /* A fixed data port is the encoder's, the next one the denoiser's. */
    CHECKF(svc_log_count(log, enc_ep) == 1, "the encoder does not serve on --data-port %d",
           data_port);
    CHECKF(svc_log_count(log, den_ep) == 1, "the denoiser does not serve on --data-port + 1 (%d)",
           data_port + 1);
    CHECK(svc_get_status(atoi(hp), "/healthz") == 200);
    double until = kiln_now_ms() + 10000;
    while (svc_get_status(atoi(hp), "/readyz") != 200 && kiln_now_ms() < until)
        svc_sleep_ms(50);
    CHECKF(svc_get_status(atoi(hp), "/readyz") == 200, "the health port is not ready");

    char json[256];
    svc_series_json(json, sizeof json, "colo", SEED, 0, STEPS);
    gwc_response r;
    svc_images im;
    CHECK(svc_post_json(gw_port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0);
    CHECKF(svc_parse_images(&r, &im) == 0 && im.n == 1 &&
               svc_same_file(svc_tmp("colo-0.png"), &im.files[0]),
           "status %d, or not the CLI's image", r.status);
    svc_images_free(&im);
    gwc_response_free(&r);

    int rc = svc_stop(st, 60000);
    st = -1;
    CHECKF(rc == 0, "kiln-stages exited with %d after SIGTERM", rc);
    char bad[512];
    CHECKF(svc_exit_reports(log, bad, sizeof bad) == 3 && !bad[0],
           "want three clean at-exit reports: %s", bad);
    static const char *const stopped[] = {"pod-7-encode stopped", "pod-7-denoise stopped",
                                          "pod-7-decode stopped"};
    for (int i = 0; i < 3; i++)
        CHECKF(svc_log_count(log, stopped[i]) == 1, "no \"%s\"", stopped[i]);
out:
    if (st > 0)
        svc_stop(st, 30000);
    if (gw > 0)
        svc_stop(gw, 30000);
}

/* ---- kiln serve --colocate ---- */

static void test_colocated_serve(void)
{
    pid_t kids[4];
    CHECKF(stage_processes(kids, 4) == 2, "want two kiln-stages children");
    CHECK(svc_children(serve, "kiln-encoder", kids, 4) == 0 &&
          svc_children(serve, "kiln-denoiser", kids, 4) == 0 &&
          svc_children(serve, "kiln-decoder", kids, 4) == 0);
    expect_full_round("colocated");
    expect_full_round("colocated, the second round");
}

/* The KILN_FAULT_INJECT'ed denoiser of one process loses its device at
 * its first batch: its process halts whole and is restarted. */
static void test_device_lost(void)
{
    const char *log = svc_tmp("serve.log");
    /* Rounds until the faulty process got a denoise batch (the gateway
     * chooses the replica). */
    for (int tries = 0; tries < 4 && svc_log_count(log, "of its process halted") == 0; tries++) {
        svc_client cs[N_ROUND];
        send_round(cs);
        finish_round(cs, 1, "device lost");
    }
    CHECKF(svc_wait_log(log, "kiln-denoiser of its process halted", 2, 30000) == 0,
           "the encoder and decoder of the faulted process did not halt with it");
    CHECKF(svc_wait_log(log, "exited with status 75", 1, 30000) == 0,
           "the faulted process did not exit with 75");
    expect_replaced(-1, "after the lost device");
    expect_full_round("after the lost device");
}

static pid_t busy_process(size_t from)
{
    pid_t kids[4];
    int n = stage_processes(kids, 4);
    return svc_batch_started(svc_tmp("serve.log"), from, kids, n, 60000);
}

static void test_kill(void)
{
    svc_client cs[N_ROUND];
    size_t from = svc_log_size(svc_tmp("serve.log"));
    send_round(cs);
    pid_t victim = busy_process(from);
    CHECKF(victim > 0, "no process started a denoise batch");
    if (victim > 0)
        kill(victim, SIGKILL);
    finish_round(cs, 1, "SIGKILL");
    expect_replaced(victim, "after SIGKILL");
    expect_full_round("after SIGKILL");
}

static void test_pause(void)
{
    svc_client cs[N_ROUND];
    const char *log = svc_tmp("serve.log");
    size_t from = svc_log_size(log);
    send_round(cs);
    pid_t victim = busy_process(from);
    CHECKF(victim > 0, "no process started a denoise batch");
    if (victim <= 0)
        return;
    kill(victim, SIGSTOP);
    svc_sleep_ms(PAUSE_MS);
    kill(victim, SIGCONT);
    finish_round(cs, 1, "SIGSTOP");
    /* Resumed, its stages hear they were fenced; the process exits 75. */
    char exited[96];
    snprintf(exited, sizeof exited, "(pid %ld) exited with status 75", (long)victim);
    CHECKF(svc_wait_log(log, exited, 1, READY_AGAIN_MS) == 0,
           "the paused process did not exit with 75 once resumed");
    expect_replaced(victim, "after SIGSTOP");
    expect_full_round("after SIGSTOP");
}

int main(void)
{
    if (svc_init("colocate"))
        return 1;
    char fault[160];
    snprintf(fault, sizeof fault, "KILN_FAULT_INJECT=denoise:device_lost_after_steps=2,once=%s/once",
             svc.tmpdir);
    const char *env[] = {
        "KILN_LOG=debug",    /* the denoisers log each batch they start */
        "OMP_NUM_THREADS=1", /* several processes on a 2-core CI machine */
        fault,
        NULL,
    };
    const char *extra[] = {"--colocate", "--encoders", "2", "--decoders", "2",
                           "--heartbeat-timeout-ms", HB_TIMEOUT_MS, NULL};
    if (svc_cli_series("colo", SEED, N_SERIES, STEPS)) {
        fprintf(stderr, "kiln generate failed (logs in %s)\n", svc.tmpdir);
        svc_cleanup(1);
        return 1;
    }
    RUN(test_one_process);
    serve = svc_serve(2, extra, env, &port);
    if (serve <= 0) {
        fprintf(stderr, "kiln serve --colocate did not come up (logs in %s)\n", svc.tmpdir);
        svc_stop(serve, 60000);
        svc_cleanup(1);
        return 1;
    }
    RUN(test_device_lost);
    RUN(test_colocated_serve);
    RUN(test_kill);
    RUN(test_pause);
    /* The stop's at-exit reports, not those of the processes that
     * halted before: a halted stage drains for at most 5 s, and the
     * surviving process's denoiser may still be reading the halted
     * encoder's embeddings then (a batch on this 2-core machine takes
     * that long), so a range in use there is no leak.  A halted worker's
     * drain is judged where its consumers are quick (test_service_device). */
    size_t stop_from = svc_log_size(svc_tmp("serve.log"));
    int st = svc_stop(serve, 60000);
    CHECKF(st == 0, "kiln serve exit status %d", st);
    char bad[512];
    int reports = svc_exit_reports_from(svc_tmp("serve.log"), stop_from, bad, sizeof bad);
    CHECKF(!bad[0], "a stage held something at exit: %s", bad);
    CHECKF(reports == 6, "%d at-exit reports at the stop (want 2 processes x 3 stages)", reports);
    int rc = test_finish();
    svc_cleanup(rc != 0);
    return rc;
}
