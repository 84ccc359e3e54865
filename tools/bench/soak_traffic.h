/* kiln-soak's requests: what request k of a run is, its HTTP body, the
 * edit references it sends, and the check of its answer.
 *
 *   kiln_soak_traffic *t = kiln_soak_traffic_create(&opts, &prompts, &err);
 *   kiln_soak_req r;
 *   kiln_soak_traffic_request(t, k, &r);          // the same k gives the same r
 *   kiln_buf body = {0}; char ctype[128];
 *   kiln_soak_traffic_body(t, &r, &body, ctype, sizeof ctype, &err);
 *   ... POST it to kiln_soak_req_path(&r) ...
 *   kiln_soak_images im;
 *   kiln_soak_check(t, &r, status, &resp, &im, &err);   // 200 with r.n right images
 *   kiln_soak_images_free(&im); kiln_soak_traffic_destroy(t);
 *
 * Everything follows from opts.seed through splitmix64: request k's kind
 * (generation, or an edit with 1..max_refs references), size (sides
 * multiples of 16 in min_side..max_side, two in five square), n (1..max_n,
 * smaller ones likelier), output format (png half the time, jpeg and webp a
 * quarter each), seed and prompt, and whether its client leaves mid-way.
 * With opts.pool > 0 the request is one of `pool` distinct ones, picked by
 * k (the leaving is still drawn per k).  The references (six per run,
 * sides 64..max_side, png, jpeg and webp) are drawn patterns encoded once
 * at creation.  The traffic object is read-only after creation:
 * thread-safe.
 */
#ifndef KILN_SOAK_TRAFFIC_H
#define KILN_SOAK_TRAFFIC_H

#include <stdint.h>

#include "bench_run.h"
#include "common/buf.h"
#include "common/error.h"
#include "common/image.h"
#include "soak_opts.h"

#define KILN_SOAK_REFS 6
#define KILN_SOAK_MAX_N 10

typedef struct kiln_soak_req {
    uint64_t k;           /* request number in the run */
    int pool_index;       /* which distinct request (-1 without a pool) */
    int edit;
    int width, height, n;
    kiln_image_format format;
    uint64_t seed;
    int prompt;           /* index into the prompt list */
    int refs[8], n_refs;  /* indices into the run's references */
    int leave;            /* the client leaves mid-request ... */
    double leave_after_s; /* ... this long after sending it */
} kiln_soak_req;

typedef struct kiln_soak_ref {
    kiln_buf bytes; /* the encoded file */
    kiln_image_format format;
    int width, height;
    uint64_t hash;  /* FNV-1a of the bytes */
} kiln_soak_ref;

typedef struct kiln_soak_traffic {
    const kiln_soak_opts *o;
    const kiln_bench_prompts *prompts;
    kiln_soak_ref refs[KILN_SOAK_REFS];
} kiln_soak_traffic;

/* Draws and encodes the references.  NULL with err: _NOMEM, or the
 * encoder's error. */
kiln_soak_traffic *kiln_soak_traffic_create(const kiln_soak_opts *o, const kiln_bench_prompts *p,
                                            kiln_err *err);
void kiln_soak_traffic_destroy(kiln_soak_traffic *t);

/* Request k of the run. */
void kiln_soak_traffic_request(const kiln_soak_traffic *t, uint64_t k, kiln_soak_req *r);
/* Pool entry p (0 <= p < opts.pool) as a request (k 0, no leaving). */
void kiln_soak_traffic_pool_entry(const kiln_soak_traffic *t, int p, kiln_soak_req *r);
/* A generation of w x h, n = 1, png, seed 0, prompt 0 (--first). */
void kiln_soak_traffic_first(const kiln_soak_traffic *t, int w, int h, kiln_soak_req *r);

/* "/v1/images/generations" or "/v1/images/edits". */
const char *kiln_soak_req_path(const kiln_soak_req *r);
/* The body (JSON for a generation, multipart/form-data with the reference
 * files for an edit) into `out` (cleared first) and its Content-Type into
 * ctype.  _NOMEM. */
kiln_status kiln_soak_traffic_body(const kiln_soak_traffic *t, const kiln_soak_req *r,
                                   kiln_buf *out, char *ctype, size_t cap, kiln_err *err);

/* FNV-1a over bytes, continuing from h (start with KILN_SOAK_FNV). */
#define KILN_SOAK_FNV 0xcbf29ce484222325ull
uint64_t kiln_soak_fnv(uint64_t h, const void *p, size_t n);

typedef struct kiln_soak_images {
    int n;
    kiln_buf files[KILN_SOAK_MAX_N];
} kiln_soak_images;

/* KILN_OK when the answer is a 200 OpenAI images body with r->n images,
 * image i reporting seed r->seed + i, each a file of r->format (PNGs of
 * r's size); their bytes go to im (free with kiln_soak_images_free, also
 * after a failure).  Otherwise KILN_ERR_INVALID with the reason (for a
 * status other than 200, the error body's message). */
kiln_status kiln_soak_check(const kiln_soak_req *r, int status, const kiln_buf *body,
                            kiln_soak_images *im, kiln_err *err);
void kiln_soak_images_free(kiln_soak_images *im);

#endif
