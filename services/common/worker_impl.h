/* Internals shared by the worker's files (queue and bus thread in
 * worker.c, job inputs/outputs in worker_io.c, start-up in worker_main.c). */
#ifndef KILN_SERVICES_WORKER_IMPL_H
#define KILN_SERVICES_WORKER_IMPL_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>

#include "common/bus.h"
#include "common/transport.h"
#include "worker.h"

#define WORKER_HB_MS 250
/* A halted incarnation (fenced, or its device lost) waits this long for
 * consumers to return
 * the ranges they still read before it exits; the bus thread ends the
 * process WORKER_HALT_EXIT_MS after the halt whatever the backend thread
 * is doing (it may be stuck in the device). */
#define WORKER_HALT_DRAIN_MS 5000
#define WORKER_HALT_EXIT_MS 10000
/* A leaving incarnation holding nothing stops no sooner than this after
 * its `leaving`, so that jobs the gateway sent before hearing it arrive. */
#define WORKER_LEAVE_SETTLE_MS 500

/* Why an incarnation ends before its time (kiln_worker.halt). */
enum { WORKER_RUNNING = 0, WORKER_FENCED, WORKER_FAULTED };

/* KILN_FAULT_INJECT for this stage (worker_fault.c): after how many steps
 * (kiln_worker_step) the backend thread stalls for good, its backend is
 * lost, or (CUDA) an op faults on an illegal address; which done handing
 * images by reference (counted in image_dones) frees them before it goes
 * out (the decoder); 0: never. */
typedef struct worker_fault {
    uint64_t stall_at, lost_at, illegal_at, stale_images_at;
    atomic_uint_fast64_t image_dones;
} worker_fault;

/* The stages of one process (worker_group.c): one replica of each at
 * most, each on its own backend thread, loaded together, started only
 * once all loaded, and halted together (they share the process, and on a
 * GPU its context, so one's lost device or fence is all of theirs). */
#define WORKER_GROUP_MAX KILN_STAGE_COUNT

typedef struct worker_group {
    const char *binary; /* for logs and usage: "kiln-stages", "kiln-encoder", ... */
    kiln_worker *w[WORKER_GROUP_MAX];
    int n;
    pthread_mutex_t mu; /* the barriers (worker_group.c) */
    pthread_cond_t cv;
    int n_arrived, n_failed; /* start: stages loaded or failed to, those that failed */
    int n_served;            /* stop: stages done serving (none runs work any more) */
    atomic_int halting; /* a stage halted: the first one halts the others */
    /* Drawn when the process starts, said in every stage's hello: the
     * gateway ends them together (common/proto.h, kiln_msg_hello). */
    char process[KILN_PROTO_PROCESS_MAX];
    int health_port; /* 0: none (worker_health.c) */
    int health_fd, health_started;
    atomic_int health_stop;
    pthread_t health_thread;
} worker_group;

typedef struct job_input {
    kiln_tensor_ref ref; /* a copy: the message may be freed first */
    kiln_transport *tx;  /* the transport it was opened with; NULL when fetched */
    void *fetched;       /* its bytes, fetched by value (owned) */
    kiln_tensor t;       /* backend tensor when uploaded (owned) */
    int uploaded;
} job_input;

typedef struct job_output {
    kiln_transport *tx;
    kiln_tensor_ref ref;
} job_output;

struct kiln_worker_job {
    kiln_msg *msg; /* the decoded `job` */
    atomic_int cancelled;
    _Atomic double t_cancel; /* kiln_now_ms when the cancel came, 0 before */
    atomic_int *stop; /* the worker's: shutting down counts as cancelled */
    double t_recv, t_start;
    kiln_worker_job *next; /* queue link */
    int queued;
    job_input in[KILN_PROTO_MAX_TENSORS];
    int n_in, released;
    int inputs_lost; /* an input's range was freed while we read it */
    job_output out[KILN_PROTO_MAX_TENSORS];
    int n_out;
    kiln_msg *done; /* the reply under construction */
    /* KILN_PROTO_MAX_ROWS, allocated by the first image to arrive: the
     * decoder's pool threads append a job's rows at once. */
    _Atomic(kiln_buf *) images;
};

