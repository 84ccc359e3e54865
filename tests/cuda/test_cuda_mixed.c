/* One process through a sequence of requests that change everything that
 * changes between a service's requests: image size (square and not, up to
 * 2048x2048), batch rows (prompts x images), reference count and sizes,
 * steps; so the DiT and VAE arenas grow and settle, recorded DiT steps are
 * replayed after other shapes moved memory, the backend's scratch grows
 * under existing recordings, and RoPE tables and cuDNN plans are rebuilt.
 * Every request's final latents and 8-bit images are then compared with
 * the same request run alone in a fresh process (this program, re-executed
 * with --only K): they must be bit-identical.  A fault (illegal address,
 * stale recording, stale staging) shows up as an error or a difference;
 * tools/gpu/check.sh also runs it under compute-sanitizer.
 *
 * Between requests the sequence also allocates and frees device buffers of
 * assorted sizes, as a service's per-job tensors and IPC mappings do, so
 * that memory freed and allocated again by the stages lands at varying
 * addresses: what a stale recording would read is then gone or reused.
 *
 * Usage: test_cuda_mixed [--model DIR] [--out-layers 1,2,3] [--device cuda|cpu]
 *                        [--max-seq N] [--quick]
 *   default model: $KILN_SHARED/oracle/ckpt/klein-tiny (out layers 1,2,3)
 *   --quick: the sizes above 1024 are left out (the full-size model's run
 *            in check.sh keeps them)
 * Skipped (77) without a CUDA device unless KILN_REQUIRE_GPU=1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/image.h"
#include "common/log.h"
#include "engine/decode_stage.h"
#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "tests/cuda/gpu_skip.h"
#include "tests/test.h"

/* One request as the stages see it: P prompts x n images, refs of the
 * given sizes (synthetic images), an edit's size, steps, seed. */
typedef struct request {
    int P, n, width, height, steps;
    int n_refs;
    int ref_w[2], ref_h[2];
    int big; /* above 1024 on a side: left out by --quick */
} request;

static const request sequence[] = {
    {1, 1, 2048, 2048, 4, 0, {0}, {0}, 1}, /* the arenas at their largest first */
    {1, 2, 512, 512, 4, 0, {0}, {0}, 0},
    {3, 1, 768, 1344, 4, 0, {0}, {0}, 1}, /* several passes of one recorded shape */
    {2, 1, 1024, 1024, 4, 0, {0}, {0}, 0},
    {1, 1, 768, 1344, 4, 0, {0}, {0}, 1},
    {1, 1, 768, 768, 4, 1, {1024}, {1024}, 0},
    {1, 4, 512, 512, 3, 0, {0}, {0}, 0},
    {1, 1, 768, 768, 4, 2, {1024, 800}, {1024, 1200}, 0},
    {1, 1, 1344, 768, 4, 0, {0}, {0}, 1},
    {1, 1, 1024, 1024, 4, 0, {0}, {0}, 0}, /* replayed after every other shape */
    {2, 2, 256, 384, 4, 0, {0}, {0}, 0},
    {1, 2, 512, 512, 4, 0, {0}, {0}, 0},
    {1, 1, 768, 768, 4, 1, {800}, {1200}, 0},
    {1, 1, 2048, 1024, 2, 0, {0}, {0}, 1}, /* grows the arenas again late */
    {1, 1, 1024, 1024, 4, 0, {0}, {0}, 0},
};
#define N_REQ ((int)(sizeof sequence / sizeof sequence[0]))

static const char *const prompts[] = {"a red fox sitting in fresh snow", "a lighthouse at dusk",
                                      "a bowl of ripe cherries on a wooden table"};

typedef struct opts {
    const char *model, *device;
    int out_layers[KILN_MAX_OUT_LAYERS], n_out_layers;
    int max_seq, quick;
} opts;

typedef struct stages {
    kiln_checkpoint *ck;
    kiln_backend *be;
    kiln_encode_stage *enc;
    kiln_denoise_stage *den;
    kiln_decode_stage *dec;
} stages;

/* A request's outputs: the final latents as host f32 and the images'
 * pixels, one buffer each. */
