#include "cli_pipeline.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checkpoint.h"
#include "common/image.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "engine/decode_stage.h"
#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "engine/inpaint.h"
#include "engine/plan.h"
#include "common/args.h"

static void usage(FILE *f, int edit)
{
    fprintf(f,
            "usage: kiln %s --model DIR%s --prompt TEXT [--prompt TEXT ...] --out FILE.png\n"
            "  [--seed N] [--width W --height H] [--steps S] [--guidance G] [-n N]\n"
            "  [--negative-prompt TEXT] [--max-sequence-length L]%s\n"
            "  [--text-encoder-out-layers A,B,C] [--batch-noise] [--fp32-noise]\n"
            "  [--latents-in FILE.safetensors] [--latents-out FILE.safetensors]\n"
            "  [--device cpu|cuda] [--gpu N] [--precision exact|fp8] [-q | --progress]\n"
            "  [--no-metadata]\n"
            "Image i of the run uses seed + i, drawn alone (--batch-noise: one draw for the\n"
            "batch, as diffusers with a single generator); without --seed a random seed is\n"
            "drawn.  Several images are written as FILE-0.png, FILE-1.png, ...; each path\n"
            "and its seed is printed.  The format follows the extension (.png, .jpg, .jpeg,\n"
            ".webp); PNGs carry the request (prompt, seed, steps, guidance, size, model) as\n"
            "text chunks unless --no-metadata.  Progress goes to stderr on a terminal, or\n"
            "always with --progress; -q prints only errors and the paths.  --precision fp8\n"
            "runs the transformer blocks' linear layers as FP8 (E4M3) GEMMs: faster on GPUs\n"
            "with FP8 tensor cores, slightly different images (docs/PERFORMANCE.md); the\n"
            "default, exact, is the reference precision.%s\n",
            edit ? "edit" : "generate", edit ? " --image A.png [--image B.jpg ...]" : "",
            edit ? " [--strength S] [--mask M.png]" : "",
            edit ? "\n--strength S (0 < S <= 1): image-to-image from the one --image (klein:\n"
                   "diffusers' FluxImg2ImgPipeline algorithm; Z-Image: ZImageImg2ImgPipeline,\n"
                   "where an edit is always image-to-image, strength 0.6 unless given): it is\n"
                   "resized to its prepared size, noised to fraction S of the schedule and the\n"
                   "last steps - int(steps - steps x S) steps run; the output has the image's\n"
                   "prepared size.\n"
                   "--mask M.png: inpainting (Flux2KleinInpaintPipeline, strength 0.8 unless\n"
                   "given; ZImageInpaintPipeline, 1.0) of the one --image, of its size: with\n"
                   "alpha, transparent pixels are repainted (OpenAI's masks); without, white ones\n"
                   "(diffusers' masks)."
                 : "");
}

static int parse_layers(const char *s, cli_gen_opts *o)
{
    o->n_out_layers = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (o->n_out_layers == KILN_MAX_OUT_LAYERS ||
            kiln_parse_int(tok, -1000, 1000, &o->out_layers[o->n_out_layers]))
            return -1;
        o->n_out_layers++;
    }
    return o->n_out_layers ? 0 : -1;
}

/* The extension of the file name (after the last '.' of its last part), or
 * NULL. */
static const char *extension(const char *path)
{
    const char *dot = strrchr(path, '.');
    const char *slash = strrchr(path, '/');
    return dot && (!slash || dot > slash) && dot[1] ? dot + 1 : NULL;
}

/* The format an output's extension names (any case); -1 for none or an
 * unknown one, so that cat.bmp is refused rather than filled with PNG. */
static int format_of(const char *path, kiln_image_format *f)
{
    const char *ext = extension(path);
    char low[8];
    size_t n = ext ? strlen(ext) : 0;
    if (!n || n >= sizeof low)
        return -1;
    for (size_t i = 0; i <= n; i++)
        low[i] = (char)tolower((unsigned char)ext[i]);
    return kiln_image_format_parse(low, f);
}

