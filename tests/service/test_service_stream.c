/* Streaming with previews (partial_images) through `kiln serve` on the
 * tiny klein and Z-Image checkpoints (CPU), over raw HTTP:
 * - a streamed generation with partial_images 1..3 (one and two images)
 *   answers with chunked server-sent events: per image that many
 *   image_generation.partial_image events, partial_image_index 0.. in
 *   order, each a PNG of the size that is not the final image, all before
 *   the completed events, whose images (and seeds) are the non-streamed
 *   request's, byte for byte; a run of fewer steps sends fewer previews
 *   (one per step before the last);
 * - an inpainting edit (multipart, image + mask) streams image_edit.*
 *   events the same way, its completed image the non-streamed edit's;
 * - Z-Image (its 9 default steps): three previews, the same final bytes;
 * - a client that goes away after its first preview stops the denoiser
 *   (the replica logs how soon after the cancel it stopped) long before
 *   the run could have ended, and the gateway is left with no job. */
#include <cjson/cJSON.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/image.h"
#include "common/log.h"
#include "services/gateway/base64.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define T_REQ 120000

typedef struct sse_event {
    char event[48], type[48];
    int index; /* partial_image_index, -1 when absent */
    uint64_t seed;
    int has_usage;
    kiln_buf image;
} sse_event;

typedef struct sse {
    int n;
    sse_event ev[64];
} sse;

static void sse_free(sse *s)
{
    for (int i = 0; i < s->n; i++)
        kiln_buf_free(&s->ev[i].image);
    s->n = 0;
}

/* Splits a text/event-stream body into its events; 0 when every event
 * is "event: NAME\ndata: {json}" with an image. */
static int sse_parse(const kiln_buf *body, sse *s)
{
    memset(s, 0, sizeof *s);
    char *text = malloc(body->len + 1);
    memcpy(text, body->data, body->len);
    text[body->len] = '\0';
    int bad = 0;
    for (char *p = text, *next; *p && !bad; p = next) {
        char *end = strstr(p, "\n\n");
        if (!end) {
            bad = 1;
            break;
        }
        *end = '\0';
        next = end + 2;
        sse_event *e = &s->ev[s->n];
        char *data = strstr(p, "\ndata: ");
        if (s->n == 64 || strncmp(p, "event: ", 7) || !data) {
            bad = 1;
            break;
        }
        snprintf(e->event, sizeof e->event, "%.*s", (int)(data - p - 7), p + 7);
        cJSON *j = cJSON_Parse(data + 7);
        const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "type"));
        const char *b64 = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "b64_json"));
        const cJSON *idx = cJSON_GetObjectItemCaseSensitive(j, "partial_image_index");
        const cJSON *seed = cJSON_GetObjectItemCaseSensitive(j, "seed");
        e->index = cJSON_IsNumber(idx) ? idx->valueint : -1;
        e->seed = cJSON_IsNumber(seed) ? (uint64_t)seed->valuedouble : 0;
        e->has_usage = cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(j, "usage"));
        if (type)
            snprintf(e->type, sizeof e->type, "%s", type);
        if (!type || !b64 || kiln_base64_decode(b64, strlen(b64), &e->image, NULL))
            bad = 1;
        cJSON_Delete(j);
        s->n++;
    }
    free(text);
    return bad ? -1 : 0;
}

/* The checks of the header on one streamed answer: `kind` is
 * "image_generation" or "image_edit"; plain holds the non-streamed
 * request's images. */
