/* End to end: the real `kiln generate` / `kiln edit` binaries against the
 * diffusers oracle images, determinism (same command, same bytes; image i
 * of seed S equals image 0 of seed S + i), --strength and --mask against
 * their diffusers cases, --latents-in/--latents-out,
 * the Z-Image cases, refusal of bad input with a clear message, and what
 * the user sees (paths, seeds, progress, PNG text). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/image.h"
#include "common/json.h"
#include "oracle_util.h"
#include "tests/run_util.h"
#include "tests/test.h"
#include "tests/unit/io_helpers.h"

static char log_text[16384];
static const char *kiln;

static int run(const char **argv)
{
    int rc = test_run(kiln, argv, log_text, sizeof log_text);
    if (rc)
        fprintf(stderr, "  kiln exited %d: %s", rc, log_text);
    return rc;
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    *len = buf ? fread(buf, 1, (size_t)n, f) : 0;
    fclose(f);
    return buf;
}

static int same_file(const char *a, const char *b)
{
    size_t na = 0, nb = 0;
    char *x = read_all(a, &na), *y = read_all(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x), free(y);
    return same;
}

static double psnr_vs_oracle(const char *png, const char *case_name, int b)
{
    char rel[256];
    snprintf(rel, sizeof rel, "cases/%s/image_fp32_%d.png", case_name, b);
    kiln_image got = {0}, want = {0};
    kiln_err err = {0};
    if (kiln_image_read_file(png, NULL, &got, &err) ||
        kiln_image_read_file(oracle_path(rel), NULL, &want, &err) || got.width != want.width ||
        got.height != want.height) {
        kiln_image_free(&got), kiln_image_free(&want);
        return -1;
    }
    double p = oracle_psnr_u8(got.pixels, want.pixels, (size_t)got.width * got.height * 3);
    kiln_image_free(&got), kiln_image_free(&want);
    fprintf(stderr, "  %s image %d: PSNR %.2f dB\n", case_name, b, p);
    return p;
}

static void test_t2i_matches_oracle_and_is_deterministic(void)
{
    const char *ckpt = oracle_path("ckpt/klein-tiny");
    char model[512];
    snprintf(model, sizeof model, "%s", ckpt);
    const char *argv[] = {NULL, "generate", "--model", model, "--prompt",
                          "a red fox sitting in fresh snow, soft winter light", "--seed", "42",
                          "--width", "256", "--height", "256", "--steps", "4",
                          "--text-encoder-out-layers", "1,2,3", "--out", io_path("fox.png"),
                          "--latents-out", io_path("fox.safetensors"), NULL};
    CHECK(run(argv) == 0);
    CHECK(psnr_vs_oracle(io_path("fox.png"), "klein_t2i_256", 0) >= 50.0);
    kiln_st *ref = oracle_open("klein_t2i_256", "ref_fp32.safetensors");
    kiln_err err = {0};
    kiln_st *got = kiln_st_open(io_path("fox.safetensors"), NULL, &err);
    CHECKF(got, "%s", err.msg);
    if (got) {
        int64_t n = 0;
        float *a = oracle_f32(got, "latents", &n), *b = oracle_f32(ref, "latents_step.3", NULL);
        CHECK(a && b && test_rel_err(a, b, (size_t)n) < 1e-4);
        free(a), free(b);
        kiln_st_close(got);
    }
    kiln_st_close(ref);

    argv[17] = io_path("fox2.png");
    argv[18] = NULL;
    CHECK(run(argv) == 0);
    CHECKF(same_file(io_path("fox.png"), io_path("fox2.png")), "same command, different bytes");
}

static void test_batch_case(void)
{
    char model[512];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    cJSON *meta = oracle_meta("klein_t2i_batch2");
    cJSON *prompts = cJSON_GetObjectItem(meta, "prompts");
    const char *argv[] = {NULL, "generate", "--model", model, "--prompt",
                          cJSON_GetArrayItem(prompts, 0)->valuestring, "--prompt",
                          cJSON_GetArrayItem(prompts, 1)->valuestring, "--seed", "1234",
                          "--width", "192", "--height", "128", "--batch-noise",
                          "--text-encoder-out-layers", "1,2,3", "--out", io_path("b.png"), NULL};
    CHECK(run(argv) == 0);
    CHECK(psnr_vs_oracle(io_path("b-0.png"), "klein_t2i_batch2", 0) >= 50.0);
    CHECK(psnr_vs_oracle(io_path("b-1.png"), "klein_t2i_batch2", 1) >= 50.0);
    cJSON_Delete(meta);
}

static void test_seed_per_image(void)
{
    char model[512];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    const char *two[] = {NULL, "generate", "--model", model, "--prompt", "a lighthouse",
                         "--seed", "10", "-n", "2", "--width", "64", "--height", "64",
                         "--steps", "2", "--text-encoder-out-layers", "1,2,3", "--out",
                         io_path("s.png"), NULL};
    CHECK(run(two) == 0);
    const char *one[] = {NULL, "generate", "--model", model, "--prompt", "a lighthouse",
                         "--seed", "11", "--width", "64", "--height", "64", "--steps", "2",
                         "--text-encoder-out-layers", "1,2,3", "--out", io_path("s11.png"), NULL};
    CHECK(run(one) == 0);
    CHECKF(same_file(io_path("s-1.png"), io_path("s11.png")),
           "image 1 of seed 10 differs from image 0 of seed 11");
    CHECK(!same_file(io_path("s-0.png"), io_path("s-1.png")));
}

static void test_edit_and_cfg_cases(void)
{
    char model[512], base[512], ref_png[512];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    snprintf(base, sizeof base, "%s", oracle_path("ckpt/klein-base-tiny"));
    snprintf(ref_png, sizeof ref_png, "%s", oracle_path("cases/klein_edit_1ref/input_ref0.png"));
    /* No size: the output takes the reference's prepared size (192x128). */
    const char *edit[] = {NULL, "edit", "--model", model, "--image", ref_png, "--prompt",
                          "make the sky purple", "--seed", "5", "--text-encoder-out-layers",
                          "1,2,3", "--out", io_path("edit.png"), NULL};
    CHECK(run(edit) == 0);
    CHECK(psnr_vs_oracle(io_path("edit.png"), "klein_edit_1ref", 0) >= 50.0);
    /* Two references run (ids t = 10 and 20) and change the result. */
    const char *edit2[] = {NULL, "edit", "--model", model, "--image", ref_png, "--image", ref_png,
                           "--prompt", "make the sky purple", "--seed", "5", "--steps", "1",
                           "--text-encoder-out-layers", "1,2,3", "--out", io_path("edit2.png"),
                           NULL};
    CHECK(run(edit2) == 0);
    CHECK(!same_file(io_path("edit.png"), io_path("edit2.png")));
    const char *cfg[] = {NULL, "generate", "--model", base, "--prompt",
                         "a watercolor map of an imaginary island", "--seed", "3", "--width",
                         "256", "--height", "256", "--steps", "6", "--guidance", "4",
                         "--text-encoder-out-layers", "1,2,3", "--out", io_path("cfg.png"), NULL};
    CHECK(run(cfg) == 0);
    CHECK(psnr_vs_oracle(io_path("cfg.png"), "klein_base_cfg_256", 0) >= 50.0);
}