struct kiln_worker {
    const kiln_stage_ops *ops;
    worker_group *group; /* the process's stages, this one among them */
    int status;          /* its exit status (worker_group.c): 0, or why the process ends */
    kiln_worker_opts opts;
    char replica[KILN_PROTO_ID_MAX], host[KILN_PROTO_ID_MAX], model[KILN_PROTO_ID_MAX];
    uint64_t epoch; /* this incarnation: random, != 0, in every message */
    kiln_checkpoint *ck;
    kiln_model_traits traits; /* the checkpoint's, sent in every hello */
    kiln_backend *be;
    void *state;
    kiln_worker_job **watch; /* kiln_worker_watch: the backend stops when all are cancelled */
    int n_watch;
    kiln_transport *shm, *inl;
    kiln_transport *cuda; /* cuda_ipc: on a CUDA backend (consumes; produces when cuda_out) */
    int cuda_out;         /* device outputs go as cuda_ipc references */
    int capacity; /* jobs held at most (queued + running) */

    pthread_mutex_t mu; /* queue and held */
    pthread_cond_t cv;
    kiln_worker_job *q_head, *q_tail;
    int q_rows;
    kiln_worker_job **held;
    int n_held, cap_held;

    pthread_mutex_t out_mu; /* outbound frames */
    kiln_buf *frames;
    int n_frames, cap_frames;
    int efd; /* eventfd waking the bus thread */

    atomic_int stop;     /* shutting down: no new batches */
    /* SIGTERM with --drain-s: it said `leaving` and answers the jobs it
     * holds until leave_deadline (kiln_now_ms), then stops; it says `bye`
     * once its outputs came back (worker_shutdown).  leave_started,
     * leave_deadline and signals_seen are the bus thread's. */
    atomic_int leaving;
    double leave_started, leave_deadline;
    int signals_seen;
    atomic_int bus_stop; /* the bus thread flushes and exits */
    /* WORKER_FENCED once the gateway declared this incarnation dead,
     * WORKER_FAULTED once its backend was lost (it said `bye`): nothing it
     * does counts any more, so it sends no replies, drains its ranges and
     * exits with KILN_WORKER_EXIT_RESTART. */
    atomic_int halt;
    /* What the backend finished (steps, batches, jobs answered), sent with
     * every hb: the gateway's proof that a replica with work is alive. */
    atomic_uint_fast64_t progress;
    /* Bytes of /dev/shm its outputs need and cannot have now (hb.shm_short,
     * worker_shm_short): no work comes while it is not 0. */
    atomic_uint_fast64_t shm_short;
    /* The device's memory in use and in all, sampled by the backend
     * thread after its model load and each batch (0 on the CPU); sent
     * with the heartbeats. */
    atomic_uint_fast64_t dev_used, dev_total;
    uint64_t steps;          /* kiln_worker_step calls (backend thread) */
    uint64_t steps_at_batch; /* steps when the running batch started */
    worker_fault fault;
    pthread_t bus_thread;
    int bus_started;
    kiln_bus_keys bus_keys; /* loaded from opts.bus_key / bus_server_key / bus_allow */
    kiln_bus *bus;

    /* Transport domain and the by-value hand-off (worker_data.c). */
    kiln_domain domain;
    char data_host[KILN_PROTO_ENDPOINT_MAX - 16]; /* how other stages reach this one */
    char data_ep[KILN_PROTO_ENDPOINT_MAX];        /* announced in hello; "" when none */
    kiln_bus *data;                               /* producer: the data thread's socket */
    pthread_t data_thread;
    int data_started;
    atomic_int data_stop;
    struct data_conn *conns; /* consumer: sockets to producers (the backend thread's) */
    int n_conns;
    unsigned conn_serial;
    atomic_llong fetched, fetched_bytes, served, served_bytes;

    /* Read by the health port (worker_health.c). */
    atomic_int loaded, registered; /* model loaded; hello sent on a live connection */
    atomic_llong bus_tick_ms;      /* the bus thread's last turn */
};

