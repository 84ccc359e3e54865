/* Replica faults under load, on the tiny klein checkpoint (CPU backend):
 * - kiln serve with two denoisers: one is stopped (SIGTERM: a container
 *   restart, a rolling update, a scale-down) in the middle of a denoise
 *   batch while four requests are in flight.  It leaves gracefully: every
 *   request gets its correct image, no 503 and nothing re-run (the
 *   gateway sends it no new job and counts replica_left, not
 *   replica_lost); it exits with 0 once its jobs are answered, leaving no
 *   slab, and the supervisor's restart registers and serves.
 * - kiln serve with two denoisers: one is killed (SIGKILL) in the middle
 *   of a denoise batch while four requests are in flight.  Every request
 *   gets either its correct image (byte-identical to `kiln generate`) or
 *   a 503 OpenAI error, none hangs; the gateway counts the lost replica and
 *   re-dispatches its jobs; the supervisor restarts it, its slabs are
 *   gone, kiln_replicas and /readyz are back, and the restarted replica
 *   serves a new request correctly.
 * - kiln-gateway and one replica of each stage started directly: the only
 *   denoiser is killed mid-batch.  Its requests get 503 within seconds
 *   (the heartbeat timeout), /readyz turns 503 and a new request
 *   is refused with 503 at once.  A new denoiser brings the pipeline
 *   back.  Then a denoiser is killed after its output was handed to a
 *   (paused) decoder and its slabs removed, as kiln serve's supervisor
 *   removes a dead child's: that request too ends in its image or a 503,
 *   never another status.  A last denoiser serves a request correctly and
 *   everything stops cleanly. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/transport.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

/* Long enough (with --max-sequence-length 32) that a kill at the start of
 * a batch lands well inside it (a 2-row batch: ~0.7 s in a plain build,
 * several seconds with sanitizers), short enough for CI. */
#define SLOW_STEPS "24"
#define N_INFLIGHT 4
/* The direct deployment's gateway.  The decoder stays paused from before
 * a request is sent until after its denoiser was killed and cleaned up
 * (several seconds under ASan on a loaded machine), and must not be taken
 * for dead meanwhile. */
#define HB_TIMEOUT_MS "8000"
#define SEED_SLOW 500
#define SEED_AFTER 600

static const char *const proc_env[] = {
    "KILN_LOG=debug",    /* the denoisers log each batch they start */
    "OMP_NUM_THREADS=1", /* several processes on a 2-core CI machine */
    NULL,
};

static void slow_json(char *buf, size_t cap, int seed)
{
    snprintf(buf, cap,
             "{\"prompt\":\"fault\",\"size\":\"64x64\",\"seed\":%d,\"num_inference_steps\":" SLOW_STEPS
             ",\"max_sequence_length\":32}",
             seed);
}

static void after_json(char *buf, size_t cap)
{
    snprintf(buf, cap,
             "{\"prompt\":\"after\",\"size\":\"64x64\",\"seed\":%d,\"num_inference_steps\":2,"
             "\"max_sequence_length\":32}",
             SEED_AFTER);
}

/* The CLI's images for the slow requests (slow-<i>.png) and the one sent
 * after recovery (after.png). */
static int cli_references(void)
{
    char seed[16], n[16];
    snprintf(seed, sizeof seed, "%d", SEED_SLOW);
    snprintf(n, sizeof n, "%d", N_INFLIGHT);
    const char *slow[] = {"--prompt", "fault", "--seed", seed, "-n", n, "--width", "64", "--height",
                          "64", "--steps", SLOW_STEPS, "--max-sequence-length", "32", NULL};
    char seed2[16];
    snprintf(seed2, sizeof seed2, "%d", SEED_AFTER);
    const char *after[] = {"--prompt", "after", "--seed", seed2, "--width", "64", "--height", "64",
                           "--steps", "2", "--max-sequence-length", "32", NULL};
    return svc_cli("generate", slow, svc_tmp("slow.png")) == 0 &&
                   svc_cli("generate", after, svc_tmp("after.png")) == 0
               ? 0
               : -1;
}

