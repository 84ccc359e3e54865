/* What an operator sees of `kiln serve`: the playground page at /, the
 * ready line with the URL once
 * every stage is up (and no URL before), one access line per request (id,
 * method, path, status, bytes, time), the model id of a Hugging Face cache
 * folder (models--ORG--NAME/snapshots/<commit> -> ORG/NAME) or of
 * --served-model-name in /v1/models and in requests, the gateway's
 * timeouts set through kiln serve, and a bad served name refused at
 * start. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tests/service/prom_lint.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

/* A Hugging Face cache snapshot of the tiny checkpoint: real folders, each
 * entry a symlink (the hub links snapshot files to blobs/). */
static int make_hub_snapshot(const char *oracle, char *out, size_t cap)
{
    const char *parts[] = {"hub", "hub/models--acme--tiny-klein",
                           "hub/models--acme--tiny-klein/snapshots",
                           "hub/models--acme--tiny-klein/snapshots/0123abcd"};
    for (int i = 0; i < 4; i++)
        if (mkdir(svc_tmp(parts[i]), 0755))
            return -1;
    snprintf(out, cap, "%s", svc_tmp(parts[3]));
    const char *entries[] = {"model_index.json", "transformer", "text_encoder", "tokenizer",
                             "vae", "scheduler"};
    for (int i = 0; i < 6; i++) {
        char from[PATH_MAX + 32], to[PATH_MAX + 32];
        snprintf(from, sizeof from, "%s/%s", oracle, entries[i]);
        snprintf(to, sizeof to, "%s/%s", out, entries[i]);
        if (symlink(from, to))
            return -1;
    }
    return 0;
}

