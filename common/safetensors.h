/* kiln safetensors reader: memory-mapped, validated, shard-aware.
 *
 *   kiln_err err = {0};
 *   kiln_st *st = kiln_st_open("ckpt/transformer", "transformer", &err);
 *   if (!st) die(err.msg);
 *   const kiln_st_tensor *w = kiln_st_find(st, "proj_out.weight");
 *   // w->dtype, w->ndim, w->shape, w->data (read-only, valid until close)
 *   kiln_st_close(st);
 *
 * kiln_st_open accepts a single `.safetensors` file, a
 * `*.safetensors.index.json` (its weight_map names the shards, opened from
 * the same folder), or a folder (which must hold exactly one index or one
 * .safetensors file).  Every header is validated before any tensor is
 * exposed: well-formed JSON, known dtype, shape product times dtype size equal
 * to the byte range, ranges inside the file, no overlaps, and, for shards,
 * every tensor in the file its index names.  A truncated or hostile file is a
 * KILN_ERR_FORMAT error, never a crash.
 *
 * `label` names the set in error messages instead of the path ("vae"), so
 * messages can reach clients without leaking paths; pass NULL to use the file
 * name.  A kiln_st is read-only after open and safe to share between threads.
 */
#ifndef KILN_SAFETENSORS_H
#define KILN_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "tensor.h"

typedef struct kiln_st kiln_st;

typedef struct kiln_st_tensor {
    const char *name;
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    const void *data; /* into the read-only mapping */
    size_t nbytes;
} kiln_st_tensor;

/* Opens and validates; returns NULL with err set (KILN_ERR_NOT_FOUND, _IO,
 * _FORMAT, _NOMEM).  The caller owns the result. */
kiln_st *kiln_st_open(const char *path, const char *label, kiln_err *err);
void kiln_st_close(kiln_st *st);

/* Looks a tensor up by name; NULL when absent. */
const kiln_st_tensor *kiln_st_find(const kiln_st *st, const char *name);
size_t kiln_st_count(const kiln_st *st);
/* Tensors in a stable order (sorted by name); i < kiln_st_count(). */
const kiln_st_tensor *kiln_st_at(const kiln_st *st, size_t i);

/* Finds `name` and checks its rank and shape (ndim entries); a missing tensor
 * is KILN_ERR_NOT_FOUND and a mismatch KILN_ERR_FORMAT, both naming the
 * tensor and the label.  Returns NULL on failure. */
const kiln_st_tensor *kiln_st_expect(const kiln_st *st, const char *name, int ndim,
                                     const int64_t *shape, kiln_err *err);

/* Writer, for tools and tests: tensors given as host buffers, written as one
 * file with a sorted, 8-byte-aligned header.  Returns KILN_OK or _IO. */
typedef struct kiln_st_entry {
    const char *name;
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    const void *data;
} kiln_st_entry;

kiln_status kiln_st_write(const char *path, const kiln_st_entry *entries, size_t n,
                          kiln_err *err);

/* Streaming writer for files too large to hold in memory (the checkpoint
 * maker): an entry whose data is NULL gets its bytes from `fill`, called
 * with consecutive chunks of that tensor (offset 0 first, then in order,
 * at most a few MiB each, whole elements).  Tensors are written in name
 * order; `index` is the entry's position in `entries`.  A failed write
 * removes the partial file.  Returns KILN_OK, _INVALID (bad entry, duplicate
 * name), _IO, or what `fill` returned. */
typedef kiln_status (*kiln_st_fill_fn)(void *ctx, size_t index, size_t offset, void *buf,
                                       size_t nbytes, kiln_err *err);
kiln_status kiln_st_write_stream(const char *path, const kiln_st_entry *entries, size_t n,
                                 kiln_st_fill_fn fill, void *ctx, kiln_err *err);

#endif
