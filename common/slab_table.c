/* The slab transports' shared bookkeeping: kiln_transport_ops over a
 * kiln_slab_kind's hooks. */
#include "slab_table.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "slab_ranges.h"

#define MIB ((size_t)1 << 20)
#define DEFAULT_SLAB (64 * MIB)
#define STAGE_MAX 16 /* with the NUL */

/* The ranges stay out of kiln_slab: the hooks have no business with them. */
typedef struct pool_slab {
    kiln_slab s;
    kiln_slab_ranges ranges;
    int retired; /* lost (kind->alive): no new ranges; unmade once empty */
} pool_slab;

typedef struct mapping {
    kiln_slab_map m;
    int refs;
    int doomed; /* its owner incarnation is gone: unmapped at the last close */
    uint64_t last_use;
} mapping;

typedef struct kiln_slab_table {
    const kiln_slab_kind *kind;
    const char *what; /* the kind's name, for messages */
    pthread_mutex_t mu;
    char owner[KILN_PROTO_ID_MAX];
    uint64_t epoch;    /* the owner's incarnation, in every reference */
    uint64_t next_gen; /* the last generation handed out */
    int refused;       /* frees refused */
    int lost;          /* slabs retired by kind->alive */
    size_t short_bytes; /* the last slab kind->make had no memory for; 0 once one was made */
    char stage[STAGE_MAX];
    int device;
    size_t slab_bytes, max_bytes, total;
    pool_slab **slabs; /* pointers: a kind may keep the address of a slab */
    int n_slabs, cap_slabs;
    mapping *maps;
    int n_maps, cap_maps;
    int open;       /* references opened and not closed */
    int local_open; /* those of them served by kind->local */
    uint64_t tick;
} kiln_slab_table;

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* Each range is preceded in its slab by a header that says which
 * allocation lives there: written by the producer when it hands the range
 * out, cleared when the range comes back.  A consumer reads it when it
 * opens a reference and again when it is done (kiln_transport_verify), so
 * a reference whose range was freed, or freed and handed out again, is
 * refused instead of read: the slab's memory is the arbiter, whatever the
 * messages say. */
typedef struct range_header {
    uint64_t magic; /* RANGE_LIVE while live, 0 once freed */
    uint64_t epoch, gen, len;
    uint64_t pad[4];
} range_header;
#define HDR ((uint64_t)KILN_PROTO_ALIGN)
#define RANGE_LIVE 0x026e72676e6c696bull /* "kilnrng" 2 */
_Static_assert(sizeof(range_header) == KILN_PROTO_ALIGN, "a header keeps ranges aligned");

/* The bytes a range of a `bytes`-long tensor takes with its header: every
 * range starts aligned, and an empty tensor still gets an offset of its
 * own. */
static uint64_t range_len(uint64_t bytes)
{
    return HDR + round_up(bytes ? bytes : 1, KILN_PROTO_ALIGN);
}

static kiln_status put_header(const kiln_slab_table *tab, uint8_t *at, const range_header *h,
                              kiln_err *err)
{
    if (tab->kind->copy_in)
        return tab->kind->copy_in(at, h, sizeof *h, tab->device, err);
    memcpy(at, h, sizeof *h);
    return KILN_OK;
}

/* KILN_ERR_NOT_FOUND unless the header before the ref's range in the
 * slab mapped at `base` names the ref's allocation. */
static kiln_status check_header(const kiln_slab_table *tab, const uint8_t *base,
                                const kiln_tensor_ref *ref, kiln_err *err)
{
    range_header h;
    const uint8_t *at = base + ref->off - HDR;
    if (tab->kind->copy_out) {
        if (tab->kind->copy_out(&h, at, sizeof h, tab->device, err))
            return err ? err->code : KILN_ERR_DEVICE;
    } else {
        memcpy(&h, at, sizeof h);
    }
    if (h.magic == RANGE_LIVE && h.epoch == ref->epoch && h.gen == ref->gen && h.len == ref->len)
        return KILN_OK;
    return kiln_err_set(err, KILN_ERR_NOT_FOUND,
                        "%s ref %s+%llu gen %llu is not live (freed, or handed out again)",
                        tab->what, ref->slab, (unsigned long long)ref->off,
                        (unsigned long long)ref->gen);
}

/* Array v (n used of *cap, elements of `size` bytes) with room for one
 * more, or NULL with v untouched. */
static void *grow(void *v, int n, int *cap, size_t size)
{
    if (n < *cap)
        return v;
    int c = *cap ? 2 * *cap : 8;
    void *nv = realloc(v, (size_t)c * size);
    if (nv)
        *cap = c;
    return nv;
}

/* ---- producer ---- */

