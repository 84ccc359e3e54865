/* Protocol names and the semantic checks shared by the encoder (refuse to
 * send) and the decoder (refuse to accept). */
#include "proto.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const msg_names[KILN_MSG_TYPE_END] = {
    [KILN_MSG_HELLO] = "hello",   [KILN_MSG_READY] = "ready",   [KILN_MSG_HB] = "hb",
    [KILN_MSG_DONE] = "done",     [KILN_MSG_RELEASE] = "release", [KILN_MSG_BYE] = "bye",
    [KILN_MSG_LEAVING] = "leaving", [KILN_MSG_PARTIAL] = "partial",
    [KILN_MSG_JOB] = "job",
    [KILN_MSG_CANCEL] = "cancel", [KILN_MSG_FREE] = "free",     [KILN_MSG_FENCED] = "fenced",
    [KILN_MSG_GONE] = "gone",     [KILN_MSG_FETCH] = "fetch",
};

const char *kiln_msg_type_name(kiln_msg_type t)
{
    return t >= KILN_MSG_HELLO && t < KILN_MSG_TYPE_END ? msg_names[t] : NULL;
}

int kiln_msg_type_parse(const char *name, kiln_msg_type *out)
{
    for (int t = KILN_MSG_HELLO; t < KILN_MSG_TYPE_END; t++)
        if (!strcmp(name, msg_names[t])) {
            *out = (kiln_msg_type)t;
            return 0;
        }
    return -1;
}

static const char *const stage_names[] = {"encode", "denoise", "decode"};

const char *kiln_stage_name(kiln_stage s)
{
    return s >= 0 && s < KILN_STAGE_COUNT ? stage_names[s] : NULL;
}

int kiln_stage_parse(const char *name, kiln_stage *out)
{
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        if (!strcmp(name, stage_names[s])) {
            *out = (kiln_stage)s;
            return 0;
        }
    return -1;
}

int kiln_status_parse(const char *name, kiln_status *out)
{
    for (int c = KILN_OK; c <= KILN_ERR_INTERNAL; c++)
        if (!strcmp(name, kiln_status_name((kiln_status)c))) {
            *out = (kiln_status)c;
            return 0;
        }
    return -1;
}

static const char *const kind_names[] = {"inline", "shm", "cuda_ipc"};

const char *kiln_ref_kind_name(kiln_ref_kind k)
{
    return k >= 0 && k < KILN_REF_KIND_COUNT ? kind_names[k] : NULL;
}

int kiln_ref_kind_parse(const char *name, kiln_ref_kind *out)
{
    for (int k = 0; k < KILN_REF_KIND_COUNT; k++)
        if (!strcmp(name, kind_names[k])) {
            *out = (kiln_ref_kind)k;
            return 0;
        }
    return -1;
}

static int name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
}

int kiln_slab_name_valid(const char *name)
{
    static const char prefix[] = "/kiln-";
    size_t n = strnlen(name, KILN_PROTO_SLAB_MAX);
    if (n >= KILN_PROTO_SLAB_MAX || n <= sizeof prefix - 1 || memcmp(name, prefix, sizeof prefix - 1))
        return 0;
    for (size_t i = sizeof prefix - 1; i < n; i++)
        if (!name_char(name[i]))
            return 0;
    return 1;
}

void kiln_proto_model_id(const char *model_dir, char *out, size_t cap)
{
    char real[PATH_MAX];
    const char *path = realpath(model_dir, real) ? real : model_dir;
    size_t end = strlen(path);
    while (end > 1 && path[end - 1] == '/')
        end--;
    size_t start = end;
    while (start > 0 && path[start - 1] != '/')
        start--;
    size_t n = 0;
    for (size_t i = start; i < end && n + 1 < cap; i++)
        out[n++] = name_char(path[i]) ? path[i] : '_';
    if (cap)
        out[n] = '\0';
    if (!n && cap)
        snprintf(out, cap, "model");
}

