/* Bus protocol: every message type survives encode -> decode unchanged;
 * malformed frames (truncations, wrong types, bad references, hostile
 * container counts, random corruption) are refused with an error, never a
 * crash. */
#include <msgpack.h>

#include "common/proto.h"
#include "tests/test.h"

#define EPOCH 0xfeedface12345678ull

static kiln_msg *roundtrip(const kiln_msg *m)
{
    kiln_buf b = {0};
    kiln_err err = {0};
    kiln_msg *out = NULL;
    CHECKF(kiln_msg_encode(m, &b, &err) == KILN_OK, "%s", err.msg);
    if (b.len) {
        out = kiln_msg_decode(b.data, b.len, &err);
        CHECKF(out != NULL, "%s", err.msg);
    }
    kiln_buf_free(&b);
    return out;
}

static kiln_tensor_ref shm_ref(const char *slab, uint64_t off, int64_t rows)
{
    kiln_tensor_ref r = {.kind = KILN_REF_SHM, .dtype = KILN_F32, .ndim = 3,
                         .shape = {rows, 16, 48}, .off = off};
    r.len = (uint64_t)rows * 16 * 48 * 4;
    r.epoch = 0x0123456789abcdefull;
    r.gen = 42 + off;
    snprintf(r.owner, sizeof r.owner, "encode-host-42");
    snprintf(r.slab, sizeof r.slab, "%s", slab);
    return r;
}

static int ref_equal(const kiln_tensor_ref *a, const kiln_tensor_ref *b)
{
    if (a->kind != b->kind || a->dtype != b->dtype || a->ndim != b->ndim || a->len != b->len ||
        memcmp(a->shape, b->shape, sizeof a->shape))
        return 0;
    if (a->kind == KILN_REF_INLINE)
        return !a->len || !memcmp(a->data, b->data, (size_t)a->len);
    if (strcmp(a->owner, b->owner) || strcmp(a->slab, b->slab) || a->off != b->off ||
        a->epoch != b->epoch || a->gen != b->gen)
        return 0;
    return a->kind != KILN_REF_CUDA_IPC ||
           (a->device == b->device && !memcmp(a->handle, b->handle, sizeof a->handle));
}

/* A Z-Image-Turbo replica's traits (engine/family.c). */
static const kiln_model_traits zimage = {.family = "zimage", .cfg = 1, .cfg_above_zero = 1,
                                         .no_references = 1, .img2img_strength = 0.6, .inpaint_strength = 1.0, .default_steps = 9,
                                         .default_guidance = 0.0f, .text_width = 2560,
                                         .latent_channels = 64};

