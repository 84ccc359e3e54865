/* Strict decoding of bus messages: a structural pre-scan bounds what
 * msgpack-c will allocate, msgpack-c unpacks, and typed extraction copies
 * every string and byte range into one block owned by the message. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "proto.h"

#define MAX_DEPTH 8

/* ---- pre-scan ---- */

typedef struct scan {
    const uint8_t *p, *end;
    size_t payload; /* str + bin bytes */
    size_t strings; /* str count (each needs a NUL) */
} scan;

static int take(scan *s, size_t n, uint64_t *v)
{
    if ((size_t)(s->end - s->p) < n)
        return -1;
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++)
        x = (x << 8) | s->p[i];
    s->p += n;
    *v = x;
    return 0;
}

static int skip(scan *s, uint64_t n)
{
    if ((uint64_t)(s->end - s->p) < n)
        return -1;
    s->p += n;
    return 0;
}

/* Walks one object.  A container's declared count must fit in the bytes
 * left (every element takes at least one), so msgpack-c never allocates
 * for more objects than the frame can hold. */
static int scan_obj(scan *s, int depth)
{
    uint64_t n = 0, len;
    if (depth > MAX_DEPTH || s->p >= s->end)
        return -1;
    uint8_t b = *s->p++;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return 0;
    if ((b & 0xe0) == 0xa0) {
        len = b & 0x1f;
        goto str;
    }
    if ((b & 0xf0) == 0x90) {
        n = b & 0x0f;
        goto array;
    }
    if ((b & 0xf0) == 0x80) {
        n = (uint64_t)(b & 0x0f) * 2;
        goto array;
    }
    switch (b) {
    case 0xc4: case 0xc5: case 0xc6:
        if (take(s, (size_t)1 << (b - 0xc4), &len) || skip(s, len))
            return -1;
        s->payload += len;
        return 0;
    case 0xca: return skip(s, 4);
    case 0xcb: return skip(s, 8);
    case 0xcc: case 0xcd: case 0xce: case 0xcf: return skip(s, (size_t)1 << (b - 0xcc));
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: return skip(s, (size_t)1 << (b - 0xd0));
    case 0xd9: case 0xda: case 0xdb:
        if (take(s, (size_t)1 << (b - 0xd9), &len))
            return -1;
        goto str;
    case 0xdc: case 0xdd:
        if (take(s, (size_t)2 << (b - 0xdc), &n))
            return -1;
        goto array;
    case 0xde: case 0xdf:
        if (take(s, (size_t)2 << (b - 0xde), &n))
            return -1;
        n *= 2;
        goto array;
    default:
        return -1; /* 0xc1 and every ext type: never used by the protocol */
    }
str:
    if (skip(s, len))
        return -1;
    s->payload += len;
    s->strings++;
    return 0;
array:
    if (n > (uint64_t)(s->end - s->p))
        return -1;
    for (uint64_t i = 0; i < n; i++)
        if (scan_obj(s, depth + 1))
            return -1;
    return 0;
}

/* ---- typed extraction ---- */

typedef struct dec {
    char *arena;
    size_t used, cap;
    kiln_err *err;
} dec;

static kiln_status bad(dec *d, const char *field, const char *what)
{
    return kiln_err_set(d->err, KILN_ERR_INVALID, "%s: %s", field, what);
}

static const msgpack_object *get(const msgpack_object *map, const char *k)
{
    size_t n = strlen(k);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *key = &map->via.map.ptr[i].key;
        if (key->type == MSGPACK_OBJECT_STR && key->via.str.size == n &&
            !memcmp(key->via.str.ptr, k, n))
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

static kiln_status need(dec *d, const msgpack_object *map, const char *k,
                        msgpack_object_type type, const msgpack_object **out)
{
    *out = get(map, k);
    if (!*out)
        return bad(d, k, "missing");
    if ((*out)->type != type)
        return bad(d, k, "wrong type");
    return KILN_OK;
}

static kiln_status i64_of(dec *d, const msgpack_object *o, const char *k, int64_t lo, int64_t hi,
                          int64_t *v)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX)
            return bad(d, k, "out of range");
        *v = (int64_t)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *v = o->via.i64;
    } else {
        return bad(d, k, "not an integer");
    }
    return *v < lo || *v > hi ? bad(d, k, "out of range") : KILN_OK;
}

