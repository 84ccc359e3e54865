/* The service end to end: kiln-gateway and one replica of each stage (the
 * real executables, as `kiln serve` starts them) on the tiny klein
 * checkpoint, driven over HTTP by a plain-socket client.  Checks that
 * - generations and edits (multipart, and JSON with base64 / data URLs)
 *   return the same PNG / JPEG bytes as `kiln generate` / `kiln edit` with
 *   the same parameters, every image carrying its seed; a request without
 *   a seed gets a fresh one that reproduces the image;
 * - bad input gets the right status and OpenAI error body, and the gateway
 *   keeps serving: malformed JSON, wrong types, sizes out of range or not
 *   multiples of 16, n out of range, an unknown model, response_format
 *   url, an oversized body, broken multipart, a non-image upload, unknown
 *   routes and methods, slowloris requests (408 then close);
 * - 64 concurrent mixed-size requests over 16 connections (pipelined) all
 *   succeed with the right sizes and seeds and distinct images (a few
 *   checked against the CLI);
 * - clients that disconnect mid-request leave no job behind (/metrics
 *   gauges back to 0) and the service still answers;
 * - past --max-connections a connection gets 503; without replicas
 *   /readyz and requests answer 503;
 * - SIGTERM drains: an accepted request is still answered, then the
 *   gateway exits 0. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/image.h"
#include "common/log.h"
#include "services/gateway/base64.h"
#include "tests/service/gw_client.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define T_REQ 120000 /* ms for one image request */

static const char *build_root;
static char model[512], tmpdir[64], bus[128];
static int port;
static pid_t pids[4]; /* gateway, encoder, denoiser, decoder */

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts))
        ;
}

static pid_t spawn(const char *const *argv, const char *log)
{
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static int run_wait(const char *const *argv)
{
    char log[128];
    snprintf(log, sizeof log, "%s/cli.log", tmpdir);
    pid_t pid = spawn(argv, log);
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int read_file(const char *path, kiln_buf *out)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        kiln_buf_append(out, buf, n, NULL);
    fclose(f);
    return 0;
}

/* The port the gateway logged once it listens. */
static int gateway_port(const char *log)
{
    for (int i = 0; i < 200; i++) {
        kiln_buf b = {0};
        if (read_file(log, &b) == 0 && b.len) {
            kiln_buf_append(&b, "", 1, NULL);
            const char *p = strstr((const char *)b.data, "on http://127.0.0.1:");
            int v = p ? atoi(p + strlen("on http://127.0.0.1:")) : 0;
            kiln_buf_free(&b);
            if (v > 0)
                return v;
        }
        kiln_buf_free(&b);
        sleep_ms(50);
    }
    return -1;
}

static int get_status(const char *path)
{
    gwc_response r;
    int st = gwc_request(port, "GET", path, NULL, NULL, 0, &r, 5000) ? -1 : r.status;
    gwc_response_free(&r);
    return st;
}

/* ---- responses ---- */

typedef struct images {
    int n;
    kiln_buf files[16];
    uint64_t seeds[16];
    char size[32], format[16];
} images;

static void images_free(images *im)
{
    for (int i = 0; i < im->n; i++)
        kiln_buf_free(&im->files[i]);
    memset(im, 0, sizeof *im);
}

/* Parses an OpenAI images response; 0 when well-formed. */
static int parse_images(const gwc_response *r, images *im)
{
    memset(im, 0, sizeof *im);
    cJSON *j = cJSON_ParseWithLength((const char *)r->body.data, r->body.len);
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(j, "data");
    int ok = j && cJSON_IsArray(data) && cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "created"));
    const char *size = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "size"));
    const char *fmt = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "output_format"));
    ok = ok && size && fmt;
    if (ok) {
        snprintf(im->size, sizeof im->size, "%s", size);
        snprintf(im->format, sizeof im->format, "%s", fmt);
    }
    /* Seeds are exact in the text even past 2^53 (a double is not): read
     * them from the text, in order. */
    const char *seed_at = r->body.len ? (const char *)r->body.data : "";
    const char *body_end = seed_at + r->body.len;
    const cJSON *it;
    cJSON_ArrayForEach(it, data)
    {
        const char *b64 = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "b64_json"));
        const cJSON *seed = cJSON_GetObjectItemCaseSensitive(it, "seed");
        ok = ok && b64 && cJSON_IsNumber(seed) && im->n < 16 &&
             cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(it, "revised_prompt"));
        if (!ok)
            break;
        seed_at = memmem(seed_at, (size_t)(body_end - seed_at), "\"seed\":", 7);
        ok = seed_at != NULL;
        if (!ok)
            break;
        seed_at += 7;
        im->seeds[im->n] = strtoull(seed_at, NULL, 10);
        ok = kiln_base64_decode(b64, strlen(b64), &im->files[im->n], NULL) == KILN_OK;
        im->n++;
    }
    cJSON_Delete(j);
    return ok ? 0 : -1;
}

/* Checks an error response: status, JSON shape, param and code. */
static void check_error(const gwc_response *r, int status, const char *param, const char *code,
                        const char *what)
{
    CHECKF(r->status == status, "%s: status %d, want %d: %.*s", what, r->status, status,
           (int)r->body.len, r->body.data ? (char *)r->body.data : "");
    cJSON *j = cJSON_ParseWithLength((const char *)r->body.data, r->body.len);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    const char *msg = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "message"));
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "type"));
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(e, "param");
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "code");
    CHECKF(msg && msg[0] && type && p && c, "%s: not an OpenAI error body", what);
    if (msg)
        CHECKF(!strstr(msg, "/work/") && !strstr(msg, tmpdir), "%s: leaks a path: %s", what, msg);
    if (param)
        CHECKF(cJSON_IsString(p) && !strcmp(p->valuestring, param), "%s: param %s", what,
               cJSON_IsString(p) ? p->valuestring : "null");
    if (code)
        CHECKF(cJSON_IsString(c) && !strcmp(c->valuestring, code), "%s: code %s", what,
               cJSON_IsString(c) ? c->valuestring : "null");
    cJSON_Delete(j);
}

