/* kiln-soak's pieces without a service (tools/bench/soak_*.c): the memory
 * judgement flags growth after the warm-up and only that, the traffic is
 * reproducible and within its bounds, the answer check refuses what is
 * wrong, and the plot is a PNG of the requested size.  tests/service/
 * test_soak.c runs the whole tool against kiln serve. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/image.h"
#include "services/gateway/base64.h"
#include "tests/test.h"
#include "tools/bench/soak_mem.h"
#include "tools/bench/soak_opts.h"
#include "tools/bench/soak_plot.h"
#include "tools/bench/soak_traffic.h"

/* Samples once a second for 100 s of: a flat process with noise (pid 1),
 * one that grows 0.5 MiB/s (2), one born at 40 s that grows during its own
 * warm-up only (3), one gone at 60 s (4), a GPU-only one whose GPU
 * memory grows 20 MiB/s (5), and two encoders born at 30 s that grow
 * 0.5 MiB/s after their warm-up: one up to below pid 2's peak (6, its
 * arenas filling again), one past it (7). */
static void test_growth(void)
{
    kiln_soak_sample *s = calloc(600, sizeof *s);
    size_t n = 0;
    for (int t = 0; t <= 100; t++) {
        long noise = (t * 7919) % 5 * 100; /* kB */
        s[n++] = (kiln_soak_sample){t, 1, "kiln-gateway", 200000, 100 * 1024 + noise, -1};
        s[n++] = (kiln_soak_sample){t, 2, "kiln-encoder", 200000, 100 * 1024 + t * 512, -1};
        if (t >= 40) {
            int age = t - 40;
            long kb = 50 * 1024 + (age < 20 ? age * 1024 : 20 * 1024);
            s[n++] = (kiln_soak_sample){t, 3, "kiln-denoiser", 200000, kb, 4000};
        }
        if (t <= 60)
            s[n++] = (kiln_soak_sample){t, 4, "kiln-denoiser", 200000, 40 * 1024 + t * 1024, -1};
        s[n++] = (kiln_soak_sample){t, 5, "kiln-decoder", -1, -1, 3000 + 20 * t};
        if (t >= 30) {
            s[n++] = (kiln_soak_sample){t, 6, "kiln-encoder", 200000, 60 * 1024 + t * 512, -1};
            s[n++] = (kiln_soak_sample){t, 7, "kiln-encoder", 200000, 130 * 1024 + t * 512, -1};
        }
    }
    kiln_soak_growth *g;
    size_t ng = kiln_soak_mem_growth(s, n, 20, 100, 10, 1024, &g);
    CHECK(ng == 7);
    for (size_t i = 0; i < ng; i++) {
        switch (g[i].pid) {
        case 1:
            CHECKF(g[i].judged && !g[i].over && g[i].end_mb - g[i].base_mb < 1, "flat: %+.2f",
                   g[i].end_mb - g[i].base_mb);
            break;
        case 2: /* 80 s after the warm-up, medians 64 s apart: +32 MiB */
            CHECKF(g[i].judged && g[i].over && g[i].end_mb - g[i].base_mb > 25 &&
                       g[i].reach_mb < 0,
                   "growing: %+.2f", g[i].end_mb - g[i].base_mb);
            break;
        case 3: /* warm-up from 40 + 20 s: flat after */
            CHECKF(g[i].judged && !g[i].over && g[i].end_mb == g[i].base_mb &&
                       g[i].gpu_base_mb == 4000,
                   "restarted: judged %d over %d %+.2f", g[i].judged, g[i].over,
                   g[i].end_mb - g[i].base_mb);
            break;
        case 4:
            CHECK(!g[i].judged && !g[i].over && g[i].peak_mb == 100);
            break;
        case 5: /* GPU only: +1280 MiB in 64 s, over 1024 */
            CHECKF(g[i].judged && g[i].over && g[i].base_mb < 0 && g[i].gpu_peak_mb == 5000,
                   "gpu: judged %d over %d base %g", g[i].judged, g[i].over, g[i].gpu_base_mb);
            break;
        case 6: /* +20 MiB, to 110 MiB: under pid 2's 150 */
            CHECKF(g[i].judged && !g[i].over && g[i].refilled &&
                       g[i].end_mb - g[i].base_mb > 10 && g[i].reach_mb == 150,
                   "refilling: over %d %+.2f reach %g", g[i].over, g[i].end_mb - g[i].base_mb,
                   g[i].reach_mb);
            break;
        case 7: /* +20 MiB, to 180 MiB: past pid 2's 150 */
            CHECKF(g[i].judged && g[i].over && !g[i].refilled, "past the reach: over %d",
                   g[i].over);
            break;
        default:
            CHECK(0);
        }
    }
    free(g);
    /* A bound above the growth passes it. */
    ng = kiln_soak_mem_growth(s, n, 20, 100, 40, 2048, &g);
    int over = 0;
    for (size_t i = 0; i < ng; i++)
        over += g[i].over;
    CHECK(over == 0);
    free(g);
    free(s);
}

