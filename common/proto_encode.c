/* msgpack encoding of bus messages (msgpack-c's packer over a kiln_buf). */
#include <string.h>

#include <msgpack.h>

#include "proto.h"

typedef struct sink {
    kiln_buf *buf;
    kiln_err *err;
    kiln_status failed;
} sink;

static int sink_write(void *data, const char *p, size_t len)
{
    sink *s = data;
    if (!s->failed && kiln_buf_append(s->buf, p, len, s->err))
        s->failed = KILN_ERR_NOMEM;
    return s->failed ? -1 : 0;
}

/* The packer functions report failure through the sink; checking the sink
 * once at the end is enough because a failed sink drops every later write. */
static void key(msgpack_packer *pk, const char *k)
{
    size_t n = strlen(k);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, k, n);
}

static void str(msgpack_packer *pk, const char *v)
{
    if (!v) {
        msgpack_pack_nil(pk);
        return;
    }
    size_t n = strlen(v);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, v, n);
}

static void bin(msgpack_packer *pk, const void *p, size_t n)
{
    msgpack_pack_bin(pk, n);
    msgpack_pack_bin_body(pk, p, n);
}

static void kv_str(msgpack_packer *pk, const char *k, const char *v) { key(pk, k), str(pk, v); }
static void kv_int(msgpack_packer *pk, const char *k, int64_t v) { key(pk, k), msgpack_pack_int64(pk, v); }
static void kv_u64(msgpack_packer *pk, const char *k, uint64_t v) { key(pk, k), msgpack_pack_uint64(pk, v); }
static void kv_bool(msgpack_packer *pk, const char *k, int v)
{
    key(pk, k);
    if (v)
        msgpack_pack_true(pk);
    else
        msgpack_pack_false(pk);
}

/* A message map with `t`, `epoch` and `fields` more entries. */
static void head(msgpack_packer *pk, const kiln_msg *m, size_t fields)
{
    msgpack_pack_map(pk, fields + 2);
    kv_str(pk, "t", kiln_msg_type_name(m->type));
    kv_u64(pk, "epoch", m->epoch);
}

static void tensor_ref(msgpack_packer *pk, const kiln_tensor_ref *r)
{
    size_t fields = r->kind == KILN_REF_INLINE ? 5 : r->kind == KILN_REF_SHM ? 9 : 11;
    msgpack_pack_map(pk, fields);
    kv_str(pk, "kind", kiln_ref_kind_name(r->kind));
    kv_str(pk, "dtype", kiln_dtype_name(r->dtype));
    key(pk, "shape");
    msgpack_pack_array(pk, (size_t)r->ndim);
    for (int i = 0; i < r->ndim; i++)
        msgpack_pack_int64(pk, r->shape[i]);
    kv_u64(pk, "len", r->len);
    if (r->kind == KILN_REF_INLINE) {
        key(pk, "data");
        bin(pk, r->data, (size_t)r->len);
        return;
    }
    kv_str(pk, "owner", r->owner);
    kv_u64(pk, "epoch", r->epoch);
    kv_str(pk, "slab", r->slab);
    kv_u64(pk, "off", r->off);
    kv_u64(pk, "gen", r->gen);
    if (r->kind == KILN_REF_CUDA_IPC) {
        key(pk, "handle");
        bin(pk, r->handle, sizeof r->handle);
        kv_int(pk, "device", r->device);
    }
}

static void ref_map(msgpack_packer *pk, const char *k, const kiln_ref_map *m)
{
    key(pk, k);
    msgpack_pack_map(pk, (size_t)m->n);
    for (int i = 0; i < m->n; i++) {
        key(pk, m->items[i].name);
        tensor_ref(pk, &m->items[i].ref);
    }
}

static void domain(msgpack_packer *pk, const kiln_domain *d)
{
    key(pk, "domain");
    msgpack_pack_map(pk, 7);
    kv_str(pk, "host", d->host);
    kv_str(pk, "shm", d->shm);
    kv_u64(pk, "ipc", d->ipc_ns);
    kv_u64(pk, "mnt", d->mnt_ns);
    kv_u64(pk, "pid", d->pid_ns);
    key(pk, "gpus");
    msgpack_pack_array(pk, (size_t)d->n_gpus);
    for (int i = 0; i < d->n_gpus; i++)
        str(pk, d->gpus[i]);
    kv_int(pk, "gpu", d->gpu);
}

