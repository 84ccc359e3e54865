/* cuDNN loading and the graph API plumbing shared by the cuDNN-backed ops
 * (see cuda_cudnn.cuh).  Without cuDNN >= 9.13.1, or with KILN_CUDNN=0 in
 * the environment when the backend is created, every op runs on kiln's own
 * kernels (for comparisons and for the op tests of those kernels). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_cudnn.cuh"

extern "C" {
#include "common/log.h"
}

#define CUDNN_MIN_VERSION 91301 /* first with CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR */

static void close_lib(cuda_cudnn *c)
{
    for (int i = 0; i < c->n_plans; i++) {
        cudnn_plan *p = &c->plans[i];
        if (p->plan)
            c->destroy_desc(p->plan);
        for (int j = p->n_owned - 1; j >= 0; j--)
            c->destroy_desc(p->owned[j]);
    }
    if (c->handle)
        c->destroy(c->handle);
    if (c->lib)
        dlclose(c->lib);
    free(c);
}

/* Loads the library and its entry points; NULL with the reason in `why`. */
static cuda_cudnn *open_lib(char *why, size_t why_len)
{
    cuda_cudnn *c = (cuda_cudnn *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    c->lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        snprintf(why, why_len, "%s", dlerror());
        free(c);
        return NULL;
    }
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&c->get_version, "cudnnGetVersion"},
        {(void **)&c->error_string, "cudnnGetErrorString"},
        {(void **)&c->create, "cudnnCreate"},
        {(void **)&c->destroy, "cudnnDestroy"},
        {(void **)&c->set_stream, "cudnnSetStream"},
        {(void **)&c->create_desc, "cudnnBackendCreateDescriptor"},
        {(void **)&c->destroy_desc, "cudnnBackendDestroyDescriptor"},
        {(void **)&c->finalize, "cudnnBackendFinalize"},
        {(void **)&c->set_attr, "cudnnBackendSetAttribute"},
        {(void **)&c->get_attr, "cudnnBackendGetAttribute"},
        {(void **)&c->execute, "cudnnBackendExecute"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(c->lib, syms[i].name);
        if (!*syms[i].slot) {
            snprintf(why, why_len, "libcudnn.so.9 lacks %s", syms[i].name);
            dlclose(c->lib);
            free(c);
            return NULL;
        }
    }
    c->version = c->get_version();
    if (c->version < CUDNN_MIN_VERSION) {
        snprintf(why, why_len, "cuDNN %zu is older than %d", c->version, CUDNN_MIN_VERSION);
        dlclose(c->lib);
        free(c);
        return NULL;
    }
    return c;
}

void cuda_cudnn_init(kiln_backend *be)
{
    cuda_impl *ci = cuda_of(be);
    const char *mode = getenv("KILN_CUDNN");
    if (mode && !strcmp(mode, "0")) {
        KILN_LOG_INFO("cuda: attention and convolutions on kiln's kernels "
                      "(KILN_CUDNN=0)");
        return;
    }
    char why[256] = "";
    /* One backend at a time: the stages of a kiln-stages process create
     * theirs in parallel, and cuDNN wants "a single synchronous call of
     * cudnnCreate() ... first before each thread creates its own handle"
     * (cuDNN developer guide, Thread Safety).  Exclusive also of other
     * threads' graph captures, as cudnnDestroy (close_lib) must be. */
    int held = cuda_exclusive_begin();
    cuda_cudnn *c = open_lib(why, sizeof why);
    if (c) {
        cudnnStatus_t s = c->create(&c->handle);
        if (s == CUDNN_STATUS_SUCCESS)
            s = c->set_stream(c->handle, ci->stream);
        if (s != CUDNN_STATUS_SUCCESS) {
            snprintf(why, sizeof why, "cudnnCreate: %s", c->error_string(s));
            close_lib(c);
            c = NULL;
        }
    }
    cuda_exclusive_end(held);
    if (!c) {
        KILN_LOG_INFO("cuda: cuDNN not used (%s); kiln's kernels run every op", why);
        return;
    }
    KILN_LOG_INFO("cuda: plain attention and convolutions through cuDNN %zu", c->version);
    ci->cudnn = c;
}

void cuda_cudnn_fini(kiln_backend *be)
{
    cuda_impl *ci = cuda_of(be);
    /* cudnnDestroy calls cudaDeviceSynchronize (cuDNN API, cudnnDestroy):
     * never beside another thread's capture.  cuda_destroy holds the gate
     * already; this keeps any other caller honest. */
    int held = cuda_exclusive_begin();
    if (ci->cudnn)
        close_lib(ci->cudnn);
    cuda_exclusive_end(held);
    ci->cudnn = NULL;
}

/* --- building ---------------------------------------------------------------- */

void cudnn_builder_init(cudnn_builder *b, cuda_cudnn *c, cudnn_plan *p)
{
    b->c = c;
    b->p = p;
    b->st = CUDNN_STATUS_SUCCESS;
    b->what = NULL;
}

desc_t cudnn_make(cudnn_builder *b, cudnnBackendDescriptorType_t type)
{
    desc_t d = NULL;
    if (b->st)
        return NULL;
    if (b->p->n_owned == CUDNN_MAX_OWNED) {
        b->st = CUDNN_STATUS_INTERNAL_ERROR, b->what = "too many descriptors";
        return NULL;
    }
    b->st = b->c->create_desc(type, &d);
    if (b->st) {
        b->what = "cudnnBackendCreateDescriptor";
        return NULL;
    }
    b->p->owned[b->p->n_owned++] = d;
    return d;
}