static int post_json(const char *path, const char *json, gwc_response *r)
{
    return gwc_request(port, "POST", path, "application/json", json, strlen(json), r, T_REQ);
}

/* Runs the CLI and compares its files with the service's images. */
static void compare_cli(const char *cmd, const char *const *extra, const images *im,
                        const char *ext, const char *what)
{
    char out[256];
    snprintf(out, sizeof out, "%s/cli.%s", tmpdir, ext);
    const char *argv[64];
    int n = 0;
    char exe[512];
    snprintf(exe, sizeof exe, "%s/tools/kiln", build_root);
    argv[n++] = exe;
    argv[n++] = cmd;
    argv[n++] = "--model";
    argv[n++] = model;
    argv[n++] = "--text-encoder-out-layers";
    argv[n++] = "1,2,3";
    argv[n++] = "--no-metadata"; /* the service's PNGs carry no text chunks */
    argv[n++] = "--out";
    argv[n++] = out;
    for (int i = 0; extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    CHECKF(run_wait(argv) == 0, "%s: kiln %s failed (see %s/cli.log)", what, cmd, tmpdir);
    for (int i = 0; i < im->n; i++) {
        char name[300];
        if (im->n == 1)
            snprintf(name, sizeof name, "%s", out);
        else
            snprintf(name, sizeof name, "%s/cli-%d.%s", tmpdir, i, ext);
        kiln_buf f = {0};
        CHECKF(read_file(name, &f) == 0, "%s: no %s", what, name);
        CHECKF(f.len == im->files[i].len && !memcmp(f.data, im->files[i].data, f.len),
               "%s: image %d differs from kiln %s (%zu vs %zu bytes)", what, i, cmd,
               im->files[i].len, f.len);
        kiln_buf_free(&f);
    }
}

/* ---- tests ---- */

static void test_generate_matches_cli(void)
{
    gwc_response r;
    images im;
    CHECK(post_json("/v1/images/generations",
                    "{\"model\":\"klein-tiny\",\"prompt\":\"a red fox\",\"size\":\"64x128\","
                    "\"seed\":1234,\"n\":2,\"num_inference_steps\":2,\"quality\":\"auto\"}",
                    &r) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    CHECK(parse_images(&r, &im) == 0);
    CHECK(im.n == 2 && im.seeds[0] == 1234 && im.seeds[1] == 1235);
    CHECK(!strcmp(im.size, "64x128") && !strcmp(im.format, "png"));
    /* OpenAI's response fields: quality and background as served, usage
     * in the transformer's tokens (512 text, 2 x (64/16)(128/16) out). */
    cJSON *j = cJSON_ParseWithLength((const char *)r.body.data, r.body.len);
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "quality")), "auto"));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "background")), "opaque"));
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
    CHECK(cJSON_GetObjectItemCaseSensitive(u, "input_tokens")->valuedouble == 512);
    CHECK(cJSON_GetObjectItemCaseSensitive(u, "output_tokens")->valuedouble == 64);
    CHECK(cJSON_GetObjectItemCaseSensitive(u, "total_tokens")->valuedouble == 576);
    cJSON_Delete(j);
    char rid[80] = "";
    CHECK(gwc_header(&r, "X-Request-Id", rid, sizeof rid) == 0 && strlen(rid) == 20 &&
          !strncmp(rid, "req_", 4));
    gwc_response_free(&r);
    const char *args[] = {"--prompt", "a red fox", "--seed", "1234", "--width", "64", "--height",
                          "128", "--steps", "2", "-n", "2", NULL};
    compare_cli("generate", args, &im, "png", "generate n=2");
    /* Keep image 0 as an edit reference. */
    char ref[128];
    snprintf(ref, sizeof ref, "%s/ref0.png", tmpdir);
    FILE *f = fopen(ref, "wb");
    fwrite(im.files[0].data, 1, im.files[0].len, f);
    fclose(f);
    snprintf(ref, sizeof ref, "%s/ref1.png", tmpdir);
    f = fopen(ref, "wb");
    fwrite(im.files[1].data, 1, im.files[1].len, f);
    fclose(f);
    images_free(&im);

    CHECK(post_json("/v1/images/generations",
                    "{\"prompt\":\"a boat\",\"size\":\"128x64\",\"seed\":99,"
                    "\"num_inference_steps\":1,\"output_format\":\"jpeg\"}",
                    &r) == 0);
    CHECK(r.status == 200 && parse_images(&r, &im) == 0 && im.n == 1 && !strcmp(im.format, "jpeg"));
    gwc_response_free(&r);
    const char *jargs[] = {"--prompt", "a boat", "--seed", "99", "--width", "128", "--height",
                           "64", "--steps", "1", NULL};
    compare_cli("generate", jargs, &im, "jpg", "generate jpeg");
    images_free(&im);
}