static void test_hello_ready_hb_cancel(void)
{
    kiln_msg m = {.type = KILN_MSG_HELLO, .epoch = EPOCH,
                  .hello = {.stage = KILN_STAGE_DENOISE, .replica = "denoise-box-17",
                            .model = "klein-tiny", .host = "box", .max_batch = 4,
                            .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM) |
                                          KILN_TRANSPORT_BIT(KILN_REF_INLINE),
                            .domain = {.host = "boot-1", .gpu = -1}, .traits = zimage}};
    kiln_msg *d = roundtrip(&m);
    if (d) {
        CHECK(kiln_model_traits_equal(&d->hello.traits, &zimage));
        CHECK(!strcmp(d->hello.traits.family, "zimage") && d->hello.traits.default_steps == 9);
        CHECK(d->type == KILN_MSG_HELLO && d->hello.stage == KILN_STAGE_DENOISE);
        CHECK(!strcmp(d->hello.replica, "denoise-box-17") && !strcmp(d->hello.model, "klein-tiny"));
        CHECK(!strcmp(d->hello.host, "box") && d->hello.max_batch == 4);
        CHECK(d->hello.transports == m.hello.transports);
        CHECK(d->hello.version == KILN_PROTO_VERSION && d->epoch == EPOCH);
        CHECK(!d->hello.process || !d->hello.process[0]); /* optional: not said */
    }
    kiln_msg_free(d);
    /* The process token of kiln-stages' replicas travels as it is; one
     * that is not 1..32 lowercase hex digits is refused. */
    m.hello.process = "0123456789abcdef";
    d = roundtrip(&m);
    CHECK(d && d->hello.process && !strcmp(d->hello.process, "0123456789abcdef"));
    kiln_msg_free(d);
    const char *bad_tokens[] = {"0123456789ABCDEF", "token!", "0123456789abcdef0123456789abcdef0"};
    for (size_t i = 0; i < sizeof bad_tokens / sizeof *bad_tokens; i++) {
        kiln_buf pb = {0};
        kiln_err perr = {0};
        kiln_msg pbad = m;
        pbad.hello.process = bad_tokens[i];
        CHECK(kiln_msg_encode(&pbad, &pb, &perr) == KILN_ERR_INVALID &&
              strstr(perr.msg, "process token"));
        kiln_buf_free(&pb);
    }
    /* A forged one (the bytes changed after encoding) is refused by the
     * decoder the gateway runs, not only by the encoder. */
    kiln_buf fb = {0};
    kiln_err ferr = {0};
    CHECK(kiln_msg_encode(&m, &fb, &ferr) == KILN_OK);
    uint8_t *tok = fb.data ? memmem(fb.data, fb.len, "0123456789abcdef", 16) : NULL;
    CHECK(tok != NULL);
    if (tok) {
        memcpy(tok, "0123456789ABCDEF", 16);
        kiln_msg *forged = kiln_msg_decode(fb.data, fb.len, &ferr);
        CHECKF(!forged && strstr(ferr.msg, "process token"), "forged token: %s", ferr.msg);
        kiln_msg_free(forged);
    }
    kiln_buf_free(&fb);
    m.hello.process = NULL;
    /* A klein base checkpoint's traits: the guidance default as a float. */
    m.hello.traits = (kiln_model_traits){.family = "flux2", .cfg = 1, .default_steps = 50,
                                         .default_guidance = 4.0f, .text_width = 7680,
                                         .latent_channels = 128};
    d = roundtrip(&m);
    CHECK(d && kiln_model_traits_equal(&d->hello.traits, &m.hello.traits) &&
          !d->hello.traits.cfg_above_zero && d->hello.traits.default_guidance == 4.0f);
    kiln_msg_free(d);
    /* Traits a gateway could not resolve requests with are refused. */
    kiln_buf tb = {0};
    kiln_err terr = {0};
    kiln_msg tbad = m;
    tbad.hello.traits.family[0] = '\0';
    CHECK(kiln_msg_encode(&tbad, &tb, &terr) == KILN_ERR_INVALID && strstr(terr.msg, "traits"));
    tbad = m, tbad.hello.traits.default_steps = 0;
    CHECK(kiln_msg_encode(&tbad, &tb, &terr) == KILN_ERR_INVALID);
    tbad = m, tbad.hello.traits.default_guidance = 101.0f;
    CHECK(kiln_msg_encode(&tbad, &tb, &terr) == KILN_ERR_INVALID);
    tbad = m, tbad.hello.traits.text_width = KILN_TRAITS_WIDEST_TEXT + 1;
    CHECK(kiln_msg_encode(&tbad, &tb, &terr) == KILN_ERR_INVALID);
    snprintf(tbad.hello.traits.family, sizeof tbad.hello.traits.family, "Flux 2");
    tbad.hello.traits.text_width = 7680;
    CHECK(kiln_msg_encode(&tbad, &tb, &terr) == KILN_ERR_INVALID);
    kiln_buf_free(&tb);
    m.hello.traits = zimage;

    m = (kiln_msg){.type = KILN_MSG_FENCED, .epoch = UINT64_MAX};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_FENCED && d->epoch == UINT64_MAX);
    kiln_msg_free(d);

    m = (kiln_msg){.type = KILN_MSG_BYE, .epoch = EPOCH, .bye_reason = "device lost"};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_BYE && !strcmp(d->bye_reason, "device lost"));
    kiln_msg_free(d);

    m = (kiln_msg){.type = KILN_MSG_LEAVING, .epoch = EPOCH};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_LEAVING && d->epoch == EPOCH &&
          !strcmp(kiln_msg_type_name(KILN_MSG_LEAVING), "leaving"));
    kiln_msg_free(d);

    m = (kiln_msg){.type = KILN_MSG_GONE, .epoch = EPOCH,
                   .gone = {.replica = "denoise-box-17-0badcafe", .incarnation = 99}};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_GONE && !strcmp(d->gone.replica, "denoise-box-17-0badcafe") &&
          d->gone.incarnation == 99);
    kiln_msg_free(d);
    kiln_buf b = {0};
    kiln_err err = {0};
    m.gone.incarnation = 0;
    CHECK(kiln_msg_encode(&m, &b, &err) == KILN_ERR_INVALID);
    m.gone = (kiln_msg_gone){.replica = "bad id", .incarnation = 1};
    CHECK(kiln_msg_encode(&m, &b, &err) == KILN_ERR_INVALID);
    kiln_buf_free(&b);

    m = (kiln_msg){.type = KILN_MSG_READY, .epoch = EPOCH, .ready.credits = 7};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_READY && d->ready.credits == 7);
    kiln_msg_free(d);

    m = (kiln_msg){.type = KILN_MSG_HB, .epoch = EPOCH, .progress = 1ull << 40,
                   .shm_short = 64ull << 20, .rss = 3ull << 30, .dev_used = 20ull << 30,
                   .dev_total = 141ull << 30};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_HB && d->progress == 1ull << 40 &&
          d->shm_short == 64ull << 20 && d->rss == 3ull << 30 && d->dev_used == 20ull << 30 &&
          d->dev_total == 141ull << 30);
    kiln_msg_free(d);

    m = (kiln_msg){.type = KILN_MSG_CANCEL, .epoch = EPOCH, .cancel_job = UINT64_MAX};
    d = roundtrip(&m);
    CHECK(d && d->type == KILN_MSG_CANCEL && d->cancel_job == UINT64_MAX);
    kiln_msg_free(d);
}