/* Sends request bodies on their own connections; fds[i] or -1. */
static void send_all(int port, char bodies[][256], int n, int *fds)
{
    for (int i = 0; i < n; i++) {
        kiln_buf wire = {0};
        gwc_format(&wire, "POST", "/v1/images/generations", "application/json", bodies[i],
                   strlen(bodies[i]), 0);
        fds[i] = gwc_connect(port);
        CHECKF(fds[i] >= 0 && gwc_send(fds[i], wire.data, wire.len, 5000) == 0, "request %d not sent",
               i);
        kiln_buf_free(&wire);
    }
}

/* Reads one answer per connection: each must be the image in `ref` (a
 * file under tmpdir) or a 503 stage_unavailable error.  Counts both. */
static void expect_image_or_503(int fd, const char *ref, const char *what, int *images, int *unavail)
{
    kiln_buf in = {0};
    gwc_response r = {0};
    CHECKF(fd >= 0 && gwc_read_response(fd, &in, &r, SVC_T_REQ) == 0, "%s: no answer", what);
    if (r.status == 200) {
        svc_images im;
        CHECKF(svc_parse_images(&r, &im) == 0 && im.n == 1 && svc_same_file(svc_tmp(ref), &im.files[0]),
               "%s: a 200 whose image is not the CLI's", what);
        svc_images_free(&im);
        ++*images;
    } else {
        char why[512] = "";
        CHECKF(r.status == 503, "%s: status %d (want 200 or 503): %.*s", what, r.status,
               (int)(r.body.len > 300 ? 300 : r.body.len), r.body.data ? (char *)r.body.data : "");
        CHECKF(svc_error_body(&r, "stage_unavailable", why, sizeof why) == 0, "%s: %s", what, why);
        ++*unavail;
    }
    gwc_response_free(&r);
    kiln_buf_free(&in);
    if (fd >= 0)
        close(fd);
}

static double metric_now(int port, const char *prefix)
{
    kiln_buf m = {0};
    double v = svc_metrics(port, &m) == 0 ? svc_metric((const char *)m.data, prefix) : -1;
    kiln_buf_free(&m);
    return v;
}

/* One request with the after.png reference: its image, exactly. */
static void expect_after_image(int port, const char *what)
{
    char json[256];
    after_json(json, sizeof json);
    gwc_response r;
    svc_images im;
    CHECK(svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0);
    CHECKF(svc_parse_images(&r, &im) == 0 && im.n == 1 && svc_same_file(svc_tmp("after.png"), &im.files[0]),
           "%s: status %d, or not the CLI's image", what, r.status);
    svc_images_free(&im);
    gwc_response_free(&r);
}

/* ---- kiln serve: one of two denoisers is stopped (SIGTERM) ---- */

/* The number after `key` in the last line of `log` holding it, or -1. */
static int last_count_after(const char *log, const char *key)
{
    kiln_buf text = {0};
    svc_read_log(log, &text);
    const char *last = NULL;
    for (const char *p = (const char *)text.data; p && (p = strstr(p, key)); p++)
        last = p;
    int v = last ? atoi(last + strlen(key)) : -1;
    kiln_buf_free(&text);
    return v;
}

/* kiln serve with two denoisers on a fresh port, bus `bus_name` and log
 * `log_name` (set in *port, *log); both denoisers' pids in before[].  -1
 * (a failure recorded, serve stopped) when it did not come up. */
