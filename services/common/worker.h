/* kiln stage workers: the loop shared by kiln-encoder, kiln-denoiser,
 * kiln-decoder and kiln-stages (several stages in one process).  A stage
 * supplies a kiln_stage_ops table; the worker does the rest:
 * registration, heartbeats, credits, the job queue, batching of
 * compatible jobs, cancellation, tensor references in and out, and the
 * `done` / `release` replies.
 *
 *   int main(int argc, char **argv)
 *   {
 *       const kiln_stage_ops *ops[] = {&kiln_decoder_ops};
 *       return kiln_worker_main(argc, argv, "kiln-decoder", ops, 1);
 *   }
 *
 * Threads, per stage: a backend thread loads the model and runs batches
 * (it owns the backend; the process's main thread for its first stage);
 * a bus thread owns the ZeroMQ socket, sends heartbeats every
 * 250 ms however long a batch runs, queues incoming jobs, answers cancels
 * of queued jobs and returns freed ranges to the shm pool.  Stages may
 * finish jobs from other threads (the decoder's image encoders):
 * kiln_worker_done and the job helpers below are thread-safe for distinct
 * jobs.
 */
#ifndef KILN_SERVICES_WORKER_H
#define KILN_SERVICES_WORKER_H

#include "common/buf.h"
#include "common/checkpoint.h"
#include "common/proto.h"
#include "engine/denoise_stage.h"
#include "engine/request.h"
#include "kernels/backend.h"

typedef struct kiln_worker kiln_worker;
typedef struct kiln_worker_job kiln_worker_job;

typedef struct kiln_worker_opts {
    const char *model;   /* checkpoint folder */
    const char *bus;     /* gateway ROUTER endpoint */
    /* --replica-id: a stable id for this replica (a StatefulSet pod's
     * name); NULL: "<stage>-<host>-<pid>-<first 8 hex digits of the
     * epoch>", unique per process even where every stage is PID 1. */
    const char *replica_id;
    /* CURVE (common/bus_keys.h): this replica's secret key file and the
     * gateway's public key file, both or neither. */
    const char *bus_key, *bus_server_key;
    /* The replicas' public keys (--bus-allow): who may fetch this
     * producer's outputs by value when the bus runs CURVE. */
    const char *bus_allow;
    /* The data socket for by-value hand-offs (producer stages): the port
     * to bind (0: any free one, -1: none) and the host name or address
     * other stages reach this replica by (NULL: its host name). */
    int data_port;
    const char *data_host;
    int health_port; /* 0: none; else /healthz and /readyz there (worker_health.c) */
    /* --drain-s: on the first SIGTERM/SIGINT, how long the jobs it holds
     * may take to finish while it takes no new ones (`leaving`); 0: stop
     * at once (a running batch at its next op, queued jobs back). */
    int drain_s;
    const char *device;  /* "cpu" or "cuda" */
    int gpu;
    int max_batch;       /* rows per batch (a bigger job runs alone) */
    int batch_window_ms; /* how long the first job waits for company */
    int out_layers[KILN_MAX_OUT_LAYERS];
    int n_out_layers;
    /* Where device outputs go (--tensor-transport): KILN_REF_SHM, or
     * KILN_REF_CUDA_IPC (device slabs; every consumer must be a CUDA
     * replica on this host).  -1 = auto: cuda_ipc on a CUDA backend when
     * every GPU of the host can map every other's memory, else shm. */
    int tensor_transport;
    /* kiln-encoder's prompt cache in MiB of host memory (--prompt-cache-mb,
     * engine/prompt_cache.h); 0 turns it off. */
    int prompt_cache_mb;
    /* kiln-encoder's and kiln-decoder's VAE in bands of rows (models/
     * vae_band.h) for images of more than --vae-band-above megapixels
     * (1 MP = 1024 x 1024), bands of --vae-band-rows rows. */
    double vae_band_above_mp;
    int vae_band_rows;
    /* kiln-denoiser's --precision (engine/denoise_stage.h kiln_precision:
     * exact, the default, or fp8). */
    kiln_precision precision;
    /* kiln-decoder's image encoders (--image-threads): threads that turn
     * decoded rows into PNG/JPEG/WebP files while the backend decodes the
     * next batch; 0 = half the CPUs, from 1 to 4. */
    int image_threads;
} kiln_worker_opts;