/* hello's process token: 1..32 lowercase hex digits. */
static int process_valid(const char *t)
{
    size_t n = strnlen(t, KILN_PROTO_PROCESS_MAX);
    if (n == 0 || n >= KILN_PROTO_PROCESS_MAX)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((t[i] >= '0' && t[i] <= '9') || (t[i] >= 'a' && t[i] <= 'f')))
            return 0;
    return 1;
}

/* Replica ids and host names: 1..127 characters of [A-Za-z0-9._:@-]. */
static int id_valid(const char *id)
{
    if (!id)
        return 0;
    size_t n = strnlen(id, KILN_PROTO_ID_MAX);
    if (n == 0 || n >= KILN_PROTO_ID_MAX)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!name_char(id[i]) && id[i] != ':' && id[i] != '@')
            return 0;
    return 1;
}

const kiln_tensor_ref *kiln_ref_map_get(const kiln_ref_map *m, const char *name)
{
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->items[i].name, name))
            return &m->items[i].ref;
    return NULL;
}

kiln_status kiln_ref_map_put(kiln_ref_map *m, const char *name, const kiln_tensor_ref *ref,
                             kiln_err *err)
{
    size_t len = strlen(name);
    if (len == 0 || len >= KILN_PROTO_TENSOR_NAME_MAX)
        return kiln_err_set(err, KILN_ERR_INVALID, "tensor name '%.32s' is empty or too long",
                            name);
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->items[i].name, name)) {
            m->items[i].ref = *ref;
            return KILN_OK;
        }
    if (m->n == KILN_PROTO_MAX_TENSORS)
        return kiln_err_set(err, KILN_ERR_INVALID, "more than %d named tensors",
                            KILN_PROTO_MAX_TENSORS);
    memcpy(m->items[m->n].name, name, len + 1);
    m->items[m->n++].ref = *ref;
    return KILN_OK;
}

void kiln_image_ref_name(int row, char *out)
{
    snprintf(out, KILN_PROTO_TENSOR_NAME_MAX, "image.%d", row);
}

int kiln_image_ref_row(const char *name)
{
    static const char prefix[] = "image.";
    if (strncmp(name, prefix, sizeof prefix - 1))
        return -1;
    const char *d = name + sizeof prefix - 1;
    size_t n = strspn(d, "0123456789");
    if (n == 0 || n > 3 || d[n] || (n > 1 && d[0] == '0'))
        return -1;
    return atoi(d);
}

/* Dims up to 2^40 keep every product below 2^63 until the overflow check. */
#define MAX_DIM (1LL << 40)

kiln_status kiln_tensor_ref_check(const kiln_tensor_ref *r, kiln_err *err)
{
    if (r->kind < 0 || r->kind >= KILN_REF_KIND_COUNT)
        return kiln_err_set(err, KILN_ERR_INVALID, "unknown reference kind");
    size_t esize = kiln_dtype_size(r->dtype);
    if (r->dtype < 0 || r->dtype >= KILN_DTYPE_COUNT || r->dtype == KILN_F8E4M3 || !esize)
        return kiln_err_set(err, KILN_ERR_INVALID, "unknown dtype");
    if (r->ndim < 1 || r->ndim > KILN_MAX_DIMS)
        return kiln_err_set(err, KILN_ERR_INVALID, "shape must have 1 to %d dims", KILN_MAX_DIMS);
    uint64_t bytes = esize;
    for (int i = 0; i < r->ndim; i++) {
        if (r->shape[i] < 0 || r->shape[i] > MAX_DIM)
            return kiln_err_set(err, KILN_ERR_INVALID, "bad dim %lld", (long long)r->shape[i]);
        if (r->shape[i] && bytes > UINT64_MAX / (uint64_t)r->shape[i])
            return kiln_err_set(err, KILN_ERR_INVALID, "shape overflows");
        bytes *= (uint64_t)r->shape[i];
    }
    if (bytes != r->len)
        return kiln_err_set(err, KILN_ERR_INVALID, "len %llu does not match the shape (%llu bytes)",
                            (unsigned long long)r->len, (unsigned long long)bytes);
    if (r->kind == KILN_REF_INLINE) {
        if (r->len && !r->data)
            return kiln_err_set(err, KILN_ERR_INVALID, "inline reference without data");
        return KILN_OK;
    }
    if (!id_valid(r->owner) || !r->epoch)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad owner id or epoch");
    if (!r->gen)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad generation");
    if (!kiln_slab_name_valid(r->slab))
        return kiln_err_set(err, KILN_ERR_INVALID, "bad slab name");
    /* Consumers use the mapped range in place as typed memory. */
    if (r->off % KILN_PROTO_ALIGN || r->off > UINT64_MAX - r->len)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad slab offset");
    if (r->kind == KILN_REF_CUDA_IPC && (r->device < 0 || r->device > 1023))
        return kiln_err_set(err, KILN_ERR_INVALID, "bad device ordinal");
    return KILN_OK;
}

