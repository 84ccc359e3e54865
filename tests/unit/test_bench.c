/* kiln-bench (tools/bench/): arguments, statistics, the /metrics reader,
 * request bodies and response checks, the prompt list, and the HTTP client
 * against a small scripted server on a loopback socket (keep-alive,
 * chunked bodies, a connection the server closed while idle, errors). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/image.h"
#include "services/gateway/base64.h"
#include "tests/test.h"
#include "tools/bench/bench_args.h"
#include "tools/bench/bench_http.h"
#include "tools/bench/bench_metrics.h"
#include "tools/bench/bench_run.h"
#include "tools/bench/bench_stats.h"

static int parse(kiln_bench_opts *o, kiln_err *err, int argc, const char **argv)
{
    return kiln_bench_parse_args(argc, (char **)argv, o, err);
}

static void test_args(void)
{
    kiln_bench_opts o;
    kiln_err err = {0};
    CHECK(parse(&o, &err, 1, (const char *[]){"kiln-bench"}) == KILN_OK);
    CHECK(o.latency && o.throughput && o.warmup == 3 && o.n_latency == 20);
    CHECK(o.n_conc == 3 && o.conc[0] == 4 && o.conc[1] == 8 && o.conc[2] == 16);
    CHECK(o.images == 32 && o.repeats == 3 && o.width == 1024 && o.height == 1024);
    CHECK(!strcmp(o.format, "png") && o.steps == 0 && !o.model);

    const char *full[] = {"kiln-bench", "--url", "http://10.0.0.2:9000", "--mode", "latency",
                          "--size", "512x768", "--steps", "4", "--format", "webp",
                          "--model", "klein-4b", "--concurrency", "1,2", "--images", "8",
                          "--repeats", "2", "--requests", "5", "--warmup", "0",
                          "--timeout", "30", "--json", "-", "--label", "x"};
    CHECK(parse(&o, &err, (int)(sizeof full / sizeof *full), full) == KILN_OK);
    CHECK(o.latency && !o.throughput && o.width == 512 && o.height == 768 && o.steps == 4);
    CHECK(!strcmp(o.format, "webp") && !strcmp(o.model, "klein-4b"));
    CHECK(o.n_conc == 2 && o.conc[0] == 1 && o.conc[1] == 2 && o.images == 8);
    CHECK(o.repeats == 2 && o.n_latency == 5 && o.warmup == 0 && o.timeout_s == 30);
    CHECK(!strcmp(o.json, "-") && !strcmp(o.label, "x"));

    CHECK(parse(&o, &err, 2, (const char *[]){"kiln-bench", "--help"}) == KILN_OK && o.help);

    static const char *bad[][2] = {
        {"--size", "1024"},      {"--size", "0x10"},  {"--steps", "0"},
        {"--format", "gif"},     {"--mode", "fast"},  {"--concurrency", "4,,8"},
        {"--concurrency", "0"},  {"--repeats", "65"}, {"--timeout", "-1"},
        {"--requests", "2x"},    {"--bogus", "1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kiln_err_clear(&err);
        CHECKF(parse(&o, &err, 3, (const char *[]){"kiln-bench", bad[i][0], bad[i][1]}) ==
                   KILN_ERR_INVALID,
               "%s %s", bad[i][0], bad[i][1]);
        CHECK(strstr(err.msg, bad[i][0]) != NULL);
    }
    CHECK(parse(&o, &err, 2, (const char *[]){"kiln-bench", "--steps"}) == KILN_ERR_INVALID);
    CHECK(parse(&o, &err, 2, (const char *[]){"kiln-bench", "stray"}) == KILN_ERR_INVALID);
}

static void test_stats(void)
{
    double odd[] = {5, 1, 3};
    CHECK(kiln_bench_median(odd, 3) == 3);
    double even[] = {4, 1, 3, 2};
    CHECK(kiln_bench_median(even, 4) == 2.5);
    /* n = 20: ceil(0.95 * 20) = 19th smallest, the second largest. */
    double v[20];
    for (int i = 0; i < 20; i++)
        v[i] = (double)(20 - i); /* 20..1 */
    kiln_bench_summary s;
    kiln_bench_summarize(v, 20, &s);
    CHECK(s.n == 20 && s.min == 1 && s.max == 20 && s.p95 == 19);
    CHECK(s.median == 10.5 && s.mean == 10.5);
    double one[] = {7};
    kiln_bench_summarize(one, 1, &s);
    CHECK(s.median == 7 && s.p95 == 7 && s.min == 7 && s.max == 7);
    double p[] = {10, 20, 30, 40, 50};
    CHECK(kiln_bench_percentile(p, 5, 50) == 30 && kiln_bench_percentile(p, 5, 1) == 10);
    kiln_bench_summarize(NULL, 0, &s);
    CHECK(s.n == 0 && s.median == 0);
}

