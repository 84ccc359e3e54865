/* Stages in different transport domains (docs/ARCHITECTURE.md, "Transport
 * domains"), on the real executables (tiny klein checkpoint, CPU backend,
 * a CURVE bus with the allow-list on every replica):
 *
 * - namespaces: the denoiser and the decoder run in an IPC and mount
 *   namespace of their own with their own /dev/shm (`unshare --ipc --mount
 *   --fork`, the decoder joining the denoiser's with nsenter), like a
 *   second stage pod; the encoder's embeddings cannot be opened there, so
 *   the denoiser fetches them by value from the encoder's data socket,
 *   while the latents go from the denoiser to the decoder through their
 *   shared /dev/shm.  Every image is the CLI's bytes; the replicas' exit
 *   lines count what went by value.  Where namespaces cannot be made, the
 *   same runs with KILN_DOMAIN_HOST making the two stages look like
 *   another machine's (the by-value path is the real one either way);
 *   with KILN_REQUIRE_NAMESPACES=1 (CI) that is a failure.
 * - a producer stage whose /dev/shm is the 64 MiB a container gets by
 *   default refuses to start (exit 78) and says what to do; one whose
 *   /dev/shm fills up later takes no work until there is room again, and
 *   the 503s, the logs and /readyz say why meanwhile.
 * - KILN_DOMAIN_HOST that could not travel is refused at start.
 * - a stage's --health-port answers /healthz and /readyz (200 once loaded
 *   and registered). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

static int port;
static char health[16];
static char bus[64], gw_key[256], gw_pub[256], rep_key[256], rep_pub[256];

static int keygen(const char *name)
{
    const char *argv[] = {svc_exe("tools/kiln"), "keygen", "--out", svc_tmp(name), NULL};
    pid_t pid = svc_spawn(argv, NULL, svc_tmp("keygen.log"));
    return pid < 0 ? -1 : svc_wait_exit(pid, 30000) == 0 ? 0 : -1;
}

/* 1 when this process may make IPC + mount namespaces and mount a tmpfs
 * in them (root, and a sandbox that allows it). */
static int can_unshare(void)
{
    const char *argv[] = {"/usr/bin/unshare", "--ipc", "--mount", "--fork", "sh", "-c",
                          "mount -t tmpfs -o size=1m kiln-probe /dev/shm", NULL};
    pid_t pid = svc_spawn(argv, NULL, svc_tmp("unshare-probe.log"));
    return pid > 0 && svc_wait_exit(pid, 30000) == 0;
}

/* The argv of a stage worker (NULL-terminated in argv[n]). */
static int stage_argv(const char **argv, const char *bin)
{
    int n = 0;
    argv[n++] = svc_exe(bin);
    argv[n++] = "--model", argv[n++] = svc.model, argv[n++] = "--bus", argv[n++] = bus;
    argv[n++] = "--bus-key", argv[n++] = rep_key, argv[n++] = "--bus-server-key";
    argv[n++] = gw_pub, argv[n++] = "--bus-allow", argv[n++] = rep_pub;
    argv[n++] = "--data-host", argv[n++] = "127.0.0.1";
    if (strstr(bin, "encoder"))
        argv[n++] = "--text-encoder-out-layers", argv[n++] = "1,2,3";
    argv[n] = NULL;
    return n;
}

static const struct {
    int n, seed;
} reqs[] = {{1, 11}, {2, 20}};

/* The CLI's images for reqs, once: cli-<i>.png, cli-<i>-<k>.png. */
static void cli_images(void)
{
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
        char seed[16], n[8], out[64];
        snprintf(seed, sizeof seed, "%d", reqs[i].seed);
        snprintf(n, sizeof n, "%d", reqs[i].n);
        snprintf(out, sizeof out, "cli-%zu.png", i);
        const char *args[] = {"--prompt", "a door in a wall", "--seed", seed, "-n", n,
                              "--width", "64", "--height", "64", "--steps", "1", NULL};
        CHECK(svc_cli("generate", args, svc_tmp(out)) == 0);
    }
}