static void test_edit_matches_cli(void)
{
    char ref0[128], ref1[128];
    snprintf(ref0, sizeof ref0, "%s/ref0.png", tmpdir);
    snprintf(ref1, sizeof ref1, "%s/ref1.png", tmpdir);
    kiln_buf a = {0}, b = {0};
    CHECK(read_file(ref0, &a) == 0 && read_file(ref1, &b) == 0);
    /* multipart, one image, no size: the reference's size (64x128). */
    kiln_buf body = {0};
    const char *head = "--kilnB\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nmake it blue\r\n"
                       "--kilnB\r\nContent-Disposition: form-data; name=\"seed\"\r\n\r\n77\r\n"
                       "--kilnB\r\nContent-Disposition: form-data; name=\"num_inference_steps\"\r\n\r\n2\r\n"
                       "--kilnB\r\nContent-Disposition: form-data; name=\"image\"; filename=\"r.png\"\r\n"
                       "Content-Type: image/png\r\n\r\n";
    kiln_buf_append(&body, head, strlen(head), NULL);
    kiln_buf_append(&body, a.data, a.len, NULL);
    kiln_buf_append(&body, "\r\n--kilnB--\r\n", 13, NULL);
    gwc_response r;
    images im;
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "multipart/form-data; boundary=kilnB",
                      body.data, body.len, &r, T_REQ) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    CHECK(parse_images(&r, &im) == 0 && im.n == 1 && im.seeds[0] == 77 && !strcmp(im.size, "64x128"));
    gwc_response_free(&r);
    const char *args[] = {"--image", ref0, "--prompt", "make it blue", "--seed", "77", "--steps",
                          "2", NULL};
    compare_cli("edit", args, &im, "png", "edit multipart");
    images_free(&im);
    kiln_buf_free(&body);

    /* JSON, two references: a data URL and plain base64. */
    kiln_buf ea = {0}, eb = {0}, json = {0};
    kiln_base64_encode(a.data, a.len, &ea, NULL);
    kiln_base64_encode(b.data, b.len, &eb, NULL);
    const char *p1 = "{\"prompt\":\"two foxes\",\"seed\":5,\"size\":\"128x128\",\"num_inference_steps\":1,"
                     "\"image\":[\"data:image/png;base64,";
    kiln_buf_append(&json, p1, strlen(p1), NULL);
    kiln_buf_append(&json, ea.data, ea.len, NULL);
    kiln_buf_append(&json, "\",\"", 3, NULL);
    kiln_buf_append(&json, eb.data, eb.len, NULL);
    kiln_buf_append(&json, "\"]}", 3, NULL);
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "application/json", json.data, json.len, &r,
                      T_REQ) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    CHECK(parse_images(&r, &im) == 0 && im.n == 1 && !strcmp(im.size, "128x128"));
    gwc_response_free(&r);
    const char *args2[] = {"--image", ref0, "--image", ref1, "--prompt", "two foxes", "--seed", "5",
                           "--width", "128", "--height", "128", "--steps", "1", NULL};
    compare_cli("edit", args2, &im, "png", "edit JSON two refs");
    /* OpenAI's JSON edit form gives the same image. */
    kiln_buf_clear(&json);
    const char *p2 = "{\"prompt\":\"two foxes\",\"seed\":5,\"size\":\"128x128\","
                     "\"num_inference_steps\":1,\"images\":[{\"image_url\":\"data:image/png;base64,";
    kiln_buf_append(&json, p2, strlen(p2), NULL);
    kiln_buf_append(&json, ea.data, ea.len, NULL);
    kiln_buf_append(&json, "\"},{\"image_url\":\"", 17, NULL);
    kiln_buf_append(&json, eb.data, eb.len, NULL);
    kiln_buf_append(&json, "\"}]}", 4, NULL);
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "application/json", json.data, json.len, &r,
                      T_REQ) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    images im2;
    CHECK(parse_images(&r, &im2) == 0 && im2.n == 1);
    CHECK(im2.files[0].len == im.files[0].len &&
          !memcmp(im2.files[0].data, im.files[0].data, im.files[0].len));
    gwc_response_free(&r);
    images_free(&im2);
    images_free(&im);

    /* Image-to-image: strength over HTTP is kiln edit --strength. */
    kiln_buf_clear(&json);
    const char *p3 = "{\"prompt\":\"a blue fox\",\"seed\":9,\"strength\":0.5,"
                     "\"num_inference_steps\":2,\"images\":[{\"image_url\":\"";
    kiln_buf_append(&json, p3, strlen(p3), NULL);
    kiln_buf_append(&json, ea.data, ea.len, NULL);
    kiln_buf_append(&json, "\"}]}", 4, NULL);
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "application/json", json.data, json.len, &r,
                      T_REQ) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    CHECK(parse_images(&r, &im) == 0 && im.n == 1 && !strcmp(im.size, "64x128"));
    gwc_response_free(&r);
    const char *args3[] = {"--image", ref0, "--prompt", "a blue fox", "--seed", "9", "--steps", "2",
                           "--strength", "0.5", NULL};
    compare_cli("edit", args3, &im, "png", "img2img strength 0.5");
    images_free(&im);

    /* A 100x76 image: img2img resizes it to 96x64 (not the edit
     * references' center crop), in the encoder (the job's `start`) as in
     * kiln edit. */
    char odd[1024];
    snprintf(odd, sizeof odd, "%s/tests/data/oracle/klein_img2img_100x76/input.png",
             getenv("KILN_SOURCE_ROOT") ? getenv("KILN_SOURCE_ROOT") : "..");
    kiln_buf oddf = {0}, eo = {0};
    CHECK(read_file(odd, &oddf) == 0);
    kiln_base64_encode(oddf.data, oddf.len, &eo, NULL);
    kiln_buf_clear(&json);
    const char *p5 = "{\"prompt\":\"a blue fox\",\"seed\":9,\"strength\":0.6,"
                     "\"num_inference_steps\":2,\"images\":[{\"image_url\":\"";
    kiln_buf_append(&json, p5, strlen(p5), NULL);
    kiln_buf_append(&json, eo.data, eo.len, NULL);
    kiln_buf_append(&json, "\"}]}", 4, NULL);
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "application/json", json.data, json.len, &r,
                      T_REQ) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    CHECK(parse_images(&r, &im) == 0 && im.n == 1 && !strcmp(im.size, "96x64"));
    gwc_response_free(&r);
    const char *args5[] = {"--image", odd, "--prompt", "a blue fox", "--seed", "9", "--steps", "2",
                           "--strength", "0.6", NULL};
    compare_cli("edit", args5, &im, "png", "img2img of a 100x76 image");
    images_free(&im);
    kiln_buf_free(&oddf), kiln_buf_free(&eo);

    /* Inpainting: a multipart mask (ref1, read by its luminance) over
     * HTTP is kiln edit --mask. */
    kiln_buf mp = {0};
    const char *mh = "--kilnM\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na green fox\r\n"
                     "--kilnM\r\nContent-Disposition: form-data; name=\"seed\"\r\n\r\n12\r\n"
                     "--kilnM\r\nContent-Disposition: form-data; name=\"num_inference_steps\"\r\n\r\n2\r\n"
                     "--kilnM\r\nContent-Disposition: form-data; name=\"image\"; filename=\"i.png\"\r\n"
                     "Content-Type: image/png\r\n\r\n";
    kiln_buf_append(&mp, mh, strlen(mh), NULL);
    kiln_buf_append(&mp, a.data, a.len, NULL);
    const char *mm = "\r\n--kilnM\r\nContent-Disposition: form-data; name=\"mask\"; filename=\"m.png\"\r\n"
                     "Content-Type: image/png\r\n\r\n";
    kiln_buf_append(&mp, mm, strlen(mm), NULL);
    kiln_buf_append(&mp, b.data, b.len, NULL);
    kiln_buf_append(&mp, "\r\n--kilnM--\r\n", 13, NULL);
    CHECK(gwc_request(port, "POST", "/v1/images/edits", "multipart/form-data; boundary=kilnM",
                      mp.data, mp.len, &r, T_REQ) == 0);
    CHECKF(r.status == 200, "status %d: %.*s", r.status, (int)r.body.len, (char *)r.body.data);
    CHECK(parse_images(&r, &im) == 0 && im.n == 1 && !strcmp(im.size, "64x128"));
    gwc_response_free(&r);
    const char *args4[] = {"--image", ref0, "--mask", ref1, "--prompt", "a green fox", "--seed",
                           "12", "--steps", "2", NULL};
    compare_cli("edit", args4, &im, "png", "inpaint with a mask");
    images_free(&im);
    kiln_buf_free(&mp);
    kiln_buf_free(&ea), kiln_buf_free(&eb), kiln_buf_free(&json);
    kiln_buf_free(&a), kiln_buf_free(&b);
}