static const char *metrics_before =
    "# HELP kiln_latency_seconds Request latency by phase.\n"
    "# TYPE kiln_latency_seconds histogram\n"
    "kiln_latency_seconds_bucket{phase=\"encode\",le=\"+Inf\"} 2\n"
    "kiln_latency_seconds_sum{phase=\"encode\"} 0.100000\n"
    "kiln_latency_seconds_count{phase=\"encode\"} 2\n"
    "kiln_latency_seconds_sum{phase=\"decode\"} 1.0\n"
    "kiln_latency_seconds_count{phase=\"decode\"} 4\n"
    "kiln_jobs 0\n";

static const char *metrics_after =
    "kiln_latency_seconds_sum{phase=\"encode\"} 0.400000\r\n"
    "kiln_latency_seconds_count{phase=\"encode\"} 5\r\n"
    "kiln_latency_seconds_sum{phase=\"decode\"} 1.0\n"
    "kiln_latency_seconds_count{phase=\"decode\"} 4\n"
    "  kiln_latency_seconds_sum{phase=\"total\"} 3\n"
    "kiln_latency_seconds_count{phase=\"total\"} 3 1700000000000\n"
    "kiln_batch_rows_sum{stage=\"encode\"} 9\n"
    "kiln_batch_rows_count{stage=\"encode\"} 3\n"
    "odd_seconds_sum{path=\"a}b\\\"c\"} 2.5\n"
    "odd_seconds_count{path=\"a}b\\\"c\"} +Inf\n"
    "kiln_jobs 1\n";

static void test_metrics(void)
{
    kiln_err err = {0};
    kiln_prom *b = kiln_prom_parse(metrics_before, strlen(metrics_before), &err);
    kiln_prom *a = kiln_prom_parse(metrics_after, strlen(metrics_after), &err);
    CHECKF(a && b, "%s", err.msg);
    if (!a || !b)
        return;
    double v;
    CHECK(kiln_prom_size(b) == 6);
    CHECK(kiln_prom_get(a, "kiln_jobs", "", &v) && v == 1);
    CHECK(kiln_prom_get(a, "odd_seconds_sum", "path=\"a}b\\\"c\"", &v) && v == 2.5);
    CHECK(!kiln_prom_get(a, "kiln_jobs", "x=\"1\"", &v));

    kiln_bench_stage *st;
    size_t n;
    CHECK(kiln_bench_stage_deltas(b, a, &st, &n, &err) == KILN_OK);
    /* encode grew by 3 (0.3 s), decode did not, total is new, batch_rows is
     * not a _seconds family; odd_seconds grew by +Inf observations. */
    CHECK(n == 3);
    if (n == 3) {
        CHECK(!strcmp(st[0].family, "kiln_latency_seconds") &&
              !strcmp(st[0].labels, "phase=\"encode\""));
        CHECK(st[0].count == 3);
        CHECK_NEAR(st[0].sum_s, 0.3, 1e-12);
        CHECK(!strcmp(st[1].labels, "phase=\"total\"") && st[1].count == 3 && st[1].sum_s == 3);
        CHECK(!strcmp(st[2].family, "odd_seconds"));
    }
    free(st);
    kiln_prom_free(a);
    kiln_prom_free(b);

    static const char *bad[] = {"1abc 3\n", "name{a=\"1\" 3\n", "name 3x\n", "name\n",
                                "name{a=\"}\"}\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kiln_err_clear(&err);
        kiln_prom *p = kiln_prom_parse(bad[i], strlen(bad[i]), &err);
        CHECKF(!p && err.code == KILN_ERR_FORMAT && strstr(err.msg, "line 1"), "'%s'", bad[i]);
        kiln_prom_free(p);
    }
}