/* Sends reqs and compares each image with the CLI's. */
static void check_images(const char *tag)
{
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
        char json[256];
        snprintf(json, sizeof json,
                 "{\"prompt\":\"a door in a wall\",\"size\":\"64x64\",\"seed\":%d,\"n\":%d,"
                 "\"num_inference_steps\":1}",
                 reqs[i].seed, reqs[i].n);
        gwc_response r;
        svc_images im;
        int ok = svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0 &&
                 svc_parse_images(&r, &im) == 0;
        CHECKF(ok, "%s: status %d: %.*s", tag, r.status, (int)(r.body.len > 200 ? 200 : r.body.len),
               r.body.data ? (char *)r.body.data : "");
        gwc_response_free(&r);
        if (!ok)
            continue;
        CHECK(im.n == reqs[i].n);
        for (int k = 0; k < im.n; k++) {
            char file[64];
            if (im.n == 1)
                snprintf(file, sizeof file, "cli-%zu.png", i);
            else
                snprintf(file, sizeof file, "cli-%zu-%d.png", i, k);
            CHECKF(svc_same_file(svc_tmp(file), &im.files[k]), "%s: image %d of n=%d differs",
                   tag, k, im.n);
        }
        svc_images_free(&im);
    }
}

/* How many inputs the replica's exit line says it fetched by value, or
 * outputs it served ("fetched" / "served"); -1 when the line is missing. */
static long by_value(const char *log, const char *what)
{
    kiln_buf b = {0};
    svc_read_log(log, &b);
    const char *p = b.data ? strstr((char *)b.data, "by value: ") : NULL;
    long fetched = -1, served = -1;
    if (p && sscanf(p, "by value: %ld input(s) fetched (%*[0-9] bytes), %ld output(s) served",
                    &fetched, &served) != 2)
        fetched = served = -1;
    kiln_buf_free(&b);
    return !strcmp(what, "fetched") ? fetched : served;
}