static pid_t serve_two_denoisers(const char *bus_name, const char *log_name, int *port,
                                 const char **log, pid_t before[2])
{
    *port = svc_free_port();
    char port_s[16], bus[128];
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(bus, sizeof bus, "ipc://%s/%s", svc.tmpdir, bus_name);
    *log = svc_tmp(log_name);
    const char *argv[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                          "--bus", bus, "--min-size", "64", "--max-size", "128",
                          "--text-encoder-out-layers", "1,2,3", "--encoders", "1", "--denoisers",
                          "2", "--decoders", "1", NULL};
    pid_t serve = svc_spawn(argv, proc_env, *log);
    double v;
    CHECKF(svc_wait_ready(*port, 60000) == 0 &&
               svc_wait_metric(*port, "kiln_replicas{stage=\"denoise\"}", 2, 30000, &v) == 0,
           "kiln serve with two denoisers did not come up (log %s)", *log);
    if (test_failures) {
        svc_stop(serve, 60000);
        return -1;
    }
    CHECK(svc_children(serve, "kiln-denoiser", before, 2) == 2);
    return serve;
}

/* Sends N_INFLIGHT slow requests, sends `sig` to the denoiser (of
 * before[]) that starts a batch first (*t_sig: when) and reads every answer
 * (an image or a 503, counted).  The denoiser signalled, or <= 0. */
static pid_t signal_busy_denoiser(int port, const char *log, const pid_t before[2], int sig,
                                  double *t_sig, int *images, int *unavail)
{
    char bodies[N_INFLIGHT][256];
    int fds[N_INFLIGHT];
    for (int i = 0; i < N_INFLIGHT; i++)
        slow_json(bodies[i], sizeof bodies[i], SEED_SLOW + i);
    size_t from = svc_log_size(log);
    send_all(port, bodies, N_INFLIGHT, fds);
    pid_t victim = svc_batch_started(log, from, before, 2, 60000);
    CHECKF(victim == before[0] || victim == before[1], "no denoiser started a batch (got pid %ld)",
           (long)victim);
    if (victim > 0)
        kill(victim, sig);
    *t_sig = kiln_now_ms();
    for (int i = 0; i < N_INFLIGHT; i++) {
        char what[64], ref[32];
        snprintf(what, sizeof what, "in-flight request %d", i);
        snprintf(ref, sizeof ref, "slow-%d.png", i);
        expect_image_or_503(fds[i], ref, what, images, unavail);
    }
    return victim;
}

/* The denoiser the supervisor started in place of one of before[] (within
 * 60 s), or -1. */
static pid_t replacement_denoiser(pid_t serve, const pid_t before[2])
{
    pid_t now[2] = {0, 0}, fresh = -1;
    double until = kiln_now_ms() + 60000;
    while (fresh < 0 && kiln_now_ms() < until) {
        int n = svc_children(serve, "kiln-denoiser", now, 2);
        for (int i = 0; i < n; i++)
            if (now[i] != before[0] && now[i] != before[1])
                fresh = now[i];
        if (fresh < 0)
            svc_sleep_ms(50);
    }
    return fresh;
}

