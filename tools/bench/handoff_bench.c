/* kiln-handoffbench: the cost of a by-value hand-off between stages in
 * different transport domains (services/common/worker_data.c), measured
 * through the real code: a producer's shm range served by its data socket
 * thread, fetched by a consumer over loopback TCP, plaintext and CURVE.
 *
 *   kiln-handoffbench [--iters N]
 *
 * Sizes: a klein-4B request's prompt embeddings (1 x 512 x 7680 f32, encode
 * -> denoise) and a 1024x1024 image's latents (1 x 4096 x 128 f32, denoise
 * -> decode).  Prints the median and best ms per fetch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"
#include "common/log.h"
#include "services/common/worker_impl.h"

static const kiln_stage_ops producer_ops = {.stage = KILN_STAGE_ENCODE, .binary = "producer"};
static const kiln_stage_ops consumer_ops = {.stage = KILN_STAGE_DENOISE, .binary = "consumer"};

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int run(const char *what, int64_t rows, int64_t cols, int curve, int iters)
{
    kiln_err err = {0};
    kiln_worker *p = calloc(1, sizeof *p), *c = calloc(1, sizeof *c);
    kiln_worker_job *j = calloc(1, sizeof *j);
    double *ms = calloc((size_t)iters, sizeof *ms);
    int rc = 1;
    if (!p || !c || !j || !ms)
        goto out;
    p->ops = &producer_ops, c->ops = &consumer_ops;
    snprintf(p->replica, sizeof p->replica, "encode-bench-%d", curve);
    snprintf(c->replica, sizeof c->replica, "denoise-bench-%d", curve);
    snprintf(p->data_host, sizeof p->data_host, "127.0.0.1");
    p->epoch = 0xbe0c0001 + (uint64_t)curve, c->epoch = 0xbe0c1001 + (uint64_t)curve;
    if (curve) {
        char pub[KILN_BUS_KEY_TEXT], sec[KILN_BUS_KEY_TEXT];
        if (kiln_bus_keygen(pub, sec, &err))
            goto out;
        memcpy(p->bus_keys.secret, sec, sizeof sec), memcpy(p->bus_keys.public_key, pub, sizeof pub);
        memcpy(c->bus_keys.secret, sec, sizeof sec), memcpy(c->bus_keys.public_key, pub, sizeof pub);
        if (kiln_bus_keys_allow(&p->bus_keys, pub, &err))
            goto out;
    }
    p->shm = kiln_transport_shm_create(p->replica, p->epoch, "encode", 0, 0, &err);
    if (!p->shm || worker_data_start(p, &err))
        goto out;
    kiln_tensor_ref ref;
    void *dst;
    int64_t shape[3] = {1, rows, cols};
    if (kiln_transport_alloc(p->shm, KILN_F32, 3, shape, &ref, &dst, &err))
        goto out;
    for (size_t i = 0; i < ref.len / 4; i++)
        ((float *)dst)[i] = (float)i;
    kiln_fetch_src src = {.endpoint = p->data_ep, .key = curve ? p->bus_keys.public_key : ""};
    snprintf(src.owner, sizeof src.owner, "%s", p->replica);
    for (int i = -2; i < iters; i++) { /* two to connect and warm up */
        void *bytes = NULL;
        double t0 = kiln_now_ms();
        if (worker_data_fetch(c, j, &src, &ref, &bytes, &err))
            goto out;
        double t = kiln_now_ms() - t0;
        int same = !memcmp(bytes, dst, ref.len);
        free(bytes);
        if (!same) {
            kiln_err_set(&err, KILN_ERR_INTERNAL, "fetched bytes differ");
            goto out;
        }
        if (i >= 0)
            ms[i] = t;
    }
    qsort(ms, (size_t)iters, sizeof *ms, cmp);
    printf("%-28s %9.1f MB %-9s median %7.2f ms  best %7.2f ms  (%.0f MB/s)\n", what,
           (double)ref.len / 1e6, curve ? "CURVE" : "plaintext", ms[iters / 2], ms[0],
           (double)ref.len / 1e6 / (ms[iters / 2] / 1e3));
    kiln_transport_free(p->shm, &ref, NULL);
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "kiln-handoffbench: %s\n", err.msg);
    if (p) {
        worker_data_stop(p);
        kiln_transport_destroy(p->shm);
        kiln_bus_keys_free(&p->bus_keys);
    }
    if (c)
        worker_data_stop(c);
    free(p), free(c), free(j), free(ms);
    return rc;
}

int main(int argc, char **argv)
{
    int iters = 20;
    if (argc == 3 && !strcmp(argv[1], "--iters") && !kiln_parse_int(argv[2], 1, 100000, &iters)) {
    } else if (argc != 1) {
        fprintf(stderr, "usage: kiln-handoffbench [--iters N]\n");
        return 2;
    }
    int rc = 0;
    for (int curve = 0; curve < 2; curve++) {
        rc |= run("embeds 512x7680 (klein-4B)", 512, 7680, curve, iters);
        rc |= run("latents 4096x128 (1024^2)", 4096, 128, curve, iters);
    }
    return rc;
}