void cudnn_set(cudnn_builder *b, desc_t d, cudnnBackendAttributeName_t name,
               cudnnBackendAttributeType_t type, int64_t n, const void *v, const char *what)
{
    if (b->st)
        return;
    b->st = b->c->set_attr(d, name, type, n, v);
    if (b->st)
        b->what = what;
}

void cudnn_finalize(cudnn_builder *b, desc_t d, const char *what)
{
    if (b->st)
        return;
    b->st = b->c->finalize(d);
    if (b->st)
        b->what = what;
}

desc_t cudnn_tensor(cudnn_builder *b, int64_t uid, cudnnDataType_t dt, int ndim,
                    const int64_t *dims, const int64_t *strides, int by_value)
{
    desc_t t = cudnn_make(b, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    int64_t align = by_value ? 4 : 16;
    bool bv = true;
    cudnn_set(b, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor type");
    cudnn_set(b, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, ndim, dims, "tensor dims");
    cudnn_set(b, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, ndim, strides, "tensor strides");
    cudnn_set(b, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor id");
    cudnn_set(b, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align,
              "tensor alignment");
    if (by_value)
        cudnn_set(b, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv, "by value");
    cudnn_finalize(b, t, "tensor");
    return t;
}

void cudnn_plan_graph(cudnn_builder *b, desc_t *ops, int n_ops,
                      int (*accept)(cuda_cudnn *c, desc_t cfg), const char *label)
{
    cuda_cudnn *c = b->c;
    cudnn_plan *p = b->p;
    desc_t graph = cudnn_make(b, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    cudnn_set(b, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n_ops, ops,
              "graph ops");
    cudnn_set(b, graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &c->handle,
              "graph handle");
    cudnn_finalize(b, graph, "operation graph");

    desc_t heur = cudnn_make(b, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    cudnn_set(b, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
              &graph, "heuristic graph");
    cudnn_set(b, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode,
              "heuristic mode");
    cudnn_finalize(b, heur, "engine heuristic");

    /* The heuristic's configurations, in its order of preference. */
    enum { N_CFG = 8 };
    desc_t cfgs[N_CFG];
    int64_t n_cfg = 0;
    for (int i = 0; i < N_CFG; i++)
        cfgs[i] = cudnn_make(b, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    if (!b->st) {
        b->st = c->get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                            N_CFG, &n_cfg, cfgs);
        if (b->st)
            b->what = "heuristic results";
        else if (!n_cfg)
            b->st = CUDNN_STATUS_NOT_SUPPORTED, b->what = "no engine for this graph";
    }
    cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
    int refused = 0;
    for (int64_t i = 0; !b->st && i < n_cfg && !p->plan; i++) {
        if (accept && !accept(c, cfgs[i])) {
            refused++;
            continue;
        }
        desc_t pl = NULL;
        if ((last = c->create_desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &pl)))
            break;
        int64_t ws = 0, got = 0;
        if (!(last = c->set_attr(pl, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                 &c->handle)) &&
            !(last = c->set_attr(pl, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i])) &&
            !(last = c->finalize(pl)) &&
            !(last = c->get_attr(pl, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                 &got, &ws))) {
            p->plan = pl;
            p->workspace = ws;
        } else {
            c->destroy_desc(pl);
        }
    }
    if (!b->st && !p->plan)
        b->st = last, b->what = refused == n_cfg ? "every engine has inexact numerics"
                                                 : "execution plan";
    if (b->st)
        KILN_LOG_WARN("cuda: cuDNN declined %s (%s: %s); using kiln's kernel", label, b->what,
                      c->error_string(b->st));
}

cudnn_plan *cudnn_find_plan(cuda_cudnn *c, const int64_t *key, int n,
                            void (*build)(cuda_cudnn *c, cudnn_plan *p, const void *arg),
                            const void *arg)
{
    int64_t k[CUDNN_MAX_KEY] = {0};
    memcpy(k, key, (size_t)n * sizeof *k);
    for (int i = 0; i < c->n_plans; i++)
        if (!memcmp(c->plans[i].key, k, sizeof k))
            return &c->plans[i];
    if (c->n_plans == CUDNN_MAX_PLANS)
        return NULL; /* a server sees a bounded set of shapes; past that, run natively */
    cudnn_plan *p = &c->plans[c->n_plans++];
    memset(p, 0, sizeof *p);
    memcpy(p->key, k, sizeof k);
    build(c, p, arg);
    return p;
}

int cudnn_execute(kiln_backend *be, const cudnn_plan *p, int n, const int64_t *uids, void **ptrs,
                  const char *what)
{
    cuda_cudnn *c = cuda_of(be)->cudnn;
    void *ws = NULL;
    if (p->workspace > 0 && !(ws = cuda_scratch(be, (size_t)p->workspace)))
        return -1; /* cuda_scratch recorded the error */
    desc_t pack = NULL;
    cudnnStatus_t s = c->create_desc(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
    if (!s)
        s = c->set_attr(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (!s)
        s = c->set_attr(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (!s)
        s = c->set_attr(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (!s)
        s = c->finalize(pack);
    if (!s)
        s = c->execute(c->handle, p->plan, pack);
    if (pack)
        c->destroy_desc(pack);
    if (s) {
        cuda_check_context(be, what);
        kiln_be_fail(be, KILN_ERR_DEVICE, "cuda: cuDNN %s: %s", what, c->error_string(s));
        return -1;
    }
    return 0;
}