/* kiln edit --strength / --mask on the diffusers cases of tests/data/oracle
 * (tests/oracle/gen_edit_oracle.py): the binary's own preparation of the
 * image and mask, its step arithmetic and its output, >= 50 dB. */
static void test_strength_and_mask_cases(void)
{
    static const char *const cases[] = {"klein_img2img_128", "klein_img2img_100x76",
                                        "klein_inpaint_128", "klein_inpaint_100x76"};
    const char *root = getenv("KILN_SOURCE_ROOT");
    CHECK(root != NULL);
    for (size_t c = 0; root && c < sizeof cases / sizeof *cases; c++) {
        char dir[1024], meta_path[1100], image[1100], mask[1100], want[1100], model[512];
        char steps[16], seed[32], strength[32], maxseq[16];
        snprintf(dir, sizeof dir, "%s/tests/data/oracle/%s", root, cases[c]);
        snprintf(meta_path, sizeof meta_path, "%s/meta.json", dir);
        kiln_err err = {0};
        cJSON *meta = kiln_json_load(meta_path, "meta.json", &err);
        CHECKF(meta, "%s", err.msg);
        if (!meta)
            continue;
        snprintf(model, sizeof model, "%s",
                 oracle_path(cJSON_GetObjectItem(meta, "checkpoint")->valuestring));
        snprintf(image, sizeof image, "%s/input.png", dir);
        snprintf(mask, sizeof mask, "%s/mask.png", dir);
        snprintf(want, sizeof want, "%s/image.png", dir);
        snprintf(steps, sizeof steps, "%d", cJSON_GetObjectItem(meta, "steps")->valueint);
        snprintf(seed, sizeof seed, "%.0f", cJSON_GetObjectItem(meta, "seed")->valuedouble);
        snprintf(strength, sizeof strength, "%.17g",
                 cJSON_GetObjectItem(meta, "strength")->valuedouble);
        snprintf(maxseq, sizeof maxseq, "%d", cJSON_GetObjectItem(meta, "max_seq")->valueint);
        int inpaint = !strcmp(cJSON_GetObjectItem(meta, "mode")->valuestring, "inpaint");
        const char *argv[] = {NULL, "edit", "--model", model, "--image", image, "--prompt",
                              cJSON_GetObjectItem(meta, "prompt")->valuestring, "--seed", seed,
                              "--steps", steps, "--strength", strength, "--max-sequence-length",
                              maxseq, "--text-encoder-out-layers", "1,2,3", "--out",
                              io_path("strength.png"), inpaint ? "--mask" : NULL, mask, NULL};
        CHECK(run(argv) == 0);
        kiln_image got = {0}, ref = {0};
        if (!kiln_image_read_file(io_path("strength.png"), NULL, &got, &err) &&
            !kiln_image_read_file(want, NULL, &ref, &err) && got.width == ref.width &&
            got.height == ref.height) {
            double p = oracle_psnr_u8(got.pixels, ref.pixels, (size_t)got.width * got.height * 3);
            fprintf(stderr, "  %s: PSNR %.2f dB\n", cases[c], p);
            CHECK(p >= 50.0);
        } else
            CHECKF(0, "%s: no image of the reference's size (%s)", cases[c], err.msg);
        kiln_image_free(&got), kiln_image_free(&ref);
        cJSON_Delete(meta);
    }
}

