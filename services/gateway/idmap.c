#include "idmap.h"

#include <stdlib.h>

/* splitmix64's finaliser: job ids are sequential, the slots must not be. */
static size_t slot_of(uint64_t k, size_t cap)
{
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    k ^= k >> 31;
    return (size_t)k & (cap - 1);
}

static void insert(kiln_idmap_slot *slots, size_t cap, uint64_t key, void *value)
{
    size_t i = slot_of(key, cap);
    while (slots[i].key && slots[i].key != key)
        i = (i + 1) & (cap - 1);
    slots[i].key = key;
    slots[i].value = value;
}

kiln_status kiln_idmap_put(kiln_idmap *m, uint64_t key, void *value, kiln_err *err)
{
    if (!key)
        return kiln_err_set(err, KILN_ERR_INVALID, "id 0 is reserved");
    if (kiln_idmap_get(m, key)) {
        insert(m->slots, m->cap, key, value);
        return KILN_OK;
    }
    if ((m->count + 1) * 2 > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 64;
        kiln_idmap_slot *s = calloc(cap, sizeof *s);
        if (!s)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < m->cap; i++)
            if (m->slots[i].key)
                insert(s, cap, m->slots[i].key, m->slots[i].value);
        free(m->slots);
        m->slots = s;
        m->cap = cap;
    }
    insert(m->slots, m->cap, key, value);
    m->count++;
    return KILN_OK;
}

void *kiln_idmap_get(const kiln_idmap *m, uint64_t key)
{
    if (!m->cap || !key)
        return NULL;
    for (size_t i = slot_of(key, m->cap); m->slots[i].key; i = (i + 1) & (m->cap - 1))
        if (m->slots[i].key == key)
            return m->slots[i].value;
    return NULL;
}

void *kiln_idmap_del(kiln_idmap *m, uint64_t key)
{
    if (!m->cap || !key)
        return NULL;
    size_t mask = m->cap - 1, i = slot_of(key, m->cap);
    while (m->slots[i].key != key) {
        if (!m->slots[i].key)
            return NULL;
        i = (i + 1) & mask;
    }
    void *value = m->slots[i].value;
    /* Backward shift: pull later entries of the probe run into the hole
     * unless their home slot lies cyclically in (hole, j]. */
    for (size_t j = (i + 1) & mask; m->slots[j].key; j = (j + 1) & mask) {
        size_t home = slot_of(m->slots[j].key, m->cap);
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].key = 0;
    m->slots[i].value = NULL;
    m->count--;
    return value;
}

void kiln_idmap_free(kiln_idmap *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->count = 0;
}
