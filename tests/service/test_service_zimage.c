/* Z-Image through `kiln serve` on the tiny Z-Image checkpoint (CPU): the
 * images the service returns are byte for byte those of `kiln generate`
 * with the same parameters, and the oracle's.
 * - zimage_t2i_256 as the oracle runs it (PSNR >= 50 dB against its image);
 * - the prompts of zimage_batch2_160x96 (10 and 75 tokens) sent at once,
 *   so the denoiser may batch captions of different lengths: each image
 *   equals the CLI's for its prompt alone;
 * - the Turbo defaults (9 steps, no guidance) on a request that names
 *   neither, and CFG with a negative prompt (guidance > 0, the prompt's
 *   and the negative prompt's token counts travel beside the embeddings);
 * - edits as ZImageImg2ImgPipeline and ZImageInpaintPipeline run them:
 *   image-to-image at the default strength 0.6 with n = 2 (each row its
 *   own posterior sample and noise) and inpainting with a mask (strength
 *   1.0), each equal to kiln edit's bytes and the diffusers cases'
 *   images (tests/data/oracle/zimage_*) at >= 50 dB; two images are a 400
 *   (Z-Image takes no references). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

static char zmodel[600];
static int port;

/* kiln `cmd` (generate, edit) on the Z-Image checkpoint with the
 * pipeline's own layers. */
static int cli_run(const char *cmd, const char *const *args, const char *out)
{
    const char *argv[64] = {svc_exe("tools/kiln"), cmd, "--model", zmodel,
                            "--no-metadata", /* the service's PNGs carry no text chunks */
                            "--out", out};
    int n = 7;
    for (int i = 0; args[i] && n < 63; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = svc_spawn(argv, NULL, svc_tmp("cli.log"));
    return pid < 0 ? -1 : svc_wait_exit(pid, SVC_T_REQ);
}

static int cli(const char *const *args, const char *out) { return cli_run("generate", args, out); }

static double psnr_vs_file(const kiln_buf *png, const char *path)
{
    kiln_image got = {0}, want = {0};
    kiln_err err = {0};
    double p = -1;
    if (!kiln_image_decode(png->data, png->len, NULL, &got, &err) &&
        !kiln_image_read_file(path, NULL, &want, &err) && got.width == want.width &&
        got.height == want.height) {
        double se = 0;
        size_t n = (size_t)got.width * got.height * 3;
        for (size_t i = 0; i < n; i++)
            se += ((double)got.pixels[i] - want.pixels[i]) * ((double)got.pixels[i] - want.pixels[i]);
        p = se == 0 ? 999.0 : 10.0 * log10(255.0 * 255.0 * (double)n / se);
    }
    kiln_image_free(&got), kiln_image_free(&want);
    return p;
}

static double psnr_vs_oracle(const kiln_buf *png, const char *case_name, int b)
{
    char path[900];
    snprintf(path, sizeof path, "%s/oracle/cases/%s/image_fp32_%d.png", getenv("KILN_SHARED"),
             case_name, b);
    return psnr_vs_file(png, path);
}

/* One generation request; its images in *im (0) or -1 with the check failed. */
static int generate(const char *json, svc_images *im)
{
    gwc_response r;
    int ok = svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ) == 0;
    CHECKF(ok && r.status == 200, "%s: status %d: %.*s", json, ok ? r.status : -1,
           ok ? (int)r.body.len : 0, ok ? (char *)r.body.data : "");
    ok = ok && r.status == 200 && svc_parse_images(&r, im) == 0;
    if (ok || r.body.data)
        gwc_response_free(&r);
    return ok ? 0 : -1;
}

static void test_oracle_case(void)
{
    svc_images im;
    if (generate(
                 "{\"prompt\":\"a bowl of ramen on a wooden table, steam rising\",\"size\":"
                 "\"256x256\",\"seed\":42,\"num_inference_steps\":8}",
                 &im))
        return;
    double p = psnr_vs_oracle(&im.files[0], "zimage_t2i_256", 0);
    fprintf(stderr, "  zimage_t2i_256 through the service: PSNR %.2f dB\n", p);
    CHECK(p >= 50.0);
    const char *args[] = {"--prompt", "a bowl of ramen on a wooden table, steam rising", "--seed",
                          "42", "--width", "256", "--height", "256", "--steps", "8", NULL};
    CHECK(cli(args, svc_tmp("t2i.png")) == 0);
    CHECKF(svc_same_file(svc_tmp("t2i.png"), &im.files[0]), "service and CLI images differ");
    svc_images_free(&im);
}

