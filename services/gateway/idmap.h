/* kiln id map: uint64 job ids to pointers, for the gateway's job table.
 *
 *   kiln_idmap m = {0};
 *   if (kiln_idmap_put(&m, id, job, &err)) ...
 *   job = kiln_idmap_get(&m, id);     // NULL when absent
 *   kiln_idmap_del(&m, id);
 *   kiln_idmap_free(&m);
 *
 * Open addressing with linear probing and backward-shift deletion (no
 * tombstones, so lookups stay short however many jobs come and go); the
 * table doubles at 50% load.  Id 0 is reserved (never a key).  A zeroed
 * struct is an empty map.  Not thread-safe.
 */
#ifndef KILN_GW_IDMAP_H
#define KILN_GW_IDMAP_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct kiln_idmap_slot {
    uint64_t key;
    void *value;
} kiln_idmap_slot;

typedef struct kiln_idmap {
    kiln_idmap_slot *slots;
    size_t cap; /* a power of two, or 0 */
    size_t count;
} kiln_idmap;

/* Adds or replaces.  KILN_ERR_NOMEM (the map is unchanged), _INVALID for
 * key 0. */
kiln_status kiln_idmap_put(kiln_idmap *m, uint64_t key, void *value, kiln_err *err);
void *kiln_idmap_get(const kiln_idmap *m, uint64_t key);
/* Returns the removed value, or NULL. */
void *kiln_idmap_del(kiln_idmap *m, uint64_t key);
void kiln_idmap_free(kiln_idmap *m);

#endif