/* --vae-band-above in pixels for kiln_vae_set_banding. */
int64_t kiln_worker_band_pixels(const kiln_worker_opts *o);

typedef struct kiln_stage_ops {
    kiln_stage stage;
    const char *binary; /* "kiln-encoder", for usage and logs */
    /* Loads this stage's part of the checkpoint onto `be`; NULL with err. */
    void *(*load)(kiln_backend *be, const kiln_checkpoint *ck, const kiln_worker_opts *o,
                  kiln_err *err);
    void (*unload)(void *state);
    /* Rows a job adds to a batch (images, prompts). */
    int (*rows)(const kiln_msg_job *job);
    /* 1 when `job` may run in one batch with `head` (the oldest queued
     * job): same shapes and parameters, so that concatenating rows gives
     * each row exactly the result it gets alone. */
    int (*compatible)(const kiln_msg_job *head, const kiln_msg_job *job);
    /* Runs a batch of n >= 1 jobs.  Every job must end in exactly one
     * kiln_worker_done (here or later, from any thread). */
    void (*run)(void *state, kiln_worker *w, kiln_worker_job **jobs, int n);
} kiln_stage_ops;

/* Exit status of a worker whose checkpoint or options are unusable
 * (sysexits' EX_CONFIG): restarting it cannot help. */
#define KILN_WORKER_EXIT_CONFIG 78
/* Exit status of a worker whose incarnation ended early (the gateway
 * fenced it): it must be started again (sysexits' EX_TEMPFAIL). */
#define KILN_WORKER_EXIT_RESTART 75

/* The three stages (services/<stage>/<stage>.c). */
extern const kiln_stage_ops kiln_encoder_ops, kiln_denoiser_ops, kiln_decoder_ops;

/* The main of executable `binary`, which offers the stages ops[0..n_ops)
 * (one of each at most): parses the common command line (--model --bus
 * [--bus-key --bus-server-key] [--device] [--gpu] [--max-batch]
 * [--text-encoder-out-layers] [--prompt-cache-mb] [--vae-band-above MP]
 * [--vae-band-rows N] [--image-threads N] [--batch-window-ms] [--tensor-transport
 * auto|shm|cuda_ipc] [--replica-id ID], and with several stages offered
 * --stages, default all), loads the stages, serves until SIGINT/SIGTERM
 * or until one halts, and returns the exit status (0, 2 on a usage error,
 * KILN_WORKER_EXIT_CONFIG when the checkpoint or options are unusable,
 * KILN_WORKER_EXIT_RESTART when the gateway fenced this incarnation or
 * its device was lost, 1 on another fatal error).  Main thread, once. */
int kiln_worker_main(int argc, char **argv, const char *binary, const kiln_stage_ops *const *ops,
                     int n_ops);

/* ---- for stage implementations ---- */

const kiln_msg_job *kiln_worker_job_msg(const kiln_worker_job *j);
kiln_backend *kiln_worker_backend(kiln_worker *w);

/* 1 once the gateway cancelled the job or the worker is shutting down. */
int kiln_worker_cancelled(const kiln_worker_job *j);

/* While jobs[0..n) are watched, the backend stops at its next op once
 * every one of them is cancelled (kiln_be_set_cancel): the work under way
 * for them ends with KILN_ERR_CANCELLED within one op, whatever model runs
 * it.  The jobs must not be finished while watched; n = 0 ends the watch
 * and clears a cancel left in the backend.  Main (backend) thread only. */
void kiln_worker_watch(kiln_worker *w, kiln_worker_job **jobs, int n);

/* Opens input `name` of the job.  A missing optional input gives KILN_OK
 * with t zeroed.  The tensor's memory is the mapped reference itself when
 * the backend can use it in place (CPU backend and shm, or CUDA backend
 * and cuda_ipc, same dtype), otherwise a fresh backend tensor uploaded
 * from it; either way it stays valid until kiln_worker_done or
 * kiln_worker_release_inputs.  Errors:
 * KILN_ERR_INVALID for a missing required input or a bad reference,
 * KILN_ERR_UNSUPPORTED for a transport this worker cannot open. */