/* A response body as the gateway writes it, holding `img` as `fmt`. */
static void images_body(kiln_buf *out, const kiln_image *img, kiln_image_format fmt, long seed)
{
    kiln_err err = {0};
    kiln_image_encode_opts eo = KILN_IMAGE_ENCODE_DEFAULTS;
    eo.format = fmt;
    kiln_buf file = {0}, b64 = {0};
    CHECK(kiln_image_encode(img, &eo, &file, &err) == KILN_OK);
    CHECK(kiln_base64_encode(file.data, file.len, &b64, &err) == KILN_OK);
    char head[128];
    int n = snprintf(head, sizeof head, "{\"created\":1,\"data\":[{\"seed\":%ld,\"b64_json\":\"",
                     seed);
    kiln_buf_clear(out);
    kiln_buf_append(out, head, (size_t)n, &err);
    kiln_buf_append(out, b64.data, b64.len, &err);
    kiln_buf_append(out, "\"}]}", 4, &err);
    kiln_buf_free(&file);
    kiln_buf_free(&b64);
}

static void test_request_and_check(void)
{
    kiln_bench_opts o;
    kiln_err err = {0};
    const char *argv[] = {"kiln-bench", "--size", "48x32", "--steps", "4", "--model", "m"};
    CHECK(parse(&o, &err, 7, argv) == KILN_OK);

    kiln_buf body = {0};
    CHECK(kiln_bench_request_body(&o, "a \"quoted\" prompt", 17, &body, &err) == KILN_OK);
    cJSON *j = cJSON_ParseWithLength((const char *)body.data, body.len);
    CHECK(j != NULL);
    CHECK(!strcmp(cJSON_GetObjectItem(j, "prompt")->valuestring, "a \"quoted\" prompt"));
    CHECK(cJSON_GetObjectItem(j, "seed")->valuedouble == 17);
    CHECK(cJSON_GetObjectItem(j, "n")->valuedouble == 1);
    CHECK(!strcmp(cJSON_GetObjectItem(j, "size")->valuestring, "48x32"));
    CHECK(cJSON_GetObjectItem(j, "num_inference_steps")->valuedouble == 4);
    CHECK(!strcmp(cJSON_GetObjectItem(j, "model")->valuestring, "m"));
    CHECK(!strcmp(cJSON_GetObjectItem(j, "response_format")->valuestring, "b64_json"));
    CHECK(!strcmp(cJSON_GetObjectItem(j, "output_format")->valuestring, "png"));
    cJSON_Delete(j);

    kiln_image img = {0}, other = {0};
    CHECK(kiln_image_alloc(&img, 48, 32, &err) == KILN_OK);
    CHECK(kiln_image_alloc(&other, 32, 48, &err) == KILN_OK);
    memset(img.pixels, 90, 48 * 32 * 3);
    memset(other.pixels, 90, 48 * 32 * 3);
    images_body(&body, &img, KILN_IMAGE_PNG, 17);
    CHECK(kiln_bench_check_response(&o, 200, &body, 17, &err) == KILN_OK);
    kiln_err_clear(&err);
    CHECK(kiln_bench_check_response(&o, 200, &body, 18, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "seed"));
    images_body(&body, &other, KILN_IMAGE_PNG, 17);
    CHECK(kiln_bench_check_response(&o, 200, &body, 17, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "32x48"));
    images_body(&body, &img, KILN_IMAGE_JPEG, 17);
    CHECK(kiln_bench_check_response(&o, 200, &body, 17, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "not a PNG"));
    o.format = "jpeg";
    CHECK(kiln_bench_check_response(&o, 200, &body, 17, &err) == KILN_OK);
    o.format = "webp";
    CHECK(kiln_bench_check_response(&o, 200, &body, 17, &err) == KILN_ERR_INVALID);
    images_body(&body, &img, KILN_IMAGE_WEBP, 17);
    CHECK(kiln_bench_check_response(&o, 200, &body, 17, &err) == KILN_OK);

    const char *e = "{\"error\":{\"message\":\"queue full\",\"type\":\"rate_limit_error\"}}";
    kiln_buf_clear(&body);
    kiln_buf_append(&body, e, strlen(e), &err);
    CHECK(kiln_bench_check_response(&o, 429, &body, 17, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "429") && strstr(err.msg, "queue full"));
    const char *two = "{\"data\":[{\"b64_json\":\"\",\"seed\":1},{\"b64_json\":\"\",\"seed\":1}]}";
    kiln_buf_clear(&body);
    kiln_buf_append(&body, two, strlen(two), &err);
    CHECK(kiln_bench_check_response(&o, 200, &body, 1, &err) == KILN_ERR_INVALID);
    kiln_buf_clear(&body);
    kiln_buf_append(&body, "<html>", 6, &err);
    CHECK(kiln_bench_check_response(&o, 200, &body, 1, &err) == KILN_ERR_INVALID);
    kiln_image_free(&img);
    kiln_image_free(&other);
    kiln_buf_free(&body);
}