int cli_parse_gen_args(int argc, char **argv, int edit, cli_gen_opts *o)
{
    enum { O_NEG = 256, O_MAXSEQ, O_LAYERS, O_BATCH, O_FP32, O_LIN, O_LOUT, O_DEVICE, O_GPU,
           O_PROGRESS, O_NO_META, O_STRENGTH, O_MASK, O_PRECISION };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},   {"prompt", required_argument, 0, 'p'},
        {"out", required_argument, 0, 'o'},     {"seed", required_argument, 0, 's'},
        {"width", required_argument, 0, 'W'},   {"height", required_argument, 0, 'H'},
        {"steps", required_argument, 0, 'S'},   {"guidance", required_argument, 0, 'g'},
        {"image", required_argument, 0, 'i'},   {"negative-prompt", required_argument, 0, O_NEG},
        {"max-sequence-length", required_argument, 0, O_MAXSEQ},
        {"text-encoder-out-layers", required_argument, 0, O_LAYERS},
        {"batch-noise", no_argument, 0, O_BATCH}, {"fp32-noise", no_argument, 0, O_FP32},
        {"latents-in", required_argument, 0, O_LIN}, {"latents-out", required_argument, 0, O_LOUT},
        {"device", required_argument, 0, O_DEVICE}, {"gpu", required_argument, 0, O_GPU},
        {"quiet", no_argument, 0, 'q'},         {"progress", no_argument, 0, O_PROGRESS},
        {"no-metadata", no_argument, 0, O_NO_META},
        {"strength", required_argument, 0, O_STRENGTH},
        {"mask", required_argument, 0, O_MASK},
        {"precision", required_argument, 0, O_PRECISION},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0},
    };
    memset(o, 0, sizeof *o);
    kiln_request_init(&o->req);
    o->device = "cpu";
    o->n_out_layers = 0; /* the checkpoint's (kiln_encode_layers_of) */
    const char *cmd = edit ? "edit" : "generate";
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "n:qh", longopts, NULL)) != -1) {
        int bad = 0;
        char *end;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'o': o->out = optarg; break;
        case 'p':
            if (o->n_prompts == CLI_MAX_PROMPTS)
                bad = 1;
            else
                o->prompts[o->n_prompts++] = optarg;
            break;
        case 'i':
            if (!edit || o->n_images == KILN_MAX_REFS)
                bad = 1;
            else
                o->images[o->n_images++] = optarg;
            break;
        case 's':
            errno = 0;
            o->req.seed = strtoull(optarg, &end, 10);
            bad = errno || *end || end == optarg || optarg[0] == '-';
            o->seed_given = 1;
            break;
        case 'W': bad = kiln_parse_int(optarg, 1, 1 << 16, &o->req.width); break;
        case 'H': bad = kiln_parse_int(optarg, 1, 1 << 16, &o->req.height); break;
        case 'S': bad = kiln_parse_int(optarg, 1, 100000, &o->req.steps); break;
        case 'n': bad = kiln_parse_int(optarg, 1, 1000, &o->req.n); break;
        case 'g':
            o->req.guidance = strtof(optarg, &end);
            bad = *end || end == optarg || o->req.guidance < 0;
            break;
        case O_NEG: o->req.negative_prompt = optarg; break;
        case O_MAXSEQ: bad = kiln_parse_int(optarg, 1, 1 << 20, &o->req.max_sequence_length); break;
        case O_LAYERS: bad = parse_layers(optarg, o); break;
        case O_BATCH: o->req.batch_noise = 1; break;
        case O_FP32: o->fp32_noise = 1; break;
        case O_LIN: o->latents_in = optarg; break;
        case O_LOUT: o->latents_out = optarg; break;
        case O_DEVICE: o->device = optarg; break;
        case O_GPU: bad = kiln_parse_int(optarg, 0, 64, &o->gpu); break;
        case 'q': o->progress = CLI_PROGRESS_OFF; break;
        case O_PROGRESS: o->progress = CLI_PROGRESS_ON; break;
        case O_NO_META: o->no_metadata = 1; break;
        case O_MASK: o->mask = optarg, bad = !edit; break;
        case O_PRECISION: bad = kiln_precision_parse(optarg, &o->precision); break;
        case O_STRENGTH:
            /* Checked by kiln_request_resolve, as the service's. */
            o->req.strength = strtod(optarg, &end);
            bad = !edit || *end || end == optarg || !(o->req.strength > 0);
            break;
        case 'h': usage(stdout, edit); exit(0);
        default: bad = 1;
        }
        if (bad) {
            if (c != '?')
                fprintf(stderr, "kiln %s: invalid value '%s' for %s\n", cmd,
                        optarg ? optarg : "",
                        kiln_arg_option(argv, optind, optarg));
            usage(stderr, edit);
            return 2;
        }
    }
    if (optind < argc || !o->model || !o->out || !o->n_prompts || (edit && !o->n_images)) {
        fprintf(stderr, "kiln %s: %s\n", cmd,
                optind < argc ? "unexpected argument"
                              : "--model, --prompt and --out are required" );
        usage(stderr, edit);
        return 2;
    }
    const char *ext = extension(o->out);
    if (format_of(o->out, &o->req.format)) {
        fprintf(stderr,
                "kiln %s: --out %s: %s; the format follows it: .png, .jpg, .jpeg or .webp\n",
                cmd, o->out, ext ? "unknown image extension" : "no file extension");
        return 2;
    }
    if (!o->seed_given) {
        /* A fresh seed, printed with each image so that it can be made
         * again; below 2^53 as the service draws them (docs/API.md). */
        uint64_t r = 0;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
            r = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
        o->req.seed = r & ((UINT64_C(1) << 53) - 1);
    }
    if (o->progress == CLI_PROGRESS_OFF)
        kiln_log_set_level(KILN_LOG_WARN);
    return 0;
}