static void traits(msgpack_packer *pk, const kiln_model_traits *t)
{
    key(pk, "traits");
    msgpack_pack_map(pk, 12);
    kv_str(pk, "family", t->family);
    kv_bool(pk, "cfg", t->cfg);
    kv_bool(pk, "cfg_above_zero", t->cfg_above_zero);
    kv_bool(pk, "kv_cache", t->kv_cache);
    kv_bool(pk, "no_references", t->no_references);
    kv_bool(pk, "shrink_images", t->shrink_images);
    key(pk, "strength");
    msgpack_pack_double(pk, t->img2img_strength);
    key(pk, "inpaint_strength");
    msgpack_pack_double(pk, t->inpaint_strength);
    kv_int(pk, "steps", t->default_steps);
    key(pk, "guidance");
    msgpack_pack_float(pk, t->default_guidance);
    kv_int(pk, "text_width", t->text_width);
    kv_int(pk, "latent_channels", t->latent_channels);
}

static void hello(msgpack_packer *pk, const kiln_msg *m)
{
    const kiln_msg_hello *h = &m->hello;
    int has_process = h->process && h->process[0];
    head(pk, m, 11 + has_process);
    traits(pk, &h->traits);
    if (has_process)
        kv_str(pk, "proc", h->process);
    domain(pk, &h->domain);
    kv_str(pk, "data", h->data ? h->data : "");
    kv_str(pk, "dkey", h->data_key ? h->data_key : "");
    kv_str(pk, "stage", kiln_stage_name(h->stage));
    kv_str(pk, "replica", h->replica);
    kv_str(pk, "model", h->model);
    kv_str(pk, "host", h->host);
    kv_int(pk, "max_batch", h->max_batch);
    kv_int(pk, "version", h->version ? h->version : KILN_PROTO_VERSION);
    key(pk, "transports");
    int n = 0;
    for (int k = 0; k < KILN_REF_KIND_COUNT; k++)
        n += (h->transports >> k) & 1;
    msgpack_pack_array(pk, (size_t)n);
    for (int k = 0; k < KILN_REF_KIND_COUNT; k++)
        if ((h->transports >> k) & 1)
            str(pk, kiln_ref_kind_name((kiln_ref_kind)k));
}

static void done(msgpack_packer *pk, const kiln_msg *m)
{
    const kiln_msg_done *d = &m->done;
    head(pk, m, d->ok ? 5 : 6);
    kv_u64(pk, "job", d->job);
    kv_bool(pk, "ok", d->ok);
    if (!d->ok) {
        key(pk, "error");
        msgpack_pack_map(pk, 2);
        kv_str(pk, "code", kiln_status_name(d->code));
        kv_str(pk, "message", d->message);
    }
    ref_map(pk, "out", &d->out);
    key(pk, "images");
    msgpack_pack_array(pk, (size_t)d->n_images);
    for (int i = 0; i < d->n_images; i++)
        bin(pk, d->images[i].data, d->images[i].len);
    key(pk, "ms");
    msgpack_pack_map(pk, (size_t)d->n_ms);
    for (int i = 0; i < d->n_ms; i++) {
        key(pk, d->ms[i].name);
        msgpack_pack_double(pk, d->ms[i].ms);
    }
}