static kiln_soak_traffic *traffic(kiln_soak_opts *o, kiln_bench_prompts *p, const char *pool)
{
    char *argv[] = {"kiln-soak", "--duration", "60", "--seed", "5", "--min-side", "256",
                    "--max-side", "1024", "--edits", "0.3", "--disconnects", "0.1", "--pool",
                    (char *)pool, "--steps", "4", NULL};
    kiln_err err = {0};
    CHECKF(kiln_soak_parse_args(17, argv, o, &err) == 0, "%s", err.msg);
    static char *prompts[] = {"a fox", "a \"quoted\" lighthouse", "snow"};
    p->v = prompts;
    p->n = 3;
    kiln_soak_traffic *t = kiln_soak_traffic_create(o, p, &err);
    CHECKF(t != NULL, "%s", err.msg);
    return t;
}

static void test_traffic(void)
{
    kiln_soak_opts o, o2;
    kiln_bench_prompts p, p2;
    kiln_soak_traffic *t = traffic(&o, &p, "0"), *t2 = traffic(&o2, &p2, "0");
    if (!t || !t2)
        return;
    CHECK(o.kill_at_s == 20 && o.stop_at_s == 40 && o.stop_for_s == 30 && o.warmup_s == 12);
    int edits = 0, leave = 0, square = 0, ns[5] = {0}, fmt[3] = {0};
    const int N = 2000;
    for (int k = 0; k < N; k++) {
        kiln_soak_req a, b;
        kiln_soak_traffic_request(t, (uint64_t)k, &a);
        kiln_soak_traffic_request(t2, (uint64_t)k, &b);
        CHECK(!memcmp(&a, &b, sizeof a)); /* the same seed, the same request */
        CHECK(a.width >= 256 && a.width <= 1024 && a.width % 16 == 0);
        CHECK(a.height >= 256 && a.height <= 1024 && a.height % 16 == 0);
        CHECK(a.n >= 1 && a.n <= 4 && (!a.edit || (a.n_refs >= 1 && a.n_refs <= 4)));
        edits += a.edit, leave += a.leave, square += a.width == a.height;
        ns[a.n]++, fmt[a.format]++;
    }
    CHECKF(abs(edits - 600) < 100 && abs(leave - 200) < 60 && square > N / 3 && square < N / 2,
           "%d edits, %d leave, %d square", edits, leave, square);
    CHECKF(ns[1] > ns[2] && ns[2] > ns[4] && ns[4] > 0 && fmt[0] > fmt[1] && fmt[2] > 0,
           "n %d %d %d %d, formats %d %d %d", ns[1], ns[2], ns[3], ns[4], fmt[0], fmt[1], fmt[2]);
    /* An edit's body: multipart with each reference's file, byte for byte. */
    kiln_soak_req r = {0};
    for (uint64_t k = 0; !r.edit || r.n_refs < 2; k++)
        kiln_soak_traffic_request(t, k, &r);
    kiln_buf body = {0};
    char ctype[128];
    kiln_err err = {0};
    CHECK(kiln_soak_traffic_body(t, &r, &body, ctype, sizeof ctype, &err) == 0);
    CHECK(!strncmp(ctype, "multipart/form-data; boundary=", 30));
    CHECK(!strcmp(kiln_soak_req_path(&r), "/v1/images/edits"));
    for (int i = 0; i < r.n_refs; i++) {
        const kiln_soak_ref *ref = &t->refs[r.refs[i]];
        CHECK(memmem(body.data, body.len, ref->bytes.data, ref->bytes.len) != NULL);
    }
    /* A generation's: JSON with the prompt escaped. */
    do
        kiln_soak_traffic_request(t, r.k + 1, &r);
    while (r.edit || r.prompt != 1);
    CHECK(kiln_soak_traffic_body(t, &r, &body, ctype, sizeof ctype, &err) == 0);
    CHECK(!strcmp(ctype, "application/json") &&
          memmem(body.data, body.len, "a \\\"quoted\\\" lighthouse", 23) &&
          memmem(body.data, body.len, "\"num_inference_steps\":4", 23));
    kiln_buf_free(&body);
    kiln_soak_traffic_destroy(t);
    kiln_soak_traffic_destroy(t2);
    /* With a pool, every request is one of its entries. */
    t = traffic(&o, &p, "7");
    for (int k = 0; t && k < 200; k++) {
        kiln_soak_req a, e;
        kiln_soak_traffic_request(t, (uint64_t)k, &a);
        CHECK(a.pool_index >= 0 && a.pool_index < 7);
        kiln_soak_traffic_pool_entry(t, a.pool_index, &e);
        CHECK(a.width == e.width && a.height == e.height && a.seed == e.seed && a.n == e.n &&
              a.edit == e.edit && a.prompt == e.prompt);
    }
    kiln_soak_traffic_destroy(t);
}