static kiln_status get_int(dec *d, const msgpack_object *map, const char *k, int *v)
{
    const msgpack_object *o = get(map, k);
    int64_t x = 0;
    if (!o)
        return bad(d, k, "missing");
    if (i64_of(d, o, k, INT_MIN, INT_MAX, &x))
        return KILN_ERR_INVALID;
    *v = (int)x;
    return KILN_OK;
}

static kiln_status get_u64(dec *d, const msgpack_object *map, const char *k, uint64_t *v)
{
    const msgpack_object *o;
    if (need(d, map, k, MSGPACK_OBJECT_POSITIVE_INTEGER, &o))
        return KILN_ERR_INVALID;
    *v = o->via.u64;
    return KILN_OK;
}

/* As get_u64, 0 when absent (fields later versions added). */
static kiln_status opt_u64(dec *d, const msgpack_object *map, const char *k, uint64_t *v)
{
    *v = 0;
    return get(map, k) ? get_u64(d, map, k, v) : KILN_OK;
}

static kiln_status get_bool(dec *d, const msgpack_object *map, const char *k, int *v)
{
    const msgpack_object *o;
    if (need(d, map, k, MSGPACK_OBJECT_BOOLEAN, &o))
        return KILN_ERR_INVALID;
    *v = o->via.boolean ? 1 : 0;
    return KILN_OK;
}

static kiln_status num_of(dec *d, const msgpack_object *o, const char *k, double *v)
{
    int64_t x = 0;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64)
        *v = o->via.f64;
    else if (i64_of(d, o, k, -(1LL << 53), 1LL << 53, &x))
        return KILN_ERR_INVALID;
    else
        *v = (double)x;
    return KILN_OK;
}

/* Copies a str object into the arena as a C string (no embedded NULs). */
static kiln_status str_of(dec *d, const msgpack_object *o, const char *k, const char **out)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return bad(d, k, "not a string");
    uint32_t n = o->via.str.size;
    if (n > KILN_PROTO_MAX_STRING || memchr(o->via.str.ptr, 0, n))
        return bad(d, k, "too long or holds a NUL byte");
    /* The pre-scan sized the arena for every string plus its NUL; only a
     * field read twice could overrun it. */
    if ((size_t)n + 1 > d->cap - d->used)
        return kiln_err_set(d->err, KILN_ERR_INTERNAL, "%s: decode arena exhausted", k);
    char *p = d->arena + d->used;
    memcpy(p, o->via.str.ptr, n);
    p[n] = '\0';
    d->used += (size_t)n + 1;
    *out = p;
    return KILN_OK;
}

static kiln_status get_str(dec *d, const msgpack_object *map, const char *k, const char **out)
{
    const msgpack_object *o = get(map, k);
    return o ? str_of(d, o, k, out) : bad(d, k, "missing");
}

/* A string into a fixed buffer (ids, names). */
static kiln_status get_name(dec *d, const msgpack_object *map, const char *k, char *buf, size_t cap)
{
    const msgpack_object *o;
    if (need(d, map, k, MSGPACK_OBJECT_STR, &o))
        return KILN_ERR_INVALID;
    if (o->via.str.size >= cap || memchr(o->via.str.ptr, 0, o->via.str.size))
        return bad(d, k, "too long");
    memcpy(buf, o->via.str.ptr, o->via.str.size);
    buf[o->via.str.size] = '\0';
    return KILN_OK;
}

static kiln_status bin_of(dec *d, const msgpack_object *o, const char *k, kiln_bytes *out)
{
    if (o->type != MSGPACK_OBJECT_BIN)
        return bad(d, k, "not bytes");
    if (o->via.bin.size > d->cap - d->used)
        return kiln_err_set(d->err, KILN_ERR_INTERNAL, "%s: decode arena exhausted", k);
    char *p = d->arena + d->used;
    if (o->via.bin.size)
        memcpy(p, o->via.bin.ptr, o->via.bin.size);
    d->used += o->via.bin.size;
    out->data = (const uint8_t *)p;
    out->len = o->via.bin.size;
    return KILN_OK;
}