/* The value of PNG iTXt entry `key` in the file (into out), or -1. */
static int png_text(const char *path, const char *key, char *out, size_t cap)
{
    size_t len = 0;
    char *d = read_all(path, &len);
    int found = -1;
    for (size_t off = 8; d && off + 12 <= len;) {
        const unsigned char *p = (const unsigned char *)d + off;
        size_t n = (size_t)p[0] << 24 | (size_t)p[1] << 16 | (size_t)p[2] << 8 | p[3];
        if (off + 12 + n > len)
            break;
        size_t kl = strlen(key);
        if (!memcmp(p + 4, "iTXt", 4) && n >= kl + 5 && !memcmp(p + 8, key, kl) && !p[8 + kl]) {
            snprintf(out, cap, "%.*s", (int)(n - kl - 5), (const char *)p + 8 + kl + 5);
            found = 0;
        }
        off += 12 + n;
    }
    free(d);
    return found;
}

/* What a person sees: each path written and its seed on stdout, a drawn
 * seed that makes the same image again, the request in the PNG's text
 * chunks (none with --no-metadata), progress on stderr with --progress and
 * nothing but errors with -q, and an output extension that names no format
 * refused before any work. */
static void test_cli_outputs(void)
{
    char model[512], out[4096], text[256];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    const char *drawn[] = {NULL, "generate", "--model", model, "--prompt", "a caf\xc3\xa9",
                           "-n", "2", "--width", "64", "--height", "64", "--steps", "2",
                           "--text-encoder-out-layers", "1,2,3", "--progress", "--out",
                           io_path("r.png"), NULL};
    CHECK(test_run_capture(kiln, drawn, out, sizeof out, log_text, sizeof log_text) == 0);
    unsigned long long s0 = 0, s1 = 0;
    char p0[1024], p1[1024];
    CHECKF(sscanf(out, "%1023[^:]: seed %llu\n%1023[^:]: seed %llu", p0, &s0, p1, &s1) == 4,
           "stdout: %s", out);
    CHECK(!strcmp(p0, io_path("r-0.png")) && !strcmp(p1, io_path("r-1.png")) && s1 == s0 + 1);
    CHECKF(strstr(log_text, "denoise: step 2/2") && strstr(log_text, "decode"), "stderr: %s",
           log_text);
    CHECK(png_text(io_path("r-1.png"), "prompt", text, sizeof text) == 0 &&
          !strcmp(text, "a caf\xc3\xa9"));
    char want[32];
    snprintf(want, sizeof want, "%llu", s1);
    CHECK(png_text(io_path("r-1.png"), "seed", text, sizeof text) == 0 && !strcmp(text, want));
    CHECK(png_text(io_path("r-1.png"), "size", text, sizeof text) == 0 && !strcmp(text, "64x64"));
    CHECK(png_text(io_path("r-1.png"), "steps", text, sizeof text) == 0 && !strcmp(text, "2"));
    CHECK(png_text(io_path("r-1.png"), "model", text, sizeof text) == 0 &&
          !strcmp(text, "klein-tiny"));
    /* the printed seed makes image 1 again, alone; -q: nothing on stderr */
    const char *again[] = {NULL, "generate", "--model", model, "--prompt", "a caf\xc3\xa9",
                           "--seed", want, "--width", "64", "--height", "64", "--steps", "2",
                           "--text-encoder-out-layers", "1,2,3", "-q", "--out",
                           io_path("again.png"), NULL};
    CHECK(test_run_capture(kiln, again, out, sizeof out, log_text, sizeof log_text) == 0);
    CHECKF(log_text[0] == '\0', "-q printed: %s", log_text);
    CHECK(same_file(io_path("r-1.png"), io_path("again.png")));
    const char *bare[] = {NULL, "generate", "--model", model, "--prompt", "x", "--seed", want,
                          "--width", "64", "--height", "64", "--steps", "2",
                          "--text-encoder-out-layers", "1,2,3", "--no-metadata", "--out",
                          io_path("bare.png"), NULL};
    CHECK(test_run_capture(kiln, bare, out, sizeof out, log_text, sizeof log_text) == 0);
    CHECK(png_text(io_path("bare.png"), "prompt", text, sizeof text) == -1);
    const char *bmp[] = {NULL, "generate", "--model", model, "--prompt", "x", "--out",
                         io_path("cat.bmp"), NULL};
    CHECK(test_run(kiln, bmp, log_text, sizeof log_text) == 2);
    CHECKF(strstr(log_text, "unknown image extension") && strstr(log_text, ".webp"), "%s",
           log_text);
    CHECK(access(io_path("cat.bmp"), F_OK) != 0);
    const char *noext[] = {NULL, "generate", "--model", model, "--prompt", "x", "--out",
                           io_path("cat"), NULL};
    CHECK(test_run(kiln, noext, log_text, sizeof log_text) == 2);
    CHECKF(strstr(log_text, "no file extension"), "%s", log_text);
}

