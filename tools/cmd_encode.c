/* `kiln encode`: prompts -> chat template -> tokens -> Qwen3 -> a safetensors
 * file with prompt_embeds (B, T, L*H) F32, input_ids and attention_mask
 * (B, T) I64, the tensors diffusers' Flux2KleinPipeline.encode_prompt hands
 * to the transformer (for Z-Image: hidden_states[-2] of every row; its
 * pipeline keeps the rows where attention_mask is 1). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "common/checkpoint.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "engine/encode_stage.h"
#include "engine/family_stages.h"
#include "models/qwen3.h"
#include "models/tokenizer.h"
#include "common/args.h"

#define ENCODE_MAX_PROMPTS 64
/* Far above any prompt (diffusers' default is 512); bounds the scratch memory. */
#define ENCODE_MAX_SEQ 8192

typedef struct encode_args {
    const char *model, *out, *backend;
    const char *prompts[ENCODE_MAX_PROMPTS];
    int n_prompts;
    int max_seq;
    int layers[KILN_QWEN3_MAX_OUT];
    int n_layers; /* 0: the pipeline's default */
    int template_set;
    kiln_chat_template template;
    int device;
} encode_args;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kiln encode --model DIR --prompt TEXT [--prompt TEXT ...] --out FILE\n"
            "  --model DIR                     diffusers checkpoint folder\n"
            "  --prompt TEXT                   a prompt (repeat for a batch; \"\" is allowed)\n"
            "  --out FILE                      output .safetensors (prompt_embeds F32,\n"
            "                                  input_ids and attention_mask I64)\n"
            "  --max-sequence-length L         tokens per prompt (default 512); longer\n"
            "                                  prompts are truncated with a warning\n"
            "  --text-encoder-out-layers A,B,C hidden states to stack (default: the\n"
            "                                  checkpoint's, else 9,18,27 for FLUX.2 klein,\n"
            "                                  -2 for Z-Image)\n"
            "  --template klein|zimage         chat template (default: from the pipeline)\n"
            "  --backend cpu|cuda              compute backend (default cpu)\n"
            "  --device N                      GPU index (default 0)\n");
}

static int parse_layers(const char *s, encode_args *a)
{
    char buf[256];
    if (snprintf(buf, sizeof buf, "%s", s) >= (int)sizeof buf)
        return -1;
    a->n_layers = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (a->n_layers == KILN_QWEN3_MAX_OUT ||
            kiln_parse_int(tok, -100000, 100000, &a->layers[a->n_layers]))
            return -1;
        a->n_layers++;
    }
    return a->n_layers ? 0 : -1;
}

/* Returns 0, 1 for --help, or -1 after printing a usage error. */
static int parse_args(int argc, char **argv, encode_args *a)
{
    memset(a, 0, sizeof *a);
    a->max_seq = KILN_TOKENIZER_MAX_LENGTH;
    a->backend = "cpu";
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h"))
            return 1;
        if (i + 1 >= argc) {
            fprintf(stderr, "kiln encode: %s needs a value (or is unknown)\n", opt);
            return -1;
        }
        const char *v = argv[++i];
        if (!strcmp(opt, "--model")) {
            a->model = v;
        } else if (!strcmp(opt, "--out")) {
            a->out = v;
        } else if (!strcmp(opt, "--backend")) {
            a->backend = v;
        } else if (!strcmp(opt, "--prompt")) {
            if (a->n_prompts == ENCODE_MAX_PROMPTS) {
                fprintf(stderr, "kiln encode: at most %d prompts\n", ENCODE_MAX_PROMPTS);
                return -1;
            }
            a->prompts[a->n_prompts++] = v;
        } else if (!strcmp(opt, "--max-sequence-length")) {
            if (kiln_parse_int(v, 1, ENCODE_MAX_SEQ, &a->max_seq)) {
                fprintf(stderr, "kiln encode: --max-sequence-length must be 1..%d\n",
                        ENCODE_MAX_SEQ);
                return -1;
            }
        } else if (!strcmp(opt, "--text-encoder-out-layers")) {
            if (parse_layers(v, a)) {
                fprintf(stderr,
                        "kiln encode: --text-encoder-out-layers takes 1..%d comma-separated "
                        "integers, got '%s'\n",
                        KILN_QWEN3_MAX_OUT, v);
                return -1;
            }
        } else if (!strcmp(opt, "--template")) {
            a->template_set = 1;
            if (!strcmp(v, "klein")) {
                a->template = KILN_CHAT_KLEIN;
            } else if (!strcmp(v, "zimage")) {
                a->template = KILN_CHAT_ZIMAGE;
            } else {
                fprintf(stderr, "kiln encode: --template must be klein or zimage\n");
                return -1;
            }
        } else if (!strcmp(opt, "--device")) {
            if (kiln_parse_int(v, 0, 1023, &a->device)) {
                fprintf(stderr, "kiln encode: bad --device '%s'\n", v);
                return -1;
            }
        } else {
            fprintf(stderr, "kiln encode: unknown option '%s'\n", opt);
            return -1;
        }
    }
    if (!a->model || !a->out || !a->n_prompts) {
        fprintf(stderr, "kiln encode: --model, --out and at least one --prompt are required\n");
        return -1;
    }
    return 0;
}

/* Defaults that depend on the pipeline, from its family (the encode
 * stage's): the chat template (diffusers' Flux2KleinPipeline templates
 * with enable_thinking=False, ZImagePipeline with enable_thinking=True)
 * and the hidden states (kiln_encode_layers_of: the checkpoint's, else
 * 9, 18, 27 for klein, -2 for Z-Image). */