static void test_jobs(void)
{
    kiln_msg *m = calloc(1, sizeof *m);
    static const uint8_t png[] = {0x89, 'P', 'N', 'G', 1, 2, 3};
    m->type = KILN_MSG_JOB;
    m->epoch = EPOCH;
    m->job.job = 1234567890123ull;
    m->job.stage = KILN_STAGE_ENCODE;
    m->job.encode = (kiln_job_encode){.n_prompts = 2, .prompts = {"a cat", "ein Hund \xc3\xa4"},
                                      .negative = "", .max_seq = 64, .n_refs = 1,
                                      .refs = {{png, sizeof png}}, .mask = {png, 4}};
    kiln_msg *d = roundtrip(m);
    if (d) {
        const kiln_job_encode *e = &d->job.encode;
        CHECK(d->job.job == 1234567890123ull && d->job.stage == KILN_STAGE_ENCODE);
        CHECK(e->n_prompts == 2 && !strcmp(e->prompts[1], "ein Hund \xc3\xa4"));
        CHECK(e->negative && !strcmp(e->negative, "") && e->max_seq == 64);
        CHECK(e->n_refs == 1 && e->refs[0].len == sizeof png &&
              !memcmp(e->refs[0].data, png, sizeof png));
        CHECK(e->mask.len == 4 && !memcmp(e->mask.data, png, 4));
        CHECK(d->job.in.n == 0);
    }
    kiln_msg_free(d);
    m->job.encode.negative = NULL;
    d = roundtrip(m);
    CHECK(d && d->job.encode.negative == NULL && d->job.encode.start == 0);
    kiln_msg_free(d);
    /* Image-to-image's start image (no mask): the flag round-trips. */
    m->job.encode.mask = (kiln_bytes){0};
    m->job.encode.start = 1;
    d = roundtrip(m);
    CHECK(d && d->job.encode.start == 1 && d->job.encode.mask.len == 0);
    kiln_msg_free(d);

    memset(m, 0, sizeof *m);
    m->type = KILN_MSG_JOB;
    m->epoch = EPOCH;
    m->job.job = 9;
    m->job.stage = KILN_STAGE_DENOISE;
    m->job.denoise = (kiln_job_denoise){.n = 2, .n_seeds = 4, .seeds = {UINT64_MAX, 0, 5, 6},
                                        .width = 64, .height = 128, .steps = 2,
                                        .guidance = 3.7f, .batch_noise = 1, .strength = 0.35,
                                        .previews = 3};
    kiln_tensor_ref emb = shm_ref("/kiln-encode-42-0", 128, 2);
    int32_t ids[8] = {10, 0, 0, 0, 10, 0, 1, 0};
    kiln_tensor_ref rid = {.kind = KILN_REF_INLINE, .dtype = KILN_I32, .ndim = 2, .shape = {2, 4},
                           .len = sizeof ids, .data = ids};
    kiln_tensor_ref ipc = shm_ref("/kiln-x", 0, 1);
    ipc.kind = KILN_REF_CUDA_IPC, ipc.device = 3;
    for (int i = 0; i < KILN_PROTO_IPC_HANDLE; i++)
        ipc.handle[i] = (uint8_t)(i * 7);
    kiln_err err = {0};
    CHECK(kiln_ref_map_put(&m->job.in, "embeds", &emb, &err) == KILN_OK);
    CHECK(kiln_ref_map_put(&m->job.in, "ref_ids", &rid, &err) == KILN_OK);
    CHECK(kiln_ref_map_put(&m->job.in, "ref_tokens", &ipc, &err) == KILN_OK);
    d = roundtrip(m);
    if (d) {
        const kiln_job_denoise *j = &d->job.denoise;
        CHECK(j->n == 2 && j->n_seeds == 4 && j->seeds[0] == UINT64_MAX && j->seeds[3] == 6);
        CHECK(j->width == 64 && j->height == 128 && j->steps == 2 && j->batch_noise == 1);
        CHECK(j->guidance == 3.7f && j->strength == 0.35 && j->previews == 3);
        CHECK(d->job.in.n == 3);
        const kiln_tensor_ref *r = kiln_ref_map_get(&d->job.in, "embeds");
        CHECK(r && ref_equal(r, &emb));
        r = kiln_ref_map_get(&d->job.in, "ref_ids");
        CHECK(r && ref_equal(r, &rid));
        r = kiln_ref_map_get(&d->job.in, "ref_tokens");
        CHECK(r && ref_equal(r, &ipc));
        CHECK(kiln_ref_map_get(&d->job.in, "neg") == NULL);
    }
    kiln_msg_free(d);

    memset(m, 0, sizeof *m);
    m->type = KILN_MSG_JOB;
    m->epoch = EPOCH;
    m->job.stage = KILN_STAGE_DECODE;
    m->job.decode = (kiln_job_decode){.width = 96, .height = 64, .format = KILN_IMAGE_WEBP,
                                      .compression = 80};
    CHECK(kiln_ref_map_put(&m->job.in, "latents", &emb, &err) == KILN_OK);
    d = roundtrip(m);
    CHECK(d && d->job.decode.width == 96 && d->job.decode.format == KILN_IMAGE_WEBP &&
          d->job.decode.compression == 80 && d->job.in.n == 1 && d->job.decode.image_kinds == 0);
    kiln_msg_free(d);
    /* Image files by reference: shm only (inline is always allowed). */
    m->job.decode.image_kinds = KILN_TRANSPORT_BIT(KILN_REF_SHM);
    d = roundtrip(m);
    CHECK(d && d->job.decode.image_kinds == KILN_TRANSPORT_BIT(KILN_REF_SHM));
    kiln_msg_free(d);
    kiln_buf frame = {0};
    m->job.decode.image_kinds = KILN_TRANSPORT_BIT(KILN_REF_CUDA_IPC);
    CHECK(kiln_msg_encode(m, &frame, &err) == KILN_ERR_INVALID && strstr(err.msg, "imgk"));
    kiln_buf_free(&frame);
    free(m);
}