static void expect_failure(const char **argv, const char *needle)
{
    int rc = test_run(kiln, argv, log_text, sizeof log_text);
    CHECKF(rc == 1 || rc == 2, "exit %d", rc);
    CHECKF(strstr(log_text, needle) != NULL, "expected '%s' in: %s", needle, log_text);
}

/* Z-Image checkpoints through the same command: the pipeline's template and
 * hidden state without flags, both oracle cases (the batch with captions of
 * 10 and 75 tokens), an edit (image-to-image) and references refused. */
static void test_zimage_cases(void)
{
    char model[512];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/zimage-tiny"));
    cJSON *meta = oracle_meta("zimage_t2i_256");
    const char *one[] = {NULL, "generate", "--model", model, "--prompt",
                         cJSON_GetObjectItem(meta, "prompt")->valuestring, "--seed", "42",
                         "--width", "256", "--height", "256", "--steps", "8", "--out",
                         io_path("zi.png"), NULL};
    CHECK(run(one) == 0);
    CHECK(psnr_vs_oracle(io_path("zi.png"), "zimage_t2i_256", 0) >= 50.0);
    cJSON_Delete(meta);
    meta = oracle_meta("zimage_batch2_160x96");
    cJSON *prompts = cJSON_GetObjectItem(meta, "prompts");
    const char *two[] = {NULL, "generate", "--model", model, "--prompt",
                         cJSON_GetArrayItem(prompts, 0)->valuestring, "--prompt",
                         cJSON_GetArrayItem(prompts, 1)->valuestring, "--seed", "77", "--width",
                         "96", "--height", "160", "--steps", "8", "--batch-noise", "--out",
                         io_path("zb.png"), NULL};
    CHECK(run(two) == 0);
    CHECK(psnr_vs_oracle(io_path("zb-0.png"), "zimage_batch2_160x96", 0) >= 50.0);
    CHECK(psnr_vs_oracle(io_path("zb-1.png"), "zimage_batch2_160x96", 1) >= 50.0);
    cJSON_Delete(meta);
    char ref_png[512];
    snprintf(ref_png, sizeof ref_png, "%s", oracle_path("cases/klein_edit_1ref/input_ref0.png"));
    /* An edit is image-to-image of one image (tests/oracle/test_edit_oracle
     * checks it against diffusers); two images are references, refused. */
    const char *edit[] = {NULL, "edit", "--model", model, "--image", ref_png, "--prompt", "x",
                          "--steps", "3", "--out", io_path("zi2i.png"), NULL};
    CHECK(run(edit) == 0 && access(io_path("zi2i.png"), F_OK) == 0);
    const char *two_refs[] = {NULL, "edit", "--model", model, "--image", ref_png, "--image",
                              ref_png, "--prompt", "x", "--out", io_path("bad.png"), NULL};
    expect_failure(two_refs, "not 2 references");
}

