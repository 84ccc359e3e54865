/* The prompt-embedding cache of the encode stage: a least-recently-used map
 * from (prompt bytes, max_seq) to one row's text embedding, held in host
 * memory and bounded in bytes.  A row of Qwen3 output depends on nothing
 * else for a given loaded stage, so services that see a prompt again (other
 * seeds, the negative prompt of CFG models, retries) upload it instead of
 * recomputing it.
 *
 *   kiln_prompt_cache *c = kiln_prompt_cache_create(256u << 20, &err);
 *   size_t n;
 *   const void *row = kiln_prompt_cache_get(c, prompt, strlen(prompt), 512, &n);
 *   if (!row && kiln_prompt_cache_accepts(c, prompt, strlen(prompt), 512, bytes)) {
 *       void *v = malloc(bytes);  ... fill v ...
 *       kiln_prompt_cache_put(c, prompt, strlen(prompt), 512, v, bytes, &err);  // takes v
 *   }
 *   kiln_prompt_cache_destroy(c);
 *
 * Admission: a key enters the cache only on its second miss.  Most prompts
 * of a service are seen once, and producing a value to store costs the
 * caller (the encode stage downloads and converts a 7.5 MB row per klein-4B
 * prompt), so get remembers the keys it missed (about the last 4096, in
 * 40 KiB) and accepts/put admit only a key missed before: a prompt seen
 * once costs nothing, a prompt seen twice is stored, a third sight hits.
 *
 * Values are opaque bytes; the encode stage stores rows in the backend's
 * activation dtype.  The byte bound counts keys, values and per-entry
 * bookkeeping; an entry larger than the bound is not stored, and a bound of
 * 0 stores nothing.
 *
 * Thread-safety: none.  A cache belongs to its encode stage's thread (a
 * get reorders the LRU list, so even lookups mutate it).
 */
#ifndef KILN_ENGINE_PROMPT_CACHE_H
#define KILN_ENGINE_PROMPT_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

/* kiln-encoder's default bound: 34 klein-4B rows of 512 tokens. */
#define KILN_PROMPT_CACHE_DEFAULT_MIB 256

typedef struct kiln_prompt_cache kiln_prompt_cache;

typedef struct kiln_prompt_cache_stats {
    uint64_t hits, misses; /* kiln_prompt_cache_get results */
    uint64_t deferred;     /* misses of a key not missed before (or forgotten by
                            * the filter): not admitted, so not stored */
    uint64_t evictions;    /* entries dropped to make room */
    uint64_t rejected;     /* puts not stored: not admitted, too big, bound 0,
                            * out of memory */
    size_t entries;
    size_t bytes;          /* held now, as counted against max_bytes */
    size_t max_bytes;
} kiln_prompt_cache_stats;

/* A cache holding at most max_bytes.  NULL with err set (KILN_ERR_NOMEM).
 * The caller owns it. */
kiln_prompt_cache *kiln_prompt_cache_create(size_t max_bytes, kiln_err *err);
/* Frees every entry; accepts NULL. */
void kiln_prompt_cache_destroy(kiln_prompt_cache *c);

/* The value stored for (prompt[0..len), max_seq), or NULL.  A hit becomes
 * the most recently used entry.  The pointer stays valid until the next
 * put or destroy; *value_len receives its size on a hit.  A miss is
 * remembered by the admission filter (nothing is when the bound is 0),
 * which admits the key from its next miss on. */
const void *kiln_prompt_cache_get(kiln_prompt_cache *c, const char *prompt, size_t len,
                                  int max_seq, size_t *value_len);

/* 1 when an entry of this key and value size would be stored: it fits the
 * bound and the key is admitted (get missed it at least twice while the
 * filter remembered it), so a caller can skip producing a value that would
 * be dropped.  Changes nothing. */
int kiln_prompt_cache_accepts(const kiln_prompt_cache *c, const char *prompt, size_t len,
                              int max_seq, size_t value_len);

/* Stores `value` (malloc'd, value_len bytes) for the key when
 * kiln_prompt_cache_accepts says so, replacing an entry of the same key,
 * and evicts least-recently-used entries until the bound holds.  Always
 * takes ownership of `value`: it is freed here when the entry is not
 * stored (not admitted, too big, bound 0; the cache is unchanged) or on
 * failure.  Returns KILN_OK when stored or deliberately not stored,
 * KILN_ERR_NOMEM with err set when the entry could not be allocated (the
 * cache is unchanged). */
kiln_status kiln_prompt_cache_put(kiln_prompt_cache *c, const char *prompt, size_t len,
                                  int max_seq, void *value, size_t value_len, kiln_err *err);

/* Counters since creation and the current size. */
void kiln_prompt_cache_get_stats(const kiln_prompt_cache *c, kiln_prompt_cache_stats *out);

#endif
