/* A fixed-size thread pool for CPU work beside the backend thread (the
 * decoder's PNG/JPEG/WebP encoding).
 *
 *   kiln_pool *p = kiln_pool_create(4, &err);
 *   kiln_pool_submit(p, encode_one, task, &err);   // runs encode_one(task) on a pool thread
 *   kiln_pool_destroy(p);                           // runs what is queued, then joins
 *
 * Tasks run in submission order on whichever thread is free; a task owns
 * its argument.  Submit is thread-safe.
 */
#ifndef KILN_SERVICES_POOL_H
#define KILN_SERVICES_POOL_H

#include "common/error.h"

typedef struct kiln_pool kiln_pool;

/* The most threads a pool may have: the one bound of kiln-decoder's
 * --image-threads (a pool of that many), which kiln serve checks too
 * before passing the value on, so that both accept exactly what
 * kiln_pool_create does. */
#define KILN_POOL_MAX_THREADS 64

/* Starts `threads` (1..KILN_POOL_MAX_THREADS) threads.  NULL with err set. */
kiln_pool *kiln_pool_create(int threads, kiln_err *err);
/* Queues fn(arg).  KILN_ERR_NOMEM, or KILN_ERR_UNAVAILABLE while the pool
 * is being destroyed; the task does not run then and the caller keeps arg. */
kiln_status kiln_pool_submit(kiln_pool *p, void (*fn)(void *arg), void *arg, kiln_err *err);
/* Runs every queued task, joins the threads and frees the pool.  Accepts
 * NULL.  Must not be called from a pool thread. */
void kiln_pool_destroy(kiln_pool *p);

#endif
