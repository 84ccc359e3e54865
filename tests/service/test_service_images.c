/* Decoded images by reference (docs/ARCHITECTURE.md, "Images by
 * reference"), on the real executables (tiny klein checkpoint, CPU
 * backend):
 *
 * - `kiln serve` on one host: every image of PNG and JPEG requests of 1 to
 *   3 images comes through the decoder's /dev/shm
 *   (kiln_image_handoffs_total{via="shm"}), and is the CLI's bytes; with
 *   KILN_IMAGE_REFS=0 the same requests come inline (via="inline") with
 *   the same bytes; the decoder ends with no range in use either way.
 * - a gateway that looks like another machine's (KILN_DOMAIN_HOST) gets
 *   them inline, the same bytes.
 * - a decoder that frees its first image references before its done goes
 *   out (KILN_FAULT_INJECT=decode:stale_image_refs_at=1, as if it died
 *   and its slabs were removed before the gateway read them): that request
 *   runs again once and gets its own image, never the bytes the ranges
 *   hold by then; the gateway counts the failed hand-off and the re-run.
 * - KILN_IMAGE_REFS other than 0 or 1 stops the gateway at start (78). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

static const struct {
    const char *format, *ext;
    int n, seed;
} reqs[] = {{"png", "png", 1, 11}, {"png", "png", 3, 20}, {"jpeg", "jpg", 2, 30}};
#define N_REQS ((int)(sizeof reqs / sizeof reqs[0]))
#define N_IMAGES 6 /* of all reqs */

/* The CLI's file k of request i (cli-<i>.<ext>, or cli-<i>-<k>.<ext>
 * for several). */
static const char *cli_file(int i, int k)
{
    char name[64];
    if (reqs[i].n == 1)
        snprintf(name, sizeof name, "cli-%d.%s", i, reqs[i].ext);
    else
        snprintf(name, sizeof name, "cli-%d-%d.%s", i, k, reqs[i].ext);
    return svc_tmp(name);
}

static void cli_images(void)
{
    for (int i = 0; i < N_REQS; i++) {
        char seed[16], n[8], out[64];
        snprintf(seed, sizeof seed, "%d", reqs[i].seed);
        snprintf(n, sizeof n, "%d", reqs[i].n);
        snprintf(out, sizeof out, "cli-%d.%s", i, reqs[i].ext);
        const char *args[] = {"--prompt", "a door in a wall", "--seed", seed, "-n", n,
                              "--width", "128", "--height", "64", "--steps", "1", NULL};
        CHECK(svc_cli("generate", args, svc_tmp(out)) == 0);
    }
}

/* Request i; every image checked against the CLI's.  0 when all match. */
static int check_request(int port, int i, const char *tag)
{
    char json[256];
    snprintf(json, sizeof json,
             "{\"prompt\":\"a door in a wall\",\"size\":\"128x64\",\"seed\":%d,\"n\":%d,"
             "\"num_inference_steps\":1,\"output_format\":\"%s\"}",
             reqs[i].seed, reqs[i].n, reqs[i].format);
    gwc_response r;
    svc_images im = {0};
    int ok = svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0 &&
             svc_parse_images(&r, &im) == 0 && im.n == reqs[i].n;
    CHECKF(ok, "%s: request %d: status %d: %.*s", tag, i, r.status,
           (int)(r.body.len > 200 ? 200 : r.body.len), r.body.data ? (char *)r.body.data : "");
    gwc_response_free(&r);
    for (int k = 0; ok && k < im.n; k++) {
        int same = svc_same_file(cli_file(i, k), &im.files[k]);
        CHECKF(same, "%s: request %d: image %d of %d is not the CLI's", tag, i, k, im.n);
        ok = same;
    }
    svc_images_free(&im);
    return ok ? 0 : -1;
}

static void check_all(int port, const char *tag)
{
    for (int i = 0; i < N_REQS; i++)
        check_request(port, i, tag);
}

/* kiln_image_handoffs_total{via=`how`} now. */
static double handoffs(int port, const char *how)
{
    kiln_buf m = {0};
    char key[64];
    snprintf(key, sizeof key, "kiln_image_handoffs_total{via=\"%s\"}", how);
    double v = svc_metrics(port, &m) == 0 ? svc_metric((char *)m.data, key) : -1;
    kiln_buf_free(&m);
    return v;
}

static double metric_now(int port, const char *key)
{
    kiln_buf m = {0};
    double v = svc_metrics(port, &m) == 0 ? svc_metric((char *)m.data, key) : -1;
    kiln_buf_free(&m);
    return v;
}

/* Stops `kiln serve` and checks its replicas' exit lines: nothing held,
 * no range in use, no free refused unless `refused_ok`; keeps its log as
 * <tag>-serve.log. */
static void stop_serve(pid_t serve, const char *tag, int refused_ok)
{
    CHECK(svc_stop(serve, 60000) == 0);
    char bad[512] = "";
    CHECKF(svc_exit_reports(svc_tmp("serve.log"), bad, sizeof bad) >= 3 && !bad[0],
           "%s: %s", tag, bad);
    if (!refused_ok)
        CHECKF(svc_log_count(svc_tmp("serve.log"), " 0 free(s) refused") >= 3,
               "%s: a replica refused a free", tag);
    char keep[64];
    snprintf(keep, sizeof keep, "%s-serve.log", tag);
    rename(svc_tmp("serve.log"), svc_tmp(keep));
}