static void test_ragged_captions(void)
{
    static const char *prompts[2] = {
        "a cat",
        "A wide panoramic photograph of an old harbour town at dusk, fishing boats with peeling "
        "blue paint resting on wet sand, gulls circling above slate roofs, warm lamplight in "
        "small windows, a lighthouse on the far cliff sweeping its beam across low clouds, film "
        "grain, 35mm, f/2.8"};
    svc_client cs[2];
    for (int i = 0; i < 2; i++) {
        char seed[16], out[32];
        snprintf(seed, sizeof seed, "%d", 500 + i);
        snprintf(out, sizeof out, "ragged%d.png", i);
        const char *args[] = {"--prompt", prompts[i], "--seed", seed, "--width", "96",
                              "--height", "160", "--steps", "3", NULL};
        CHECK(cli(args, svc_tmp(out)) == 0);
    }
    for (int i = 0; i < 2; i++) {
        char json[1024], ref[32];
        snprintf(json, sizeof json,
                 "{\"prompt\":\"%s\",\"size\":\"96x160\",\"seed\":%d,\"num_inference_steps\":3}",
                 prompts[i], 500 + i);
        snprintf(ref, sizeof ref, "ragged%d.png", i);
        svc_client_send(&cs[i], port, json, ref);
    }
    CHECK(svc_clients_wait(cs, 2, 2 * SVC_T_REQ) == 0);
    for (int i = 0; i < 2; i++)
        CHECKF(cs[i].verdict == SVC_IMAGE, "prompt %d: %s", i, cs[i].why);
}

static void test_defaults_and_cfg(void)
{
    svc_images im;
    /* No steps, no guidance: the Turbo recipe on both sides. */
    if (!generate( "{\"prompt\":\"a lighthouse\",\"size\":\"64x64\",\"seed\":7}", &im)) {
        const char *args[] = {"--prompt", "a lighthouse", "--seed", "7", "--width", "64",
                              "--height", "64", NULL};
        CHECK(cli(args, svc_tmp("def.png")) == 0);
        CHECKF(svc_same_file(svc_tmp("def.png"), &im.files[0]), "default run differs");
        const char *nine[] = {"--prompt", "a lighthouse", "--seed", "7", "--width", "64",
                              "--height", "64", "--steps", "9", "--guidance", "0", NULL};
        CHECK(cli(nine, svc_tmp("nine.png")) == 0);
        CHECKF(svc_same_file(svc_tmp("nine.png"), &im.files[0]),
               "the defaults are not 9 steps without guidance");
        svc_images_free(&im);
    }
    if (!generate(
                  "{\"prompt\":\"a lighthouse\",\"size\":\"64x64\",\"seed\":7,\"n\":2,"
                  "\"num_inference_steps\":2,\"guidance_scale\":2.5,\"negative_prompt\":"
                  "\"blurry, low quality, oversaturated\"}",
                  &im)) {
        const char *args[] = {"--prompt", "a lighthouse", "--seed", "7", "-n", "2", "--width",
                              "64", "--height", "64", "--steps", "2", "--guidance", "2.5",
                              "--negative-prompt", "blurry, low quality, oversaturated", NULL};
        CHECK(cli(args, svc_tmp("cfg.png")) == 0);
        CHECK(im.n == 2);
        CHECKF(svc_same_file(svc_tmp("cfg-0.png"), &im.files[0]) &&
                   svc_same_file(svc_tmp("cfg-1.png"), &im.files[1]),
               "CFG images differ from the CLI's");
        const char *plain[] = {"--prompt", "a lighthouse", "--seed", "7", "--width", "64",
                               "--height", "64", "--steps", "2", NULL};
        CHECK(cli(plain, svc_tmp("plain.png")) == 0);
        CHECKF(!svc_same_file(svc_tmp("plain.png"), &im.files[0]), "CFG changed nothing");
        svc_images_free(&im);
    }
}

/* A diffusers edit case's file (tests/data/oracle/<c>/<file>). */
static const char *edit_case(const char *c, const char *file)
{
    static char paths[4][PATH_MAX];
    static int next;
    char *p = paths[next++ % 4];
    snprintf(p, PATH_MAX, "%s/tests/data/oracle/%s/%s", getenv("KILN_SOURCE_ROOT"), c, file);
    return p;
}

/* A multipart /v1/images/edits: text fields (name, value pairs, NULL
 * ended), then files (name, path pairs); *r the response. */
static int post_edit(const char *const *fields, const char *const *files, gwc_response *r)
{
    kiln_buf body = {0}, data = {0};
    char part[512];
    for (int i = 0; fields[i]; i += 2) {
        snprintf(part, sizeof part, "--kilnZ\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n"
                 "%s\r\n", fields[i], fields[i + 1]);
        kiln_buf_append(&body, part, strlen(part), NULL);
    }
    int rc = 0;
    for (int i = 0; files[i]; i += 2) {
        snprintf(part, sizeof part, "--kilnZ\r\nContent-Disposition: form-data; name=\"%s\"; "
                 "filename=\"f.png\"\r\nContent-Type: image/png\r\n\r\n", files[i]);
        kiln_buf_append(&body, part, strlen(part), NULL);
        rc |= svc_read_file(files[i + 1], &data);
        kiln_buf_append(&body, data.data, data.len, NULL);
        kiln_buf_append(&body, "\r\n", 2, NULL);
        kiln_buf_free(&data);
    }
    kiln_buf_append(&body, "--kilnZ--\r\n", 11, NULL);
    rc |= gwc_request(port, "POST", "/v1/images/edits", "multipart/form-data; boundary=kilnZ",
                      body.data, body.len, r, SVC_T_REQ);
    kiln_buf_free(&body);
    return rc;
}