/* The names of a decode done's image references. */
static void test_image_ref_names(void)
{
    char name[KILN_PROTO_TENSOR_NAME_MAX];
    kiln_image_ref_name(0, name);
    CHECK(!strcmp(name, "image.0") && kiln_image_ref_row(name) == 0);
    kiln_image_ref_name(KILN_PROTO_MAX_ROWS - 1, name);
    CHECK(!strcmp(name, "image.255") && kiln_image_ref_row(name) == 255);
    static const char *const bad[] = {"image.", "image.01", "image.-1", "image.1x", "image1",
                                      "latents", "image.1234", "Image.1", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECKF(kiln_image_ref_row(bad[i]) == -1, "'%s' taken for an image", bad[i]);
    /* A done of a job of 16 rows can name every one (the most a map holds). */
    kiln_msg *m = calloc(1, sizeof *m);
    m->type = KILN_MSG_DONE;
    m->epoch = EPOCH;
    m->done = (kiln_msg_done){.job = 5, .ok = 1};
    for (int row = 0; row < KILN_PROTO_MAX_TENSORS; row++) {
        kiln_tensor_ref r = {.kind = KILN_REF_SHM, .dtype = KILN_U8, .ndim = 1,
                             .shape = {1000 + row}, .len = 1000 + (uint64_t)row,
                             .epoch = 7, .gen = 1 + (uint64_t)row, .off = 64 * (1 + (uint64_t)row)};
        snprintf(r.owner, sizeof r.owner, "decode-host-1");
        snprintf(r.slab, sizeof r.slab, "/kiln-decode-1");
        kiln_image_ref_name(row, name);
        CHECK(kiln_ref_map_put(&m->done.out, name, &r, NULL) == KILN_OK);
    }
    kiln_msg *d = roundtrip(m);
    CHECK(d && d->done.out.n == KILN_PROTO_MAX_TENSORS &&
          kiln_image_ref_row(d->done.out.items[KILN_PROTO_MAX_TENSORS - 1].name) ==
              KILN_PROTO_MAX_TENSORS - 1 &&
          d->done.out.items[3].ref.len == 1003);
    kiln_msg_free(d);
    free(m);
}

static void test_done_release(void)
{
    kiln_msg *m = calloc(1, sizeof *m);
    static const uint8_t a[] = "first image", b[] = "second";
    m->type = KILN_MSG_DONE;
    m->epoch = EPOCH;
    m->done = (kiln_msg_done){.job = 77, .ok = 1, .n_images = 2,
                              .images = {{a, sizeof a}, {b, sizeof b}}, .n_ms = 2,
                              .ms = {{"run", 12.5}, {"queue", 0.25}}};
    kiln_tensor_ref lat = shm_ref("/kiln-denoise-9-1", 4096, 3);
    kiln_ref_map_put(&m->done.out, "latents", &lat, NULL);
    kiln_msg *d = roundtrip(m);
    if (d) {
        CHECK(d->done.job == 77 && d->done.ok && d->done.code == KILN_OK);
        CHECK(d->done.n_images == 2 && d->done.images[1].len == sizeof b &&
              !memcmp(d->done.images[0].data, a, sizeof a));
        CHECK(d->done.n_ms == 2 && !strcmp(d->done.ms[0].name, "run") && d->done.ms[1].ms == 0.25);
        CHECK(d->done.out.n == 1 && ref_equal(&d->done.out.items[0].ref, &lat));
    }
    kiln_msg_free(d);

    /* partial: a preview's latents under its index; nothing else, and
     * latents are required. */
    memset(m, 0, sizeof *m);
    m->type = KILN_MSG_PARTIAL;
    m->epoch = EPOCH;
    m->done = (kiln_msg_done){.job = 79, .ok = 1, .preview = 2};
    kiln_ref_map_put(&m->done.out, "latents", &lat, NULL);
    d = roundtrip(m);
    CHECK(d && d->type == KILN_MSG_PARTIAL && d->done.job == 79 && d->done.ok &&
          d->done.preview == 2 && d->done.out.n == 1 &&
          ref_equal(kiln_ref_map_get(&d->done.out, "latents"), &lat) &&
          !strcmp(kiln_msg_type_name(KILN_MSG_PARTIAL), "partial"));
    kiln_msg_free(d);
    kiln_buf frame = {0};
    m->done.preview = KILN_PROTO_MAX_PREVIEWS;
    CHECK(kiln_msg_encode(m, &frame, NULL) == KILN_ERR_INVALID);
    m->done.preview = 0, m->done.out.n = 0;
    CHECK(kiln_msg_encode(m, &frame, NULL) == KILN_ERR_INVALID);
    kiln_buf_free(&frame);

    memset(m, 0, sizeof *m);
    m->type = KILN_MSG_DONE;
    m->epoch = EPOCH;
    m->done = (kiln_msg_done){.job = 78, .ok = 0, .code = KILN_ERR_CANCELLED,
                              .message = "request cancelled"};
    d = roundtrip(m);
    CHECK(d && !d->done.ok && d->done.code == KILN_ERR_CANCELLED &&
          !strcmp(d->done.message, "request cancelled"));
    kiln_msg_free(d);

    memset(m, 0, sizeof *m);
    m->type = KILN_MSG_FREE;
    m->epoch = EPOCH;
    m->refs.n = 2;
    m->refs.refs[0] = lat;
    m->refs.refs[1] = shm_ref("/kiln-denoise-9-0", 0, 1);
    d = roundtrip(m);
    CHECK(d && d->type == KILN_MSG_FREE && d->refs.n == 2 &&
          ref_equal(&d->refs.refs[0], &lat) && ref_equal(&d->refs.refs[1], &m->refs.refs[1]));
    kiln_msg_free(d);
    m->type = KILN_MSG_RELEASE;
    m->epoch = EPOCH;
    d = roundtrip(m);
    CHECK(d && d->type == KILN_MSG_RELEASE && d->refs.n == 2);
    kiln_msg_free(d);
    free(m);
}

/* The encoder refuses what the decoder would refuse. */
static void test_encode_refuses(void)
{
    kiln_buf b = {0};
    kiln_err err = {0};
    kiln_msg m = {.type = KILN_MSG_READY, .epoch = EPOCH, .ready.credits = 0};
    CHECK(kiln_msg_encode(&m, &b, &err) == KILN_ERR_INVALID && b.len == 0);
    m = (kiln_msg){.type = KILN_MSG_HELLO, .epoch = EPOCH,
                   .hello = {.stage = KILN_STAGE_ENCODE, .replica = "bad id with spaces",
                             .model = "m", .host = "h", .max_batch = 1, .transports = 1}};
    CHECK(kiln_msg_encode(&m, &b, &err) == KILN_ERR_INVALID);
    kiln_msg *j = calloc(1, sizeof *j);
    j->type = KILN_MSG_JOB;
    j->epoch = EPOCH;
    j->job.stage = KILN_STAGE_DENOISE;
    j->job.denoise = (kiln_job_denoise){.n = 2, .n_seeds = 3, .width = 64, .height = 64,
                                        .steps = 1};
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID); /* seeds not a multiple of n */
    j->job.denoise.n_seeds = 2, j->job.denoise.width = 72;
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID);
    j->job.denoise.width = 64;
    kiln_tensor_ref r = shm_ref("/kiln-a", 0, 1);
    r.len -= 4;
    kiln_ref_map_put(&j->job.in, "embeds", &r, NULL);
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID); /* len mismatch */
    r = shm_ref("/dev/shm/../etc", 0, 1);
    kiln_ref_map_put(&j->job.in, "embeds", &r, NULL);
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID);
    r = shm_ref("/kiln-a", 8, 1); /* misaligned offset */
    kiln_ref_map_put(&j->job.in, "embeds", &r, NULL);
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID);
    r = shm_ref("/kiln-a", 64, 1);
    r.gen = 0; /* every range has a generation */
    kiln_ref_map_put(&j->job.in, "embeds", &r, NULL);
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID);
    r = shm_ref("/kiln-a", 64, 1);
    r.epoch = 0; /* and an owner incarnation */
    kiln_ref_map_put(&j->job.in, "embeds", &r, NULL);
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID);
    r = shm_ref("/kiln-a", 64, 1);
    kiln_ref_map_put(&j->job.in, "embeds", &r, NULL);
    j->epoch = 0; /* every message names an incarnation */
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID);
    j->epoch = EPOCH;
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_OK && b.len > 0);
    free(j);
    kiln_buf_free(&b);
}