static kiln_status check_map(const kiln_ref_map *m, const char *what, kiln_err *err)
{
    if (m->n < 0 || m->n > KILN_PROTO_MAX_TENSORS)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s: bad tensor count", what);
    for (int i = 0; i < m->n; i++) {
        const kiln_named_ref *e = &m->items[i];
        size_t len = strnlen(e->name, sizeof e->name);
        if (len == 0 || len == sizeof e->name)
            return kiln_err_set(err, KILN_ERR_INVALID, "%s: bad tensor name", what);
        for (int j = 0; j < i; j++)
            if (!strcmp(m->items[j].name, e->name))
                return kiln_err_set(err, KILN_ERR_INVALID, "%s: duplicate tensor %s", what,
                                    e->name);
        if (kiln_tensor_ref_check(&e->ref, err))
            return kiln_err_wrap(err, "%s.%s", what, e->name);
    }
    return KILN_OK;
}

static kiln_status check_string(const char *s, const char *what, kiln_err *err)
{
    if (!s || strnlen(s, KILN_PROTO_MAX_STRING + 1) > KILN_PROTO_MAX_STRING)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s: missing or too long", what);
    return KILN_OK;
}

static int side_ok(int v) { return v >= 16 && v <= 16384 && v % 16 == 0; }

/* A data socket endpoint: "tcp://" and a host:port of printable
 * characters, shorter than KILN_PROTO_ENDPOINT_MAX. */
static int endpoint_valid(const char *e)
{
    size_t n = strnlen(e, KILN_PROTO_ENDPOINT_MAX);
    if (n >= KILN_PROTO_ENDPOINT_MAX || n <= 6 || strncmp(e, "tcp://", 6) || !strchr(e + 6, ':'))
        return 0;
    for (size_t i = 6; i < n; i++)
        if (!name_char(e[i]) && !strchr(":[]", e[i]))
            return 0;
    return 1;
}

/* "" or 40 characters of Z85's alphabet (the key itself is checked when
 * a socket takes it). */
static int key_valid(const char *k)
{
    size_t n = strnlen(k, KILN_PROTO_KEY_TEXT);
    if (!n)
        return 1;
    if (n != KILN_PROTO_KEY_TEXT - 1)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (k[i] <= 0x20 || k[i] >= 0x7f || strchr("\"',;_`|~\\", k[i]))
            return 0;
    return 1;
}

static kiln_status check_domain(const kiln_domain *d, kiln_err *err)
{
    if (!kiln_domain_id_valid(d->host, KILN_DOMAIN_ID_MAX))
        return kiln_err_set(err, KILN_ERR_INVALID, "domain.host: 1..%d characters of "
                            "[A-Za-z0-9._:-]", KILN_DOMAIN_ID_MAX - 1);
    if (d->shm[0] && !kiln_domain_id_valid(d->shm, KILN_DOMAIN_ID_MAX))
        return kiln_err_set(err, KILN_ERR_INVALID, "domain.shm: bad identity");
    if (d->n_gpus < 0 || d->n_gpus > KILN_DOMAIN_MAX_GPUS)
        return kiln_err_set(err, KILN_ERR_INVALID, "domain.gpus: at most %d",
                            KILN_DOMAIN_MAX_GPUS);
    for (int i = 0; i < d->n_gpus; i++)
        if (!kiln_domain_id_valid(d->gpus[i], KILN_DOMAIN_GPU_MAX))
            return kiln_err_set(err, KILN_ERR_INVALID, "domain.gpus: bad GPU id");
    if (d->gpu < -1 || d->gpu >= d->n_gpus)
        return kiln_err_set(err, KILN_ERR_INVALID, "domain.gpu: not one of its gpus");
    return KILN_OK;
}