static kiln_status tensor_ref(dec *d, const msgpack_object *o, kiln_tensor_ref *r)
{
    memset(r, 0, sizeof *r);
    if (o->type != MSGPACK_OBJECT_MAP)
        return bad(d, "tensor", "not a map");
    char name[16];
    const msgpack_object *shape;
    if (get_name(d, o, "kind", name, sizeof name) || kiln_ref_kind_parse(name, &r->kind))
        return bad(d, "kind", "unknown");
    if (get_name(d, o, "dtype", name, sizeof name) || kiln_dtype_parse(name, &r->dtype))
        return bad(d, "dtype", "unknown");
    if (need(d, o, "shape", MSGPACK_OBJECT_ARRAY, &shape))
        return KILN_ERR_INVALID;
    if (shape->via.array.size < 1 || shape->via.array.size > KILN_MAX_DIMS)
        return bad(d, "shape", "bad rank");
    r->ndim = (int)shape->via.array.size;
    for (int i = 0; i < r->ndim; i++)
        if (i64_of(d, &shape->via.array.ptr[i], "shape", 0, INT64_MAX, &r->shape[i]))
            return KILN_ERR_INVALID;
    if (get_u64(d, o, "len", &r->len))
        return KILN_ERR_INVALID;
    if (r->kind == KILN_REF_INLINE) {
        kiln_bytes b = {0};
        const msgpack_object *data = get(o, "data");
        if (!data || bin_of(d, data, "data", &b))
            return bad(d, "data", "missing or not bytes");
        if (b.len != r->len)
            return bad(d, "data", "length differs from len");
        r->data = b.data;
    } else {
        if (get_name(d, o, "owner", r->owner, sizeof r->owner) ||
            get_u64(d, o, "epoch", &r->epoch) ||
            get_name(d, o, "slab", r->slab, sizeof r->slab) || get_u64(d, o, "off", &r->off) ||
            get_u64(d, o, "gen", &r->gen))
            return KILN_ERR_INVALID;
        if (r->kind == KILN_REF_CUDA_IPC) {
            const msgpack_object *h;
            if (need(d, o, "handle", MSGPACK_OBJECT_BIN, &h) || get_int(d, o, "device", &r->device))
                return KILN_ERR_INVALID;
            if (h->via.bin.size != KILN_PROTO_IPC_HANDLE)
                return bad(d, "handle", "wrong size");
            memcpy(r->handle, h->via.bin.ptr, KILN_PROTO_IPC_HANDLE);
        }
    }
    return kiln_tensor_ref_check(r, d->err);
}

static kiln_status ref_map(dec *d, const msgpack_object *map, const char *k, int required,
                           kiln_ref_map *m)
{
    const msgpack_object *o = get(map, k);
    m->n = 0;
    if (!o && !required)
        return KILN_OK;
    if (!o || o->type != MSGPACK_OBJECT_MAP)
        return bad(d, k, "missing or not a map");
    if (o->via.map.size > KILN_PROTO_MAX_TENSORS)
        return bad(d, k, "too many tensors");
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        kiln_named_ref *e = &m->items[m->n];
        const msgpack_object *key = &o->via.map.ptr[i].key;
        if (key->type != MSGPACK_OBJECT_STR || key->via.str.size == 0 ||
            key->via.str.size >= sizeof e->name || memchr(key->via.str.ptr, 0, key->via.str.size))
            return bad(d, k, "bad tensor name");
        memcpy(e->name, key->via.str.ptr, key->via.str.size);
        e->name[key->via.str.size] = '\0';
        if (tensor_ref(d, &o->via.map.ptr[i].val, &e->ref))
            return kiln_err_wrap(d->err, "%s.%s", k, e->name);
        m->n++;
    }
    return KILN_OK;
}

static kiln_status array(dec *d, const msgpack_object *map, const char *k, uint32_t max,
                         int required, const msgpack_object **out)
{
    *out = get(map, k);
    if (!*out && !required)
        return KILN_OK;
    if (!*out || (*out)->type != MSGPACK_OBJECT_ARRAY)
        return bad(d, k, "missing or not an array");
    if ((*out)->via.array.size > max)
        return bad(d, k, "too many elements");
    return KILN_OK;
}