/* Packs a map from (key, packer-callback) steps by hand. */
static msgpack_sbuffer sbuf;
static msgpack_packer pk;
static void begin(void)
{
    msgpack_sbuffer_init(&sbuf);
    msgpack_packer_init(&pk, &sbuf, msgpack_sbuffer_write);
}
static void pstr(const char *s)
{
    msgpack_pack_str(&pk, strlen(s));
    msgpack_pack_str_body(&pk, s, strlen(s));
}
static void pepoch(void)
{
    pstr("epoch");
    msgpack_pack_uint64(&pk, EPOCH);
}

static int decodes(const void *p, size_t n)
{
    kiln_err err = {0};
    kiln_msg *m = kiln_msg_decode(p, n, &err);
    int ok = m != NULL;
    if (!ok)
        CHECKF(err.code == KILN_ERR_INVALID && err.msg[0], "code %d", err.code);
    kiln_msg_free(m);
    return ok;
}

static void test_malformed(void)
{
    CHECK(!decodes("", 0));
    CHECK(!decodes(NULL, 5));
    static const uint8_t not_map[] = {0x93, 1, 2, 3};
    CHECK(!decodes(not_map, sizeof not_map));
    /* Declared counts far beyond the frame: refused before any allocation. */
    static const uint8_t huge_array[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0};
    CHECK(!decodes(huge_array, sizeof huge_array));
    static const uint8_t huge_map[] = {0xdf, 0x7f, 0xff, 0xff, 0xff, 0xc0, 0xc0};
    CHECK(!decodes(huge_map, sizeof huge_map));
    static const uint8_t huge_str[] = {0xdb, 0xff, 0xff, 0xff, 0xf0, 'a'};
    CHECK(!decodes(huge_str, sizeof huge_str));
    uint8_t deep[64];
    memset(deep, 0x91, sizeof deep);
    deep[63] = 0xc0;
    CHECK(!decodes(deep, sizeof deep));
    static const uint8_t ext[] = {0x81, 0xa1, 't', 0xd4, 1, 2};
    CHECK(!decodes(ext, sizeof ext));

    /* Well-formed msgpack, wrong content. */
    begin(); msgpack_pack_map(&pk, 1); pstr("t"); pstr("nope");
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 3); pstr("t"); pstr("ready"); pepoch(); pstr("credits"); pstr("4");
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 3); pstr("t"); pstr("ready"); pepoch(); pstr("credits");
    msgpack_pack_int64(&pk, -3);
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 3); pstr("t"); pstr("cancel"); pepoch(); pstr("job");
    msgpack_pack_int64(&pk, -1);
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    /* A prompt with an embedded NUL. */
    begin(); msgpack_pack_map(&pk, 6); pstr("t"); pstr("job"); pepoch(); pstr("job");
    msgpack_pack_uint64(&pk, 1); pstr("stage"); pstr("encode"); pstr("max_seq");
    msgpack_pack_int(&pk, 8); pstr("prompts"); msgpack_pack_array(&pk, 1);
    msgpack_pack_str(&pk, 3); msgpack_pack_str_body(&pk, "a\0b", 3);
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    /* Every message names an incarnation: without `epoch`, or with 0, it
     * is refused. */
    begin(); msgpack_pack_map(&pk, 2); pstr("t"); pstr("hb"); pstr("progress");
    msgpack_pack_uint64(&pk, 1);
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 3); pstr("t"); pstr("hb"); pstr("epoch");
    msgpack_pack_uint64(&pk, 0); pstr("progress"); msgpack_pack_uint64(&pk, 1);
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 2); pstr("t"); pstr("hb"); pepoch(); /* no progress */
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    /* An older replica's heartbeat has no memory fields: 0, not reported;
     * present, they must be unsigned integers. */
    begin(); msgpack_pack_map(&pk, 4); pstr("t"); pstr("hb"); pepoch(); pstr("progress");
    msgpack_pack_uint64(&pk, 1); pstr("shm_short"); msgpack_pack_uint64(&pk, 0);
    {
        kiln_err e = {0};
        kiln_msg *old = kiln_msg_decode(sbuf.data, sbuf.size, &e);
        CHECKF(old && old->rss == 0 && old->dev_used == 0 && old->dev_total == 0, "%s", e.msg);
        kiln_msg_free(old);
    }
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 5); pstr("t"); pstr("hb"); pepoch(); pstr("progress");
    msgpack_pack_uint64(&pk, 1); pstr("shm_short"); msgpack_pack_uint64(&pk, 0); pstr("rss");
    pstr("lots");
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    begin(); msgpack_pack_map(&pk, 2); pstr("t"); pstr("fenced"); pepoch();
    CHECK(decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
    /* An older gateway's decode job has no imgk: every image inline; a
     * newer one's must be a non-negative integer. */
    for (int v = 0; v < 3; v++) {
        begin(); msgpack_pack_map(&pk, v ? 9 : 8); pstr("t"); pstr("job"); pepoch();
        pstr("job"); msgpack_pack_uint64(&pk, 3); pstr("stage"); pstr("decode");
        pstr("width"); msgpack_pack_int(&pk, 64); pstr("height"); msgpack_pack_int(&pk, 64);
        pstr("format"); pstr("png"); pstr("compression"); msgpack_pack_int(&pk, 100);
        if (v == 1)
            pstr("imgk"), msgpack_pack_int(&pk, -2);
        else if (v == 2)
            pstr("imgk"), pstr("shm");
        kiln_err e = {0};
        kiln_msg *job = kiln_msg_decode(sbuf.data, sbuf.size, &e);
        CHECKF(v ? !job : job && job->job.decode.image_kinds == 0, "imgk case %d: %s", v, e.msg);
        kiln_msg_free(job);
        msgpack_sbuffer_destroy(&sbuf);
    }
    /* Unknown keys are ignored; trailing bytes are not. */
    begin(); msgpack_pack_map(&pk, 4); pstr("t"); pstr("ready"); pepoch(); pstr("credits");
    msgpack_pack_int(&pk, 2); pstr("future"); msgpack_pack_array(&pk, 0);
    CHECK(decodes(sbuf.data, sbuf.size));
    msgpack_pack_nil(&pk);
    CHECK(!decodes(sbuf.data, sbuf.size));
    msgpack_sbuffer_destroy(&sbuf);
}