static kiln_status check_job(const kiln_msg_job *j, kiln_err *err)
{
    if (j->out_kinds >> KILN_REF_KIND_COUNT)
        return kiln_err_set(err, KILN_ERR_INVALID, "outk: unknown transports");
    if (j->n_src < 0 || j->n_src > KILN_PROTO_MAX_TENSORS)
        return kiln_err_set(err, KILN_ERR_INVALID, "src: at most %d", KILN_PROTO_MAX_TENSORS);
    for (int i = 0; i < j->n_src; i++)
        if (!id_valid(j->src[i].owner) || !j->src[i].endpoint ||
            !endpoint_valid(j->src[i].endpoint) || !j->src[i].key || !key_valid(j->src[i].key))
            return kiln_err_set(err, KILN_ERR_INVALID, "src: bad owner, endpoint or key");
    switch (j->stage) {
    case KILN_STAGE_ENCODE: {
        const kiln_job_encode *e = &j->encode;
        if (e->n_prompts < 1 || e->n_prompts > KILN_PROTO_MAX_PROMPTS)
            return kiln_err_set(err, KILN_ERR_INVALID, "prompts: 1 to %d expected",
                                KILN_PROTO_MAX_PROMPTS);
        for (int i = 0; i < e->n_prompts; i++)
            if (check_string(e->prompts[i], "prompts", err))
                return err->code;
        if (e->negative && check_string(e->negative, "negative", err))
            return err->code;
        if (e->max_seq < 1 || e->max_seq > KILN_PROTO_MAX_SEQ)
            return kiln_err_set(err, KILN_ERR_INVALID, "max_seq out of range");
        if (e->n_refs < 0 || e->n_refs > KILN_PROTO_MAX_EDIT_REFS)
            return kiln_err_set(err, KILN_ERR_INVALID, "refs: at most %d", KILN_PROTO_MAX_EDIT_REFS);
        for (int i = 0; i < e->n_refs; i++)
            if (!e->refs[i].data || !e->refs[i].len)
                return kiln_err_set(err, KILN_ERR_INVALID, "refs: empty image");
        break;
    }
    case KILN_STAGE_DENOISE: {
        const kiln_job_denoise *d = &j->denoise;
        if (d->n < 1 || d->n_seeds < 1 || d->n_seeds > KILN_PROTO_MAX_ROWS || d->n_seeds % d->n)
            return kiln_err_set(err, KILN_ERR_INVALID, "seeds: a multiple of n, 1 to %d",
                                KILN_PROTO_MAX_ROWS);
        if (!side_ok(d->width) || !side_ok(d->height))
            return kiln_err_set(err, KILN_ERR_INVALID, "width/height: multiples of 16 in 16..16384");
        if (d->steps < 1 || d->steps > KILN_PROTO_MAX_STEPS)
            return kiln_err_set(err, KILN_ERR_INVALID, "steps out of range");
        if (!isfinite(d->guidance) || d->guidance < 0 || d->guidance > 100)
            return kiln_err_set(err, KILN_ERR_INVALID, "guidance out of range");
        if (d->batch_noise != 0 && d->batch_noise != 1)
            return kiln_err_set(err, KILN_ERR_INVALID, "batch_noise must be a bool");
        if (d->previews < 0 || d->previews > KILN_PROTO_MAX_PREVIEWS)
            return kiln_err_set(err, KILN_ERR_INVALID, "previews must be 0..%d",
                                KILN_PROTO_MAX_PREVIEWS);
        break;
    }
    case KILN_STAGE_DECODE: {
        const kiln_job_decode *d = &j->decode;
        if (!side_ok(d->width) || !side_ok(d->height))
            return kiln_err_set(err, KILN_ERR_INVALID, "width/height: multiples of 16 in 16..16384");
        if (!kiln_image_format_name(d->format))
            return kiln_err_set(err, KILN_ERR_INVALID, "unknown format");
        if (d->compression < 0 || d->compression > 100)
            return kiln_err_set(err, KILN_ERR_INVALID, "compression must be 0..100");
        if (d->image_kinds & ~KILN_TRANSPORT_BIT(KILN_REF_SHM))
            return kiln_err_set(err, KILN_ERR_INVALID, "imgk: image files go inline or in shm");
        break;
    }
    default:
        return kiln_err_set(err, KILN_ERR_INVALID, "unknown stage");
    }
    return check_map(&j->in, "in", err);
}