static kiln_status domain(dec *d, const msgpack_object *map, kiln_domain *dom)
{
    const msgpack_object *o, *gpus;
    if (need(d, map, "domain", MSGPACK_OBJECT_MAP, &o) ||
        get_name(d, o, "host", dom->host, sizeof dom->host) ||
        get_name(d, o, "shm", dom->shm, sizeof dom->shm) || get_u64(d, o, "ipc", &dom->ipc_ns) ||
        get_u64(d, o, "mnt", &dom->mnt_ns) || get_u64(d, o, "pid", &dom->pid_ns) ||
        array(d, o, "gpus", KILN_DOMAIN_MAX_GPUS, 1, &gpus) || get_int(d, o, "gpu", &dom->gpu))
        return kiln_err_wrap(d->err, "domain");
    for (uint32_t i = 0; i < gpus->via.array.size; i++) {
        const msgpack_object *g = &gpus->via.array.ptr[i];
        if (g->type != MSGPACK_OBJECT_STR || g->via.str.size >= KILN_DOMAIN_GPU_MAX ||
            memchr(g->via.str.ptr, 0, g->via.str.size))
            return bad(d, "domain.gpus", "not a GPU id");
        memcpy(dom->gpus[i], g->via.str.ptr, g->via.str.size);
        dom->gpus[i][g->via.str.size] = '\0';
        dom->n_gpus++;
    }
    return KILN_OK;
}

static kiln_status traits(dec *d, const msgpack_object *o, kiln_model_traits *t)
{
    const msgpack_object *m, *g;
    double guidance = 0;
    if (need(d, o, "traits", MSGPACK_OBJECT_MAP, &m) ||
        get_name(d, m, "family", t->family, sizeof t->family) || get_bool(d, m, "cfg", &t->cfg) ||
        get_bool(d, m, "cfg_above_zero", &t->cfg_above_zero) ||
        get_bool(d, m, "kv_cache", &t->kv_cache) || get_bool(d, m, "no_references", &t->no_references) ||
        get_bool(d, m, "shrink_images", &t->shrink_images) ||
        get_int(d, m, "steps", &t->default_steps) ||
        get_int(d, m, "text_width", &t->text_width) ||
        get_int(d, m, "latent_channels", &t->latent_channels))
        return kiln_err_wrap(d->err, "traits");
    g = get(m, "guidance");
    if (!g || num_of(d, g, "guidance", &guidance))
        return bad(d, "traits.guidance", "missing or not a number");
    t->default_guidance = (float)guidance;
    double s[2] = {0, 0};
    static const char *const names[2][2] = {{"strength", "traits.strength"},
                                            {"inpaint_strength", "traits.inpaint_strength"}};
    for (int i = 0; i < 2; i++)
        if (!(g = get(m, names[i][0])) || num_of(d, g, names[i][1], &s[i]) ||
            !(s[i] >= 0 && s[i] <= 1))
            return bad(d, names[i][1], "missing or not a number in [0, 1]");
    t->img2img_strength = s[0], t->inpaint_strength = s[1];
    return KILN_OK;
}

static kiln_status hello(dec *d, const msgpack_object *o, kiln_msg_hello *h)
{
    const char *stage;
    const msgpack_object *tr;
    if (traits(d, o, &h->traits) || domain(d, o, &h->domain) || get_str(d, o, "data", &h->data) ||
        get_str(d, o, "dkey", &h->data_key) ||
        (get(o, "proc") && get_str(d, o, "proc", &h->process)))
        return KILN_ERR_INVALID;
    if (get_str(d, o, "stage", &stage) || get_str(d, o, "replica", &h->replica) ||
        get_str(d, o, "model", &h->model) || get_str(d, o, "host", &h->host) ||
        get_int(d, o, "max_batch", &h->max_batch) || get_int(d, o, "version", &h->version) ||
        array(d, o, "transports", KILN_REF_KIND_COUNT, 1, &tr))
        return KILN_ERR_INVALID;
    if (kiln_stage_parse(stage, &h->stage))
        return bad(d, "stage", "unknown");
    for (uint32_t i = 0; i < tr->via.array.size; i++) {
        const msgpack_object *e = &tr->via.array.ptr[i];
        char name[16];
        kiln_ref_kind k;
        if (e->type != MSGPACK_OBJECT_STR || e->via.str.size >= sizeof name)
            return bad(d, "transports", "unknown transport");
        memcpy(name, e->via.str.ptr, e->via.str.size);
        name[e->via.str.size] = '\0';
        if (kiln_ref_kind_parse(name, &k))
            return bad(d, "transports", "unknown transport");
        h->transports |= KILN_TRANSPORT_BIT(k);
    }
    return KILN_OK;
}