/* By reference where the gateway can open the decoder's /dev/shm, and
 * inline when told so: the same bytes, the CLI's. */
static void test_refs_and_inline(void)
{
    int port;
    pid_t serve = svc_serve(1, NULL, NULL, &port);
    CHECK(serve > 0);
    if (serve <= 0)
        return;
    check_all(port, "refs");
    CHECKF(handoffs(port, "shm") == N_IMAGES && handoffs(port, "inline") == 0 &&
               handoffs(port, "failed") == 0,
           "by reference: shm %.0f, inline %.0f, failed %.0f", handoffs(port, "shm"),
           handoffs(port, "inline"), handoffs(port, "failed"));
    CHECK(svc_wait_log(svc_tmp("serve.log"), "hand their images by reference", 1, 1000) == 0);
    stop_serve(serve, "refs", 0);

    const char *env[] = {"KILN_IMAGE_REFS=0", NULL};
    serve = svc_serve(1, NULL, env, &port);
    CHECK(serve > 0);
    if (serve <= 0)
        return;
    check_all(port, "inline");
    CHECKF(handoffs(port, "inline") == N_IMAGES && handoffs(port, "shm") == 0,
           "KILN_IMAGE_REFS=0: shm %.0f, inline %.0f", handoffs(port, "shm"),
           handoffs(port, "inline"));
    CHECK(svc_wait_log(svc_tmp("serve.log"), "KILN_IMAGE_REFS=0", 1, 1000) == 0);
    stop_serve(serve, "inline", 0);
}

/* The gateway on "another machine": the decoder's shm is out of its
 * reach, so the files come inline. */
static void test_gateway_elsewhere(void)
{
    char bus[128];
    snprintf(bus, sizeof bus, "ipc://%s/bus-elsewhere", svc.tmpdir);
    const char *gw_env[] = {"KILN_DOMAIN_HOST=another-machine", NULL};
    pid_t pids[4];
    pids[0] = svc_spawn_service("gateway", bus, NULL, gw_env);
    int port = svc_log_port(svc_tmp("gateway.log"), 30000);
    static const char *const stages[] = {"encoder", "denoiser", "decoder"};
    for (int i = 0; i < 3; i++)
        pids[i + 1] = svc_spawn_service(stages[i], bus, NULL, NULL);
    CHECK(port > 0 && svc_wait_ready(port, 60000) == 0);
    if (port > 0) {
        check_all(port, "elsewhere");
        CHECKF(handoffs(port, "inline") == N_IMAGES && handoffs(port, "shm") == 0,
               "gateway elsewhere: shm %.0f, inline %.0f", handoffs(port, "shm"),
               handoffs(port, "inline"));
    }
    for (int i = 0; i < 4; i++)
        CHECK(svc_stop(pids[i], 30000) == 0);
}

/* The decoder frees the ranges of its first done's images before it goes
 * out: the gateway finds them gone, runs the request again, and answers
 * with the request's own image. */
static void test_stale_refs(void)
{
    int port;
    const char *env[] = {"KILN_FAULT_INJECT=decode:stale_image_refs_at=1", NULL};
    pid_t serve = svc_serve(1, NULL, env, &port);
    CHECK(serve > 0);
    if (serve <= 0)
        return;
    CHECK(check_request(port, 1, "stale") == 0);
    CHECKF(handoffs(port, "failed") == 3 && handoffs(port, "shm") == 3,
           "stale: failed %.0f, shm %.0f", handoffs(port, "failed"), handoffs(port, "shm"));
    CHECK(metric_now(port, "kiln_events_total{event=\"redispatch\"}") == 1);
    CHECK(svc_log_count(svc_tmp("serve.log"), "freed before its done goes out") == 1);
    CHECK(svc_log_count(svc_tmp("serve.log"),
                        "its images from a decode replica are gone; starting over") == 1);
    /* Later requests are served as usual. */
    check_all(port, "after the fault");
    CHECK(handoffs(port, "failed") == 3 && handoffs(port, "shm") == 3 + N_IMAGES);
    /* The gateway's frees of the freed ranges are refused, and nothing is
     * left in use. */
    stop_serve(serve, "stale", 1);
}

static void test_bad_env(void)
{
    char bus[128];
    snprintf(bus, sizeof bus, "ipc://%s/bus-bad", svc.tmpdir);
    const char *env[] = {"KILN_IMAGE_REFS=yes", NULL};
    pid_t gw = svc_spawn_service("gateway", bus, NULL, env);
    CHECK(gw > 0 && svc_wait_exit(gw, 30000) == 78);
    CHECK(svc_wait_log(svc_tmp("gateway.log"), "KILN_IMAGE_REFS must be 0", 1, 1000) == 0);
}

int main(void)
{
    if (svc_init("images"))
        return 1;
    cli_images();
    RUN(test_refs_and_inline);
    RUN(test_gateway_elsewhere);
    RUN(test_stale_refs);
    RUN(test_bad_env);
    svc_cleanup(test_failures);
    return test_finish();
}