static kiln_status check_done(const kiln_msg_done *d, kiln_err *err)
{
    if (d->ok && d->code != KILN_OK)
        return kiln_err_set(err, KILN_ERR_INVALID, "ok with an error code");
    if (!d->ok) {
        if (d->code <= KILN_OK || d->code > KILN_ERR_INTERNAL)
            return kiln_err_set(err, KILN_ERR_INVALID, "error.code: unknown");
        if (check_string(d->message, "error.message", err))
            return err->code;
    }
    if (d->n_images < 0 || d->n_images > KILN_PROTO_MAX_ROWS)
        return kiln_err_set(err, KILN_ERR_INVALID, "images: at most %d", KILN_PROTO_MAX_ROWS);
    for (int i = 0; i < d->n_images; i++)
        if (!d->images[i].data || !d->images[i].len)
            return kiln_err_set(err, KILN_ERR_INVALID, "images: empty image");
    if (d->n_ms < 0 || d->n_ms > KILN_PROTO_MAX_TIMINGS)
        return kiln_err_set(err, KILN_ERR_INVALID, "ms: at most %d timings",
                            KILN_PROTO_MAX_TIMINGS);
    for (int i = 0; i < d->n_ms; i++)
        if (!d->ms[i].name || !*d->ms[i].name || strlen(d->ms[i].name) >= KILN_PROTO_ID_MAX ||
            !isfinite(d->ms[i].ms) || d->ms[i].ms < 0)
            return kiln_err_set(err, KILN_ERR_INVALID, "ms: bad timing");
    return check_map(&d->out, "out", err);
}

static kiln_status check_traits(const kiln_model_traits *t, kiln_err *err)
{
    size_t n = strnlen(t->family, sizeof t->family);
    int ok = n > 0 && n < sizeof t->family;
    for (size_t i = 0; ok && i < n; i++)
        ok = !!strchr("abcdefghijklmnopqrstuvwxyz0123456789_-", t->family[i]);
    if (!ok)
        return kiln_err_set(err, KILN_ERR_INVALID, "traits: bad family name");
    if (t->default_steps < 1 || t->default_steps > KILN_PROTO_MAX_STEPS ||
        !isfinite(t->default_guidance) || t->default_guidance < 0 || t->default_guidance > 100)
        return kiln_err_set(err, KILN_ERR_INVALID, "traits: default steps or guidance out of range");
    if (t->text_width < 1 || t->text_width > KILN_TRAITS_WIDEST_TEXT || t->latent_channels < 1 ||
        t->latent_channels > KILN_TRAITS_WIDEST_LATENT)
        return kiln_err_set(err, KILN_ERR_INVALID, "traits: widths out of range");
    return KILN_OK;
}