typedef struct result {
    float *latents;
    size_t n_latents;
    uint8_t *pixels;
    size_t n_pixels;
} result;

static void result_free(result *r)
{
    free(r->latents), free(r->pixels);
    memset(r, 0, sizeof *r);
}

static int stages_open(stages *s, const opts *o, kiln_err *err)
{
    memset(s, 0, sizeof *s);
    if (!(s->ck = kiln_checkpoint_open(o->model, err)))
        return err->code;
    if (!(s->be = kiln_backend_create(o->device, 0, err)))
        return err->code;
    kiln_encode_opts eo = {.n_out_layers = o->n_out_layers, .with_references = 1};
    memcpy(eo.out_layers, o->out_layers, sizeof eo.out_layers);
    if (!(s->enc = kiln_encode_stage_create(s->be, s->ck, &eo, err)) ||
        !(s->den = kiln_denoise_stage_create(s->be, s->ck, err)) ||
        !(s->dec = kiln_decode_stage_create(s->be, s->ck, err)))
        return err->code;
    return KILN_OK;
}

static void stages_close(stages *s)
{
    kiln_encode_stage_destroy(s->enc);
    kiln_denoise_stage_destroy(s->den);
    kiln_decode_stage_destroy(s->dec);
    kiln_backend_destroy(s->be);
    kiln_checkpoint_close(s->ck);
}

/* A deterministic reference image: smooth gradients plus a pattern, so the
 * VAE encoder sees structure at every scale. */
static kiln_status make_ref(kiln_image *img, int w, int h, int k, kiln_err *err)
{
    if (kiln_image_alloc(img, w, h, err))
        return err->code;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint8_t *p = img->pixels + ((size_t)y * w + x) * 3;
            p[0] = (uint8_t)(x * 255 / w);
            p[1] = (uint8_t)(y * 255 / h);
            p[2] = (uint8_t)(((x / (8 + k)) ^ (y / (5 + k))) * 37);
        }
    return KILN_OK;
}

/* Runs request k (seed 1000 + 17k) through the three stages. */
static kiln_status run_request(stages *s, const opts *o, int k, result *res, kiln_err *err)
{
    const request *q = &sequence[k];
    kiln_backend *be = s->be;
    int64_t B = (int64_t)q->P * q->n, R = 0;
    kiln_tensor emb_p = {0}, emb = {0}, ref_tokens = {0}, lat = {0};
    kiln_image refs[2] = {{0}}, *imgs = calloc((size_t)B, sizeof *imgs);
    int32_t *ref_ids = NULL;
    uint64_t seeds[16];
    memset(res, 0, sizeof *res);
    kiln_status st = imgs ? KILN_OK : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    for (int i = 0; !st && i < q->n_refs; i++)
        st = make_ref(&refs[i], q->ref_w[i], q->ref_h[i], i, err);
    if (!st)
        st = kiln_encode_prompts(s->enc, prompts, q->P, o->max_seq, &emb_p, NULL, NULL, err);
    if (!st && !kiln_be_alloc(be, &emb, be->act_dtype, 3,
                              (int64_t[]){B, emb_p.shape[1], emb_p.shape[2]}))
        kiln_denoise_expand_rows(be, &emb, 0, &emb_p, B, q->n); /* the plan's row layout */
    if (!st)
        st = kiln_be_check(be, err);
    if (!st && q->n_refs)
        st = kiln_encode_references(s->enc, refs, q->n_refs, &ref_tokens, &ref_ids, &R, err);
    for (int64_t b = 0; b < B; b++)
        seeds[b] = 1000 + 17 * (uint64_t)k + (uint64_t)b;
    kiln_denoise_job job = {.B = B, .embeds = &emb, .width = q->width, .height = q->height,
                            .steps = q->steps, .guidance = 1.0f, .seeds = seeds,
                            .ref_tokens = R ? &ref_tokens : NULL, .ref_ids = ref_ids, .R = R};
    if (!st)
        st = kiln_denoise_run(s->den, &job, &lat, err);
    if (!st) {
        res->n_latents = (size_t)kiln_tensor_numel(&lat);
        if (!(res->latents = malloc(res->n_latents * sizeof *res->latents)))
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        else {
            kiln_be_download(be, &lat, res->latents);
            st = kiln_be_check(be, err);
        }
    }
    if (!st)
        st = kiln_decode_run(s->dec, &lat, q->width, q->height, imgs, NULL, err);
    if (!st) {
        size_t per = (size_t)q->width * q->height * 3;
        res->n_pixels = per * (size_t)B;
        if (!(res->pixels = malloc(res->n_pixels)))
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        for (int64_t b = 0; !st && b < B; b++)
            memcpy(res->pixels + per * (size_t)b, imgs[b].pixels, per);
    }
    if (st)
        result_free(res);
    for (int64_t b = 0; imgs && b < B; b++)
        kiln_image_free(&imgs[b]);
    for (int i = 0; i < q->n_refs; i++)
        kiln_image_free(&refs[i]);
    free(imgs), free(ref_ids);
    kiln_be_free(be, &emb_p), kiln_be_free(be, &emb), kiln_be_free(be, &ref_tokens);
    kiln_be_free(be, &lat);
    return st;
}

