/* Pairing producers and consumers by transport domain (docs/ARCHITECTURE.md,
 * "Transport domains"): a reference goes to a replica that can open it
 * where it is; a shm reference may instead go to any replica, which then
 * fetches its bytes from the owner's data socket; a cuda_ipc reference
 * only ever goes where it opens, so a producer is told not to make one
 * when no replica of the next stage could open it.  The gateway itself
 * opens the decoders' image files where it can. */
#include <stdio.h>
#include <string.h>

#include "scheduler_impl.h"

/* The live record of a reference's owner, or NULL when it is gone (its
 * memory with it: a consumer answers not_found and the job starts over). */
static const sched_replica *owner_of(kiln_sched *s, const kiln_tensor_ref *ref)
{
    const sched_replica *p = sched_replica_find(s, ref->owner);
    return p && p->alive ? p : NULL;
}

sched_pairing sched_pairing_of(kiln_sched *s, const sched_job *j, const sched_replica *r)
{
    if (!j->held)
        return PAIR_LOCAL;
    sched_pairing worst = PAIR_LOCAL;
    const kiln_ref_map *in = &j->held->done.out;
    for (int i = 0; i < in->n; i++) {
        const kiln_tensor_ref *ref = &in->items[i].ref;
        if (ref->kind == KILN_REF_INLINE)
            continue;
        const sched_replica *p = owner_of(s, ref);
        if (!p)
            continue; /* nobody can open it; the consumer says so */
        if (kiln_domain_can_open(ref->kind, &p->domain, &r->domain, r->transports))
            continue;
        if (ref->kind == KILN_REF_SHM && p->data[0])
            worst = PAIR_FETCH;
        else
            return PAIR_NONE;
    }
    return worst;
}

int sched_placeable(kiln_sched *s, const sched_job *j)
{
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (r->alive && !r->leaving && r->stage == j->stage &&
            sched_pairing_of(s, j, r) != PAIR_NONE)
            return 1;
    }
    return 0;
}

unsigned sched_out_kinds(kiln_sched *s, const sched_replica *producer, kiln_stage stage)
{
    unsigned host = KILN_TRANSPORT_BIT(KILN_REF_INLINE) | KILN_TRANSPORT_BIT(KILN_REF_SHM);
    if (stage + 1 >= KILN_STAGE_COUNT)
        return host;
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *c = LINK_OWNER(l, sched_replica, node);
        if (c->alive && !c->leaving && c->stage == stage + 1 &&
            kiln_domain_can_open(KILN_REF_CUDA_IPC, &producer->domain, &c->domain, c->transports))
            return host | KILN_TRANSPORT_BIT(KILN_REF_CUDA_IPC);
    }
    return host;
}

unsigned sched_image_kinds(const kiln_sched *s, const sched_replica *r)
{
    /* The gateway reads (open, copy, verify) where a stage would: it is
     * the consumer of the decoder's images. */
    unsigned shm = KILN_TRANSPORT_BIT(KILN_REF_SHM);
    return s->opts.images && s->opts.domain && !r->images_inline && (r->transports & shm) &&
                   kiln_domain_can_open(KILN_REF_SHM, &r->domain, s->opts.domain, shm)
               ? shm
               : 0;
}

void sched_fill_src(kiln_sched *s, const sched_job *j, const sched_replica *r, kiln_msg_job *mj)
{
    mj->n_src = 0;
    if (!j->held)
        return;
    const kiln_ref_map *in = &j->held->done.out;
    for (int i = 0; i < in->n; i++) {
        const kiln_tensor_ref *ref = &in->items[i].ref;
        const sched_replica *p = ref->kind == KILN_REF_SHM ? owner_of(s, ref) : NULL;
        if (!p || !p->data[0] ||
            kiln_domain_can_open(ref->kind, &p->domain, &r->domain, r->transports))
            continue;
        int known = 0;
        for (int k = 0; k < mj->n_src; k++)
            known |= !strcmp(mj->src[k].owner, p->id);
        if (known || mj->n_src == KILN_PROTO_MAX_TENSORS)
            continue;
        kiln_fetch_src *src = &mj->src[mj->n_src++];
        snprintf(src->owner, sizeof src->owner, "%s", p->id);
        src->endpoint = p->data;
        src->key = p->data_key;
    }
}
