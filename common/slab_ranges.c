#include "slab_ranges.h"

#include <stdlib.h>
#include <string.h>

static int list_insert(kiln_range_list *l, int at, kiln_range r)
{
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 8;
        kiln_range *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v)
            return -1;
        l->v = v, l->cap = cap;
    }
    memmove(&l->v[at + 1], &l->v[at], (size_t)(l->n - at) * sizeof *l->v);
    l->v[at] = r;
    l->n++;
    return 0;
}

static void list_remove(kiln_range_list *l, int at)
{
    memmove(&l->v[at], &l->v[at + 1], (size_t)(l->n - at - 1) * sizeof *l->v);
    l->n--;
}

int kiln_slab_ranges_init(kiln_slab_ranges *r, uint64_t size)
{
    memset(r, 0, sizeof *r);
    return list_insert(&r->free, 0, (kiln_range){0, size, 0});
}

int kiln_slab_ranges_take(kiln_slab_ranges *r, uint64_t len, uint64_t gen, uint64_t *off)
{
    for (int i = 0; i < r->free.n; i++) {
        kiln_range *f = &r->free.v[i];
        if (f->len < len)
            continue;
        if (list_insert(&r->used, r->used.n, (kiln_range){f->off, len, gen}))
            return -1;
        *off = f->off;
        f->off += len, f->len -= len;
        if (!f->len)
            list_remove(&r->free, i);
        return 0;
    }
    return -1;
}

/* [off, off+len) into the free list, merged with its neighbours. */
static int free_insert(kiln_range_list *fl, uint64_t off, uint64_t len)
{
    int i = 0;
    while (i < fl->n && fl->v[i].off < off)
        i++;
    kiln_range *prev = i > 0 ? &fl->v[i - 1] : NULL;
    kiln_range *next = i < fl->n ? &fl->v[i] : NULL;
    if (prev && prev->off + prev->len == off) {
        prev->len += len;
        if (next && off + len == next->off) {
            prev->len += next->len;
            list_remove(fl, i);
        }
        return 0;
    }
    if (next && off + len == next->off) {
        next->off = off, next->len += len;
        return 0;
    }
    return list_insert(fl, i, (kiln_range){off, len, 0});
}

int kiln_slab_ranges_give(kiln_slab_ranges *r, uint64_t off, uint64_t len, uint64_t gen)
{
    for (int u = 0; u < r->used.n; u++) {
        if (r->used.v[u].off != off || r->used.v[u].len != len || r->used.v[u].gen != gen)
            continue;
        if (free_insert(&r->free, off, len))
            return -1;
        list_remove(&r->used, u);
        return 0;
    }
    return 1;
}

uint64_t kiln_slab_ranges_used(const kiln_slab_ranges *r, int *live)
{
    uint64_t bytes = 0;
    for (int u = 0; u < r->used.n; u++)
        bytes += r->used.v[u].len;
    *live = r->used.n;
    return bytes;
}

void kiln_slab_ranges_release(kiln_slab_ranges *r)
{
    free(r->free.v), free(r->used.v);
    memset(r, 0, sizeof *r);
}