static void test_sigterm_one_denoiser(void)
{
    int port;
    const char *log;
    pid_t before[2];
    double v;
    pid_t serve = serve_two_denoisers("bus-term", "serve-term.log", &port, &log, before);
    if (serve < 0)
        return;
    int images = 0, unavail = 0;
    double t_term;
    pid_t victim = signal_busy_denoiser(port, log, before, SIGTERM, &t_term, &images, &unavail);
    KILN_LOG_INFO("faults: denoiser %ld stopped (SIGTERM); %d images, %d 503s, all answered "
                  "%.1f s later", (long)victim, images, unavail, (kiln_now_ms() - t_term) / 1000);
    CHECKF(images == N_INFLIGHT, "%d of %d requests got their image", images, N_INFLIGHT);
    /* It held work when it left (else this proves little), finished it
     * and said so; the gateway neither lost it nor re-ran anything. */
    CHECKF(svc_wait_log(log, "every job it held is answered; stopping", 1, 30000) == 0,
           "the stopped denoiser did not finish its jobs");
    int held = last_count_after(log, "is leaving: no new work; its ");
    CHECKF(held >= 1, "the denoiser had %d job(s) in flight when it left", held);
    char exited[64];
    snprintf(exited, sizeof exited, "(pid %ld) exited with status 0", (long)victim);
    CHECKF(svc_wait_log(log, exited, 1, 30000) == 0, "denoiser %ld did not exit with 0",
           (long)victim);
    /* The gateway logs the bye when it reads it, which may come after the
     * supervisor saw the exit. */
    CHECKF(svc_log_count(log, "signal received: leaving") == 1 &&
               svc_wait_log(log, " left (0 job(s) in flight)", 1, 10000) == 0,
           "the gateway did not see the denoiser leave");
    double left;
    CHECKF(svc_wait_metric(port, "kiln_events_total{event=\"replica_left\"}", 1, 10000, &left) == 0,
           "replica_left %g, want 1", left);
    CHECK(metric_now(port, "kiln_events_total{event=\"replica_lost\"}") == 0);
    CHECK(metric_now(port, "kiln_events_total{event=\"redispatch\"}") == 0);
    CHECKF(svc_shm_slabs(victim) == 0, "the stopped denoiser left slabs in /dev/shm");

    /* The supervisor starts it again; it registers and serves. */
    pid_t fresh = replacement_denoiser(serve, before);
    CHECKF(fresh > 0 && svc_wait_registered(log, fresh, 60000) == 0,
           "the stopped denoiser was not started again");
    CHECKF(svc_wait_metric(port, "kiln_replicas{stage=\"denoise\"}", 2, 30000, &v) == 0,
           "%g live denoisers after the restart, want 2", v);
    expect_after_image(port, "after the graceful restart");
    char last[128];
    CHECKF(svc_wait_idle(port, 10000, last, sizeof last) == 0, "jobs left: %s", last);
    int st = svc_stop(serve, 60000);
    CHECKF(st == 0, "kiln serve exit status %d", st);
}

/* ---- kiln serve: one of two denoisers dies ---- */

static void test_kill_one_denoiser(void)
{
    int port;
    const char *log;
    pid_t before[2];
    double v;
    pid_t serve = serve_two_denoisers("bus-serve", "serve.log", &port, &log, before);
    if (serve < 0)
        return;

    int images = 0, unavail = 0;
    double t_kill;
    pid_t victim = signal_busy_denoiser(port, log, before, SIGKILL, &t_kill, &images, &unavail);
    KILN_LOG_INFO("faults: denoiser %ld killed; %d images, %d 503s, all answered %.1f s later",
                  (long)victim, images, unavail, (kiln_now_ms() - t_kill) / 1000);
    /* The replica had jobs: they were re-dispatched (or failed with 503). */
    CHECK(metric_now(port, "kiln_events_total{event=\"replica_lost\"}") >= 1);
    CHECKF(metric_now(port, "kiln_events_total{event=\"redispatch\"}") + unavail >= 1,
           "nothing was re-dispatched or failed: the kill missed the batch");

    /* The supervisor restarts it; it registers and serves. */
    char started[64];
    snprintf(started, sizeof started, "(pid %ld) was killed by signal 9", (long)victim);
    CHECKF(svc_wait_log(log, started, 1, 10000) == 0, "kiln serve did not see denoiser %ld die",
           (long)victim);
    pid_t fresh = replacement_denoiser(serve, before);
    CHECKF(fresh > 0, "the killed denoiser was not restarted");
    CHECKF(svc_wait_registered(log, fresh, 60000) == 0,
           "the restarted denoiser %ld did not register", (long)fresh);
    CHECKF(svc_wait_metric(port, "kiln_replicas{stage=\"denoise\"}", 2, 30000, &v) == 0,
           "%g live denoisers after the restart, want 2", v);
    CHECK(svc_wait_ready(port, 10000) == 0);
    CHECKF(svc_shm_slabs(victim) == 0, "the killed denoiser's slabs are still in /dev/shm");
    /* The restarted replica serves: it took the re-dispatched jobs if it
     * registered before the gateway gave up on the killed one, else the
     * next job is its turn (idle replicas take turns; it had none). */
    expect_after_image(port, "after the restart");
    CHECKF(svc_batch_started(log, 0, &fresh, 1, 0) == fresh,
           "the restarted denoiser did not serve");
    char last[128];
    CHECKF(svc_wait_idle(port, 10000, last, sizeof last) == 0, "jobs left: %s", last);
    int st = svc_stop(serve, 60000);
    CHECKF(st == 0, "kiln serve exit status %d", st);
}