static int fail(const char *cmd, const kiln_err *err)
{
    fprintf(stderr, "kiln %s: %s\n", cmd, err->msg);
    return 1;
}

/* FILE.png for one image, FILE-i.png for several. */
static void output_name(char *buf, size_t len, const char *out, int i, int total)
{
    if (total == 1) {
        snprintf(buf, len, "%s", out);
        return;
    }
    const char *dot = strrchr(out, '.');
    const char *slash = strrchr(out, '/');
    if (!dot || (slash && dot < slash))
        snprintf(buf, len, "%s-%d", out, i);
    else
        snprintf(buf, len, "%.*s-%d%s", (int)(dot - out), out, i, dot);
}

static kiln_status read_latents(const char *path, int64_t B, int64_t N, int64_t C, float **out,
                                kiln_err *err)
{
    kiln_st *st = kiln_st_open(path, "--latents-in", err);
    if (!st)
        return err->code;
    const kiln_st_tensor *t = kiln_st_expect(st, "latents", 3, (int64_t[]){B, N, C}, err);
    kiln_status rc = t ? KILN_OK : err->code;
    if (t) {
        *out = malloc((size_t)(B * N * C) * sizeof **out);
        if (!*out)
            rc = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        else if (kiln_convert_to_f32(*out, t->data, t->dtype, (size_t)(B * N * C)))
            rc = kiln_err_set(err, KILN_ERR_FORMAT, "--latents-in: unsupported dtype");
    }
    kiln_st_close(st);
    return rc;
}

static kiln_status write_latents(kiln_backend *be, const char *path, const kiln_tensor *lat,
                                 kiln_err *err)
{
    float *host = malloc(kiln_tensor_numel(lat) * sizeof *host);
    if (!host)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    kiln_be_download(be, lat, host);
    kiln_status rc = kiln_be_check(be, err);
    if (!rc) {
        kiln_st_entry e = {.name = "latents", .dtype = KILN_F32, .ndim = 3, .data = host};
        memcpy(e.shape, lat->shape, sizeof e.shape);
        rc = kiln_st_write(path, &e, 1, err);
    }
    free(host);
    return rc;
}

typedef struct cli_run {
    kiln_checkpoint *ck;
    kiln_backend *be;
    kiln_encode_stage *enc;
    kiln_denoise_stage *den;
    kiln_decode_stage *dec;
    kiln_image refs[KILN_MAX_REFS];
    kiln_image mask;
    float *mask_grid; /* inpainting: the mask at the latent grid */
    kiln_image *out_images;
    kiln_tensor emb_p, emb, neg_p, neg, ref_tokens, latents;
    int32_t *ref_ids;
    int *lens;     /* [2B]: each row's and its negative's real tokens (Z-Image) */
    uint64_t *seeds;
    float *latents_in;
    int64_t B;
} cli_run;

static void cli_run_free(cli_run *r, const cli_gen_opts *o)
{
    kiln_backend *be = r->be;
    if (be) {
        kiln_be_free(be, &r->emb_p), kiln_be_free(be, &r->emb), kiln_be_free(be, &r->neg_p);
        kiln_be_free(be, &r->neg), kiln_be_free(be, &r->ref_tokens), kiln_be_free(be, &r->latents);
    }
    for (int i = 0; i < o->n_images; i++)
        kiln_image_free(&r->refs[i]);
    if (r->out_images)
        for (int64_t i = 0; i < r->B; i++)
            kiln_image_free(&r->out_images[i]);
    free(r->out_images), free(r->ref_ids), free(r->seeds), free(r->latents_in), free(r->lens);
    kiln_image_free(&r->mask), free(r->mask_grid);
    kiln_encode_stage_destroy(r->enc);
    kiln_denoise_stage_destroy(r->den);
    kiln_decode_stage_destroy(r->dec);
    kiln_backend_destroy(be);
    kiln_checkpoint_close(r->ck);
}