static kiln_status done(dec *d, const msgpack_object *o, kiln_msg_done *m)
{
    const msgpack_object *imgs, *ms;
    if (get_u64(d, o, "job", &m->job) || get_bool(d, o, "ok", &m->ok))
        return KILN_ERR_INVALID;
    if (!m->ok) {
        const msgpack_object *e;
        const char *code;
        if (need(d, o, "error", MSGPACK_OBJECT_MAP, &e) || get_str(d, e, "code", &code) ||
            get_str(d, e, "message", &m->message))
            return kiln_err_wrap(d->err, "error");
        if (kiln_status_parse(code, &m->code))
            return bad(d, "error.code", "unknown");
    }
    if (ref_map(d, o, "out", 0, &m->out) ||
        array(d, o, "images", KILN_PROTO_MAX_ROWS, 0, &imgs))
        return KILN_ERR_INVALID;
    for (uint32_t i = 0; imgs && i < imgs->via.array.size; i++)
        if (bin_of(d, &imgs->via.array.ptr[i], "images", &m->images[m->n_images++]))
            return KILN_ERR_INVALID;
    ms = get(o, "ms");
    if (ms) {
        if (ms->type != MSGPACK_OBJECT_MAP || ms->via.map.size > KILN_PROTO_MAX_TIMINGS)
            return bad(d, "ms", "not a map of at most 8 timings");
        for (uint32_t i = 0; i < ms->via.map.size; i++) {
            kiln_timing *t = &m->ms[m->n_ms++];
            if (str_of(d, &ms->via.map.ptr[i].key, "ms", &t->name) ||
                num_of(d, &ms->via.map.ptr[i].val, "ms", &t->ms))
                return KILN_ERR_INVALID;
        }
    }
    return KILN_OK;
}

static kiln_status refs(dec *d, const msgpack_object *o, kiln_msg_refs *r)
{
    const msgpack_object *a;
    if (array(d, o, "refs", KILN_PROTO_MAX_REFS, 1, &a))
        return KILN_ERR_INVALID;
    for (uint32_t i = 0; i < a->via.array.size; i++)
        if (tensor_ref(d, &a->via.array.ptr[i], &r->refs[r->n++]))
            return kiln_err_wrap(d->err, "refs[%u]", i);
    return KILN_OK;
}

static kiln_status job_encode(dec *d, const msgpack_object *o, kiln_job_encode *e)
{
    const msgpack_object *p, *neg, *refs;
    if (array(d, o, "prompts", KILN_PROTO_MAX_PROMPTS, 1, &p) ||
        get_int(d, o, "max_seq", &e->max_seq) || array(d, o, "refs", KILN_PROTO_MAX_EDIT_REFS, 0, &refs))
        return KILN_ERR_INVALID;
    for (uint32_t i = 0; i < p->via.array.size; i++)
        if (str_of(d, &p->via.array.ptr[i], "prompts", &e->prompts[e->n_prompts++]))
            return KILN_ERR_INVALID;
    neg = get(o, "negative");
    if (neg && neg->type != MSGPACK_OBJECT_NIL && str_of(d, neg, "negative", &e->negative))
        return KILN_ERR_INVALID;
    for (uint32_t i = 0; refs && i < refs->via.array.size; i++)
        if (bin_of(d, &refs->via.array.ptr[i], "refs", &e->refs[e->n_refs++]))
            return KILN_ERR_INVALID;
    const msgpack_object *mask = get(o, "mask");
    if (mask && bin_of(d, mask, "mask", &e->mask))
        return KILN_ERR_INVALID;
    if (e->mask.len && e->n_refs != 1)
        return bad(d, "mask", "needs exactly one reference");
    if (get(o, "start") && get_bool(d, o, "start", &e->start))
        return KILN_ERR_INVALID;
    if (e->start && e->n_refs != 1)
        return bad(d, "start", "needs exactly one reference");
    return KILN_OK;
}

