/* Previews (kiln_denoise_job.preview_at / on_preview: the service's
 * partial images) on the CPU backend with the tiny klein and Z-Image
 * checkpoints.  diffusers has no previews, so they are checked from inside:
 * - asking for a preview at every step leaves the run's latents the same
 *   bytes as a run without previews (klein text-to-image with two rows,
 *   klein inpainting, Z-Image with and without CFG);
 * - the estimate at the last step, x0 = x - sigma v, is the final latents
 *   bit for bit (the last Euler step goes to sigma 0 with the same
 *   velocity; with a mask the kept region is blended in as after the last
 *   step), and the earlier estimates differ from it and from each other;
 * - previews come only at the steps asked for, in order, rows as the run's;
 * - an error from on_preview stops the run with that status. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "engine/inpaint.h"
#include "oracle_util.h"
#include "tests/test.h"

#define MAX_PREVIEWS 16

static kiln_backend *be;

typedef struct capture {
    unsigned want;    /* bit k: a preview at step k */
    int n, steps[MAX_PREVIEWS];
    float *x0[MAX_PREVIEWS];
    size_t numel;
    kiln_status fail_with; /* returned by on_preview when set */
} capture;

static int want_at(void *user, int step)
{
    const capture *c = user;
    return step < 32 && (c->want >> step) & 1;
}

static kiln_status got(void *user, int step, const kiln_tensor *x0, kiln_err *err)
{
    capture *c = user;
    if (c->fail_with)
        return kiln_err_set(err, c->fail_with, "preview refused");
    if (c->n >= MAX_PREVIEWS || x0->dtype != be->act_dtype || x0->ndim != 3)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "unexpected preview");
    c->numel = (size_t)kiln_tensor_numel(x0);
    c->x0[c->n] = malloc(c->numel * sizeof(float));
    kiln_be_download(be, x0, c->x0[c->n]);
    c->steps[c->n++] = step;
    return kiln_be_check(be, err);
}

static void capture_free(capture *c)
{
    for (int i = 0; i < c->n; i++)
        free(c->x0[i]);
}

/* Runs the job, with previews as `c` asks (NULL: none); the latents on
 * the host, or NULL when the run fails (*st says why). */
static float *run(kiln_denoise_stage *den, kiln_denoise_job job, capture *c, size_t *numel,
                  kiln_status *st)
{
    if (c)
        job.preview_at = want_at, job.on_preview = got, job.user = c;
    kiln_tensor out = {0};
    kiln_err err = {0};
    *st = kiln_denoise_run(den, &job, &out, &err);
    if (*st)
        return NULL;
    *numel = (size_t)kiln_tensor_numel(&out);
    float *h = malloc(*numel * sizeof *h);
    kiln_be_download(be, &out, h);
    kiln_be_free(be, &out);
    return h;
}

/* The checks of the header on one job running `run_steps` steps. */
static void check_job(const char *what, kiln_denoise_stage *den, const kiln_denoise_job *job,
                      int run_steps)
{
    size_t n = 0, n2 = 0;
    kiln_status st;
    float *plain = run(den, *job, NULL, &n, &st);
    CHECKF(plain != NULL, "%s: plain run failed (%d)", what, st);
    capture all = {.want = (1u << run_steps) - 1};
    float *with = run(den, *job, &all, &n2, &st);
    CHECKF(with != NULL, "%s: run with previews failed (%d)", what, st);
    if (!plain || !with)
        goto out;
    CHECKF(n == n2 && memcmp(plain, with, n * sizeof *plain) == 0,
           "%s: previews changed the latents", what);
    CHECKF(all.n == run_steps, "%s: %d previews for %d steps", what, all.n, run_steps);
    for (int k = 0; k < all.n; k++)
        CHECK(all.steps[k] == k && all.numel == n);
    if (all.n != run_steps || all.numel != n)
        goto out;
    CHECKF(memcmp(all.x0[run_steps - 1], plain, n * sizeof *plain) == 0,
           "%s: the last step's estimate is not the final latents", what);
    for (int k = 0; k + 1 < run_steps; k++) {
        double d_final = 0, d_next = 0;
        for (size_t i = 0; i < n; i++) {
            d_final += fabs(all.x0[k][i] - plain[i]);
            d_next += fabs(all.x0[k][i] - all.x0[k + 1][i]);
        }
        CHECKF(d_final > 0 && d_next > 0, "%s: estimate %d equals a later one", what, k);
    }
    /* Only the steps asked for, in order. */
    capture some = {.want = 1u | (1u << (run_steps - 1))};
    free(with);
    with = run(den, *job, &some, &n2, &st);
    CHECK(with && some.n == 2 && some.steps[0] == 0 && some.steps[1] == run_steps - 1 &&
          !memcmp(some.x0[0], all.x0[0], n * sizeof(float)));
    capture_free(&some);
    /* A failing preview stops the run with its status. */
    capture fail = {.want = 1, .fail_with = KILN_ERR_NOMEM};
    float *none = run(den, *job, &fail, &n2, &st);
    CHECKF(!none && st == KILN_ERR_NOMEM, "%s: on_preview's error did not stop the run", what);
    free(none);
out:
    capture_free(&all);
    free(plain), free(with);
}