static void test_prompts(void)
{
    kiln_err err = {0};
    char path[4096];
    snprintf(path, sizeof path, "%s/tools/bench/prompts.txt", getenv("KILN_SOURCE_ROOT"));
    kiln_bench_prompts p;
    CHECKF(kiln_bench_prompts_load(path, &p, &err) == KILN_OK, "%s", err.msg);
    CHECK(p.n == 100);
    for (size_t i = 0; i < p.n; i++)
        for (size_t k = i + 1; k < p.n; k++)
            CHECKF(strcmp(p.v[i], p.v[k]), "prompts %zu and %zu repeat", i, k);
    kiln_bench_prompts_free(&p);
    CHECK(kiln_bench_prompts_load("/nonexistent/prompts.txt", &p, &err) == KILN_ERR_IO);
}

static void test_url(void)
{
    char host[64];
    int port;
    kiln_err err = {0};
    CHECK(kiln_http_parse_url("http://example.org", host, sizeof host, &port, &err) == KILN_OK &&
          !strcmp(host, "example.org") && port == 80);
    CHECK(kiln_http_parse_url("http://127.0.0.1:8000/", host, sizeof host, &port, &err) ==
              KILN_OK && !strcmp(host, "127.0.0.1") && port == 8000);
    CHECK(kiln_http_parse_url("http://[::1]:81", host, sizeof host, &port, &err) == KILN_OK &&
          !strcmp(host, "::1") && port == 81);
    static const char *bad[] = {"https://a", "http://", "http://a:0", "http://a:70000",
                                "http://a/v1", "http://[::1", "a:80"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECKF(kiln_http_parse_url(bad[i], host, sizeof host, &port, &err) == KILN_ERR_INVALID,
               "%s", bad[i]);
}

/* --- a scripted HTTP server ------------------------------------------------ */

typedef struct script {
    int listen_fd;
    /* Per request, in order: the raw response, and whether to close the
     * connection after it. */
    const char *resp[8];
    int close_after[8];
    int n;
    char paths[8][64]; /* what each request asked for */
} script;

/* Reads one request (headers + Content-Length body); 0 at EOF. */
static int read_request(int fd, char *path, size_t path_len)
{
    char buf[8192];
    size_t len = 0;
    char *end = NULL;
    while (!end) {
        ssize_t k = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        if (k <= 0)
            return 0;
        len += (size_t)k;
        buf[len] = '\0';
        end = strstr(buf, "\r\n\r\n");
    }
    const char *cl = strstr(buf, "Content-Length: ");
    size_t want = cl ? (size_t)atol(cl + 16) : 0, have = len - (size_t)(end + 4 - buf);
    while (have < want) {
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k <= 0)
            return 0;
        have += (size_t)k;
    }
    sscanf(buf, "%*s %63s", path);
    (void)path_len;
    return 1;
}