/* Posts an edit of diffusers case c and checks its n images came back,
 * the first against the case's image (>= 50 dB); 0 or -1. */
static int served_edit(const char *c, const char *const *fields, const char *const *files, int n,
                       svc_images *im)
{
    gwc_response r;
    CHECK(post_edit(fields, files, &r) == 0);
    CHECKF(r.status == 200 && svc_parse_images(&r, im) == 0 && im->n == n, "%s: status %d: %.*s",
           c, r.status, (int)r.body.len, r.body.data ? (char *)r.body.data : "");
    gwc_response_free(&r);
    if (im->n != n)
        return -1;
    double p = psnr_vs_file(&im->files[0], edit_case(c, "image.png"));
    fprintf(stderr, "  %s through the service: PSNR %.2f dB\n", c, p);
    CHECK(p >= 50.0);
    return 0;
}

static void test_img2img(void)
{
    /* No strength: the pipeline's 0.6, as the case's. */
    const char *c = "zimage_img2img_128", *prompt = "a red boat on a lake";
    const char *fields[] = {"prompt", prompt, "seed", "7", "num_inference_steps", "5", "n", "2",
                            NULL};
    const char *files[] = {"image", edit_case(c, "input.png"), NULL};
    svc_images im = {0};
    if (served_edit(c, fields, files, 2, &im))
        return;
    const char *args[] = {"--image", edit_case(c, "input.png"), "--prompt", prompt, "--seed", "7",
                          "--steps", "5", "-n", "2", NULL};
    CHECK(cli_run("edit", args, svc_tmp("i2i.png")) == 0);
    CHECKF(svc_same_file(svc_tmp("i2i-0.png"), &im.files[0]) &&
               svc_same_file(svc_tmp("i2i-1.png"), &im.files[1]),
           "img2img rows differ from kiln edit's");
    CHECKF(im.files[0].len != im.files[1].len ||
               memcmp(im.files[0].data, im.files[1].data, im.files[0].len),
           "the rows share a sample: seed + 1 must draw its own");
    svc_images_free(&im);
}

static void test_inpaint(void)
{
    const char *c = "zimage_inpaint_144x96", *prompt = "a garden path in spring";
    const char *fields[] = {"prompt", prompt, "seed", "21", "num_inference_steps", "5",
                            "strength", "0.6", NULL};
    const char *files[] = {"image", edit_case(c, "input.png"), "mask", edit_case(c, "mask.png"),
                           NULL};
    svc_images im = {0};
    if (served_edit(c, fields, files, 1, &im))
        return;
    const char *args[] = {"--image", edit_case(c, "input.png"), "--mask", edit_case(c, "mask.png"),
                          "--prompt", prompt, "--seed", "21", "--steps", "5", "--strength", "0.6",
                          NULL};
    CHECK(cli_run("edit", args, svc_tmp("inpaint.png")) == 0);
    CHECKF(svc_same_file(svc_tmp("inpaint.png"), &im.files[0]), "inpainting differs from kiln edit");
    svc_images_free(&im);
}

static void test_references_refused(void)
{
    const char *fields[] = {"prompt", "two boats", NULL};
    const char *files[] = {"image[]", edit_case("zimage_img2img_128", "input.png"), "image[]",
                           edit_case("zimage_img2img_112x80", "input.png"), NULL};
    gwc_response r;
    CHECK(post_edit(fields, files, &r) == 0);
    CHECKF(r.status == 400 && r.body.data && strstr((char *)r.body.data, "not 2 references"),
           "two images: status %d: %.*s", r.status, (int)r.body.len,
           r.body.data ? (char *)r.body.data : "");
    gwc_response_free(&r);
}

int main(void)
{
    if (svc_init("zimage"))
        return 1;
    snprintf(zmodel, sizeof zmodel, "%s/oracle/ckpt/zimage-tiny", getenv("KILN_SHARED"));
    port = svc_free_port();
    char port_s[16], bus[160];
    snprintf(port_s, sizeof port_s, "%d", port);
    snprintf(bus, sizeof bus, "ipc://%s/bus", svc.tmpdir);
    char tmpdir_env[PATH_MAX + 8];
    snprintf(tmpdir_env, sizeof tmpdir_env, "TMPDIR=%s", svc.tmpdir);
    const char *env[] = {tmpdir_env, NULL};
    const char *argv[] = {svc_exe("tools/kiln"), "serve", "--model", zmodel, "--port", port_s,
                          "--bus", bus, "--min-size", "64", "--max-size", "256", NULL};
    pid_t serve = svc_spawn(argv, env, svc_tmp("serve.log"));
    CHECKF(serve > 0 && svc_wait_ready(port, 90000) == 0, "kiln serve did not get ready");
    if (serve > 0 && !test_failures) {
        RUN(test_oracle_case);
        RUN(test_ragged_captions);
        RUN(test_defaults_and_cfg);
        RUN(test_img2img);
        RUN(test_inpaint);
        RUN(test_references_refused);
    }
    if (serve > 0)
        CHECK(svc_stop(serve, 30000) == 0);
    svc_cleanup(test_failures);
    return test_finish();
}