static kiln_status run(cli_run *r, cli_gen_opts *o, kiln_err *err)
{
    r->ck = kiln_checkpoint_open(o->model, err);
    if (!r->ck)
        return err->code;
    for (int i = 0; i < o->n_images; i++)
        if (kiln_image_read_file(o->images[i], NULL, &r->refs[i], err))
            return kiln_err_wrap(err, "--image %s", o->images[i]);
    kiln_model_traits traits = kiln_model_traits_of(r->ck);
    kiln_limits lim = KILN_LIMITS_CLI;
    o->req.refs = r->refs, o->req.n_refs = o->n_images;
    if (o->mask) {
        if (kiln_image_read_mask_file(o->mask, NULL, &r->mask, err))
            return kiln_err_wrap(err, "--mask %s", o->mask);
        o->req.mask = &r->mask;
    }
    /* The request resolved once (engine/plan.h): rows, seeds, CFG and its
     * negative prompt, the steps that run. */
    kiln_plan plan;
    if (kiln_plan_make(&plan, &o->req, o->prompts, o->n_prompts, &traits, &lim, err))
        return err->code;
    o->req = plan.req;
    kiln_request *q = &o->req;
    int P = o->n_prompts;
    r->B = plan.rows;
    r->be = kiln_backend_create(o->device, o->gpu, err);
    if (!r->be)
        return err->code;
    kiln_backend *be = r->be;

    cli_progress prog;
    cli_progress_init(&prog, o->progress, stderr);
    cli_progress_stage(&prog, "encode: loading the text encoder", 0);
    double t0 = kiln_now_ms();
    kiln_encode_opts eo = {.n_out_layers = o->n_out_layers, .with_references = o->n_images > 0};
    memcpy(eo.out_layers, o->out_layers, sizeof eo.out_layers);
    r->enc = kiln_encode_stage_create(be, r->ck, &eo, err);
    if (!r->enc)
        return err->code;
    double load_enc = kiln_now_ms() - t0;
    cli_progress_stage(&prog, o->n_images ? "encode: prompts and references" : "encode: prompts", 0);
    int T = q->max_sequence_length;
    int lens_p[CLI_MAX_PROMPTS], neg_len = 0;
    r->lens = malloc((size_t)(2 * r->B) * sizeof *r->lens);
    if (!r->lens)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (kiln_encode_prompts(r->enc, o->prompts, P, T, &r->emb_p, NULL, lens_p, err))
        return err->code;
    int64_t shape[] = {r->B, T, kiln_encode_stage_width(r->enc)};
    if (kiln_be_alloc(be, &r->emb, be->act_dtype, 3, shape))
        return kiln_be_check(be, err);
    kiln_denoise_expand_rows(be, &r->emb, 0, &r->emb_p, r->B, q->n);
    if (plan.cfg) {
        if (kiln_encode_prompts(r->enc, &plan.negative, 1, T, &r->neg_p, NULL, &neg_len, err) ||
            kiln_be_alloc(be, &r->neg, be->act_dtype, 3, shape))
            return err->code ? err->code : kiln_be_check(be, err);
        kiln_denoise_expand_rows(be, &r->neg, 0, &r->neg_p, r->B, (int)r->B);
    }
    kiln_plan_row_lens(r->B, q->n, lens_p, neg_len, r->lens, r->lens + r->B);
    int64_t R = 0;
    /* img2img and inpainting: the image as the family's pipelines
     * prepare it, resized (not cropped; engine/inpaint.h). */
    if (q->strength > 0 && kiln_inpaint_prepare_image(&r->refs[0], &traits, err))
        return err->code;
    int64_t mask_len = 0;
    if (o->mask &&
        kiln_encode_mask(r->enc, &r->mask, q->width, q->height, &r->mask_grid, &mask_len, err))
        return err->code;
    if (o->n_images &&
        kiln_encode_references(r->enc, r->refs, o->n_images, &r->ref_tokens, &r->ref_ids, &R, err))
        return err->code;
    if (kiln_be_check(be, err))
        return err->code;
    double t1 = kiln_now_ms();

    cli_progress_stage(&prog, "denoise: loading the transformer", 0);
    r->den = kiln_denoise_stage_create_at(be, r->ck, o->precision, err);
    if (!r->den)
        return err->code;
    double load_den = kiln_now_ms() - t1;
    r->seeds = malloc((size_t)r->B * sizeof *r->seeds);
    if (!r->seeds)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < r->B; i++)
        r->seeds[i] = kiln_plan_row_seed(&plan, i);
    int64_t N = (int64_t)(q->height / 16) * (q->width / 16);
    if (o->latents_in &&
        read_latents(o->latents_in, r->B, N, kiln_denoise_stage_channels(r->den), &r->latents_in, err))
        return err->code;
    kiln_denoise_job job = {
        .B = r->B, .embeds = &r->emb, .neg_embeds = plan.cfg ? &r->neg : NULL,
        .txt_len = r->lens, .neg_len = r->lens + r->B,
        .width = q->width, .height = q->height, .steps = q->steps, .guidance = q->guidance,
        .seeds = r->seeds, .batch_noise = q->batch_noise, .fp32_noise = o->fp32_noise,
        .latents_in = r->latents_in, .on_step = cli_progress_step, .user = &prog,
    };
    kiln_denoise_job_image(r->den, &job, R ? &r->ref_tokens : NULL, r->ref_ids, R, q->strength,
                           o->mask ? r->mask_grid : NULL);
    cli_progress_stage(&prog, "denoise", plan.run_steps);
    if (kiln_denoise_run(r->den, &job, &r->latents, err))
        return err->code;
    double t2 = kiln_now_ms();
    if (o->latents_out && write_latents(be, o->latents_out, &r->latents, err))
        return err->code;

    cli_progress_stage(&prog, "decode", 0);
    r->dec = kiln_decode_stage_create(be, r->ck, err);
    if (!r->dec)
        return err->code;
    double load_dec = kiln_now_ms() - t2;
    r->out_images = calloc((size_t)r->B, sizeof *r->out_images);
    if (!r->out_images)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (kiln_decode_run(r->dec, &r->latents, q->width, q->height, r->out_images, NULL, err))
        return err->code;
    cli_progress_stage(&prog, "write", 0);
    kiln_image_encode_opts eopts = KILN_IMAGE_ENCODE_DEFAULTS;
    eopts.format = q->format;
    eopts.quality = q->compression;
    char model_id[128]; /* as the service names it (kiln_checkpoint_model_name) */
    kiln_checkpoint_model_name(o->model, model_id, sizeof model_id);
    for (int64_t i = 0; i < r->B; i++) {
        char name[4096], seed[24], steps[16], guidance[32], size[32];
        output_name(name, sizeof name, o->out, (int)i, (int)r->B);
        /* The request that made this image, as other tools keep it (A1111's
         * and ComfyUI's PNGs carry their parameters too), so that a file
         * says how to make it again. */
        snprintf(seed, sizeof seed, "%llu", (unsigned long long)r->seeds[i]);
        snprintf(steps, sizeof steps, "%d", q->steps);
        snprintf(guidance, sizeof guidance, "%g", q->guidance);
        snprintf(size, sizeof size, "%dx%d", q->width, q->height);
        kiln_image_text text[] = {
            {"prompt", o->prompts[kiln_plan_row_prompt(i, q->n)]}, {"seed", seed}, {"steps", steps},
            {"guidance", guidance}, {"size", size}, {"model", model_id}, {"Software", "kiln"},
            {"negative_prompt", q->negative_prompt ? q->negative_prompt : ""},
        };
        eopts.text = o->no_metadata ? NULL : text;
        eopts.n_text = o->no_metadata ? 0 : plan.cfg ? 8 : 7;
        if (kiln_image_write_file(name, &r->out_images[i], &eopts, err))
            return err->code;
        if (prog.open) /* the path on a line of its own */
            fputc('\n', stderr), prog.open = 0;
        printf("%s: seed %llu\n", name, (unsigned long long)r->seeds[i]);
        fflush(stdout);
    }
    cli_progress_end(&prog);
    double t3 = kiln_now_ms();
    /* Each stage's time includes loading its weights, given apart. */
    KILN_LOG_INFO("%lld image(s) %dx%d, %d steps: encode %.1f ms (load %.1f), denoise %.1f ms "
                  "(load %.1f), decode %.1f ms (load %.1f)",
                  (long long)r->B, q->width, q->height, q->steps, t1 - t0, load_enc, t2 - t1,
                  load_den, t3 - t2, load_dec);
    return KILN_OK;
}

int cli_run_pipeline(const char *cmd, cli_gen_opts *o)
{
    kiln_err err = {0};
    cli_run r = {0};
    kiln_status st = run(&r, o, &err);
    cli_run_free(&r, o);
    return st ? fail(cmd, &err) : 0;
}