/* Counts SIGINT/SIGTERMs (the handler's), polled by the bus thread. */
extern volatile sig_atomic_t kiln_worker_signalled;

/* Stamps m with the worker's epoch, encodes it and queues it for the bus
 * thread (any thread); fails when m cannot be encoded (logged). */
kiln_status worker_send(kiln_worker *w, kiln_msg *m);
/* 1 once the incarnation is halted (any thread). */
int worker_halted(kiln_worker *w);
/* Halts the incarnation (WORKER_FENCED or WORKER_FAULTED; the first halt
 * wins): no new work, the held jobs cancelled, no more replies; then the
 * other stages of its process, and a faulted one says `bye` with `why`.
 * Any thread. */
void worker_halt(kiln_worker *w, int why, const char *reason);
/* worker_halt's parts: the halt itself (1 when this call made it, 0 when
 * it was halted already), and the `bye`. */
int worker_halt_mark(kiln_worker *w, int why, const char *reason);
void worker_say_bye(kiln_worker *w, const char *reason);
/* Removes a job from the held table (any thread). */
void worker_unhold(kiln_worker *w, kiln_worker_job *j);
void worker_job_free(kiln_worker_job *j);

/* Reads KILN_FAULT_INJECT (a test aid, docs/OPERATIONS.md) into w->fault:
 * -1 with a message on stderr when it is malformed. */
int worker_fault_setup(kiln_worker *w);
/* KILN_FAULT_INJECT decode:stale_image_refs_at: called with every ok
 * done about to be sent; frees the image ranges of the one it names
 * (any thread). */
void worker_fault_images(kiln_worker *w, kiln_worker_job *j);
/* Progress that is not a step: a job answered (any thread). */
void worker_progress(kiln_worker *w);

/* Its locks and wake-up eventfd, before anything else may touch it. */
kiln_status worker_init(kiln_worker *w, kiln_err *err);
/* Connects to the bus and starts the bus thread (hello once connected). */
kiln_status worker_start(kiln_worker *w, kiln_err *err);

/* worker_health.c: the --health-port thread of the process, which
 * answers for all its stages (nothing without one). */
kiln_status worker_health_start(worker_group *g, kiln_err *err);
void worker_health_stop(worker_group *g);

/* worker_main.c: one stage's life on its backend thread: loads it
 * (worker_load), then, once the whole group loaded, registers and serves
 * (worker_start, worker_serve) until it stops; worker_teardown frees what
 * it made.  worker_load and worker_teardown must run on the thread that
 * serves, which owns the backend (a CUDA device is current per thread). */
kiln_status worker_load(kiln_worker *w, kiln_err *err);
void worker_teardown(kiln_worker *w);

/* worker_group.c: loads and runs the group's stages, one backend thread
 * each (the first on the calling thread); returns the process's exit
 * status (worker.h kiln_worker_main). */
int worker_group_run(worker_group *g);
/* After w halted: halts the other stages of its process, then says w's
 * `bye` when `bye` is set and theirs (any thread). */
void worker_group_halt_others(kiln_worker *w, const char *reason, int bye);

/* worker_data.c: binds the data socket of a producer stage and starts its
 * thread (nothing for the decoder, or when --data-port is -1). */
kiln_status worker_data_start(kiln_worker *w, kiln_err *err);
void worker_data_stop(kiln_worker *w);
/* Fetches the bytes of shm reference `ref` from its owner's data socket
 * into *out (64-byte aligned, the caller frees), giving up after 30 s or
 * when the job is cancelled.  On the thread that opens the job's inputs. */
kiln_status worker_data_fetch(kiln_worker *w, kiln_worker_job *j, const kiln_fetch_src *src,
                              const kiln_tensor_ref *ref, void **out, kiln_err *err);
/* Runs batches until stop, then fails queued jobs and winds down. */
void worker_serve(kiln_worker *w);
void worker_shutdown(kiln_worker *w);
/* Samples the device's memory into w->dev_used / dev_total (nothing on a
 * backend without device memory).  Backend thread. */
void worker_sample_memory(kiln_worker *w);

#endif
