#include "soak_traffic.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "services/gateway/base64.h"

/* --- random numbers: splitmix64, one stream per (run seed, purpose, index) */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t next(rng *g)
{
    uint64_t z = (g->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static rng stream(uint64_t seed, uint64_t purpose, uint64_t index)
{
    rng g = {seed * 0x100000001b3ull ^ purpose << 56 ^ index};
    next(&g);
    return g;
}

static double u01(rng *g) { return (double)(next(g) >> 11) * 0x1.0p-53; }

enum { S_REQUEST = 1, S_POOL, S_PICK, S_LEAVE, S_REF };

uint64_t kiln_soak_fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* --- references ---------------------------------------------------------- */

/* Reference i: smooth gradients and rings (something a VAE encodes into
 * varied latents), its size and format drawn from the run's seed. */
static kiln_status make_ref(const kiln_soak_opts *o, int i, kiln_soak_ref *ref, kiln_err *err)
{
    rng g = stream(o->seed, S_REF, (uint64_t)i);
    int lo = 64, hi = o->max_side > lo ? o->max_side : lo;
    int w = lo + (int)(next(&g) % (uint64_t)(hi - lo + 1));
    int h = lo + (int)(next(&g) % (uint64_t)(hi - lo + 1));
    if (w > 3 * h) /* the klein pipeline takes aspect ratios up to 8; stay well inside */
        w = 3 * h;
    if (h > 3 * w)
        h = 3 * w;
    kiln_image im = {0};
    kiln_status st = kiln_image_alloc(&im, w, h, err);
    if (st)
        return st;
    unsigned a = (unsigned)(next(&g) & 255), ring = 24 + (unsigned)(next(&g) % 64);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint8_t *p = im.pixels + 3 * ((size_t)y * (size_t)w + (size_t)x);
            unsigned dx = (unsigned)abs(x - w / 2), dy = (unsigned)abs(y - h / 3);
            p[0] = (uint8_t)(a + (unsigned)(255 * x / w));
            p[1] = (uint8_t)(255 * y / h);
            p[2] = (uint8_t)(((dx * dx + dy * dy) / ring) & 255);
        }
    kiln_image_encode_opts eo = KILN_IMAGE_ENCODE_DEFAULTS;
    eo.format = (kiln_image_format)(i % 3);
    eo.quality = 90;
    ref->format = eo.format;
    ref->width = w, ref->height = h;
    st = kiln_image_encode(&im, &eo, &ref->bytes, err);
    kiln_image_free(&im);
    ref->hash = kiln_soak_fnv(KILN_SOAK_FNV, ref->bytes.data, ref->bytes.len);
    return st;
}

kiln_soak_traffic *kiln_soak_traffic_create(const kiln_soak_opts *o, const kiln_bench_prompts *p,
                                            kiln_err *err)
{
    kiln_soak_traffic *t = calloc(1, sizeof *t);
    if (!t) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    t->o = o;
    t->prompts = p;
    for (int i = 0; i < KILN_SOAK_REFS; i++)
        if (make_ref(o, i, &t->refs[i], err)) {
            kiln_soak_traffic_destroy(t);
            return NULL;
        }
    return t;
}

void kiln_soak_traffic_destroy(kiln_soak_traffic *t)
{
    if (!t)
        return;
    for (int i = 0; i < KILN_SOAK_REFS; i++)
        kiln_buf_free(&t->refs[i].bytes);
    free(t);
}

/* --- requests ------------------------------------------------------------ */

static int side(const kiln_soak_opts *o, rng *g)
{
    uint64_t steps = (uint64_t)((o->max_side - o->min_side) / 16 + 1);
    return o->min_side + 16 * (int)(next(g) % steps);
}

static void draw(const kiln_soak_traffic *t, rng *g, kiln_soak_req *r)
{
    const kiln_soak_opts *o = t->o;
    r->width = side(o, g);
    r->height = next(g) % 5 < 2 ? r->width : side(o, g);
    static const int n_of[8] = {1, 1, 1, 1, 2, 2, 3, 4}; /* smaller batches likelier */
    r->n = n_of[next(g) % 8];
    if (r->n > o->max_n)
        r->n = o->max_n;
    static const kiln_image_format fmt[4] = {KILN_IMAGE_PNG, KILN_IMAGE_PNG, KILN_IMAGE_JPEG,
                                             KILN_IMAGE_WEBP};
    r->format = fmt[next(g) % 4];
    r->seed = next(g) & 0xffffffffu;
    r->prompt = (int)(next(g) % t->prompts->n);
    r->edit = u01(g) < o->edits;
    r->n_refs = 0;
    if (r->edit) {
        r->n_refs = 1 + (int)(next(g) % (uint64_t)o->max_refs);
        for (int i = 0; i < r->n_refs; i++)
            r->refs[i] = (int)(next(g) % KILN_SOAK_REFS);
    }
}

void kiln_soak_traffic_request(const kiln_soak_traffic *t, uint64_t k, kiln_soak_req *r)
{
    memset(r, 0, sizeof *r);
    r->k = k;
    r->pool_index = -1;
    if (t->o->pool > 0) {
        rng pick = stream(t->o->seed, S_PICK, k);
        kiln_soak_traffic_pool_entry(t, (int)(next(&pick) % (uint64_t)t->o->pool), r);
        r->k = k;
    } else {
        rng g = stream(t->o->seed, S_REQUEST, k);
        draw(t, &g, r);
    }
    rng leave = stream(t->o->seed, S_LEAVE, k);
    r->leave = u01(&leave) < t->o->disconnects;
    r->leave_after_s = u01(&leave) * t->o->disconnect_max_s;
}

void kiln_soak_traffic_pool_entry(const kiln_soak_traffic *t, int p, kiln_soak_req *r)
{
    memset(r, 0, sizeof *r);
    r->pool_index = p;
    rng g = stream(t->o->seed, S_POOL, (uint64_t)p);
    draw(t, &g, r);
}

void kiln_soak_traffic_first(const kiln_soak_traffic *t, int w, int h, kiln_soak_req *r)
{
    (void)t;
    memset(r, 0, sizeof *r);
    r->pool_index = -1;
    r->width = w, r->height = h, r->n = 1;
    r->format = KILN_IMAGE_PNG;
}

const char *kiln_soak_req_path(const kiln_soak_req *r)
{
    return r->edit ? "/v1/images/edits" : "/v1/images/generations";
}

/* The request's fields as (name, value) text pairs, in one order for both
 * body kinds.  Returns how many. */
static int fields(const kiln_soak_traffic *t, const kiln_soak_req *r, char val[8][48],
                  const char *name[8])
{
    int n = 0;
    name[n] = "size", snprintf(val[n++], 48, "%dx%d", r->width, r->height);
    name[n] = "seed", snprintf(val[n++], 48, "%llu", (unsigned long long)r->seed);
    name[n] = "n", snprintf(val[n++], 48, "%d", r->n);
    if (t->o->steps)
        name[n] = "num_inference_steps", snprintf(val[n++], 48, "%d", t->o->steps);
    if (t->o->max_seq)
        name[n] = "max_sequence_length", snprintf(val[n++], 48, "%d", t->o->max_seq);
    name[n] = "output_format", snprintf(val[n++], 48, "%s", kiln_image_format_name(r->format));
    name[n] = "response_format", snprintf(val[n++], 48, "b64_json");
    return n;
}

static kiln_status add(kiln_buf *b, const char *s, kiln_err *err)
{
    return kiln_buf_append(b, s, strlen(s), err);
}

kiln_status kiln_soak_traffic_body(const kiln_soak_traffic *t, const kiln_soak_req *r,
                                   kiln_buf *out, char *ctype, size_t cap, kiln_err *err)
{
    char val[8][48];
    const char *name[8];
    int nf = fields(t, r, val, name);
    const char *prompt = t->prompts->v[r->prompt];
    kiln_buf_clear(out);
    if (!r->edit) {
        snprintf(ctype, cap, "application/json");
        cJSON *j = cJSON_CreateObject();
        int ok = j && cJSON_AddStringToObject(j, "prompt", prompt);
        for (int i = 0; ok && i < nf; i++) {
            /* numbers as numbers, the rest as strings */
            int num = strcmp(name[i], "size") && strcmp(name[i], "output_format") &&
                      strcmp(name[i], "response_format");
            ok = num ? cJSON_AddNumberToObject(j, name[i], strtod(val[i], NULL)) != NULL
                     : cJSON_AddStringToObject(j, name[i], val[i]) != NULL;
        }
        char *text = ok ? cJSON_PrintUnformatted(j) : NULL;
        cJSON_Delete(j);
        if (!text)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        kiln_status st = add(out, text, err);
        cJSON_free(text);
        return st;
    }
    char boundary[64], part[256];
    snprintf(boundary, sizeof boundary, "kiln-soak-%016llx", (unsigned long long)r->k);
    snprintf(ctype, cap, "multipart/form-data; boundary=%s", boundary);
    kiln_status st = KILN_OK;
    for (int i = -1; !st && i < nf; i++) {
        snprintf(part, sizeof part, "--%s\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n",
                 boundary, i < 0 ? "prompt" : name[i]);
        if (!(st = add(out, part, err)) && !(st = add(out, i < 0 ? prompt : val[i], err)))
            st = add(out, "\r\n", err);
    }
    for (int i = 0; !st && i < r->n_refs; i++) {
        const kiln_soak_ref *ref = &t->refs[r->refs[i]];
        snprintf(part, sizeof part,
                 "--%s\r\nContent-Disposition: form-data; name=\"image[]\"; filename=\"ref%d.%s\"\r\n"
                 "Content-Type: %s\r\n\r\n",
                 boundary, r->refs[i], kiln_image_format_name(ref->format),
                 kiln_image_format_mime(ref->format));
        if (!(st = add(out, part, err)) &&
            !(st = kiln_buf_append(out, ref->bytes.data, ref->bytes.len, err)))
            st = add(out, "\r\n", err);
    }
    if (!st) {
        snprintf(part, sizeof part, "--%s--\r\n", boundary);
        st = add(out, part, err);
    }
    return st;
}

/* --- answers ------------------------------------------------------------- */

void kiln_soak_images_free(kiln_soak_images *im)
{
    for (int i = 0; i < KILN_SOAK_MAX_N; i++)
        kiln_buf_free(&im->files[i]);
    im->n = 0;
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The file's first bytes against the requested format (and PNG size). */
static kiln_status check_file(const kiln_soak_req *r, const kiln_buf *f, kiln_err *err)
{
    const uint8_t *h = f->data;
    if (f->len < 24)
        return kiln_err_set(err, KILN_ERR_INVALID, "an image of %zu bytes", f->len);
    if (r->format == KILN_IMAGE_PNG) {
        if (memcmp(h, "\x89PNG\r\n\x1a\n", 8) || memcmp(h + 12, "IHDR", 4))
            return kiln_err_set(err, KILN_ERR_INVALID, "not a PNG");
        if (be32(h + 16) != (uint32_t)r->width || be32(h + 20) != (uint32_t)r->height)
            return kiln_err_set(err, KILN_ERR_INVALID, "PNG is %ux%u, asked for %dx%d",
                                be32(h + 16), be32(h + 20), r->width, r->height);
    } else if (r->format == KILN_IMAGE_JPEG) {
        if (memcmp(h, "\xff\xd8\xff", 3))
            return kiln_err_set(err, KILN_ERR_INVALID, "not a JPEG");
    } else if (memcmp(h, "RIFF", 4) || memcmp(h + 8, "WEBP", 4)) {
        return kiln_err_set(err, KILN_ERR_INVALID, "not a WebP");
    }
    return KILN_OK;
}

kiln_status kiln_soak_check(const kiln_soak_req *r, int status, const kiln_buf *body,
                            kiln_soak_images *im, kiln_err *err)
{
    memset(im, 0, sizeof *im);
    cJSON *j = cJSON_ParseWithLength((const char *)body->data, body->len);
    kiln_status st = KILN_OK;
    if (status != 200) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(e, "message");
        st = kiln_err_set(err, KILN_ERR_INVALID, "HTTP %d: %s", status,
                          cJSON_IsString(m) ? m->valuestring : "(no OpenAI error body)");
        cJSON_Delete(j);
        return st;
    }
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(j, "data");
    if (!j)
        st = kiln_err_set(err, KILN_ERR_INVALID, "the body is not JSON");
    else if (!cJSON_IsArray(data) || cJSON_GetArraySize(data) != r->n)
        st = kiln_err_set(err, KILN_ERR_INVALID, "not %d images in data", r->n);
    for (int i = 0; !st && i < r->n; i++) {
        const cJSON *img = cJSON_GetArrayItem(data, i);
        const cJSON *b64 = cJSON_GetObjectItemCaseSensitive(img, "b64_json");
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(img, "seed");
        if (!cJSON_IsString(b64))
            st = kiln_err_set(err, KILN_ERR_INVALID, "data[%d] has no b64_json", i);
        else if (!cJSON_IsNumber(s) || s->valuedouble != (double)(r->seed + (uint64_t)i))
            st = kiln_err_set(err, KILN_ERR_INVALID, "data[%d].seed is not %llu", i,
                              (unsigned long long)(r->seed + (uint64_t)i));
        else if (!(st = kiln_base64_decode(b64->valuestring, strlen(b64->valuestring),
                                           &im->files[i], err)))
            st = check_file(r, &im->files[i], err);
        im->n = i + 1;
    }
    cJSON_Delete(j);
    return st;
}