/* ---- one replica per stage, started here: the only denoiser dies ---- */

typedef struct direct {
    int port;
    char bus[128];
    pid_t gateway, encoder, decoder;
} direct;

static pid_t start_denoiser(const direct *d, int k)
{
    char log[32];
    snprintf(log, sizeof log, "denoiser-%d.log", k);
    const char *argv[] = {svc_exe("services/kiln-denoiser"), "--model", svc.model, "--bus", d->bus,
                          NULL};
    return svc_spawn(argv, proc_env, svc_tmp(log));
}

static int start_direct(direct *d)
{
    snprintf(d->bus, sizeof d->bus, "ipc://%s/bus-direct", svc.tmpdir);
    /* A dead replica is noticed within HB_TIMEOUT_MS; the paused decoder
     * below must not be taken for dead meanwhile. */
    const char *gw[] = {svc_exe("services/gateway/kiln-gateway"), "--model", svc.model, "--host",
                        "127.0.0.1", "--port", "0", "--bus", d->bus, "--min-size", "64",
                        "--max-size", "128", "--heartbeat-timeout-ms", HB_TIMEOUT_MS, NULL};
    d->gateway = svc_spawn(gw, proc_env + 1, svc_tmp("gateway.log"));
    d->port = svc_log_port(svc_tmp("gateway.log"), 30000);
    const char *enc[] = {svc_exe("services/kiln-encoder"), "--model", svc.model, "--bus", d->bus,
                         "--text-encoder-out-layers", "1,2,3", NULL};
    const char *dec[] = {svc_exe("services/kiln-decoder"), "--model", svc.model, "--bus", d->bus,
                         NULL};
    d->encoder = svc_spawn(enc, proc_env + 1, svc_tmp("encoder.log"));
    d->decoder = svc_spawn(dec, proc_env + 1, svc_tmp("decoder.log"));
    return d->port > 0 ? 0 : -1;
}