static void test_random_seed(void)
{
    const char *req = "{\"prompt\":\"a tree\",\"size\":\"64x64\",\"num_inference_steps\":1}";
    gwc_response r1, r2, r3;
    images a, b, c;
    CHECK(post_json("/v1/images/generations", req, &r1) == 0 && r1.status == 200);
    CHECK(post_json("/v1/images/generations", req, &r2) == 0 && r2.status == 200);
    CHECK(parse_images(&r1, &a) == 0 && parse_images(&r2, &b) == 0 && a.n == 1 && b.n == 1);
    CHECKF(a.seeds[0] != b.seeds[0], "two requests without a seed got seed %llu",
           (unsigned long long)a.seeds[0]);
    char again[256];
    snprintf(again, sizeof again,
             "{\"prompt\":\"a tree\",\"size\":\"64x64\",\"num_inference_steps\":1,\"seed\":%llu}",
             (unsigned long long)a.seeds[0]);
    CHECK(post_json("/v1/images/generations", again, &r3) == 0 && r3.status == 200);
    CHECK(parse_images(&r3, &c) == 0 && c.n == 1 && c.seeds[0] == a.seeds[0]);
    CHECK(c.files[0].len == a.files[0].len && !memcmp(c.files[0].data, a.files[0].data, a.files[0].len));
    images_free(&a), images_free(&b), images_free(&c);
    gwc_response_free(&r1), gwc_response_free(&r2), gwc_response_free(&r3);
}

/* stream: true: OpenAI's server-sent events, the same image as without. */
static void test_stream(void)
{
    const char *plain = "{\"prompt\":\"a tree\",\"size\":\"64x64\",\"num_inference_steps\":1,"
                        "\"seed\":5}";
    const char *streamed = "{\"prompt\":\"a tree\",\"size\":\"64x64\",\"num_inference_steps\":1,"
                           "\"seed\":5,\"stream\":true,\"partial_images\":2}";
    gwc_response a, b;
    images im;
    CHECK(post_json("/v1/images/generations", plain, &a) == 0 && a.status == 200);
    CHECK(parse_images(&a, &im) == 0 && im.n == 1);
    CHECK(post_json("/v1/images/generations", streamed, &b) == 0);
    CHECKF(b.status == 200, "status %d: %.*s", b.status, (int)b.body.len, (char *)b.body.data);
    char ctype[64] = "";
    CHECK(gwc_header(&b, "Content-Type", ctype, sizeof ctype) == 0 &&
          !strcmp(ctype, "text/event-stream"));
    kiln_buf_append(&b.body, "", 1, NULL);
    const char *text = (const char *)b.body.data;
    static const char head[] = "event: image_generation.completed\ndata: ";
    CHECK(!strncmp(text, head, sizeof head - 1));
    const char *data = strstr(text, "data: ");
    cJSON *j = data ? cJSON_Parse(data + 6) : NULL;
    const char *b64 = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "b64_json"));
    kiln_buf png = {0};
    CHECK(b64 && kiln_base64_decode(b64, strlen(b64), &png, NULL) == KILN_OK);
    CHECK(im.n == 1 && png.len == im.files[0].len &&
          !memcmp(png.data, im.files[0].data, png.len));
    CHECK(cJSON_GetObjectItemCaseSensitive(j, "usage") != NULL);
    cJSON_Delete(j);
    kiln_buf_free(&png);
    images_free(&im);
    gwc_response_free(&a), gwc_response_free(&b);
}