static void test_klein(void)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (!ck)
        return;
    kiln_encode_opts eo = {.out_layers = {1, 2, 3}, .n_out_layers = 3, .with_references = 1};
    kiln_encode_stage *enc = kiln_encode_stage_create(be, ck, &eo, &err);
    kiln_denoise_stage *den = kiln_denoise_stage_create(be, ck, &err);
    kiln_checkpoint_close(ck);
    CHECKF(enc && den, "%s", err.msg);
    const char *prompts[2] = {"a lighthouse", "a red door"};
    kiln_tensor emb = {0}, img = {0};
    CHECK(kiln_encode_prompts(enc, prompts, 2, 32, &emb, NULL, NULL, &err) == KILN_OK);
    uint64_t seeds[2] = {3, 4};
    kiln_denoise_job t2i = {.B = 2, .embeds = &emb, .width = 64, .height = 48, .steps = 4,
                            .guidance = 1.0f, .seeds = seeds};
    check_job("klein t2i", den, &t2i, 4);

    /* Inpainting: one row, a mask keeping every third token. */
    enum { W = 64, H = 96, NTOK = (W / 16) * (H / 16) };
    kiln_tensor emb1 = kiln_tensor_batch_view(&emb, 0, 1);
    kiln_model_traits tr = kiln_encode_stage_traits(enc);
    kiln_image im = {0};
    CHECK(kiln_image_alloc(&im, W, H, NULL) == KILN_OK);
    for (int i = 0; i < W * H * 3; i++)
        im.pixels[i] = (uint8_t)((i * 37) % 256);
    int32_t *ids = NULL;
    int64_t R = 0;
    CHECK(kiln_inpaint_prepare_image(&im, &tr, &err) == KILN_OK);
    CHECKF(kiln_encode_references(enc, &im, 1, &img, &ids, &R, &err) == KILN_OK, "%s", err.msg);
    kiln_image_free(&im);
    float mask[NTOK];
    for (int t = 0; t < NTOK; t++)
        mask[t] = t % 3 ? 1.0f : 0.0f;
    kiln_denoise_job inp = {.B = 1, .embeds = &emb1, .width = W, .height = H, .steps = 4,
                            .guidance = 1.0f, .seeds = seeds, .init_tokens = &img,
                            .strength = 0.75, .mask = mask, .ref_tokens = &img, .ref_ids = ids,
                            .R = R};
    check_job("klein inpaint", den, &inp, 4 - kiln_denoise_first_step(4, 0.75));
    free(ids);
    kiln_be_free(be, &emb), kiln_be_free(be, &img);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
}

static void test_zimage(void)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/zimage-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (!ck)
        return;
    kiln_encode_opts eo = KILN_ENCODE_DEFAULTS;
    eo.with_references = 0;
    kiln_encode_stage *enc = kiln_encode_stage_create(be, ck, &eo, &err);
    kiln_denoise_stage *den = kiln_denoise_stage_create(be, ck, &err);
    kiln_checkpoint_close(ck);
    CHECKF(enc && den, "%s", err.msg);
    const char *prompts[2] = {"a lighthouse at dusk", ""};
    kiln_tensor emb = {0};
    int lens[2] = {0};
    CHECK(kiln_encode_prompts(enc, prompts, 2, 32, &emb, NULL, lens, &err) == KILN_OK);
    kiln_tensor pos = kiln_tensor_batch_view(&emb, 0, 1), neg = kiln_tensor_batch_view(&emb, 1, 1);
    uint64_t seed = 9;
    kiln_denoise_job job = {.B = 1, .embeds = &pos, .txt_len = lens, .width = 64, .height = 32,
                            .steps = 5, .guidance = 0.0f, .seeds = &seed};
    check_job("zimage", den, &job, 5);
    job.guidance = 2.0f, job.neg_embeds = &neg, job.neg_len = lens + 1;
    check_job("zimage cfg", den, &job, 5);
    kiln_be_free(be, &emb);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
}

int main(void)
{
    kiln_err err = {0};
    be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    RUN(test_klein);
    RUN(test_zimage);
    kiln_backend_destroy(be);
    return test_finish();
}