static void run_split(int namespaces)
{
    port = svc_free_port_pair();
    char p[16];
    snprintf(p, sizeof p, "%d", port);
    snprintf(bus, sizeof bus, "tcp://127.0.0.1:%d", port + 1);
    const char *gw_argv[] = {svc_exe("services/gateway/kiln-gateway"), "--model", svc.model,
                             "--host", "127.0.0.1", "--port", p, "--min-size", "64", "--bus",
                             bus, "--bus-key", gw_key, "--bus-allow", rep_pub, NULL};
    pid_t gw = svc_spawn(gw_argv, NULL, svc_tmp("gateway.log"));
    const char *argv[40];
    stage_argv(argv, "services/kiln-encoder");
    pid_t enc = svc_spawn(argv, NULL, svc_tmp("encoder.log"));
    pid_t den, dec, den_worker = -1;
    if (namespaces) {
        /* A second "pod": its own IPC and mount namespaces and /dev/shm. */
        const char *un[48] = {"/usr/bin/unshare", "--ipc", "--mount", "--fork",
                              "--kill-child=SIGTERM",
                              "sh", "-c",
                              "mount -t tmpfs -o size=512m kiln-pod /dev/shm && exec \"$@\"",
                              "sh"};
        int k = 9 + stage_argv(un + 9, "services/kiln-denoiser");
        un[k] = NULL;
        den = svc_spawn(un, NULL, svc_tmp("denoiser.log"));
        for (double until = kiln_now_ms() + 30000; den_worker < 0 && kiln_now_ms() < until;) {
            pid_t kids[2];
            if (svc_children(den, "kiln-denoiser", kids, 2) == 1)
                den_worker = kids[0];
            else
                svc_sleep_ms(20);
        }
        CHECK(den_worker > 0);
        char target[16];
        snprintf(target, sizeof target, "%d", (int)den_worker);
        const char *ns[48] = {"/usr/bin/nsenter", "-t", target, "--ipc", "--mount", "--"};
        k = 6 + stage_argv(ns + 6, "services/kiln-decoder");
        ns[k] = NULL;
        dec = svc_spawn(ns, NULL, svc_tmp("decoder.log"));
    } else {
        const char *env[] = {"KILN_DOMAIN_HOST=another-machine", NULL};
        stage_argv(argv, "services/kiln-denoiser");
        den = svc_spawn(argv, env, svc_tmp("denoiser.log"));
        int n = stage_argv(argv, "services/kiln-decoder");
        snprintf(health, sizeof health, "%d", svc_free_port());
        argv[n++] = "--health-port", argv[n++] = health, argv[n] = NULL;
        dec = svc_spawn(argv, env, svc_tmp("decoder.log"));
    }
    CHECK(svc_wait_ready(port, 60000) == 0);
    check_images(namespaces ? "ns" : "env");
    if (!namespaces) { /* the stage's probes */
        int hp = atoi(health);
        CHECK(svc_get_status(hp, "/healthz") == 200 && svc_get_status(hp, "/readyz") == 200);
        CHECK(svc_get_status(hp, "/metrics") == 404);
    }

    /* nsenter execs the decoder; unshare ignores SIGTERM while it waits
     * for its child, so the denoiser itself is told, and unshare ends
     * with it. */
    CHECK(svc_stop(gw, 30000) == 0);
    CHECK(svc_stop(enc, 30000) == 0);
    CHECK(svc_stop(dec, 30000) == 0);
    if (namespaces) {
        CHECK(den_worker > 0 && kill(den_worker, SIGTERM) == 0);
        CHECK(svc_wait_exit(den, 30000) == 0);
    } else {
        CHECK(svc_stop(den, 30000) == 0);
    }
    /* 3 requests' embeddings crossed by value; the latents did not (the
     * denoiser and decoder share a /dev/shm, or a host id). */
    long served = by_value(svc_tmp("encoder.log"), "served");
    long fetched = by_value(svc_tmp("denoiser.log"), "fetched");
    long dec_fetched = by_value(svc_tmp("decoder.log"), "fetched");
    CHECKF(served >= 2 && fetched == served && dec_fetched == 0,
           "encoder served %ld, denoiser fetched %ld, decoder fetched %ld", served, fetched,
           dec_fetched);
    CHECK(svc_log_count(svc_tmp("gateway.log"), "failed") == 0);
    const char *logs[] = {"gateway.log", "encoder.log", "denoiser.log", "decoder.log"};
    for (int i = 0; i < 4; i++) {
        char keep[64];
        snprintf(keep, sizeof keep, "%s-%s", namespaces ? "ns" : "env", logs[i]);
        rename(svc_tmp(logs[i]), svc_tmp(keep));
    }
}

static void test_split_domains(void)
{
    int ns = can_unshare();
    CHECKF(ns || !svc_namespaces_required(),
           "KILN_REQUIRE_NAMESPACES=1, but unshare --ipc --mount fails here: see %s",
           svc_tmp("unshare-probe.log"));
    if (!ns)
        fprintf(stderr, "namespaces cannot be made here: running the split with "
                        "KILN_DOMAIN_HOST only\n");
    else
        run_split(1);
    run_split(0);
}

/* A producer with a container's default /dev/shm refuses to start. */
static void test_small_shm(void)
{
    if (!can_unshare()) {
        CHECKF(!svc_namespaces_required(),
               "KILN_REQUIRE_NAMESPACES=1, but unshare --ipc --mount fails here: see %s",
               svc_tmp("unshare-probe.log"));
        fprintf(stderr, "skipped: namespaces cannot be made here\n");
        return;
    }
    const char *un[48] = {"/usr/bin/unshare", "--ipc", "--mount", "--fork", "sh", "-c",
                          "mount -t tmpfs -o size=64m kiln-small /dev/shm && exec \"$@\"", "sh"};
    int k = 8 + stage_argv(un + 8, "services/kiln-denoiser");
    un[k] = NULL;
    pid_t pid = svc_spawn(un, NULL, svc_tmp("small.log"));
    CHECK(pid > 0 && svc_wait_exit(pid, 60000) == 78);
    CHECK(svc_wait_log(svc_tmp("small.log"), "/dev/shm has 64 MiB free of 64 MiB", 1, 1000) == 0);
    CHECK(svc_wait_log(svc_tmp("small.log"), "--shm-size", 1, 1000) == 0);
}