static kiln_status pipeline_defaults(const kiln_checkpoint *ck, encode_args *a, kiln_err *err)
{
    if (!a->template_set)
        a->template = kiln_family_stages_of(ck)->chat;
    return a->n_layers ? KILN_OK : kiln_encode_layers_of(ck, a->layers, &a->n_layers, err);
}

typedef struct encode_batch {
    int32_t *ids; /* (B, T) */
    int *lens;    /* (B) */
    int64_t *ids64, *mask64;
} encode_batch;

static kiln_status tokenize(const kiln_checkpoint *ck, const encode_args *a, encode_batch *bt,
                            kiln_err *err)
{
    char dir[4096];
    if (kiln_checkpoint_path(ck, "tokenizer", dir, sizeof dir, err))
        return err->code;
    kiln_tokenizer *tok = kiln_tokenizer_load(dir, err);
    if (!tok)
        return err->code;
    int64_t B = a->n_prompts, T = a->max_seq;
    kiln_status st = KILN_OK;
    for (int64_t b = 0; b < B; b++) {
        size_t full = 0;
        st = kiln_tokenizer_encode_chat(tok, a->prompts[b], strlen(a->prompts[b]), a->template,
                                        a->max_seq, bt->ids + b * T, &bt->lens[b], &full, err);
        if (st) {
            kiln_err_wrap(err, "prompt %lld", (long long)b + 1);
            break;
        }
        if (full > (size_t)a->max_seq) {
            /* diffusers truncates silently (and cuts off the assistant header); a
             * warning at least tells the user */
            fprintf(stderr,
                    "kiln encode: warning: prompt %lld is %zu tokens after templating; "
                    "truncated to %d\n",
                    (long long)b + 1, full, a->max_seq);
        }
        for (int64_t t = 0; t < T; t++) {
            bt->ids64[b * T + t] = bt->ids[b * T + t];
            bt->mask64[b * T + t] = t < bt->lens[b];
        }
    }
    kiln_tokenizer_free(tok);
    return st;
}

static kiln_status write_output(const char *path, const float *embeds, int64_t W,
                                const encode_args *a, const encode_batch *bt, kiln_err *err)
{
    int64_t B = a->n_prompts, T = a->max_seq;
    const kiln_st_entry e[3] = {
        {.name = "prompt_embeds", .dtype = KILN_F32, .ndim = 3, .shape = {B, T, W},
         .data = embeds},
        {.name = "input_ids", .dtype = KILN_I64, .ndim = 2, .shape = {B, T}, .data = bt->ids64},
        {.name = "attention_mask", .dtype = KILN_I64, .ndim = 2, .shape = {B, T},
         .data = bt->mask64},
    };
    return kiln_st_write(path, e, 3, err);
}

static kiln_status run(encode_args *a, kiln_err *err)
{
    kiln_status st;
    kiln_checkpoint *ck = kiln_checkpoint_open(a->model, err);
    if (!ck)
        return err->code;
    if (pipeline_defaults(ck, a, err)) {
        kiln_checkpoint_close(ck);
        return err->code;
    }
    int64_t B = a->n_prompts, T = a->max_seq;
    encode_batch bt = {
        .ids = calloc((size_t)(B * T), sizeof *bt.ids),
        .lens = calloc((size_t)B, sizeof *bt.lens),
        .ids64 = calloc((size_t)(B * T), sizeof *bt.ids64),
        .mask64 = calloc((size_t)(B * T), sizeof *bt.mask64),
    };
    kiln_backend *be = NULL;
    kiln_qwen3 *enc = NULL;
    kiln_tensor out = {0};
    float *host = NULL;
    if (!bt.ids || !bt.lens || !bt.ids64 || !bt.mask64) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((st = tokenize(ck, a, &bt, err)))
        goto done;
    if (!(be = kiln_backend_create(a->backend, a->device, err)) ||
        !(enc = kiln_qwen3_load(be, ck, a->layers, a->n_layers, err))) {
        st = err->code;
        goto done;
    }
    int64_t W = kiln_qwen3_out_width(enc);
    if (!(host = malloc((size_t)(B * T * W) * sizeof *host))) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){B, T, W})) {
        st = kiln_be_check(be, err);
        goto done;
    }
    if ((st = kiln_qwen3_encode(enc, bt.ids, bt.lens, B, T, &out, err)))
        goto done;
    kiln_be_download(be, &out, host);
    if ((st = kiln_be_check(be, err)))
        goto done;
    st = write_output(a->out, host, W, a, &bt, err);
done:
    free(host);
    if (be)
        kiln_be_free(be, &out);
    kiln_qwen3_destroy(enc);
    kiln_backend_destroy(be);
    free(bt.ids);
    free(bt.lens);
    free(bt.ids64);
    free(bt.mask64);
    kiln_checkpoint_close(ck);
    return st;
}

int kiln_cmd_encode(int argc, char **argv)
{
    encode_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) {
        usage(rc > 0 ? stdout : stderr);
        return rc > 0 ? 0 : 2;
    }
    kiln_err err = {0};
    if (run(&a, &err)) {
        fprintf(stderr, "kiln encode: %s\n", err.msg);
        /* bad user input (a prompt, a layer index) is a usage error */
        return err.code == KILN_ERR_INVALID ? 2 : 1;
    }
    return 0;
}