kiln_status kiln_worker_input(kiln_worker *w, kiln_worker_job *j, const char *name, int required,
                              kiln_tensor *t, kiln_err *err);
/* The same, as host bytes (small tensors such as ref_ids); *data points to
 * ref->len bytes valid as above.  A cuda_ipc input is KILN_ERR_UNSUPPORTED
 * here (its bytes are on a device). */
kiln_status kiln_worker_input_host(kiln_worker *w, kiln_worker_job *j, const char *name,
                                   int required, const kiln_tensor_ref **ref, const void **data,
                                   kiln_err *err);

/* Closes the job's inputs and sends `release` for their shm and cuda_ipc
 * references (idempotent; kiln_worker_done does it too).  With cuda_ipc
 * inputs it first waits for the backend's stream (kiln_be_sync), so the
 * producer never reuses a range this stage may still read.  Each opened
 * input is verified first (kiln_transport_verify): when one was freed
 * while the stage read it, the job's done becomes KILN_ERR_NOT_FOUND
 * whatever the stage reports, so a result computed from it is never
 * sent. */
void kiln_worker_release_inputs(kiln_worker *w, kiln_worker_job *j);

/* Output `name` of the job: rows [row0, row0 + rows) of a backend tensor,
 * copied into the shm pool, or for a device tensor with the cuda_ipc
 * transport into a device slab (same dtype, copied on the device and
 * synced before the reference can be sent), or into an inline buffer when
 * asked (small tensors). */
kiln_status kiln_worker_output(kiln_worker *w, kiln_worker_job *j, const char *name,
                               const kiln_tensor *src, int64_t row0, int64_t rows, int as_inline,
                               kiln_err *err);
/* A preview of the job's result before its done (the denoiser's partial
 * images): rows [row0, row0 + rows) of src go out at once as a `partial`
 * message with the job's id, preview index `preview` and output
 * "latents", made like kiln_worker_output's (shm or cuda_ipc, synced
 * first); the gateway hands it to a decoder, and the range comes back
 * through `free` like any output.  Nothing is sent for a cancelled job or
 * a halted incarnation (KILN_OK).  Errors (no memory in the pool, a
 * message that cannot be sent) leave nothing allocated; the job itself
 * may go on.  Backend thread (it may copy on the device). */
kiln_status kiln_worker_partial(kiln_worker *w, kiln_worker_job *j, int preview,
                                const kiln_tensor *src, int64_t row0, int64_t rows, kiln_err *err);
/* Output from host memory (e.g. int32 ids), always inline. */
kiln_status kiln_worker_output_host(kiln_worker *w, kiln_worker_job *j, const char *name,
                                    kiln_dtype dt, int ndim, const int64_t *shape,
                                    const void *data, kiln_err *err);
/* Appends encoded image `row` (the job takes the buffer's memory).  Any
 * thread: distinct rows of one job may arrive from several at once, all
 * before the job is done. */
kiln_status kiln_worker_output_image(kiln_worker_job *j, int row, kiln_buf *img, kiln_err *err);
/* The backend thread finished one step of a batch (a denoising step).
 * Steps are the gateway's proof that a busy replica is alive (a replica
 * with work whose steps stand still is fenced, docs/ARCHITECTURE.md); the
 * worker counts a whole batch as one step for stages that report none, and
 * counts answered jobs too.  KILN_FAULT_INJECT acts here.  Backend thread
 * only. */
void kiln_worker_step(kiln_worker *w);
/* Records a stage timing reported in done.ms. */
void kiln_worker_timing(kiln_worker_job *j, const char *name, double ms);

/* Finishes a job: st == KILN_OK sends done with its outputs; otherwise
 * done with the error (err's message; KILN_ERR_CANCELLED when the job was
 * cancelled), and its shm outputs return to the pool.  Releases inputs
 * and frees the job; the done returns the job's credit to the gateway. */
void kiln_worker_done(kiln_worker *w, kiln_worker_job *j, kiln_status st, const kiln_err *err);

#endif