/* Runs `nsenter -t pid --mount -- sh -c script`: 0 when it exits 0. */
static int in_mount_ns(pid_t pid, const char *script)
{
    char target[16];
    snprintf(target, sizeof target, "%d", (int)pid);
    const char *argv[] = {"/usr/bin/nsenter", "-t", target, "--mount", "--", "sh", "-c", script,
                          NULL};
    pid_t p = svc_spawn(argv, NULL, svc_tmp("nsenter.log"));
    return p > 0 && svc_wait_exit(p, 30000) == 0 ? 0 : -1;
}

/* Polls the gateway's /readyz until its status is `want` (up to ms);
 * the last body in *body.  0 when it was. */
static int wait_readyz(int want, int ms, kiln_buf *body)
{
    for (double until = kiln_now_ms() + ms;;) {
        gwc_response r;
        int st = gwc_request(port, "GET", "/readyz", NULL, NULL, 0, &r, 5000) ? -1 : r.status;
        body->len = 0;
        if (st > 0 && r.body.len)
            kiln_buf_append(body, r.body.data, r.body.len, NULL);
        kiln_buf_append(body, "", 1, NULL);
        gwc_response_free(&r);
        if (st == want)
            return 0;
        if (kiln_now_ms() > until)
            return -1;
        svc_sleep_ms(100);
    }
}

/* A denoiser whose /dev/shm fills up after it started (another tenant of
 * a shared tmpfs, a leak elsewhere): its next output has no room.  The
 * client gets a 503 OpenAI error, both logs say what is wrong and what to
 * do, /readyz (the gateway's and the stage's health port) reports it
 * until there is room again, requests meanwhile are refused at once, and
 * once room is made the service serves the CLI's bytes again. */