/* Every truncation and many single-byte corruptions of a rich message:
 * each either decodes to a message that passes kiln_msg_check or is
 * refused; none crashes (run under ASan/UBSan in CI). */
static void test_corruption(void)
{
    kiln_msg *m = calloc(1, sizeof *m);
    m->type = KILN_MSG_JOB;
    m->epoch = EPOCH;
    m->job.stage = KILN_STAGE_DENOISE;
    m->job.denoise = (kiln_job_denoise){.n = 1, .n_seeds = 2, .seeds = {3, 4}, .width = 64,
                                        .height = 64, .steps = 2, .guidance = 1.0f};
    kiln_tensor_ref e = shm_ref("/kiln-encode-1-0", 0, 2);
    kiln_ref_map_put(&m->job.in, "embeds", &e, NULL);
    kiln_buf b = {0};
    kiln_err err = {0};
    CHECK(kiln_msg_encode(m, &b, &err) == KILN_OK);
    int refused = 0;
    for (size_t n = 0; n < b.len; n++)
        refused += !decodes(b.data, n);
    CHECK(refused == (int)b.len);
    uint8_t *copy = malloc(b.len);
    uint32_t x = 12345;
    int accepted = 0;
    for (int it = 0; it < 4000; it++) {
        memcpy(copy, b.data, b.len);
        x = x * 1103515245u + 12345u;
        copy[(x >> 8) % b.len] = (uint8_t)(x >> 20);
        kiln_msg *d = kiln_msg_decode(copy, b.len, &err);
        if (d) {
            accepted++;
            CHECK(kiln_msg_check(d, &err) == KILN_OK);
        }
        kiln_msg_free(d);
    }
    CHECK(accepted > 0 && accepted < 4000);
    free(copy);
    kiln_buf_free(&b);
    free(m);
}