static int write_all(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n; }
static int read_all(FILE *f, void *p, size_t n) { return fread(p, 1, n, f) == n; }

/* The --only child: one request in this fresh process, its outputs to
 * `path` (latent count, latents, pixel count, pixels). */
static int run_only(const opts *o, int k, const char *path)
{
    kiln_err err = {0};
    stages s;
    result r;
    int rc = 1;
    if (stages_open(&s, o, &err) || run_request(&s, o, k, &r, &err)) {
        fprintf(stderr, "request %d alone: %s\n", k, err.msg);
    } else {
        FILE *f = fopen(path, "wb");
        uint64_t nl = r.n_latents, np = r.n_pixels;
        if (f && write_all(f, &nl, sizeof nl) && write_all(f, r.latents, nl * sizeof(float)) &&
            write_all(f, &np, sizeof np) && write_all(f, r.pixels, np))
            rc = 0;
        else
            fprintf(stderr, "request %d alone: cannot write %s: %s\n", k, path, strerror(errno));
        if (f && fclose(f))
            rc = 1;
        result_free(&r);
    }
    stages_close(&s);
    return rc;
}

/* Runs this program with --only k and reads back what it wrote. */
static int run_fresh(const char *self, char *const *argv_rest, int n_rest, int k, result *r)
{
    char path[] = "/tmp/kiln-mixed-XXXXXX", kbuf[16];
    int fd = mkstemp(path);
    if (fd < 0)
        return -1;
    close(fd);
    snprintf(kbuf, sizeof kbuf, "%d", k);
    char *argv[32];
    int a = 0;
    argv[a++] = (char *)self;
    for (int i = 0; i < n_rest && a < 27; i++)
        argv[a++] = argv_rest[i];
    argv[a++] = "--only", argv[a++] = kbuf, argv[a++] = "--dump", argv[a++] = path;
    argv[a] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        execv(self, argv);
        _exit(127);
    }
    int status = 0, ok = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
                         WEXITSTATUS(status) == 0;
    FILE *f = ok ? fopen(path, "rb") : NULL;
    uint64_t nl = 0, np = 0;
    memset(r, 0, sizeof *r);
    ok = f && read_all(f, &nl, sizeof nl) && nl < ((uint64_t)1 << 32) &&
         (r->latents = malloc(nl * sizeof(float) + 1)) && read_all(f, r->latents, nl * sizeof(float)) &&
         read_all(f, &np, sizeof np) && np < ((uint64_t)1 << 34) && (r->pixels = malloc(np + 1)) &&
         read_all(f, r->pixels, np);
    r->n_latents = nl, r->n_pixels = np;
    if (f)
        fclose(f);
    unlink(path);
    if (!ok)
        result_free(r);
    return ok ? 0 : -1;
}

static int parse_layers(const char *s, opts *o)
{
    o->n_out_layers = 0;
    while (*s && o->n_out_layers < KILN_MAX_OUT_LAYERS) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0)
            return -1;
        o->out_layers[o->n_out_layers++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return o->n_out_layers ? 0 : -1;
}