static void test_shm_fills(void)
{
    if (!can_unshare()) {
        CHECKF(!svc_namespaces_required(),
               "KILN_REQUIRE_NAMESPACES=1, but unshare --ipc --mount fails here: see %s",
               svc_tmp("unshare-probe.log"));
        fprintf(stderr, "skipped: namespaces cannot be made here\n");
        return;
    }
    port = svc_free_port_pair();
    char p[16], hp[16];
    snprintf(p, sizeof p, "%d", port);
    snprintf(bus, sizeof bus, "tcp://127.0.0.1:%d", port + 1);
    snprintf(hp, sizeof hp, "%d", svc_free_port());
    const char *gw_argv[] = {svc_exe("services/gateway/kiln-gateway"), "--model", svc.model,
                             "--host", "127.0.0.1", "--port", p, "--min-size", "64", "--bus",
                             bus, "--bus-key", gw_key, "--bus-allow", rep_pub, NULL};
    pid_t gw = svc_spawn(gw_argv, NULL, svc_tmp("full-gateway.log"));
    const char *argv[48];
    stage_argv(argv, "services/kiln-encoder");
    pid_t enc = svc_spawn(argv, NULL, svc_tmp("full-encoder.log"));
    /* 300 MiB passes the start-up check (256); the first 64 MiB slab is
     * made on the first output. */
    const char *un[48] = {"/usr/bin/unshare", "--ipc", "--mount", "--fork",
                          "--kill-child=SIGTERM", "sh", "-c",
                          "mount -t tmpfs -o size=300m kiln-full /dev/shm && exec \"$@\"", "sh"};
    int k = 9 + stage_argv(un + 9, "services/kiln-denoiser");
    un[k++] = "--health-port", un[k++] = hp, un[k] = NULL;
    pid_t den = svc_spawn(un, NULL, svc_tmp("full-denoiser.log")), den_worker = -1;
    for (double until = kiln_now_ms() + 30000; den_worker < 0 && kiln_now_ms() < until;) {
        pid_t kids[2];
        if (svc_children(den, "kiln-denoiser", kids, 2) == 1)
            den_worker = kids[0];
        else
            svc_sleep_ms(20);
    }
    CHECK(den_worker > 0);
    stage_argv(argv, "services/kiln-decoder");
    pid_t dec = svc_spawn(argv, NULL, svc_tmp("full-decoder.log"));
    CHECK(svc_wait_ready(port, 60000) == 0);
    CHECK(den_worker > 0 && in_mount_ns(den_worker, "fallocate -l 280M /dev/shm/filler") == 0);

    char json[256];
    snprintf(json, sizeof json,
             "{\"prompt\":\"a door in a wall\",\"size\":\"64x64\",\"seed\":%d,\"n\":%d,"
             "\"num_inference_steps\":1}",
             reqs[0].seed, reqs[0].n);
    gwc_response r;
    char why[256];
    CHECK(svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0);
    CHECKF(r.status == 503 && svc_error_body(&r, "stage_unavailable", why, sizeof why) == 0,
           "status %d: %s", r.status, why);
    gwc_response_free(&r);
    kiln_buf body = {0};
    CHECKF(wait_readyz(503, 10000, &body) == 0, "/readyz: %s", (char *)body.data);
    CHECKF(body.data && strstr((char *)body.data, "\"shm_full\":{\"encode\":0,\"denoise\":1"),
           "/readyz: %s", (char *)body.data);
    CHECK(svc_get_status(atoi(hp), "/readyz") == 503 && svc_get_status(atoi(hp), "/healthz") == 200);
    CHECK(svc_wait_log(svc_tmp("full-denoiser.log"), "/dev/shm is full: no room for a slab", 1,
                       1000) == 0);
    CHECK(svc_wait_log(svc_tmp("full-gateway.log"), "has no room in /dev/shm for its outputs", 1,
                       1000) == 0);
    /* Meanwhile refused at once, before the encoder spends anything. */
    double t0 = kiln_now_ms();
    CHECK(svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0);
    CHECKF(r.status == 503 && svc_error_body(&r, NULL, why, sizeof why) == 0 &&
               r.body.data && memmem(r.body.data, r.body.len, "shared memory is full", 21),
           "status %d: %s", r.status, why);
    CHECKF(kiln_now_ms() - t0 < 5000, "refused after %.0f ms", kiln_now_ms() - t0);
    gwc_response_free(&r);

    /* Room again: ready within a few heartbeats, and the bytes are right. */
    CHECK(den_worker > 0 && in_mount_ns(den_worker, "rm /dev/shm/filler") == 0);
    CHECKF(wait_readyz(200, 10000, &body) == 0, "/readyz: %s", (char *)body.data);
    CHECK(svc_get_status(atoi(hp), "/readyz") == 200);
    check_images("room again");
    kiln_buf_free(&body);

    CHECK(svc_stop(gw, 30000) == 0);
    CHECK(svc_stop(enc, 30000) == 0);
    CHECK(svc_stop(dec, 30000) == 0);
    CHECK(den_worker > 0 && kill(den_worker, SIGTERM) == 0);
    CHECK(svc_wait_exit(den, 30000) == 0);
}

static void test_bad_domain_env(void)
{
    const char *argv[40];
    stage_argv(argv, "services/kiln-decoder");
    const char *env[] = {"KILN_DOMAIN_HOST=has space", NULL};
    pid_t pid = svc_spawn(argv, env, svc_tmp("badenv.log"));
    CHECK(pid > 0 && svc_wait_exit(pid, 60000) == 78);
    CHECK(svc_wait_log(svc_tmp("badenv.log"), "KILN_DOMAIN_HOST must be", 1, 1000) == 0);
}

int main(void)
{
    if (svc_init("domains"))
        return 1;
    CHECK(keygen("gw") == 0 && keygen("rep") == 0);
    snprintf(gw_key, sizeof gw_key, "%s", svc_tmp("gw.key"));
    snprintf(gw_pub, sizeof gw_pub, "%s", svc_tmp("gw.pub"));
    snprintf(rep_key, sizeof rep_key, "%s", svc_tmp("rep.key"));
    snprintf(rep_pub, sizeof rep_pub, "%s", svc_tmp("rep.pub"));
    cli_images();
    RUN(test_split_domains);
    RUN(test_small_shm);
    RUN(test_shm_fills);
    RUN(test_bad_domain_env);
    svc_cleanup(test_failures);
    return test_finish();
}