static void job(msgpack_packer *pk, const kiln_msg *m)
{
    const kiln_msg_job *j = &m->job;
    static const int fields[KILN_STAGE_COUNT] = {6, 9, 5};
    head(pk, m, (size_t)(5 + fields[j->stage]));
    kv_u64(pk, "job", j->job);
    kv_str(pk, "stage", kiln_stage_name(j->stage));
    ref_map(pk, "in", &j->in);
    kv_int(pk, "outk", j->out_kinds);
    key(pk, "src");
    msgpack_pack_array(pk, (size_t)j->n_src);
    for (int i = 0; i < j->n_src; i++) {
        msgpack_pack_map(pk, 3);
        kv_str(pk, "owner", j->src[i].owner);
        kv_str(pk, "ep", j->src[i].endpoint);
        kv_str(pk, "key", j->src[i].key);
    }
    switch (j->stage) {
    case KILN_STAGE_ENCODE: {
        const kiln_job_encode *e = &j->encode;
        key(pk, "prompts");
        msgpack_pack_array(pk, (size_t)e->n_prompts);
        for (int i = 0; i < e->n_prompts; i++)
            str(pk, e->prompts[i]);
        kv_str(pk, "negative", e->negative);
        kv_int(pk, "max_seq", e->max_seq);
        key(pk, "refs");
        msgpack_pack_array(pk, (size_t)e->n_refs);
        for (int i = 0; i < e->n_refs; i++)
            bin(pk, e->refs[i].data, e->refs[i].len);
        key(pk, "mask"); /* empty: none */
        bin(pk, e->mask.data, e->mask.len);
        kv_bool(pk, "start", e->start);
        break;
    }
    case KILN_STAGE_DENOISE: {
        const kiln_job_denoise *d = &j->denoise;
        kv_int(pk, "n", d->n);
        key(pk, "seeds");
        msgpack_pack_array(pk, (size_t)d->n_seeds);
        for (int i = 0; i < d->n_seeds; i++)
            msgpack_pack_uint64(pk, d->seeds[i]);
        kv_int(pk, "width", d->width);
        kv_int(pk, "height", d->height);
        kv_int(pk, "steps", d->steps);
        /* float32 on the wire: the request's value exactly. */
        key(pk, "guidance");
        msgpack_pack_float(pk, d->guidance);
        kv_bool(pk, "batch_noise", d->batch_noise);
        key(pk, "strength"); /* 0: not img2img */
        msgpack_pack_double(pk, d->strength);
        kv_int(pk, "previews", d->previews);
        break;
    }
    case KILN_STAGE_DECODE: {
        const kiln_job_decode *d = &j->decode;
        kv_int(pk, "width", d->width);
        kv_int(pk, "height", d->height);
        kv_str(pk, "format", kiln_image_format_name(d->format));
        kv_int(pk, "compression", d->compression);
        kv_int(pk, "imgk", d->image_kinds);
        break;
    }
    default:
        break; /* refused by kiln_msg_check */
    }
}

static void refs(msgpack_packer *pk, const kiln_msg *m)
{
    const kiln_msg_refs *r = &m->refs;
    head(pk, m, 1);
    key(pk, "refs");
    msgpack_pack_array(pk, (size_t)r->n);
    for (int i = 0; i < r->n; i++)
        tensor_ref(pk, &r->refs[i]);
}

kiln_status kiln_msg_encode(const kiln_msg *m, kiln_buf *out, kiln_err *err)
{
    if (kiln_msg_check(m, err))
        return KILN_ERR_INVALID;
    size_t start = out->len;
    sink s = {.buf = out, .err = err};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &s, sink_write);
    switch (m->type) {
    case KILN_MSG_HELLO: hello(&pk, m); break;
    case KILN_MSG_READY:
        head(&pk, m, 1);
        kv_int(&pk, "credits", m->ready.credits);
        break;
    case KILN_MSG_HB:
        head(&pk, m, 5);
        kv_u64(&pk, "progress", m->progress);
        kv_u64(&pk, "shm_short", m->shm_short);
        kv_u64(&pk, "rss", m->rss);
        kv_u64(&pk, "dev_used", m->dev_used);
        kv_u64(&pk, "dev_total", m->dev_total);
        break;
    case KILN_MSG_FENCED:
    case KILN_MSG_LEAVING:
        head(&pk, m, 0);
        break;
    case KILN_MSG_DONE: done(&pk, m); break;
    case KILN_MSG_PARTIAL:
        head(&pk, m, 3);
        kv_u64(&pk, "job", m->done.job);
        kv_int(&pk, "preview", m->done.preview);
        ref_map(&pk, "out", &m->done.out);
        break;
    case KILN_MSG_RELEASE:
    case KILN_MSG_FREE:
    case KILN_MSG_FETCH: refs(&pk, m); break;
    case KILN_MSG_JOB: job(&pk, m); break;
    case KILN_MSG_CANCEL:
        head(&pk, m, 1);
        kv_u64(&pk, "job", m->cancel_job);
        break;
    case KILN_MSG_BYE:
        head(&pk, m, 1);
        kv_str(&pk, "reason", m->bye_reason);
        break;
    case KILN_MSG_GONE:
        head(&pk, m, 2);
        kv_str(&pk, "replica", m->gone.replica);
        kv_u64(&pk, "incarnation", m->gone.incarnation);
        break;
    case KILN_MSG_TYPE_END: break; /* refused by kiln_msg_check */
    }
    if (!s.failed && out->len - start > KILN_PROTO_MAX_FRAME)
        s.failed = kiln_err_set(err, KILN_ERR_TOO_LARGE, "message over %u bytes",
                                KILN_PROTO_MAX_FRAME);
    if (s.failed) {
        out->len = start;
        return s.failed;
    }
    return KILN_OK;
}