int main(int argc, char **argv)
{
    static char model[4096];
    opts o = {.device = "cuda", .out_layers = {1, 2, 3}, .n_out_layers = 3, .max_seq = 64};
    const char *shared = getenv("KILN_SHARED");
    snprintf(model, sizeof model, "%s/oracle/ckpt/klein-tiny", shared ? shared : "../shared");
    o.model = model;
    int only = -1;
    const char *dump = NULL;
    /* Options other than --only/--dump are passed on to the children. */
    char *rest[24];
    int n_rest = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int pass = 1;
        if (!strcmp(a, "--model") && v)
            o.model = v;
        else if (!strcmp(a, "--device") && v)
            o.device = v;
        else if (!strcmp(a, "--max-seq") && v)
            o.max_seq = atoi(v);
        else if (!strcmp(a, "--out-layers") && v && !parse_layers(v, &o))
            ;
        else if (!strcmp(a, "--quick")) {
            o.quick = 1;
            rest[n_rest++] = argv[i];
            continue;
        } else if (!strcmp(a, "--only") && v)
            only = atoi(v), pass = 0;
        else if (!strcmp(a, "--dump") && v)
            dump = v, pass = 0;
        else {
            fprintf(stderr, "usage: %s [--model DIR] [--out-layers L,..] [--device D] "
                            "[--max-seq N] [--quick]\n", argv[0]);
            return 2;
        }
        if (pass && n_rest < 22)
            rest[n_rest++] = argv[i], rest[n_rest++] = argv[i + 1];
        i++;
    }
    if (only >= 0)
        return only < N_REQ && dump ? run_only(&o, only, dump) : 2;

    kiln_err err = {0};
    stages s;
    if (stages_open(&s, &o, &err)) {
        int rc = s.be ? (fprintf(stderr, "loading %s: %s\n", o.model, err.msg), 1)
                      : gpu_test_unavailable("cuda backend", &err);
        stages_close(&s);
        return rc;
    }
    result got[N_REQ];
    memset(got, 0, sizeof got);
    kiln_tensor churn[4] = {{0}};
    for (int k = 0; k < N_REQ; k++) {
        const request *q = &sequence[k];
        if (o.quick && q->big)
            continue;
        kiln_be_free(s.be, &churn[k % 4]);
        kiln_be_alloc(s.be, &churn[k % 4], KILN_U8, 1,
                      (int64_t[]){((int64_t)(k * 7919 % 13) + 1) << 20});
        double t0 = kiln_now_ms();
        kiln_status st = run_request(&s, &o, k, &got[k], &err);
        CHECKF(!st, "request %d (%dx%d, %d x %d rows, %d refs) in sequence: %s", k, q->width,
               q->height, q->P, q->n, q->n_refs, err.msg);
        fprintf(stderr, "request %2d: %4dx%-4d %d x %d rows, %d refs, %d steps: %.0f ms\n", k,
                q->width, q->height, q->P, q->n, q->n_refs, q->steps, kiln_now_ms() - t0);
        if (st)
            break; /* a device fault poisons the rest of the sequence */
    }
    for (int i = 0; i < 4; i++)
        kiln_be_free(s.be, &churn[i]);
    stages_close(&s);

    for (int k = 0; k < N_REQ; k++) {
        if (!got[k].latents)
            continue;
        result alone;
        if (run_fresh(argv[0], rest, n_rest, k, &alone)) {
            CHECKF(0, "request %d in a fresh process failed", k);
            continue;
        }
        int same_lat = alone.n_latents == got[k].n_latents &&
                       !memcmp(alone.latents, got[k].latents, got[k].n_latents * sizeof(float));
        int same_px = alone.n_pixels == got[k].n_pixels &&
                      !memcmp(alone.pixels, got[k].pixels, got[k].n_pixels);
        CHECKF(same_lat, "request %d: latents differ from a fresh process's", k);
        CHECKF(same_px, "request %d: image bytes differ from a fresh process's", k);
        fprintf(stderr, "request %2d: %s\n", k,
                same_lat && same_px ? "identical to a fresh process" : "DIFFERENT");
        result_free(&alone);
    }
    for (int k = 0; k < N_REQ; k++)
        result_free(&got[k]);
    return test_finish();
}
