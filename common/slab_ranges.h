/* First-fit byte ranges of one slab: the pool behind the shm and cuda_ipc
 * transports (common/slab_table.h).  Only offsets are kept here; the slab's
 * memory belongs to the caller.
 *
 *   kiln_slab_ranges r;
 *   if (kiln_slab_ranges_init(&r, slab_size)) ...out of memory...
 *   uint64_t off;
 *   if (!kiln_slab_ranges_take(&r, 4096, gen, &off)) { ...use [off, off + 4096)... }
 *   kiln_slab_ranges_give(&r, off, 4096, gen);
 *   kiln_slab_ranges_release(&r);
 *
 * Each live range remembers the generation it was taken with, and only a
 * give naming the same offset, length and generation returns it: a stale
 * give (of a range freed and taken again since) changes nothing.  Freed
 * ranges merge with their free neighbours, so a slab whose ranges all
 * came back is one free range again.  Thread-safety: none; the slab table
 * holds its mutex around every call.
 */
#ifndef KILN_SLAB_RANGES_H
#define KILN_SLAB_RANGES_H

#include <stdint.h>

typedef struct kiln_range {
    uint64_t off, len;
    uint64_t gen; /* live ranges: the generation it was taken with */
} kiln_range;

typedef struct kiln_range_list {
    kiln_range *v;
    int n, cap;
} kiln_range_list;

typedef struct kiln_slab_ranges {
    kiln_range_list free; /* sorted by offset, never adjacent */
    kiln_range_list used; /* live ranges, any order */
} kiln_slab_ranges;

/* One free range [0, size).  Returns 0, or -1 when out of memory. */
int kiln_slab_ranges_init(kiln_slab_ranges *r, uint64_t size);
/* Takes the first free range that fits `len` bytes and records it as live
 * with generation `gen`.  Returns 0 with *off set, or -1 when nothing fits
 * (or out of memory). */
int kiln_slab_ranges_take(kiln_slab_ranges *r, uint64_t len, uint64_t gen, uint64_t *off);
/* Returns the live range [off, off + len) of generation `gen` to the free
 * list.  Returns 0, 1 when there is no such live range (a double, stale or
 * foreign free: nothing changes), or -1 when out of memory (the range
 * stays live). */
int kiln_slab_ranges_give(kiln_slab_ranges *r, uint64_t off, uint64_t len, uint64_t gen);
/* Bytes in live ranges; *live receives their count. */
uint64_t kiln_slab_ranges_used(const kiln_slab_ranges *r, int *live);
/* Frees the lists (not the slab). */
void kiln_slab_ranges_release(kiln_slab_ranges *r);

#endif