static void test_kill_only_denoiser(void)
{
    direct d;
    pid_t den = -1;
    if (start_direct(&d) == 0)
        den = start_denoiser(&d, 1);
    CHECKF(d.port > 0 && svc_wait_ready(d.port, 60000) == 0, "the direct pipeline did not come up");
    if (test_failures)
        goto out;

    /* Killed in the middle of a batch: its requests fail promptly. */
    char bodies[3][256];
    int fds[3];
    for (int i = 0; i < 3; i++)
        slow_json(bodies[i], sizeof bodies[i], SEED_SLOW + i);
    send_all(d.port, bodies, 3, fds);
    CHECKF(svc_batch_started(svc_tmp("denoiser-1.log"), 0, &den, 1, 60000) == den,
           "the denoiser did not start");
    kill(den, SIGKILL);
    CHECK(svc_wait_exit(den, 10000) == 128 + SIGKILL);
    double t_kill = kiln_now_ms();
    int images = 0, unavail = 0;
    for (int i = 0; i < 3; i++)
        expect_image_or_503(fds[i], "unused", "request on the killed denoiser", &images, &unavail);
    double took = kiln_now_ms() - t_kill;
    CHECKF(unavail == 3, "%d of 3 requests on the only denoiser got 503", unavail);
    CHECKF(took < atof(HB_TIMEOUT_MS) + 7000,
           "the requests took %.1f s to fail (heartbeat timeout %s ms)", took / 1000,
           HB_TIMEOUT_MS);
    CHECK(svc_get_status(d.port, "/readyz") == 503);
    char json[256];
    after_json(json, sizeof json);
    gwc_response r;
    double t0 = kiln_now_ms();
    CHECK(svc_post_json(d.port, "/v1/images/generations", json, &r, 10000) == 0);
    char why[512] = "";
    CHECKF(r.status == 503 && svc_error_body(&r, "stage_unavailable", why, sizeof why) == 0,
           "without a denoiser: status %d %s", r.status, why);
    CHECKF(kiln_now_ms() - t0 < 2000, "the 503 took %.0f ms", kiln_now_ms() - t0);
    gwc_response_free(&r);
    CHECK(metric_now(d.port, "kiln_replicas{stage=\"denoise\"}") == 0);

    /* A new denoiser: served again. */
    den = start_denoiser(&d, 2);
    CHECKF(svc_wait_ready(d.port, 60000) == 0, "not ready with a new denoiser");
    char last[128];
    CHECKF(svc_wait_idle(d.port, 10000, last, sizeof last) == 0, "jobs left: %s", last);

    /* The denoiser dies after its output was handed to the (paused)
     * decoder, and its slabs go as a supervisor removes them: the decoder
     * finds its input gone.  Image or 503, nothing else. */
    kill(d.decoder, SIGSTOP);
    after_json(json, sizeof json);
    kiln_buf wire = {0};
    gwc_format(&wire, "POST", "/v1/images/generations", "application/json", json, strlen(json), 0);
    int fd = gwc_connect(d.port);
    CHECK(fd >= 0 && gwc_send(fd, wire.data, wire.len, 5000) == 0);
    kiln_buf_free(&wire);
    double v;
    CHECKF(svc_wait_metric(d.port, "kiln_inflight{stage=\"decode\"}", 1, 30000, &v) == 0,
           "the request did not reach the decoder");
    kill(den, SIGKILL);
    CHECK(svc_wait_exit(den, 10000) == 128 + SIGKILL);
    kiln_err err = {0};
    CHECKF(kiln_transport_shm_clean_stale(&err) >= 0, "%s", err.msg);
    CHECK(svc_shm_slabs(den) == 0);
    kill(d.decoder, SIGCONT);
    images = unavail = 0;
    expect_image_or_503(fd, "after.png", "request whose latents' producer died", &images, &unavail);
    KILN_LOG_INFO("faults: the request whose latents' producer died got %s",
                  images ? "its image" : "503");
    CHECKF(svc_log_count(svc_tmp("gateway.log"), "from a denoise replica are gone; starting over") == 1,
           "the decoder did not find its input gone (paused too long?)");

    /* And back once more. */
    den = start_denoiser(&d, 3);
    CHECKF(svc_wait_ready(d.port, 60000) == 0, "not ready with a third denoiser");
    expect_after_image(d.port, "with the third denoiser");
    CHECKF(svc_wait_idle(d.port, 10000, last, sizeof last) == 0, "jobs left: %s", last);
out:
    CHECKF(svc_stop(d.gateway, 30000) == 0, "gateway exit status");
    pid_t workers[3] = {d.encoder, den, d.decoder};
    for (int i = 0; i < 3; i++) {
        int st = svc_stop(workers[i], 30000);
        CHECKF(st == 0, "worker %ld exit status %d", (long)workers[i], st);
        CHECKF(svc_shm_slabs(workers[i]) == 0, "worker %ld left slabs", (long)workers[i]);
    }
}

int main(void)
{
    if (svc_init("faults"))
        return 1;
    if (cli_references()) {
        fprintf(stderr, "kiln generate failed (log %s)\n", svc_tmp("cli.log"));
        svc_cleanup(1);
        return 1;
    }
    RUN(test_sigterm_one_denoiser);
    RUN(test_kill_one_denoiser);
    RUN(test_kill_only_denoiser);
    int rc = test_finish();
    svc_cleanup(rc != 0);
    return rc;
}