typedef struct bad_case {
    const char *path, *ctype, *body;
    int status;
    const char *param, *code, *what;
} bad_case;

static void test_bad_inputs(void)
{
    static const bad_case cases[] = {
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",", 400, NULL, "invalid_json", "malformed JSON"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"n\":\"2\"}", 400, "n", "invalid_type", "n as a string"},
        {"/v1/images/generations", "application/json", "{\"prompt\":[\"x\"]}", 400, "prompt", "invalid_type", "prompt as a list"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"sise\":\"64x64\"}", 400, "sise", "unknown_parameter", "unknown field"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"\",\"size\":\"64x64\"}", 400, "prompt", "empty_string", "empty prompt"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"quality\":\"best\"}", 400, "quality", "invalid_value", "invalid quality"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"background\":\"transparent\"}", 400, "background", "unsupported_value", "transparent background"},
        {"/v1/images/generations", "multipart/form-data; boundary=zz", "--zz\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n--zz\r\nContent-Disposition: form-data; name=\"colour\"\r\n\r\nred\r\n--zz--\r\n", 400, "colour", "unknown_parameter", "unknown form field"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"size\":\"256x256\"}", 400, "size", NULL, "size above --max-size"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"size\":\"32x64\"}", 400, "size", NULL, "size below --min-size"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"size\":\"72x64\"}", 400, "size", NULL, "size not a multiple of 16"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"size\":\"64x64\",\"n\":0}", 400, "n", "integer_below_min_value", "n = 0"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"size\":\"64x64\",\"n\":11}", 400, "n", "integer_above_max_value", "n = 11"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"model\":\"gpt-image-1\"}", 400, "model", "model_not_found", "unknown model"},
        {"/v1/images/generations", "application/json", "{\"prompt\":\"x\",\"response_format\":\"url\"}", 400, "response_format", NULL, "url responses"},
        {"/v1/images/generations", "application/json", "{\"size\":\"64x64\"}", 400, "prompt", "missing_required_parameter", "no prompt"},
        {"/v1/images/edits", "multipart/form-data; boundary=zz", "--zz\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx", 400, NULL, "invalid_multipart", "broken multipart"},
        {"/v1/images/edits", "multipart/form-data; boundary=zz", "--zz\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n--zz\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\nthis is text\r\n--zz--\r\n", 400, "image", "invalid_image", "non-image upload"},
        {"/v1/images/edits", "application/json", "{\"prompt\":\"x\"}", 400, "image", NULL, "edit without image"},
        {"/v1/nothing", NULL, NULL, 404, NULL, "not_found", "unknown route"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_case *c = &cases[i];
        gwc_response r;
        int rc = c->body ? gwc_request(port, "POST", c->path, c->ctype, c->body, strlen(c->body), &r, 10000)
                         : gwc_request(port, "GET", c->path, NULL, NULL, 0, &r, 10000);
        CHECKF(rc == 0, "%s: no response", c->what);
        if (!rc)
            check_error(&r, c->status, c->param, c->code, c->what);
        gwc_response_free(&r);
        CHECKF(get_status("/healthz") == 200, "%s: the gateway stopped serving", c->what);
    }
    /* Every answer has an X-Request-Id: the client's when it gave a
     * usable one, else the gateway's own (a fresh one each time). */
    gwc_response r;
    char rid[80];
    const char *paths[][2] = {{"GET", "/healthz"}, {"GET", "/nowhere"},
                              {"POST", "/v1/images/generations"}, {"GET", "/metrics"}};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        CHECK(gwc_request_h(port, paths[i][0], paths[i][1], "application/json",
                            "X-Request-Id: client-abc.123\r\n", "{}", 2, &r, 5000) == 0);
        CHECKF(gwc_header(&r, "X-Request-Id", rid, sizeof rid) == 0 &&
                   !strcmp(rid, "client-abc.123"), "%s: X-Request-Id '%s'", paths[i][1], rid);
        gwc_response_free(&r);
    }
    char first[80] = "";
    for (int i = 0; i < 2; i++) {
        CHECK(gwc_request_h(port, "GET", "/healthz", NULL, "X-Request-Id: no spaces please\r\n",
                            NULL, 0, &r, 5000) == 0);
        CHECK(gwc_header(&r, "X-Request-Id", rid, sizeof rid) == 0 && !strncmp(rid, "req_", 4) &&
              strlen(rid) == 20 && strcmp(rid, first) != 0);
        snprintf(first, sizeof first, "%s", rid);
        gwc_response_free(&r);
    }

    /* Wrong method, with Allow. */
    CHECK(gwc_request(port, "GET", "/v1/images/generations", NULL, NULL, 0, &r, 5000) == 0);
    check_error(&r, 405, NULL, "method_not_allowed", "GET on generations");
    char allow[64] = "";
    CHECK(gwc_header(&r, "Allow", allow, sizeof allow) == 0 && !strcmp(allow, "POST"));
    gwc_response_free(&r);

    /* A body over --max-body-mb (1 MiB): 413 before the body is read. */
    size_t big = (1u << 20) + 1;
    char *body = malloc(big);
    memset(body, ' ', big);
    CHECK(gwc_request(port, "POST", "/v1/images/generations", "application/json", body, big, &r,
                      10000) == 0);
    check_error(&r, 413, NULL, "too_large", "oversized body");
    gwc_response_free(&r);
    free(body);
    CHECK(get_status("/healthz") == 200);

    /* Keep-alive with pipelining: two requests in one write, answered in
     * order on the same connection, an error in between included. */
    int fd = gwc_connect(port);
    kiln_buf req = {0}, in = {0};
    gwc_format(&req, "GET", "/healthz", NULL, NULL, 0, 0);
    gwc_format(&req, "POST", "/v1/images/generations", "application/json", "{", 1, 0);
    gwc_format(&req, "GET", "/v1/models", NULL, NULL, 0, 0);
    CHECK(gwc_send(fd, req.data, req.len, 5000) == 0);
    gwc_response a, b, c;
    CHECK(gwc_read_response(fd, &in, &a, 5000) == 0 && a.status == 200);
    CHECK(gwc_read_response(fd, &in, &b, 5000) == 0 && b.status == 400);
    CHECK(gwc_read_response(fd, &in, &c, 5000) == 0 && c.status == 200);
    CHECK(c.body.len && strstr((const char *)c.body.data, "\"id\":\"klein-tiny\"") != NULL);
    gwc_response_free(&a), gwc_response_free(&b), gwc_response_free(&c);
    kiln_buf_free(&req), kiln_buf_free(&in);
    close(fd);

    /* Slowloris: headers that never end (408 after --header-timeout-ms),
     * and a body that never completes (408 after --read-timeout-ms); each
     * connection is then closed. */
    int slow_h = gwc_connect(port), slow_b = gwc_connect(port);
    const char *ph = "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    const char *pb = "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
    CHECK(gwc_send(slow_h, ph, strlen(ph), 1000) == 0 && gwc_send(slow_b, pb, strlen(pb), 1000) == 0);
    double t0 = kiln_now_ms();
    sleep_ms(300);
    CHECK(gwc_send(slow_h, "a", 1, 1000) == 0); /* a trickle does not extend the deadline */
    kiln_buf ih = {0}, ib = {0};
    CHECK(gwc_read_response(slow_h, &ih, &a, 5000) == 0);
    double th = kiln_now_ms() - t0;
    check_error(&a, 408, NULL, "timeout", "slow headers");
    CHECKF(th > 800 && th < 2500, "slow headers answered after %.0f ms", th);
    CHECK(gwc_wait_closed(slow_h, 3000));
    CHECK(gwc_read_response(slow_b, &ib, &b, 6000) == 0);
    double tb = kiln_now_ms() - t0;
    check_error(&b, 408, NULL, "timeout", "slow body");
    CHECKF(tb > 2500 && tb < 5000, "slow body answered after %.0f ms", tb);
    CHECK(gwc_wait_closed(slow_b, 3000));
    gwc_response_free(&a), gwc_response_free(&b);
    kiln_buf_free(&ih), kiln_buf_free(&ib);
    close(slow_h), close(slow_b);
    CHECK(get_status("/healthz") == 200);
}