static kiln_status new_slab(kiln_slab_table *tab, size_t size, pool_slab **out, kiln_err *err)
{
    if (tab->total + size > tab->max_bytes)
        return kiln_err_set(err, KILN_ERR_BUSY, "%s pool full (%zu of %zu bytes in slabs)",
                            tab->what, tab->total, tab->max_bytes);
    pool_slab **v = grow(tab->slabs, tab->n_slabs, &tab->cap_slabs, sizeof *v);
    if (!v)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    tab->slabs = v;
    pool_slab *p = calloc(1, sizeof *p);
    if (!p || kiln_slab_ranges_init(&p->ranges, size)) {
        free(p);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    p->s.size = size;
    p->s.fd = -1;
    kiln_status st = tab->kind->make(&p->s, tab->stage, tab->epoch, tab->device, err);
    if (st) {
        if (st == KILN_ERR_NOMEM)
            tab->short_bytes = size;
        kiln_slab_ranges_release(&p->ranges);
        free(p);
        return st;
    }
    tab->short_bytes = 0;
    tab->slabs[tab->n_slabs++] = p;
    tab->total += size;
    *out = p;
    return KILN_OK;
}

/* Unmakes slab i of the table (its ranges all came back). */
static void drop_slab(kiln_slab_table *tab, int i)
{
    pool_slab *p = tab->slabs[i];
    tab->kind->unmake(&p->s, tab->device);
    tab->total -= p->s.size;
    kiln_slab_ranges_release(&p->ranges);
    free(p);
    memmove(&tab->slabs[i], &tab->slabs[i + 1], (size_t)(tab->n_slabs - i - 1) * sizeof *tab->slabs);
    tab->n_slabs--;
}

static int slab_empty(const pool_slab *p)
{
    int live;
    kiln_slab_ranges_used(&p->ranges, &live);
    return live == 0;
}

/* A slab consumers can no longer open (its name was unlinked by a cleaner,
 * systemd-logind's RemoveIPC, another namespace...) hands out nothing more:
 * the references already out still work for consumers that mapped it, the
 * others answer not_found and their jobs run again, from a new slab. */
static void retire(kiln_slab_table *tab, pool_slab *p)
{
    p->retired = 1;
    tab->lost++;
    KILN_LOG_WARN("%s pool: slab %s can no longer be opened by consumers (its name is gone): "
                  "retired, new ranges come from a new slab", tab->what, p->s.name);
}

static kiln_status table_alloc(kiln_transport *t, size_t bytes, kiln_tensor_ref *ref, void **ptr,
                               kiln_err *err)
{
    kiln_slab_table *tab = t->impl;
    uint64_t len = range_len(bytes), off = 0;
    pthread_mutex_lock(&tab->mu);
    uint64_t gen = ++tab->next_gen;
    pool_slab *p = NULL;
    for (int i = 0; i < tab->n_slabs && !p; i++) {
        pool_slab *q = tab->slabs[i];
        if (!q->retired && tab->kind->alive && !tab->kind->alive(&q->s))
            retire(tab, q);
        if (q->retired) {
            if (slab_empty(q))
                drop_slab(tab, i--);
            continue;
        }
        if (!kiln_slab_ranges_take(&q->ranges, len, gen, &off))
            p = q;
    }
    kiln_status st = KILN_OK;
    if (!p) {
        size_t size = len > tab->slab_bytes ? round_up(len, MIB) : tab->slab_bytes;
        st = new_slab(tab, size, &p, err);
        if (!st && kiln_slab_ranges_take(&p->ranges, len, gen, &off))
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    if (!st) {
        range_header h = {.magic = RANGE_LIVE, .epoch = tab->epoch, .gen = gen, .len = bytes};
        st = put_header(tab, p->s.base + off, &h, err);
        if (st)
            kiln_slab_ranges_give(&p->ranges, off, len, gen);
    }
    if (!st) {
        snprintf(ref->owner, sizeof ref->owner, "%s", tab->owner);
        snprintf(ref->slab, sizeof ref->slab, "%s", p->s.name);
        ref->epoch = tab->epoch;
        ref->gen = gen;
        ref->off = off + HDR;
        memcpy(ref->handle, p->s.handle, sizeof ref->handle);
        ref->device = tab->device;
        *ptr = p->s.base + ref->off;
    }
    pthread_mutex_unlock(&tab->mu);
    return st;
}

static kiln_status table_free(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    kiln_slab_table *tab = t->impl;
    int rc = 1;
    pthread_mutex_lock(&tab->mu);
    pool_slab *p = NULL;
    int at = -1;
    if (!strcmp(ref->owner, tab->owner) && ref->epoch == tab->epoch && ref->off >= HDR)
        for (int i = 0; i < tab->n_slabs && !p; i++)
            if (!strcmp(tab->slabs[i]->s.name, ref->slab))
                p = tab->slabs[at = i];
    if (p)
        rc = kiln_slab_ranges_give(&p->ranges, ref->off - HDR, range_len(ref->len), ref->gen);
    if (!rc) {
        /* Cleared, so that a reference to it no longer opens or verifies. */
        range_header dead = {0};
        kiln_err herr = {0};
        if (put_header(tab, p->s.base + ref->off - HDR, &dead, &herr))
            KILN_LOG_WARN("%s free: clearing a range header: %s", tab->what, herr.msg);
        if (p->retired && slab_empty(p))
            drop_slab(tab, at);
    } else if (rc > 0) {
        tab->refused++;
    }
    pthread_mutex_unlock(&tab->mu);
    if (rc < 0)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (rc)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "%s free refused: %s epoch %016llx %s+%llu gen %llu is not a live "
                            "range of %s", tab->what, ref->owner, (unsigned long long)ref->epoch,
                            ref->slab, (unsigned long long)ref->off, (unsigned long long)ref->gen,
                            tab->owner);
    return KILN_OK;
}

/* ---- consumer ---- */

static kiln_status check_range(const kiln_slab_table *tab, const kiln_tensor_ref *ref,
                               size_t slab_size, kiln_err *err)
{
    if (slab_size && ref->off >= HDR && ref->off <= slab_size && ref->len <= slab_size - ref->off)
        return KILN_OK;
    return kiln_err_set(err, KILN_ERR_INVALID, "%s ref %s+%llu (%llu bytes) outside its slab",
                        tab->what, ref->slab, (unsigned long long)ref->off,
                        (unsigned long long)ref->len);
}

static mapping *find_map(kiln_slab_table *tab, const kiln_tensor_ref *ref)
{
    for (int i = 0; i < tab->n_maps; i++) {
        const kiln_slab_map *m = &tab->maps[i].m;
        if (!strcmp(m->name, ref->slab) && m->epoch == ref->epoch &&
            (!tab->kind->handle_keyed || !memcmp(m->handle, ref->handle, sizeof m->handle)))
            return &tab->maps[i];
    }
    return NULL;
}

static kiln_status map_slab(kiln_slab_table *tab, const kiln_tensor_ref *ref, mapping **out,
                            kiln_err *err)
{
    mapping *v = grow(tab->maps, tab->n_maps, &tab->cap_maps, sizeof *v);
    if (!v)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    tab->maps = v;
    mapping *m = &tab->maps[tab->n_maps];
    memset(m, 0, sizeof *m);
    snprintf(m->m.name, sizeof m->m.name, "%s", ref->slab);
    m->m.epoch = ref->epoch;
    memcpy(m->m.handle, ref->handle, sizeof m->m.handle);
    kiln_status st = tab->kind->map(&m->m, tab->device, err);
    if (st)
        return st;
    tab->n_maps++;
    *out = m;
    return KILN_OK;
}

static void unmap_at(kiln_slab_table *tab, int i)
{
    tab->kind->unmap(&tab->maps[i].m, tab->device);
    tab->maps[i] = tab->maps[--tab->n_maps];
}

/* Unmaps the least recently used idle mapping once there are too many:
 * consumers reuse a few slabs over and over, so the cache stays small
 * without ever remapping a slab still being read. */
static void evict(kiln_slab_table *tab)
{
    int idle = 0, lru = -1;
    for (int i = 0; i < tab->n_maps; i++)
        if (!tab->maps[i].refs) {
            idle++;
            if (lru < 0 || tab->maps[i].last_use < tab->maps[lru].last_use)
                lru = i;
        }
    if (idle > tab->kind->max_idle_maps)
        unmap_at(tab, lru);
}

static kiln_status table_open(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                              kiln_err *err)
{
    kiln_slab_table *tab = t->impl;
    const kiln_slab_kind *k = tab->kind;
    kiln_status st = k->ref_size ? check_range(tab, ref, k->ref_size(ref), err) : KILN_OK;
    if (st)
        return st;
    /* Outside the table's mutex: `local` takes a lock of its own. */
    const uint8_t *local = k->local ? k->local(ref) : NULL;
    pthread_mutex_lock(&tab->mu);
    if (local) {
        st = check_header(tab, local, ref, err);
        if (!st) {
            tab->local_open++;
            *ptr = local + ref->off;
        }
    } else {
        mapping *m = find_map(tab, ref);
        st = m ? KILN_OK : map_slab(tab, ref, &m, err);
        if (!st)
            st = check_range(tab, ref, m->m.size, err);
        if (!st)
            st = check_header(tab, m->m.base, ref, err);
        if (!st) {
            m->refs++;
            m->last_use = ++tab->tick;
            *ptr = m->m.base + ref->off;
        }
    }
    if (!st)
        tab->open++;
    pthread_mutex_unlock(&tab->mu);
    return st;
}

static void table_close(kiln_transport *t, const kiln_tensor_ref *ref)
{
    kiln_slab_table *tab = t->impl;
    pthread_mutex_lock(&tab->mu);
    mapping *m = find_map(tab, ref);
    if (m && m->refs > 0) {
        m->refs--;
        tab->open--;
        if (!m->refs && m->doomed)
            unmap_at(tab, (int)(m - tab->maps));
        evict(tab);
    } else if (!m && tab->local_open > 0) {
        tab->local_open--;
        tab->open--;
    }
    pthread_mutex_unlock(&tab->mu);
}

static void table_forget(kiln_transport *t, uint64_t epoch)
{
    kiln_slab_table *tab = t->impl;
    pthread_mutex_lock(&tab->mu);
    for (int i = tab->n_maps - 1; i >= 0; i--) {
        if (tab->maps[i].m.epoch != epoch)
            continue;
        if (tab->maps[i].refs)
            tab->maps[i].doomed = 1;
        else
            unmap_at(tab, i);
    }
    pthread_mutex_unlock(&tab->mu);
}

static kiln_status table_verify(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    kiln_slab_table *tab = t->impl;
    const uint8_t *local = tab->kind->local ? tab->kind->local(ref) : NULL;
    pthread_mutex_lock(&tab->mu);
    mapping *m = local ? NULL : find_map(tab, ref);
    kiln_status st = local ? check_header(tab, local, ref, err)
                     : m   ? check_header(tab, m->m.base, ref, err)
                           : kiln_err_set(err, KILN_ERR_INVALID, "%s verify: %s is not open",
                                          tab->what, ref->slab);
    pthread_mutex_unlock(&tab->mu);
    return st;
}

/* ---- both ---- */

static void table_stats(kiln_transport *t, kiln_transport_stats *st)
{
    kiln_slab_table *tab = t->impl;
    pthread_mutex_lock(&tab->mu);
    st->slabs = tab->n_slabs;
    st->slab_bytes = tab->total;
    for (int i = 0; i < tab->n_slabs; i++) {
        int live;
        st->used_bytes += kiln_slab_ranges_used(&tab->slabs[i]->ranges, &live);
        st->live += live;
    }
    st->mapped = tab->n_maps;
    st->open = tab->open;
    st->refused = tab->refused;
    st->lost = tab->lost;
    st->short_bytes = tab->short_bytes;
    pthread_mutex_unlock(&tab->mu);
}

static void table_destroy(kiln_transport *t)
{
    kiln_slab_table *tab = t->impl;
    while (tab->n_maps)
        unmap_at(tab, tab->n_maps - 1);
    for (int i = 0; i < tab->n_slabs; i++) {
        pool_slab *p = tab->slabs[i];
        tab->kind->unmake(&p->s, tab->device);
        kiln_slab_ranges_release(&p->ranges);
        free(p);
    }
    free(tab->slabs), free(tab->maps);
    pthread_mutex_destroy(&tab->mu);
    free(tab);
    free(t);
}

static const kiln_transport_ops table_ops = {
    .alloc = table_alloc, .free = table_free, .open = table_open, .close = table_close,
    .verify = table_verify, .forget = table_forget, .stats = table_stats,
    .destroy = table_destroy,
};

kiln_transport *kiln_slab_table_create(const kiln_slab_kind *kind, const char *owner,
                                       uint64_t epoch, const char *stage, int device,
                                       size_t slab_bytes, size_t max_bytes, kiln_err *err)
{
    const char *what = kiln_ref_kind_name(kind->ref_kind);
    if (!owner || !*owner || strlen(owner) >= KILN_PROTO_ID_MAX || !stage || !*stage ||
        strlen(stage) >= STAGE_MAX || !epoch) {
        kiln_err_set(err, KILN_ERR_INVALID, "%s transport: bad owner, epoch or stage name", what);
        return NULL;
    }
    /* The stage is part of slab names, which must stay valid shm names. */
    for (const char *p = stage; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9'))) {
            kiln_err_set(err, KILN_ERR_INVALID, "%s transport: stage must be [a-z0-9]", what);
            return NULL;
        }
    kiln_transport *t = calloc(1, sizeof *t);
    kiln_slab_table *tab = calloc(1, sizeof *tab);
    if (!t || !tab || pthread_mutex_init(&tab->mu, NULL)) {
        free(t), free(tab);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    tab->kind = kind;
    tab->what = what;
    snprintf(tab->owner, sizeof tab->owner, "%s", owner);
    tab->epoch = epoch;
    snprintf(tab->stage, sizeof tab->stage, "%s", stage);
    tab->device = device;
    tab->slab_bytes = round_up(slab_bytes ? slab_bytes : DEFAULT_SLAB, kind->slab_round);
    tab->max_bytes = max_bytes ? max_bytes : kind->default_max;
    t->ops = &table_ops;
    t->kind = kind->ref_kind;
    t->impl = tab;
    return t;
}