static void test_model_id(void)
{
    char id[KILN_PROTO_ID_MAX];
    kiln_proto_model_id("/nonexistent/models/FLUX.2-klein-4B//", id, sizeof id);
    CHECK(!strcmp(id, "FLUX.2-klein-4B"));
    kiln_proto_model_id("my model@v2", id, sizeof id);
    CHECK(!strcmp(id, "my_model_v2"));
    kiln_proto_model_id("", id, sizeof id);
    CHECK(!strcmp(id, "model"));
    kiln_proto_model_id("/nonexistent/abcdefgh", id, 5);
    CHECK(!strcmp(id, "abcd"));
}

/* Transport domains in hello, a job's fetch sources and output kinds, and
 * the fetch message: round trips, and bad values refused on both ends. */
static void test_domains(void)
{
    kiln_msg m = {.type = KILN_MSG_HELLO, .epoch = EPOCH,
                  .hello = {.stage = KILN_STAGE_ENCODE, .replica = "encode-pod-1", .model = "m",
                            .host = "pod", .max_batch = 2, .transports = 7,
                            .domain = {.host = "362292c9-d106-496a", .shm = "27:1", .ipc_ns = 11,
                                       .mnt_ns = 12, .pid_ns = 13, .n_gpus = 2, .gpu = 1,
                                       .gpus = {"GPU-aa", "GPU-bb"}},
                            .data = "tcp://10.0.0.7:7001",
                            .data_key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
                            .traits = zimage}};
    kiln_msg *d = roundtrip(&m);
    if (d) {
        const kiln_domain *o = &d->hello.domain;
        CHECK(!strcmp(o->host, "362292c9-d106-496a") && !strcmp(o->shm, "27:1"));
        CHECK(o->ipc_ns == 11 && o->mnt_ns == 12 && o->pid_ns == 13);
        CHECK(o->n_gpus == 2 && o->gpu == 1 && !strcmp(o->gpus[1], "GPU-bb"));
        CHECK(!strcmp(d->hello.data, "tcp://10.0.0.7:7001") &&
              !strcmp(d->hello.data_key, m.hello.data_key));
    }
    kiln_msg_free(d);
    kiln_buf b = {0};
    kiln_err err = {0};
    kiln_msg bad = m;
    snprintf(bad.hello.domain.host, sizeof bad.hello.domain.host, "a host");
    CHECK(kiln_msg_encode(&bad, &b, &err) == KILN_ERR_INVALID && strstr(err.msg, "domain.host"));
    bad = m, bad.hello.domain.host[0] = '\0';
    CHECK(kiln_msg_encode(&bad, &b, &err) == KILN_ERR_INVALID);
    bad = m, bad.hello.domain.gpu = 2;
    CHECK(kiln_msg_encode(&bad, &b, &err) == KILN_ERR_INVALID && strstr(err.msg, "domain.gpu"));
    bad = m, bad.hello.data = "ipc:///tmp/x";
    CHECK(kiln_msg_encode(&bad, &b, &err) == KILN_ERR_INVALID);
    bad = m, bad.hello.data = "tcp://host-without-port";
    CHECK(kiln_msg_encode(&bad, &b, &err) == KILN_ERR_INVALID);
    bad = m, bad.hello.data_key = "short";
    CHECK(kiln_msg_encode(&bad, &b, &err) == KILN_ERR_INVALID);

    kiln_msg *j = calloc(1, sizeof *j);
    j->type = KILN_MSG_JOB;
    j->epoch = EPOCH;
    j->job.stage = KILN_STAGE_DECODE;
    j->job.decode = (kiln_job_decode){.width = 64, .height = 64, .format = KILN_IMAGE_PNG};
    j->job.out_kinds = KILN_TRANSPORT_BIT(KILN_REF_SHM);
    j->job.n_src = 1;
    snprintf(j->job.src[0].owner, sizeof j->job.src[0].owner, "denoise-pod-2");
    j->job.src[0].endpoint = "tcp://[fd00::2]:7001";
    j->job.src[0].key = "";
    d = roundtrip(j);
    CHECK(d && d->job.out_kinds == KILN_TRANSPORT_BIT(KILN_REF_SHM) && d->job.n_src == 1 &&
          !strcmp(d->job.src[0].owner, "denoise-pod-2") &&
          !strcmp(d->job.src[0].endpoint, "tcp://[fd00::2]:7001") && !strcmp(d->job.src[0].key, ""));
    kiln_msg_free(d);
    j->job.src[0].endpoint = "tcp://x y:1";
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID && strstr(err.msg, "src"));
    j->job.src[0].endpoint = "tcp://x:1";
    j->job.out_kinds = 1u << KILN_REF_KIND_COUNT;
    CHECK(kiln_msg_encode(j, &b, &err) == KILN_ERR_INVALID && strstr(err.msg, "outk"));
    free(j);

    kiln_msg f = {.type = KILN_MSG_FETCH, .epoch = EPOCH, .refs = {.n = 1}};
    f.refs.refs[0] = shm_ref("/kiln-denoise-1-0", 128, 2);
    d = roundtrip(&f);
    CHECK(d && d->type == KILN_MSG_FETCH && d->refs.n == 1 && d->refs.refs[0].off == 128);
    kiln_msg_free(d);
    kiln_buf_free(&b);
}

int main(void)
{
    RUN(test_hello_ready_hb_cancel);
    RUN(test_jobs);
    RUN(test_done_release);
    RUN(test_image_ref_names);
    RUN(test_encode_refuses);
    RUN(test_malformed);
    RUN(test_corruption);
    RUN(test_model_id);
    RUN(test_domains);
    return test_finish();
}
