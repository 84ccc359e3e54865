/* Recorded op sequences: a stream capture of the ops between graph_begin and
 * graph_end, replayed with one launch.  A DiT step is ~350 kernels and
 * copies; replayed as a graph it costs one launch on the host, and the GPU
 * runs the kernels back to back instead of at the host's pace.
 *
 * The capture is thread-local, so other threads of the process (a worker's
 * transport, another backend instance) may make "potentially unsafe" calls
 * (cudaMalloc, cudaFree) meanwhile.  Not a device-wide synchronisation,
 * though: "it is also invalid to ... synchronize a broader handle which
 * encompasses an active stream capture, such as a device or context
 * handle" (CUDA Programming Guide, stream capture, "Prohibited and
 * Unhandled Operations"), whatever the capture mode, and cudnnDestroy
 * calls cudaDeviceSynchronize.  The gate below keeps such calls
 * (cuda_exclusive_begin/end) and captures from overlapping. */
#include <pthread.h>
#include <stdlib.h>

#include "cuda_internal.cuh"

/* --- the capture gate (cuda_internal.cuh) ---------------------------------- */

static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int gate_captures;       /* captures under way, every thread */
static int gate_exclusive;      /* a thread is between exclusive_begin and _end */
static int gate_waiting;        /* threads waiting to be: new captures let them go first */
static __thread int gate_mine;  /* captures under way on this thread */
static __thread int gate_held;  /* this thread is the exclusive one */

static void gate_capture_enter(void)
{
    pthread_mutex_lock(&gate_mu);
    while ((gate_exclusive || gate_waiting) && !gate_held)
        pthread_cond_wait(&gate_cv, &gate_mu);
    gate_captures++;
    gate_mine++;
    pthread_mutex_unlock(&gate_mu);
}

static void gate_capture_leave(void)
{
    pthread_mutex_lock(&gate_mu);
    gate_captures--;
    gate_mine--;
    if (!gate_captures)
        pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

int cuda_exclusive_begin(void)
{
    if (gate_mine || gate_held)
        return 0;
    pthread_mutex_lock(&gate_mu);
    gate_waiting++;
    while (gate_exclusive || gate_captures)
        pthread_cond_wait(&gate_cv, &gate_mu);
    gate_waiting--;
    gate_exclusive = 1;
    gate_held = 1;
    pthread_mutex_unlock(&gate_mu);
    return 1;
}

void cuda_exclusive_end(int held)
{
    if (!held)
        return;
    pthread_mutex_lock(&gate_mu);
    gate_exclusive = 0;
    gate_held = 0;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

/* --- recordings -------------------------------------------------------------- */

struct kiln_graph {
    cudaGraphExec_t exec;
    uint64_t scratch_epoch; /* the scratch buffer the recording points into */
};

void cuda_graph_begin(kiln_backend *be)
{
    if (!cuda_enter(be))
        return;
    gate_capture_enter();
    if (cuda_ok(be, cudaStreamBeginCapture(cuda_stream(be), cudaStreamCaptureModeThreadLocal),
                "cudaStreamBeginCapture"))
        cuda_of(be)->capturing = 1;
    else
        gate_capture_leave();
}

kiln_graph *cuda_graph_end(kiln_backend *be)
{
    cuda_impl *c = cuda_of(be);
    cudaGraph_t graph = NULL;
    /* Always end the capture, even after a failed op: the stream must leave
     * capture mode before anything else runs on it. */
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    if (c->capturing) {
        c->capturing = 0;
        gate_capture_leave();
    }
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