static void check_stream(const char *what, const gwc_response *r, const char *kind, int previews,
                         const svc_images *plain, int w, int h)
{
    CHECKF(r->status == 200, "%s: status %d", what, r->status);
    char v[64] = "";
    CHECKF(!gwc_header(r, "Content-Type", v, sizeof v) && !strcmp(v, "text/event-stream"),
           "%s: content type %s", what, v);
    CHECKF(previews == 0 || (!gwc_header(r, "Transfer-Encoding", v, sizeof v) &&
                             !strcmp(v, "chunked")),
           "%s: a stream with previews is not chunked", what);
    sse s;
    CHECKF(sse_parse(&r->body, &s) == 0, "%s: malformed events: %.300s", what,
           (const char *)r->body.data);
    int n = plain->n, want = n * (previews + 1);
    CHECKF(s.n == want, "%s: %d events, want %d", what, s.n, want);
    if (s.n != want) {
        sse_free(&s);
        return;
    }
    char partial[64], completed[64];
    snprintf(partial, sizeof partial, "%s.partial_image", kind);
    snprintf(completed, sizeof completed, "%s.completed", kind);
    int seen[16] = {0}; /* previews so far per image */
    for (int i = 0; i < s.n; i++) {
        sse_event *e = &s.ev[i];
        CHECKF(!strcmp(e->event, e->type), "%s: event %s carries type %s", what, e->event,
               e->type);
        int img = -1;
        for (int k = 0; k < n; k++)
            if (plain->seeds[k] == e->seed)
                img = k;
        CHECKF(img >= 0, "%s: event %d names seed %llu", what, i, (unsigned long long)e->seed);
        if (img < 0)
            continue;
        if (i < n * previews) {
            /* previews first, each image's in index order */
            CHECKF(!strcmp(e->type, partial) && e->index == seen[img] && !e->has_usage,
                   "%s: event %d is %s index %d (want %s %d)", what, i, e->type, e->index,
                   partial, seen[img]);
            seen[img]++;
            kiln_image im = {0};
            CHECKF(kiln_image_decode(e->image.data, e->image.len, NULL, &im, NULL) == KILN_OK &&
                       im.width == w && im.height == h,
                   "%s: preview %d is no %dx%d image", what, i, w, h);
            kiln_image_free(&im);
            CHECKF(e->image.len != plain->files[img].len ||
                       memcmp(e->image.data, plain->files[img].data, e->image.len),
                   "%s: preview %d is the final image", what, i);
        } else {
            CHECKF(!strcmp(e->type, completed) && e->index < 0 && e->has_usage,
                   "%s: event %d is %s (want %s with usage)", what, i, e->type, completed);
            CHECKF(e->image.len == plain->files[img].len &&
                       !memcmp(e->image.data, plain->files[img].data, e->image.len),
                   "%s: the completed image of seed %llu is not the non-streamed one", what,
                   (unsigned long long)e->seed);
        }
    }
    for (int k = 0; k < n; k++)
        CHECKF(seen[k] == previews, "%s: image %d got %d previews", what, k, seen[k]);
    sse_free(&s);
}

static int port;

static void generate_case(const char *what, const char *params, int previews, int w, int h)
{
    char plain_json[512], stream_json[600];
    snprintf(plain_json, sizeof plain_json, "{\"prompt\":\"a lighthouse\",%s}", params);
    gwc_response a, b;
    svc_images plain;
    CHECK(svc_post_json(port, "/v1/images/generations", plain_json, &a, T_REQ) == 0);
    CHECKF(a.status == 200 && svc_parse_images(&a, &plain) == 0, "%s: plain status %d", what,
           a.status);
    snprintf(stream_json, sizeof stream_json, "%.*s,\"stream\":true}",
             (int)strlen(plain_json) - 1, plain_json);
    CHECK(svc_post_json(port, "/v1/images/generations", stream_json, &b, T_REQ) == 0);
    check_stream(what, &b, "image_generation", previews, &plain, w, h);
    svc_images_free(&plain);
    gwc_response_free(&a), gwc_response_free(&b);
}

static void test_generate(void)
{
    generate_case("one image, 1 preview", "\"size\":\"64x64\",\"seed\":3,\"partial_images\":1",
                  1, 64, 64);
    generate_case("one image, 2 previews",
                  "\"size\":\"64x96\",\"seed\":4,\"partial_images\":2", 2, 64, 96);
    generate_case("two images, 3 previews",
                  "\"size\":\"64x64\",\"seed\":5,\"n\":2,\"partial_images\":3", 3, 64, 64);
    /* 2 steps: one step before the last, one preview */
    generate_case("2 steps", "\"size\":\"64x64\",\"seed\":6,\"num_inference_steps\":2,"
                  "\"partial_images\":3", 1, 64, 64);
    generate_case("no previews", "\"size\":\"64x64\",\"seed\":7,\"partial_images\":0", 0, 64,
                  64);
}