/* ---- concurrency ---- */

#define N_CONN 16
#define PER_CONN 4

static const int sizes[4][2] = {{64, 64}, {64, 128}, {128, 64}, {128, 128}};

/* A short text length: the Qwen3 and DiT work of 512 tokens made this
 * phase take 76 s of its 120 s bound in the sanitizer build, and more on
 * a loaded CI machine; what it checks does not depend on the length. */
static void request_json(char *buf, size_t cap, int i)
{
    snprintf(buf, cap,
             "{\"prompt\":\"concurrent %d\",\"size\":\"%dx%d\",\"seed\":%d,\"num_inference_steps\":1,"
             "\"max_sequence_length\":32}",
             i % 4, sizes[i % 4][0], sizes[i % 4][1], 1000 + i);
}

static void test_concurrency(void)
{
    int fds[N_CONN];
    kiln_buf in[N_CONN];
    int got[N_CONN] = {0};
    images results[N_CONN * PER_CONN];
    memset(results, 0, sizeof results);
    for (int c = 0; c < N_CONN; c++) {
        fds[c] = gwc_connect(port);
        in[c] = (kiln_buf){0};
        kiln_buf req = {0};
        for (int k = 0; k < PER_CONN; k++) {
            char json[256];
            request_json(json, sizeof json, c * PER_CONN + k);
            gwc_format(&req, "POST", "/v1/images/generations", "application/json", json,
                       strlen(json), 0);
        }
        CHECK(fds[c] >= 0 && gwc_send(fds[c], req.data, req.len, 5000) == 0);
        kiln_buf_free(&req);
    }
    double t0 = kiln_now_ms();
    int done = 0, failed = 0;
    while (done + failed < N_CONN * PER_CONN && kiln_now_ms() - t0 < T_REQ) {
        struct pollfd pf[N_CONN];
        for (int c = 0; c < N_CONN; c++)
            pf[c] = (struct pollfd){.fd = got[c] < PER_CONN ? fds[c] : -1, .events = POLLIN};
        if (poll(pf, N_CONN, 1000) <= 0)
            continue;
        for (int c = 0; c < N_CONN; c++) {
            if (!(pf[c].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            kiln_buf_reserve(&in[c], 65536, NULL);
            ssize_t n = recv(fds[c], in[c].data + in[c].len, 65536, 0);
            if (n <= 0) {
                failed += PER_CONN - got[c];
                got[c] = PER_CONN;
                continue;
            }
            in[c].len += (size_t)n;
            gwc_response r;
            while (got[c] < PER_CONN && gwc_parse(&in[c], &r) == 1) {
                int i = c * PER_CONN + got[c]++;
                CHECKF(r.status == 200, "request %d: status %d", i, r.status);
                if (r.status == 200 && parse_images(&r, &results[i]) == 0)
                    done++;
                else
                    failed++;
                gwc_response_free(&r);
            }
        }
    }
    KILN_LOG_INFO("e2e: %d concurrent requests answered in %.1f s", done, (kiln_now_ms() - t0) / 1000);
    CHECKF(done == N_CONN * PER_CONN, "%d of %d requests succeeded", done, N_CONN * PER_CONN);
    for (int c = 0; c < N_CONN; c++) {
        close(fds[c]);
        kiln_buf_free(&in[c]);
    }
    /* Right size and seed, and all different. */
    for (int i = 0; i < N_CONN * PER_CONN; i++) {
        images *im = &results[i];
        if (im->n != 1)
            continue;
        CHECK(im->seeds[0] == (uint64_t)(1000 + i));
        kiln_image img = {0};
        CHECK(kiln_image_decode(im->files[0].data, im->files[0].len, NULL, &img, NULL) == KILN_OK);
        CHECKF(img.width == sizes[i % 4][0] && img.height == sizes[i % 4][1], "request %d: %dx%d", i,
               img.width, img.height);
        kiln_image_free(&img);
        for (int k = 0; k < i; k++)
            if (results[k].n == 1 && results[k].files[0].len == im->files[0].len)
                CHECKF(memcmp(results[k].files[0].data, im->files[0].data, im->files[0].len),
                       "requests %d and %d gave the same image", k, i);
    }
    /* Batched with others, an image is what it is alone (the CLI). */
    for (int i = 60; i < 64; i++) {
        char seed[16], w[8], h[8], prompt[32];
        snprintf(seed, sizeof seed, "%d", 1000 + i);
        snprintf(w, sizeof w, "%d", sizes[i % 4][0]);
        snprintf(h, sizeof h, "%d", sizes[i % 4][1]);
        snprintf(prompt, sizeof prompt, "concurrent %d", i % 4);
        const char *args[] = {"--prompt", prompt, "--seed", seed, "--width", w, "--height", h,
                              "--steps", "1", "--max-sequence-length", "32", NULL};
        if (results[i].n == 1)
            compare_cli("generate", args, &results[i], "png", "concurrent request vs CLI");
    }
    for (int i = 0; i < N_CONN * PER_CONN; i++)
        images_free(&results[i]);
}

/* ---- disconnects ---- */

static void test_disconnects(void)
{
    enum { N = 24 };
    int fds[N];
    for (int i = 0; i < N; i++) {
        char json[256];
        snprintf(json, sizeof json,
                 "{\"prompt\":\"leave %d\",\"size\":\"128x128\",\"seed\":%d,\"num_inference_steps\":2}",
                 i, 5000 + i);
        kiln_buf req = {0};
        gwc_format(&req, "POST", "/v1/images/generations", "application/json", json, strlen(json), 0);
        fds[i] = gwc_connect(port);
        CHECK(fds[i] >= 0 && gwc_send(fds[i], req.data, req.len, 5000) == 0);
        kiln_buf_free(&req);
    }
    /* Every other client leaves, at different moments (while parsing,
     * queued, or at one stage or another), some with a reset. */
    srand(7);
    for (int i = 0; i < N; i += 2) {
        sleep_ms(rand() % 120);
        if (i % 4 == 0) {
            struct linger lg = {1, 0};
            setsockopt(fds[i], SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        }
        close(fds[i]);
        fds[i] = -1;
    }
    for (int i = 1; i < N; i += 2) {
        kiln_buf in = {0};
        gwc_response r;
        CHECKF(gwc_read_response(fds[i], &in, &r, T_REQ) == 0 && r.status == 200,
               "request %d that stayed: status %d", i, r.status);
        gwc_response_free(&r);
        kiln_buf_free(&in);
        close(fds[i]);
    }
    /* Everything drains: no job, queue, in-flight or cancelling entry is
     * left, and no replica still runs one. */
    char last[256];
    CHECKF(svc_wait_idle(port, 30000, last, sizeof last) == 0,
           "jobs left after the clients went away: %s", last);
    kiln_buf m = {0};
    if (svc_metrics(port, &m) == 0)
        KILN_LOG_INFO("e2e: after disconnects: %s, cancels %g", last,
                      svc_metric((const char *)m.data, "kiln_events_total{event=\"cancel\"}"));
    kiln_buf_free(&m);
    gwc_response r;
    CHECK(post_json("/v1/images/generations",
                    "{\"prompt\":\"still here\",\"size\":\"64x64\",\"num_inference_steps\":1}", &r) == 0);
    CHECK(r.status == 200);
    gwc_response_free(&r);
}

/* A request on a new connection right after one of ours closed: the
 * gateway frees the closed one's slot when its loop sees the close, and
 * until then refuses the new one (too_many_connections), so that answer
 * is asked again for up to 5 s. */
static int request_after_close(int gw_port, const char *method, const char *path,
                               const char *type, const char *body, size_t len, gwc_response *r)
{
    double until = kiln_now_ms() + 5000;
    for (;;) {
        if (gwc_request(gw_port, method, path, type, body, len, r, 5000))
            return -1;
        kiln_buf_append(&r->body, "", 1, NULL);
        int refused = r->status == 503 && strstr((const char *)r->body.data, "too_many_connections");
        if (!refused || kiln_now_ms() >= until)
            return 0;
        gwc_response_free(r);
        sleep_ms(50);
    }
}

/* A second gateway (no replicas needed) with room for two connections:
 * the third is told 503 and closed; /readyz fails without replicas. */
static void test_max_connections(void)
{
    char exe[512], log[160], bus2[160];
    snprintf(exe, sizeof exe, "%s/services/gateway/kiln-gateway", build_root);
    snprintf(log, sizeof log, "%s/gw2.log", tmpdir);
    snprintf(bus2, sizeof bus2, "ipc://%s/bus2", tmpdir);
    const char *argv[] = {exe, "--model", model, "--host", "127.0.0.1", "--port", "0", "--bus",
                          bus2, "--max-connections", "2", NULL};
    pid_t pid = spawn(argv, log);
    int p2 = gateway_port(log);
    CHECK(p2 > 0);
    if (p2 > 0) {
        int a = gwc_connect(p2), b = gwc_connect(p2);
        sleep_ms(100); /* both accepted */
        gwc_response r;
        CHECK(gwc_request(p2, "GET", "/healthz", NULL, NULL, 0, &r, 5000) == 0);
        check_error(&r, 503, NULL, "too_many_connections", "third connection");
        gwc_response_free(&r);
        /* One that sends a body bigger than the socket buffers before it
         * reads still gets the answer (the gateway drains what it sends),
         * not a reset. */
        size_t big = 4u << 20;
        char *body = calloc(1, big);
        CHECK(body && gwc_request(p2, "POST", "/v1/images/generations", "application/json", body,
                                  big, &r, 5000) == 0);
        check_error(&r, 503, NULL, "too_many_connections", "third connection with a big body");
        gwc_response_free(&r);
        free(body);
        close(a);
        CHECK(request_after_close(p2, "GET", "/readyz", NULL, NULL, 0, &r) == 0 &&
              r.status == 503);
        CHECK(strstr((const char *)r.body.data, "not_ready"));
        gwc_response_free(&r);
        CHECK(request_after_close(p2, "POST", "/v1/images/generations", "application/json",
                                  "{\"prompt\":\"x\"}", 14, &r) == 0);
        check_error(&r, 503, NULL, "stage_unavailable", "no replicas");
        gwc_response_free(&r);
        close(b);
    }
    kill(pid, SIGTERM);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* ---- set-up ---- */

static int start(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kiln-gw-e2e-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(bus, sizeof bus, "ipc://%s/bus", tmpdir);
    char exe[4][512], log[4][160];
    const char *names[4] = {"services/gateway/kiln-gateway", "services/kiln-encoder",
                            "services/kiln-denoiser", "services/kiln-decoder"};
    for (int i = 0; i < 4; i++) {
        snprintf(exe[i], sizeof exe[i], "%s/%s", build_root, names[i]);
        snprintf(log[i], sizeof log[i], "%s/%d.log", tmpdir, i);
    }
    const char *gw[] = {exe[0], "--model", model, "--host", "127.0.0.1", "--port", "0", "--bus",
                        bus, "--min-size", "64", "--max-size", "128", "--max-body-mb", "1",
                        "--header-timeout-ms", "1000", "--read-timeout-ms", "3000",
                        "--queue-max", "256", NULL};
    pids[0] = spawn(gw, log[0]);
    port = gateway_port(log[0]);
    if (port <= 0)
        return -1;
    const char *enc[] = {exe[1], "--model", model, "--bus", bus, "--text-encoder-out-layers",
                         "1,2,3", NULL};
    const char *den[] = {exe[2], "--model", model, "--bus", bus, NULL};
    /* Four image encoders, so that a job's rows are encoded at once even
     * on CI's two cores (the default there is one thread). */
    const char *dec[] = {exe[3], "--model", model, "--bus", bus, "--image-threads", "4", NULL};
    pids[1] = spawn(enc, log[1]);
    pids[2] = spawn(den, log[2]);
    pids[3] = spawn(dec, log[3]);
    for (int i = 0; i < 600; i++) {
        if (get_status("/readyz") == 200)
            return 0;
        sleep_ms(50);
    }
    return -1;
}

static void stop(void)
{
    /* SIGTERM drains: a request already accepted is still answered, then
     * the gateway exits 0. */
    if (pids[0] > 0) {
        const char *json = "{\"prompt\":\"last one\",\"size\":\"64x64\",\"num_inference_steps\":1}";
        int fd = port > 0 ? gwc_connect(port) : -1;
        kiln_buf req = {0}, in = {0};
        gwc_format(&req, "POST", "/v1/images/generations", "application/json", json, strlen(json), 0);
        int sent = fd >= 0 && gwc_send(fd, req.data, req.len, 5000) == 0;
        /* Accepted first: one the gateway has not parsed yet when the
         * signal comes is refused (503 shutting_down), rightly. */
        if (sent)
            svc_wait_metric(port, "kiln_jobs ", 1, 10000, NULL);
        kill(pids[0], SIGTERM);
        if (sent && !test_failures) {
            gwc_response r;
            CHECK(gwc_read_response(fd, &in, &r, T_REQ) == 0 && r.status == 200);
            gwc_response_free(&r);
        }
        if (fd >= 0)
            close(fd);
        kiln_buf_free(&req), kiln_buf_free(&in);
        int st = 0;
        CHECK(waitpid(pids[0], &st, 0) == pids[0]);
        CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "gateway exit status %d", st);
    }
    for (int i = 1; i < 4; i++)
        if (pids[i] > 0) {
            kill(pids[i], SIGTERM);
            waitpid(pids[i], NULL, 0);
        }
}

int main(void)
{
    build_root = getenv("KILN_BUILD_ROOT");
    const char *shared = getenv("KILN_SHARED");
    if (!build_root || !shared) {
        fprintf(stderr, "KILN_BUILD_ROOT and KILN_SHARED must be set (meson test sets them)\n");
        return 1;
    }
    snprintf(model, sizeof model, "%s/oracle/ckpt/klein-tiny", shared);
    signal(SIGPIPE, SIG_IGN);
    if (start()) {
        fprintf(stderr, "the service did not come up; logs in %s\n", tmpdir);
        stop();
        return 1;
    }
    RUN(test_generate_matches_cli);
    RUN(test_edit_matches_cli);
    RUN(test_random_seed);
    RUN(test_stream);
    RUN(test_bad_inputs);
    RUN(test_concurrency);
    RUN(test_disconnects);
    RUN(test_max_connections);
    stop();
    if (test_failures)
        fprintf(stderr, "logs kept in %s\n", tmpdir);
    else {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
        if (system(cmd))
            fprintf(stderr, "could not remove %s\n", tmpdir);
    }
    return test_finish();
}
