/* kiln-soak --verify: the CLI's bytes for every distinct request of the
 * pool, so that each image the service returns can be checked against what
 * `kiln generate` / `kiln edit` writes for the same request (docs/API.md:
 * the same parameters and seed give the same bytes).
 *
 *   kiln_soak_verify *v = kiln_soak_verify_create(&opts, traffic, &err);
 *   if (kiln_soak_verify_prepare(v, &err)) ...   // runs the CLI where not cached
 *   int same = kiln_soak_verify_image(v, &req, i, &file);  // 1, 0, or -1
 *   kiln_soak_verify_destroy(v);
 *
 * The CLI runs with --no-metadata (the service's PNGs carry no text
 * chunks).  The CLI's images are kept in opts.verify_cache under a hash of
 * everything that decides them (the model path, the --verify-arg list,
 * kind, size, n, seed, format, steps, sequence length, prompt and the
 * references' bytes), so later runs with the same settings reuse them;
 * the references are written there as ref-<hash>.<ext> for `kiln edit`.
 * The CLI's output goes to <cache>/cli.log.  Prepare runs at most two CLI
 * processes at once.  After prepare, kiln_soak_verify_image is
 * thread-safe (it reads files).
 */
#ifndef KILN_SOAK_VERIFY_H
#define KILN_SOAK_VERIFY_H

#include "common/buf.h"
#include "common/error.h"
#include "soak_traffic.h"

typedef struct kiln_soak_verify kiln_soak_verify;

/* NULL with err: _NOMEM, _IO (the cache folder cannot be made). */
kiln_soak_verify *kiln_soak_verify_create(const kiln_soak_opts *o, const kiln_soak_traffic *t,
                                          kiln_err *err);
void kiln_soak_verify_destroy(kiln_soak_verify *v);

/* Makes the CLI's images of every pool entry that the cache lacks.
 * KILN_ERR_IO when the CLI could not be run or failed (the message names
 * the entry and points at cli.log), _NOMEM. */
kiln_status kiln_soak_verify_prepare(kiln_soak_verify *v, kiln_err *err);
/* Seconds prepare spent, and how many CLI runs it made. */
double kiln_soak_verify_prepare_s(const kiln_soak_verify *v, int *runs);

/* 1 when `file` holds exactly the CLI's image i of r's pool entry, 0 when
 * not, -1 when there is no such reference file. */
int kiln_soak_verify_image(const kiln_soak_verify *v, const kiln_soak_req *r, int i,
                           const kiln_buf *file);

#endif