/* A multipart edit of `img` with `mask`; stream adds stream and
 * partial_images fields. */
static void post_edit(const kiln_buf *img, const kiln_buf *mask, int stream, gwc_response *r)
{
    kiln_buf body = {0};
    const char *head = "--kilnS\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na red door\r\n"
                       "--kilnS\r\nContent-Disposition: form-data; name=\"seed\"\r\n\r\n12\r\n";
    kiln_buf_append(&body, head, strlen(head), NULL);
    if (stream) {
        const char *s = "--kilnS\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n"
                        "--kilnS\r\nContent-Disposition: form-data; name=\"partial_images\"\r\n\r\n"
                        "2\r\n";
        kiln_buf_append(&body, s, strlen(s), NULL);
    }
    const char *ih = "--kilnS\r\nContent-Disposition: form-data; name=\"image\"; filename=\"i.png\"\r\n"
                     "Content-Type: image/png\r\n\r\n";
    kiln_buf_append(&body, ih, strlen(ih), NULL);
    kiln_buf_append(&body, img->data, img->len, NULL);
    const char *mh = "\r\n--kilnS\r\nContent-Disposition: form-data; name=\"mask\"; filename=\"m.png\"\r\n"
                     "Content-Type: image/png\r\n\r\n";
    kiln_buf_append(&body, mh, strlen(mh), NULL);
    kiln_buf_append(&body, mask->data, mask->len, NULL);
    kiln_buf_append(&body, "\r\n--kilnS--\r\n", 13, NULL);
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "multipart/form-data; boundary=kilnS",
                      body.data, body.len, r, T_REQ) == 0);
    kiln_buf_free(&body);
}

static void test_edit(void)
{
    enum { W = 64, H = 96 };
    kiln_image im = {0}, mk = {0};
    CHECK(kiln_image_alloc(&im, W, H, NULL) == KILN_OK && kiln_image_alloc(&mk, W, H, NULL) == KILN_OK);
    for (int i = 0; i < W * H * 3; i++) {
        im.pixels[i] = (uint8_t)((i * 37) % 256);
        mk.pixels[i] = (i / 3) % W < W / 2 ? 255 : 0; /* read by luminance: white repaints */
    }
    kiln_buf img = {0}, mask = {0};
    CHECK(kiln_image_encode(&im, NULL, &img, NULL) == KILN_OK &&
          kiln_image_encode(&mk, NULL, &mask, NULL) == KILN_OK);
    gwc_response a, b;
    svc_images plain;
    post_edit(&img, &mask, 0, &a);
    CHECKF(a.status == 200 && svc_parse_images(&a, &plain) == 0, "edit: status %d", a.status);
    post_edit(&img, &mask, 1, &b);
    check_stream("inpainting edit", &b, "image_edit", 2, &plain, W, H);
    svc_images_free(&plain);
    gwc_response_free(&a), gwc_response_free(&b);
    kiln_image_free(&im), kiln_image_free(&mk);
    kiln_buf_free(&img), kiln_buf_free(&mask);
}

/* Reads from fd until `needle` has arrived; 0, or -1 on timeout or EOF. */
static int read_until(int fd, const char *needle, int timeout_ms)
{
    kiln_buf in = {0};
    double t0 = kiln_now_ms();
    int found = 0;
    while (!found && kiln_now_ms() - t0 < timeout_ms) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 200) <= 0)
            continue;
        char buf[65536];
        ssize_t n = read(fd, buf, sizeof buf);
        if (n <= 0)
            break;
        kiln_buf_append(&in, buf, (size_t)n, NULL);
        found = memmem(in.data, in.len, needle, strlen(needle)) != NULL;
    }
    kiln_buf_free(&in);
    return found ? 0 : -1;
}