/* A 200 body for r holding `files` (PNG) with the given seeds. */
static void answer(kiln_buf *out, const kiln_buf *files, int n, uint64_t seed0)
{
    kiln_buf_clear(out);
    kiln_buf_append(out, "{\"data\":[", 9, NULL);
    for (int i = 0; i < n; i++) {
        char head[64];
        snprintf(head, sizeof head, "%s{\"seed\":%llu,\"b64_json\":\"", i ? "," : "",
                 (unsigned long long)(seed0 + (uint64_t)i));
        kiln_buf_append(out, head, strlen(head), NULL);
        kiln_base64_encode(files[i].data, files[i].len, out, NULL);
        kiln_buf_append(out, "\"}", 2, NULL);
    }
    kiln_buf_append(out, "]}", 2, NULL);
}

static void test_check(void)
{
    uint8_t px[64 * 32 * 3] = {0};
    kiln_image img = {64, 32, px};
    kiln_buf files[2] = {{0}};
    CHECK(kiln_image_encode(&img, NULL, &files[0], NULL) == 0);
    CHECK(kiln_image_encode(&img, NULL, &files[1], NULL) == 0);
    kiln_soak_req r = {.width = 64, .height = 32, .n = 2, .format = KILN_IMAGE_PNG, .seed = 9};
    kiln_buf body = {0};
    kiln_soak_images im;
    kiln_err err = {0};
    answer(&body, files, 2, 9);
    CHECKF(kiln_soak_check(&r, 200, &body, &im, &err) == 0 && im.n == 2, "%s", err.msg);
    CHECK(im.files[1].len == files[1].len);
    kiln_soak_images_free(&im);
    answer(&body, files, 2, 10); /* wrong seeds */
    CHECK(kiln_soak_check(&r, 200, &body, &im, &err) != 0 && strstr(err.msg, "seed"));
    kiln_soak_images_free(&im);
    answer(&body, files, 1, 9); /* one image short */
    CHECK(kiln_soak_check(&r, 200, &body, &im, &err) != 0);
    kiln_soak_images_free(&im);
    r.height = 48; /* another size */
    answer(&body, files, 2, 9);
    CHECK(kiln_soak_check(&r, 200, &body, &im, &err) != 0 && strstr(err.msg, "64x32"));
    kiln_soak_images_free(&im);
    r.height = 32, r.format = KILN_IMAGE_JPEG; /* another format */
    CHECK(kiln_soak_check(&r, 200, &body, &im, &err) != 0 && strstr(err.msg, "JPEG"));
    kiln_soak_images_free(&im);
    const char *e503 = "{\"error\":{\"message\":\"no denoiser\",\"type\":\"server_error\"}}";
    kiln_buf_clear(&body);
    kiln_buf_append(&body, e503, strlen(e503), NULL);
    CHECK(kiln_soak_check(&r, 503, &body, &im, &err) != 0 && strstr(err.msg, "HTTP 503: no denoiser"));
    kiln_soak_images_free(&im);
    kiln_buf_free(&body);
    kiln_buf_free(&files[0]);
    kiln_buf_free(&files[1]);
}

static void test_plot(void)
{
    double x[] = {0, 10, 20, 30}, y[] = {5, 7, 6, 9};
    kiln_plot_series s[] = {{"gateway 12", x, y, 4}};
    kiln_plot_mark m[] = {{"kill denoise", 15}};
    kiln_err err = {0};
    kiln_plot *p = kiln_plot_new(640, 400, &err);
    CHECK(p != NULL);
    if (!p)
        return;
    kiln_plot_panel(p, 0, 400, "RssAnon (MiB)", "seconds", s, 1, m, 1);
    char path[] = "/tmp/kiln-soak-plot-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0 && kiln_plot_write(p, path, &err) == 0);
    kiln_plot_free(p);
    kiln_image img = {0};
    CHECKF(kiln_image_read_file(path, NULL, &img, &err) == 0, "%s", err.msg);
    CHECK(img.width == 640 && img.height == 400);
    long colored = 0; /* the series' blue and the mark's red */
    for (long i = 0; img.pixels && i < 640L * 400; i++) {
        const uint8_t *q = img.pixels + 3 * i;
        colored += (q[0] == 31 && q[1] == 119 && q[2] == 180) || (q[0] == 200 && !q[1] && !q[2]);
    }
    CHECKF(colored > 500, "%ld coloured pixels", colored);
    kiln_image_free(&img);
    if (fd >= 0)
        close(fd), unlink(path);
}

int main(void)
{
    RUN(test_growth);
    RUN(test_traffic);
    RUN(test_check);
    RUN(test_plot);
    return test_finish();
}