static void test_ready_access_and_hub_name(void)
{
    char oracle[512], hub[400];
    snprintf(oracle, sizeof oracle, "%s", svc.model);
    CHECK(make_hub_snapshot(oracle, hub, sizeof hub) == 0);
    snprintf(svc.model, sizeof svc.model, "%s", hub);
    int port;
    pid_t serve = svc_serve(1, NULL, NULL, &port);
    CHECK(serve > 0);
    char ready[160];
    snprintf(ready, sizeof ready, "ready: http://127.0.0.1:%d serves model 'acme/tiny-klein'",
             port);
    CHECKF(svc_wait_log(svc_tmp("serve.log"), ready, 1, 30000) == 0, "no '%s'", ready);
    /* kiln serve itself names no URL: it is not serving yet when it starts */
    kiln_buf log = {0};
    svc_read_log(svc_tmp("serve.log"), &log);
    const char *start = log.data ? strstr((const char *)log.data, "kiln serve: starting") : NULL;
    CHECK(start && !memmem(start, strcspn(start, "\n"), "http://", 7));
    kiln_buf_free(&log);

    gwc_response r = {0};
    CHECK(gwc_request(port, "GET", "/v1/models", NULL, NULL, 0, &r, 10000) == 0 &&
          r.status == 200 && r.body.data && strstr((const char *)r.body.data,
                                                   "\"id\":\"acme/tiny-klein\""));
    gwc_response_free(&r);
    CHECK(svc_get_status(port, "/v1/models/acme/tiny-klein") == 200);

    const char *ok = "{\"prompt\":\"a cat\",\"model\":\"acme/tiny-klein\",\"size\":\"64x64\","
                     "\"num_inference_steps\":1,\"seed\":1}";
    CHECK(svc_post_json(port, "/v1/images/generations", ok, &r, SVC_T_REQ) == 0 &&
          r.status == 200);
    char id[64] = "", line[160];
    CHECK(gwc_header(&r, "X-Request-Id", id, sizeof id) == 0 && id[0]);
    size_t bytes = r.body.len;
    gwc_response_free(&r);
    snprintf(line, sizeof line, "access: %s POST /v1/images/generations 200 %zu bytes ", id, bytes);
    CHECKF(svc_wait_log(svc_tmp("serve.log"), line, 1, 10000) == 0, "no '%s'", line);
    const char *other = "{\"prompt\":\"a cat\",\"model\":\"klein-tiny\",\"size\":\"64x64\"}";
    CHECK(svc_post_json(port, "/v1/images/generations", other, &r, SVC_T_REQ) == 0 &&
          r.status >= 400 && r.status < 500);
    snprintf(line, sizeof line, " POST /v1/images/generations %d ", r.status);
    gwc_response_free(&r);
    CHECK(svc_wait_log(svc_tmp("serve.log"), line, 1, 10000) == 0);
    /* the playground page: self-contained, calling this gateway's API */
    CHECK(gwc_request(port, "GET", "/", NULL, NULL, 0, &r, 10000) == 0 && r.status == 200);
    char ctype[64] = "", csp[256] = "";
    CHECK(gwc_header(&r, "Content-Type", ctype, sizeof ctype) == 0 &&
          !strncmp(ctype, "text/html", 9));
    CHECK(gwc_header(&r, "Content-Security-Policy", csp, sizeof csp) == 0 &&
          strstr(csp, "default-src 'self'"));
    const char *page = r.body.data ? (const char *)r.body.data : "";
    CHECK(strstr(page, "<form") && strstr(page, "/v1/images/generations") &&
          strstr(page, "/v1/images/edits") && strstr(page, "id=\"seed\"") &&
          strstr(page, "id=\"steps\"") && strstr(page, "id=\"n\""));
    CHECK(!strstr(page, "src=\"http") && !strstr(page, "href=\"http") &&
          !strstr(page, "url(http") && !strstr(page, "@import"));
    gwc_response_free(&r);
    CHECK(svc_get_status(port, "/index.html") == 404);
    /* /metrics: in the exposition format promtool accepts, with the
     * families an SRE needs, filled by the request above */
    kiln_buf m = {0};
    CHECK(svc_metrics(port, &m) == 0);
    const char *t = m.data ? (const char *)m.data : "";
    char why[256] = "";
    CHECKF(prom_lint(t, why, sizeof why) == 0, "%s", why);
    CHECK(svc_metric(t, "kiln_request_duration_seconds_count{route=\"/v1/images/generations\","
                        "status=\"200\"}") == 1);
    CHECK(svc_metric(t, "kiln_request_duration_seconds_count{route=\"/v1/images/generations\","
                        "status=\"404\"}") + svc_metric(t, "kiln_request_duration_seconds_count{"
                        "route=\"/v1/images/generations\",status=\"400\"}") == 1);
    static const char *const stages[] = {"encode", "denoise", "decode"};
    for (int st = 0; st < 3; st++) {
        char k[160];
        snprintf(k, sizeof k, "kiln_queue_wait_seconds_count{stage=\"%s\",queue=\"gateway\"}",
                 stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        snprintf(k, sizeof k, "kiln_queue_wait_seconds_count{stage=\"%s\",queue=\"replica\"}",
                 stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        snprintf(k, sizeof k, "kiln_stage_duration_seconds_count{stage=\"%s\"}", stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        snprintf(k, sizeof k, "kiln_replica_jobs_total{stage=\"%s\",", stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
    }
    CHECK(strstr(t, "le=\"0.3\"") && strstr(t, "le=\"0.4\""));
    CHECK(svc_metric(t, "kiln_prompt_cache_misses_total") == 1);
    const char *bi = strstr(t, "\nkiln_build_info{version=\"");
    CHECK(bi && bi[strcspn(bi + 1, "\n")] == '1' && bi[strcspn(bi + 1, "\n") - 1] == ' ');
    CHECK(svc_metric(t, "process_resident_memory_bytes") > 1e6);
    CHECK(svc_metric(t, "process_open_fds") > 3);
    CHECK(svc_metric(t, "process_cpu_seconds_total") > 0);
    double started = svc_metric(t, "process_start_time_seconds");
    CHECKF(started > (double)time(NULL) - 600 && started <= (double)time(NULL) + 1, "%f", started);
    kiln_buf_free(&m);
    /* probes are not logged */
    CHECK(svc_get_status(port, "/healthz") == 200);
    CHECK(svc_log_count(svc_tmp("serve.log"), "access: - GET /healthz") == 0);
    CHECK(svc_stop(serve, 60000) == 0);
    snprintf(svc.model, sizeof svc.model, "%s", oracle);
}

/* The checker itself refuses what promtool refuses. */
static void test_prom_lint(void)
{
    char why[256];
    CHECK(prom_lint("# HELP a_total x\n# TYPE a_total counter\na_total 1\n", why, sizeof why) == 0);
    CHECK(prom_lint("# TYPE a counter\na 1\n", why, sizeof why) == -1);   /* no _total */
    CHECK(prom_lint("a 1\n", why, sizeof why) == -1);                      /* no TYPE */
    CHECK(prom_lint("# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
                    "h_sum 1\nh_count 1\n", why, sizeof why) == -1);      /* not cumulative */
    CHECK(prom_lint("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
                    "h_sum 1\nh_count 3\n", why, sizeof why) == -1);      /* +Inf != count */
    CHECK(prom_lint("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
                    "h_sum 1\nh_count 2\n", why, sizeof why) == 0);
    CHECK(prom_lint("# TYPE g gauge\ng{a=\"1\"} 1\ng{a=\"1\"} 2\n", why, sizeof why) == -1);
    CHECK(prom_lint("# TYPE g gauge\n# TYPE f gauge\ng 1\nf 1\ng{x=\"y\"} 1\n", why,
                    sizeof why) == -1); /* g's samples apart */
    CHECK(prom_lint("# TYPE g gauge\ng{a=\"x\\q\"} 1\n", why, sizeof why) == -1);
}

static void test_served_name_and_timeouts(void)
{
    const char *extra[] = {"--served-model-name", "klein-4b", "--header-timeout-ms", "4000",
                           "--drain-s", "5", NULL};
    int port;
    pid_t serve = svc_serve(1, extra, NULL, &port);
    CHECK(serve > 0);
    gwc_response r = {0};
    CHECK(gwc_request(port, "GET", "/v1/models", NULL, NULL, 0, &r, 10000) == 0 &&
          r.status == 200 && strstr((const char *)r.body.data, "\"id\":\"klein-4b\""));
    gwc_response_free(&r);
    kiln_buf m = {0};
    CHECK(svc_metrics(port, &m) == 0);
    CHECK(svc_metric((const char *)m.data, "kiln_limit{name=\"header_timeout_seconds\"}") == 4);
    kiln_buf_free(&m);
    CHECK(svc_stop(serve, 60000) == 0);

    /* a name that cannot be an id is refused, and the service stops */
    char port_s[16], bus[160];
    snprintf(port_s, sizeof port_s, "%d", svc_free_port());
    snprintf(bus, sizeof bus, "ipc://%s/bus2", svc.tmpdir);
    const char *bad[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                         "--bus", bus, "--served-model-name", "a\"b", NULL};
    pid_t p = svc_spawn(bad, NULL, svc_tmp("bad.log"));
    CHECK(p > 0 && svc_wait_exit(p, 60000) == 1);
    CHECK(svc_log_count(svc_tmp("bad.log"), "--served-model-name takes") == 1);
}

int main(void)
{
    if (svc_init("serve_ux"))
        return 1;
    RUN(test_prom_lint);
    RUN(test_ready_access_and_hub_name);
    RUN(test_served_name_and_timeouts);
    svc_cleanup(test_failures);
    return test_finish();
}