static kiln_status check_msg(const kiln_msg *m, kiln_err *err)
{
    if (!m->epoch)
        return kiln_err_set(err, KILN_ERR_INVALID, "epoch: missing or 0");
    switch (m->type) {
    case KILN_MSG_HELLO: {
        const kiln_msg_hello *h = &m->hello;
        if (!kiln_stage_name(h->stage))
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: unknown stage");
        if (!id_valid(h->replica) || !id_valid(h->host))
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: bad replica or host id");
        if (!h->model || strnlen(h->model, KILN_PROTO_ID_MAX) >= KILN_PROTO_ID_MAX)
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: bad model name");
        if (h->max_batch < 1 || h->max_batch > KILN_PROTO_MAX_ROWS)
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: max_batch out of range");
        if (!h->transports || h->transports >> KILN_REF_KIND_COUNT)
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: bad transports");
        if (h->version < 0)
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: bad version");
        if ((h->data && h->data[0] && !endpoint_valid(h->data)) ||
            (h->data_key && !key_valid(h->data_key)))
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: bad data endpoint or key");
        if (h->process && h->process[0] && !process_valid(h->process))
            return kiln_err_set(err, KILN_ERR_INVALID, "hello: bad process token");
        if (check_traits(&h->traits, err))
            return kiln_err_wrap(err, "hello");
        return check_domain(&h->domain, err) ? kiln_err_wrap(err, "hello") : KILN_OK;
    }
    case KILN_MSG_READY:
        if (m->ready.credits < 1 || m->ready.credits > KILN_PROTO_MAX_CREDITS)
            return kiln_err_set(err, KILN_ERR_INVALID, "ready: credits out of range");
        return KILN_OK;
    case KILN_MSG_HB:
    case KILN_MSG_CANCEL:
    case KILN_MSG_FENCED:
        return KILN_OK;
    case KILN_MSG_DONE:
        return check_done(&m->done, err) ? kiln_err_wrap(err, "done") : KILN_OK;
    case KILN_MSG_PARTIAL:
        if (!m->done.ok || m->done.n_images || m->done.n_ms || m->done.preview < 0 ||
            m->done.preview >= KILN_PROTO_MAX_PREVIEWS || !kiln_ref_map_get(&m->done.out, "latents"))
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "partial: needs latents and a preview index 0..%d, nothing else",
                                KILN_PROTO_MAX_PREVIEWS - 1);
        return check_map(&m->done.out, "out", err) ? kiln_err_wrap(err, "partial") : KILN_OK;
    case KILN_MSG_RELEASE:
    case KILN_MSG_FREE:
    case KILN_MSG_FETCH:
        if (m->refs.n < 1 || m->refs.n > KILN_PROTO_MAX_REFS)
            return kiln_err_set(err, KILN_ERR_INVALID, "refs: 1 to %d expected",
                                KILN_PROTO_MAX_REFS);
        for (int i = 0; i < m->refs.n; i++) {
            if (m->refs.refs[i].kind == KILN_REF_INLINE)
                return kiln_err_set(err, KILN_ERR_INVALID, "refs: an inline tensor has no owner");
            if (kiln_tensor_ref_check(&m->refs.refs[i], err))
                return kiln_err_wrap(err, "refs[%d]", i);
        }
        return KILN_OK;
    case KILN_MSG_JOB:
        return check_job(&m->job, err) ? kiln_err_wrap(err, "job") : KILN_OK;
    case KILN_MSG_BYE:
        return check_string(m->bye_reason, "bye: reason", err);
    case KILN_MSG_LEAVING: return KILN_OK;
    case KILN_MSG_GONE:
        if (!id_valid(m->gone.replica) || !m->gone.incarnation)
            return kiln_err_set(err, KILN_ERR_INVALID, "gone: bad replica id or incarnation");
        return KILN_OK;
    case KILN_MSG_TYPE_END:
        break;
    }
    return kiln_err_set(err, KILN_ERR_INVALID, "unknown message type");
}

kiln_status kiln_msg_check(const kiln_msg *m, kiln_err *err)
{
    /* The checks wrap messages, which needs a real kiln_err. */
    kiln_err local;
    return check_msg(m, err ? err : &local);
}