static void test_bad_input(void)
{
    char model[512];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    const char *odd[] = {NULL, "generate", "--model", model, "--prompt", "x", "--width", "100",
                         "--height", "64", "--out", io_path("bad.png"), NULL};
    expect_failure(odd, "multiple of 16");
    const char *small[] = {NULL, "generate", "--model", model, "--prompt", "x", "--width", "32",
                           "--height", "64", "--out", io_path("bad.png"), NULL};
    expect_failure(small, "between 64 and 4096");
    const char *nomodel[] = {NULL, "generate", "--model", io_path("nothing"), "--prompt", "x",
                             "--out", io_path("bad.png"), NULL};
    expect_failure(nomodel, "not found");
    const char *neg[] = {NULL, "generate", "--model", model, "--prompt", "x",
                         "--negative-prompt", "y", "--out", io_path("bad.png"), NULL};
    expect_failure(neg, "base");
    FILE *f = fopen(io_path("notimage.png"), "w");
    if (f) {
        fputs("hello, not an image\n", f);
        fclose(f);
    }
    const char *badimg[] = {NULL, "edit", "--model", model, "--image", io_path("notimage.png"),
                            "--prompt", "x", "--out", io_path("bad.png"), NULL};
    expect_failure(badimg, "image");
    const char *badlat[] = {NULL, "generate", "--model", model, "--prompt", "x", "--width", "64",
                            "--height", "64", "--latents-in", io_path("fox.safetensors"),
                            "--text-encoder-out-layers", "1,2,3", "--out", io_path("bad.png"),
                            NULL};
    expect_failure(badlat, "latents");
    const char *badutf[] = {NULL, "generate", "--model", model, "--prompt", "\xc3\x28",
                            "--out", io_path("bad.png"), NULL};
    expect_failure(badutf, "UTF-8");
    CHECK(access(io_path("bad.png"), F_OK) != 0);
}

int main(void)
{
    static char exe[4096];
    snprintf(exe, sizeof exe, "%s", test_build_path("tools/kiln"));
    kiln = exe;
    RUN(test_t2i_matches_oracle_and_is_deterministic);
    RUN(test_batch_case);
    RUN(test_seed_per_image);
    RUN(test_edit_and_cfg_cases);
    RUN(test_strength_and_mask_cases);
    RUN(test_bad_input);
    RUN(test_cli_outputs);
    RUN(test_zimage_cases);
    return test_finish();
}
