/* Device time of a stage's work: cudaEvents recorded on the instance's
 * stream between the ops (kernels/backend.h, ops.timer_*), read when the
 * work is done.  Recording an event costs the host about a microsecond and
 * the stream nothing; nothing here waits except timer_ms, for its end
 * mark.  Events are made on first use and kept for the instance's life, so
 * steady-state marks allocate nothing.
 *
 * Failures are not the backend's: a mark that cannot be recorded is -1,
 * and the error it left in the thread's last-error slot is cleared so no
 * later launch check reads it as its own.  A context that is really gone
 * shows at the next op anyway. */
#include "cuda_internal.cuh"

int cuda_timer_mark(kiln_backend *be)
{
    cuda_impl *c = cuda_of(be);
    if (c->n_marks >= KILN_BE_TIMER_MARKS || cudaSetDevice(c->device) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    /* An event recorded during a stream capture would become a graph node
     * (and time nothing when replayed); the marks stay outside captures. */
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c->stream, &cap) != cudaSuccess ||
        cap != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return -1;
    }
    int i = c->n_marks;
    if (i == c->n_timer_events) {
        if (cudaEventCreate(&c->timer_events[i]) != cudaSuccess) {
            cudaGetLastError();
            return -1;
        }
        c->n_timer_events++;
    }
    if (cudaEventRecord(c->timer_events[i], c->stream) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return c->n_marks++;
}

double cuda_timer_ms(kiln_backend *be, int a, int b)
{
    cuda_impl *c = cuda_of(be);
    if (a < 0 || b < 0 || a >= c->n_marks || b >= c->n_marks ||
        cudaSetDevice(c->device) != cudaSuccess)
        return -1;
    float ms = 0;
    if (cudaEventSynchronize(c->timer_events[b]) != cudaSuccess ||
        cudaEventElapsedTime(&ms, c->timer_events[a], c->timer_events[b]) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return ms;
}

void cuda_timer_reset(kiln_backend *be) { cuda_of(be)->n_marks = 0; }

void cuda_timer_fini(kiln_backend *be)
{
    cuda_impl *c = cuda_of(be);
    for (int i = 0; i < c->n_timer_events; i++)
        cudaEventDestroy(c->timer_events[i]);
    c->n_timer_events = c->n_marks = 0;
}
