/* Recorded op sequences: a stream capture of the ops between graph_begin and
 * graph_end, replayed with one launch.  A DiT step is ~350 kernels and
 * copies; replayed as a graph it costs one launch on the host, and the GPU
 * runs the kernels back to back instead of at the host's pace.
 *
 * The capture is thread-local, so other threads of the process (a worker's
 * transport, another backend instance) may use CUDA meanwhile. */
#include <stdlib.h>

#include "cuda_internal.cuh"

struct kiln_graph {
    cudaGraphExec_t exec;
    uint64_t scratch_epoch; /* the scratch buffer the recording points into */
};

void cuda_graph_begin(kiln_backend *be)
{
    if (cuda_enter(be))
        cuda_ok(be, cudaStreamBeginCapture(cuda_stream(be), cudaStreamCaptureModeThreadLocal),
                "cudaStreamBeginCapture");
}

kiln_graph *cuda_graph_end(kiln_backend *be)
{
    cuda_impl *c = cuda_of(be);
    cudaGraph_t graph = NULL;
    /* Always end the capture, even after a failed op: the stream must leave
     * capture mode before anything else runs on it. */
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    if (be->error.code) {
        if (graph)
            cudaGraphDestroy(graph);
        cudaGetLastError(); /* an invalidated capture is not a device fault */
        return NULL;
    }
    if (!cuda_ok(be, e, "cudaStreamEndCapture"))
        return NULL;
    kiln_graph *g = (kiln_graph *)calloc(1, sizeof *g);
    if (!g) {
        cudaGraphDestroy(graph);
        kiln_be_fail(be, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    g->scratch_epoch = c->scratch_epoch;
    e = cudaGraphInstantiate(&g->exec, graph, 0);
    cudaGraphDestroy(graph);
    if (!cuda_ok(be, e, "cudaGraphInstantiate")) {
        free(g);
        return NULL;
    }
    return g;
}

int cuda_graph_launch(kiln_backend *be, kiln_graph *g)
{
    if (g->scratch_epoch != cuda_of(be)->scratch_epoch)
        return 0;
    if (cuda_enter(be))
        cuda_ok(be, cudaGraphLaunch(g->exec, cuda_stream(be)), "cudaGraphLaunch");
    return 1;
}

void cuda_graph_destroy(kiln_backend *be, kiln_graph *g)
{
    if (!g)
        return;
    /* The exec may still be running; destroying it is safe then (CUDA
     * keeps it alive until the launch completes). */
    if (cuda_enter(be))
        cuda_ok(be, cudaGraphExecDestroy(g->exec), "cudaGraphExecDestroy");
    free(g);
}
