/* cuDNN inside the CUDA backend: the library, opened with dlopen at backend
 * creation (kiln neither links against cuDNN nor needs it), and the graph
 * API plumbing its ops share (cuda_cudnn_attention.cu, cuda_cudnn_conv.cu).
 *
 *   // building a plan, once per shape (find_plan caches it):
 *   cudnn_builder b; cudnn_builder_init(&b, c, p);
 *   desc_t x = cudnn_tensor(&b, UID_X, CUDNN_DATA_BFLOAT16, 4, dims, strides, 0);
 *   ... the operation ...
 *   cudnn_plan_graph(&b, &op, 1, accept);     // heuristics -> p->plan, or logs why not
 *   // running it:
 *   cudnn_execute(be, p, n, uids, ptrs);
 *
 * Only the header's types and enums are used at build time.  One instance
 * per backend, used by the backend's thread. */
#ifndef KILN_CUDA_CUDNN_CUH
#define KILN_CUDA_CUDNN_CUH

#include <cudnn_graph.h>

#include "cuda_internal.cuh"

/* Plans are built once per op shape and kept: a klein size needs ~20 (VAE
 * convolutions, attention), and a size above the VAE's banding threshold
 * about 90 more (models/vae_band.c: each conv sees a top, a middle and a
 * last band, per pass), so 1024 covers a dozen large sizes and many small
 * ones per process; shapes past that run on kiln's own kernels.  Their
 * workspace is the backend's one shared scratch. */
#define CUDNN_MAX_PLANS 1024
#define CUDNN_MAX_OWNED 24 /* descriptors in one plan's graph */
#define CUDNN_MAX_KEY 16

typedef cudnnBackendDescriptor_t desc_t;

typedef struct cudnn_plan {
    int64_t key[CUDNN_MAX_KEY]; /* op kind and shape; unused entries are 0 */
    desc_t plan;                /* NULL: cuDNN declined this graph */
    int64_t workspace;
    /* The graph's descriptors, kept for the plan's lifetime since the plan
     * refers to its engine configuration and graph. */
    desc_t owned[CUDNN_MAX_OWNED];
    int n_owned;
} cudnn_plan;

struct cuda_cudnn {
    void *lib;
    size_t version;
    cudnnHandle_t handle;
    cudnn_plan plans[CUDNN_MAX_PLANS];
    int n_plans;
    size_t (*get_version)(void);
    const char *(*error_string)(cudnnStatus_t);
    cudnnStatus_t (*create)(cudnnHandle_t *);
    cudnnStatus_t (*destroy)(cudnnHandle_t);
    cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t);
    cudnnStatus_t (*create_desc)(cudnnBackendDescriptorType_t, desc_t *);
    cudnnStatus_t (*destroy_desc)(desc_t);
    cudnnStatus_t (*finalize)(desc_t);
    cudnnStatus_t (*set_attr)(desc_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
                              int64_t, const void *);
    cudnnStatus_t (*get_attr)(desc_t const, cudnnBackendAttributeName_t,
                              cudnnBackendAttributeType_t, int64_t, int64_t *, void *);
    cudnnStatus_t (*execute)(cudnnHandle_t, desc_t, desc_t);
};
typedef struct cuda_cudnn cuda_cudnn;

/* Records the descriptors of one plan's graph; the first failure sticks and
 * later calls do nothing, so a build reads as a straight sequence. */
typedef struct cudnn_builder {
    cuda_cudnn *c;
    cudnn_plan *p;
    cudnnStatus_t st;
    const char *what; /* the step that failed */
} cudnn_builder;

void cudnn_builder_init(cudnn_builder *b, cuda_cudnn *c, cudnn_plan *p);
desc_t cudnn_make(cudnn_builder *b, cudnnBackendDescriptorType_t type);
void cudnn_set(cudnn_builder *b, desc_t d, cudnnBackendAttributeName_t name,
               cudnnBackendAttributeType_t type, int64_t n, const void *v, const char *what);
void cudnn_finalize(cudnn_builder *b, desc_t d, const char *what);
/* A finalized tensor descriptor (16-byte alignment; by_value for host
 * scalars passed at execution). */
desc_t cudnn_tensor(cudnn_builder *b, int64_t uid, cudnnDataType_t dt, int ndim,
                    const int64_t *dims, const int64_t *strides, int by_value);

/* Puts `ops` into an operation graph, asks the heuristics (mode A) for
 * engine configurations and keeps the first that `accept` allows (NULL:
 * any) and that finalizes into an execution plan.  On failure logs the
 * step and cuDNN's reason, naming the graph with `label`, and leaves
 * p->plan NULL. */
void cudnn_plan_graph(cudnn_builder *b, desc_t *ops, int n_ops,
                      int (*accept)(cuda_cudnn *c, desc_t cfg), const char *label);

/* The cached plan for `key` (n <= CUDNN_MAX_KEY values), built with
 * build(c, p, arg) the first time; NULL when the cache is full (the caller
 * then runs its in-house kernel). */
cudnn_plan *cudnn_find_plan(cuda_cudnn *c, const int64_t *key, int n,
                            void (*build)(cuda_cudnn *c, cudnn_plan *p, const void *arg),
                            const void *arg);

/* Runs plan p with the n tensors (uids[i] -> ptrs[i]) on the backend's
 * stream, with workspace from cuda_scratch.  0 on success; otherwise the
 * backend holds a sticky KILN_ERR_DEVICE naming `what`. */
int cudnn_execute(kiln_backend *be, const cudnn_plan *p, int n, const int64_t *uids, void **ptrs,
                  const char *what);

#endif