static kiln_status job_denoise(dec *d, const msgpack_object *o, kiln_job_denoise *j)
{
    const msgpack_object *seeds, *g;
    double guidance;
    if (get_int(d, o, "n", &j->n) || array(d, o, "seeds", KILN_PROTO_MAX_ROWS, 1, &seeds) ||
        get_int(d, o, "width", &j->width) || get_int(d, o, "height", &j->height) ||
        get_int(d, o, "steps", &j->steps) || get_bool(d, o, "batch_noise", &j->batch_noise))
        return KILN_ERR_INVALID;
    for (uint32_t i = 0; i < seeds->via.array.size; i++) {
        const msgpack_object *s = &seeds->via.array.ptr[i];
        if (s->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return bad(d, "seeds", "not an unsigned integer");
        j->seeds[j->n_seeds++] = s->via.u64;
    }
    g = get(o, "guidance");
    if (!g || num_of(d, g, "guidance", &guidance))
        return bad(d, "guidance", "missing or not a number");
    j->guidance = (float)guidance;
    g = get(o, "strength");
    if (g && (num_of(d, g, "strength", &j->strength) ||
              !(j->strength == 0 || (j->strength > 0 && j->strength <= 1))))
        return bad(d, "strength", "not 0 or a number in (0, 1]");
    g = get(o, "previews");
    if (g && get_int(d, o, "previews", &j->previews))
        return KILN_ERR_INVALID;
    return KILN_OK;
}

static kiln_status job_decode(dec *d, const msgpack_object *o, kiln_job_decode *j)
{
    char fmt[16];
    int imgk = 0;
    if (get_int(d, o, "width", &j->width) || get_int(d, o, "height", &j->height) ||
        get_int(d, o, "compression", &j->compression) ||
        get_name(d, o, "format", fmt, sizeof fmt) ||
        (get(o, "imgk") && get_int(d, o, "imgk", &imgk)))
        return KILN_ERR_INVALID;
    if (kiln_image_format_parse(fmt, &j->format))
        return bad(d, "format", "unknown");
    if (imgk < 0)
        return bad(d, "imgk", "out of range");
    j->image_kinds = (unsigned)imgk;
    return KILN_OK;
}

/* The job's fetch sources (optional: none). */
static kiln_status job_src(dec *d, const msgpack_object *o, kiln_msg_job *j)
{
    const msgpack_object *a;
    if (array(d, o, "src", KILN_PROTO_MAX_TENSORS, 0, &a))
        return KILN_ERR_INVALID;
    for (uint32_t i = 0; a && i < a->via.array.size; i++) {
        const msgpack_object *e = &a->via.array.ptr[i];
        kiln_fetch_src *s = &j->src[j->n_src++];
        if (e->type != MSGPACK_OBJECT_MAP || get_name(d, e, "owner", s->owner, sizeof s->owner) ||
            get_str(d, e, "ep", &s->endpoint) || get_str(d, e, "key", &s->key))
            return bad(d, "src", "not a map of owner, ep and key");
    }
    return KILN_OK;
}

static kiln_status job(dec *d, const msgpack_object *o, kiln_msg_job *j)
{
    char stage[16];
    int outk = 0;
    if (get_u64(d, o, "job", &j->job) || get_name(d, o, "stage", stage, sizeof stage))
        return KILN_ERR_INVALID;
    if (get(o, "outk") && get_int(d, o, "outk", &outk))
        return KILN_ERR_INVALID;
    if (outk < 0)
        return bad(d, "outk", "out of range");
    j->out_kinds = (unsigned)outk;
    if (job_src(d, o, j))
        return KILN_ERR_INVALID;
    if (kiln_stage_parse(stage, &j->stage))
        return bad(d, "stage", "unknown");
    if (ref_map(d, o, "in", 0, &j->in))
        return KILN_ERR_INVALID;
    switch (j->stage) {
    case KILN_STAGE_ENCODE: return job_encode(d, o, &j->encode);
    case KILN_STAGE_DENOISE: return job_denoise(d, o, &j->denoise);
    default: return job_decode(d, o, &j->decode);
    }
}

static kiln_status extract(dec *d, const msgpack_object *o, kiln_msg *m)
{
    char t[16];
    if (o->type != MSGPACK_OBJECT_MAP)
        return bad(d, "message", "not a map");
    if (get_name(d, o, "t", t, sizeof t) || kiln_msg_type_parse(t, &m->type))
        return bad(d, "t", "missing or unknown message type");
    if (get_u64(d, o, "epoch", &m->epoch))
        return KILN_ERR_INVALID;
    switch (m->type) {
    case KILN_MSG_HELLO: return hello(d, o, &m->hello);
    case KILN_MSG_READY: return get_int(d, o, "credits", &m->ready.credits);
    case KILN_MSG_HB:
        return get_u64(d, o, "progress", &m->progress) ||
                       get_u64(d, o, "shm_short", &m->shm_short) ||
                       opt_u64(d, o, "rss", &m->rss) || opt_u64(d, o, "dev_used", &m->dev_used) ||
                       opt_u64(d, o, "dev_total", &m->dev_total)
                   ? KILN_ERR_INVALID
                   : KILN_OK;
    case KILN_MSG_DONE: return done(d, o, &m->done);
    case KILN_MSG_PARTIAL:
        m->done.ok = 1;
        return get_u64(d, o, "job", &m->done.job) || get_int(d, o, "preview", &m->done.preview) ||
                       ref_map(d, o, "out", 0, &m->done.out)
                   ? KILN_ERR_INVALID
                   : KILN_OK;
    case KILN_MSG_RELEASE:
    case KILN_MSG_FREE:
    case KILN_MSG_FETCH: return refs(d, o, &m->refs);
    case KILN_MSG_JOB: return job(d, o, &m->job);
    case KILN_MSG_CANCEL: return get_u64(d, o, "job", &m->cancel_job);
    case KILN_MSG_FENCED:
    case KILN_MSG_LEAVING: return KILN_OK;
    case KILN_MSG_BYE: return get_str(d, o, "reason", &m->bye_reason);
    case KILN_MSG_GONE:
        if (get_str(d, o, "replica", &m->gone.replica) ||
            get_u64(d, o, "incarnation", &m->gone.incarnation))
            return KILN_ERR_INVALID;
        return KILN_OK;
    case KILN_MSG_TYPE_END: break;
    }
    return bad(d, "t", "unknown message type");
}

/* The message and its arena in one block. */
typedef struct msg_block {
    kiln_msg msg;
    char arena[];
} msg_block;

kiln_msg *kiln_msg_decode(const void *frame, size_t len, kiln_err *err)
{
    kiln_err local;
    if (!err)
        err = &local;
    if (!frame || len == 0 || len > KILN_PROTO_MAX_FRAME) {
        kiln_err_set(err, KILN_ERR_INVALID, "empty or oversized frame (%zu bytes)", len);
        return NULL;
    }
    scan s = {.p = frame, .end = (const uint8_t *)frame + len};
    if (scan_obj(&s, 0) || s.p != s.end) {
        kiln_err_set(err, KILN_ERR_INVALID, "not one well-formed msgpack object");
        return NULL;
    }
    msg_block *b = calloc(1, sizeof *b + s.payload + s.strings);
    if (!b) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory decoding a message");
        return NULL;
    }
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    msgpack_unpack_return rc = msgpack_unpack_next(&up, frame, len, &off);
    kiln_status st = KILN_OK;
    if (rc == MSGPACK_UNPACK_NOMEM_ERROR) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory decoding a message");
    } else if (rc != MSGPACK_UNPACK_SUCCESS || off != len) {
        st = kiln_err_set(err, KILN_ERR_INVALID, "not one well-formed msgpack object");
    } else {
        dec d = {.arena = b->arena, .cap = s.payload + s.strings, .err = err};
        st = extract(&d, &up.data, &b->msg);
        if (st)
            kiln_err_wrap(err, "%s", kiln_msg_type_name(b->msg.type) ? kiln_msg_type_name(b->msg.type)
                                                                    : "message");
        else
            st = kiln_msg_check(&b->msg, err);
    }
    msgpack_unpacked_destroy(&up);
    if (st) {
        free(b);
        return NULL;
    }
    return &b->msg;
}

void kiln_msg_free(kiln_msg *m)
{
    /* msg is the first member of its block. */
    free(m);
}