static void test_disconnect(void)
{
    /* 40 steps, previews at steps 9, 19 and 29: the client leaves after
     * the first, about three quarters of the run before its end. */
    const char *json = "{\"prompt\":\"leave early\",\"size\":\"64x64\",\"seed\":8,"
                       "\"num_inference_steps\":40,\"stream\":true,\"partial_images\":3}";
    kiln_buf req = {0};
    gwc_format(&req, "POST", "/v1/images/generations", "application/json", json, strlen(json), 0);
    size_t from = svc_log_size(svc_tmp("serve.log"));
    int fd = gwc_connect(port);
    CHECK(fd >= 0 && gwc_send(fd, req.data, req.len, 5000) == 0);
    kiln_buf_free(&req);
    CHECKF(read_until(fd, "event: image_generation.partial_image", T_REQ) == 0,
           "no preview arrived");
    close(fd);
    char last[256] = "";
    CHECKF(svc_wait_idle(port, 60000, last, sizeof last) == 0, "jobs left: %s", last);
    /* The denoiser says how soon after the cancel it stopped. */
    CHECK(svc_wait_log(svc_tmp("serve.log"), " ms after its cancel", 1, 30000) == 0);
    kiln_buf log = {0};
    svc_read_log(svc_tmp("serve.log"), &log);
    const char *p = log.len > from ? strstr((const char *)log.data + from, "kiln-denoiser: job ") : NULL;
    const char *stop = p ? strstr(p, " stopped ") : NULL;
    double after = stop ? atof(stop + strlen(" stopped ")) : -1;
    const char *into = stop ? strstr(stop, " after its cancel, ") : NULL;
    double ran = into ? atof(into + strlen(" after its cancel, ")) : -1;
    /* At the cancel at least 10 of the 40 steps had run (the preview of
     * step 9 had reached the client) and at most 30 were left: had the
     * cancel not stopped it, finishing would have taken longer than what
     * it ran before, whatever the machine's load. */
    CHECKF(stop && into && after >= 0 && after < ran / 2,
           "the denoiser did not stop soon after the cancel (%.0f ms after it, %.0f ms into its "
           "run)", after, ran);
    kiln_buf_free(&log);
}

static void test_zimage(void)
{
    char zmodel[PATH_MAX];
    snprintf(zmodel, sizeof zmodel, "%s/oracle/ckpt/zimage-tiny", getenv("KILN_SHARED"));
    int zport = svc_free_port();
    char port_s[16], bus[PATH_MAX + 16], tmpdir_env[PATH_MAX + 8];
    snprintf(port_s, sizeof port_s, "%d", zport);
    snprintf(bus, sizeof bus, "ipc://%s/zbus", svc.tmpdir);
    snprintf(tmpdir_env, sizeof tmpdir_env, "TMPDIR=%s", svc.tmpdir);
    const char *env[] = {tmpdir_env, NULL};
    const char *argv[] = {svc_exe("tools/kiln"), "serve", "--model", zmodel, "--port", port_s,
                          "--bus", bus, "--min-size", "64", "--max-size", "128", NULL};
    pid_t serve = svc_spawn(argv, env, svc_tmp("zserve.log"));
    CHECKF(serve > 0 && svc_wait_ready(zport, 90000) == 0, "kiln serve (Z-Image) did not get ready");
    if (serve > 0 && !test_failures) {
        int keep = port;
        port = zport;
        /* the Turbo recipe's 9 steps: previews after steps 2, 4 and 6 */
        generate_case("Z-Image, 3 previews", "\"size\":\"64x64\",\"seed\":11,\"partial_images\":3",
                      3, 64, 64);
        port = keep;
    }
    if (serve > 0)
        CHECK(svc_stop(serve, 30000) == 0);
}

int main(void)
{
    if (svc_init("stream"))
        return 1;
    pid_t serve = svc_serve(1, NULL, NULL, &port);
    CHECKF(serve > 0, "kiln serve did not get ready");
    if (serve > 0) {
        RUN(test_generate);
        RUN(test_edit);
        RUN(test_disconnect);
        CHECK(svc_stop(serve, 30000) == 0);
    }
    RUN(test_zimage);
    svc_cleanup(test_failures);
    return test_finish();
}