static void *serve(void *arg)
{
    script *s = arg;
    int i = 0;
    while (i < s->n) {
        int fd = accept(s->listen_fd, NULL, NULL);
        if (fd < 0)
            break;
        for (;;) {
            if (!read_request(fd, s->paths[i], sizeof s->paths[i]))
                break;
            send(fd, s->resp[i], strlen(s->resp[i]), MSG_NOSIGNAL);
            if (s->close_after[i++] || i == s->n)
                break;
        }
        close(fd);
    }
    return NULL;
}

static void test_http_client(void)
{
    script s = {0};
    s.listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    CHECK(s.listen_fd >= 0 && !bind(s.listen_fd, (struct sockaddr *)&a, sizeof a) &&
          !listen(s.listen_fd, 4) && !getsockname(s.listen_fd, (struct sockaddr *)&a, &al));
    s.resp[0] = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
    s.resp[1] = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    s.close_after[1] = 1; /* the server drops the kept-alive connection */
    s.resp[2] = "HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}";
    s.resp[3] = "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close";
    s.close_after[3] = 1;
    s.resp[4] = "SMTP ready\r\n";
    s.close_after[4] = 1;
    s.n = 5;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, serve, &s) == 0);

    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", ntohs(a.sin_port));
    kiln_err err = {0};
    kiln_http_client *c = kiln_http_client_create(url, 10, &err);
    kiln_buf body = {0};
    int status = 0;
    CHECK(c != NULL);
    CHECK(kiln_http_request(c, "POST", "/v1/x", "application/json", "{\"a\":1}", 7, &status,
                            &body, &err) == KILN_OK);
    CHECK(status == 200 && body.len == 5 && !memcmp(body.data, "hello", 5));
    CHECK(kiln_http_request(c, "GET", "/metrics", NULL, NULL, 0, &status, &body, &err) ==
          KILN_OK);
    CHECK(status == 200 && body.len == 5 && !memcmp(body.data, "abcde", 5));
    /* The server closed that connection: the client notices and reconnects. */
    CHECKF(kiln_http_request(c, "GET", "/missing", NULL, NULL, 0, &status, &body, &err) ==
               KILN_OK, "%s", err.msg);
    CHECK(status == 404 && body.len == 2);
    CHECK(kiln_http_request(c, "GET", "/close", NULL, NULL, 0, &status, &body, &err) == KILN_OK);
    CHECK(status == 200 && body.len == 11 && !memcmp(body.data, "until close", 11));
    kiln_err_clear(&err);
    CHECK(kiln_http_request(c, "GET", "/smtp", NULL, NULL, 0, &status, &body, &err) ==
          KILN_ERR_FORMAT);
    pthread_join(th, NULL);
    CHECK(!strcmp(s.paths[0], "/v1/x") && !strcmp(s.paths[1], "/metrics") &&
          !strcmp(s.paths[2], "/missing") && !strcmp(s.paths[3], "/close"));
    close(s.listen_fd);
    /* Nobody listens there any more. */
    kiln_err_clear(&err);
    CHECK(kiln_http_request(c, "GET", "/", NULL, NULL, 0, &status, &body, &err) == KILN_ERR_IO &&
          strstr(err.msg, "connect"));
    kiln_buf_free(&body);
    kiln_http_client_destroy(c);
}

int main(void)
{
    RUN(test_args);
    RUN(test_stats);
    RUN(test_metrics);
    RUN(test_request_and_check);
    RUN(test_prompts);
    RUN(test_url);
    RUN(test_http_client);
    return test_finish();
}
