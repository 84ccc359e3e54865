/* kiln bus protocol: the msgpack messages between the gateway and the stage
 * replicas, and the tensor references they carry (docs/ARCHITECTURE.md,
 * "Services", is the normative description; this is its C form).
 *
 *   kiln_msg m = {.type = KILN_MSG_READY, .epoch = my_epoch, .ready.credits = 4};
 *   kiln_buf frame = {0};
 *   if (kiln_msg_encode(&m, &frame, &err)) ...        // one zmq frame
 *
 *   kiln_msg *in = kiln_msg_decode(frame.data, frame.len, &err);
 *   if (!in) { KILN_LOG_WARN("dropped: %s", err.msg); ... }  // never fatal
 *   switch (in->type) { case KILN_MSG_JOB: ... in->job.denoise.width ... }
 *   kiln_msg_free(in);
 *
 * Encoding reads a kiln_msg whose strings and byte ranges are borrowed from
 * the caller.  Decoding is strict: the frame must be one msgpack map whose
 * `t` names a known type, every field the type needs must be present with
 * the right msgpack type and within its bounds (sizes, counts, shapes whose
 * byte count matches `len`, shm names of the kiln form); unknown keys are
 * ignored so newer peers can add fields.  Anything else is KILN_ERR_INVALID
 * with a message naming the field; a hostile frame can cost at most a few
 * times its own size in memory (container counts are checked against the
 * bytes left before msgpack-c allocates for them).
 *
 * A decoded message owns every string and byte range it points to (one
 * allocation freed by kiln_msg_free); copy what must outlive it.
 * All functions are thread-safe on distinct messages; there is no global
 * state.
 */
#ifndef KILN_PROTO_H
#define KILN_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "buf.h"
#include "domain.h"
#include "error.h"
#include "image.h"
#include "tensor.h"
#include "traits.h"

#define KILN_PROTO_VERSION 7 /* 7: decode jobs may take their image files by reference */

#define KILN_PROTO_MAX_FRAME (512u << 20) /* bytes in one message */
#define KILN_PROTO_ID_MAX 128             /* replica ids, host and model names, with the NUL */
#define KILN_PROTO_MODEL_ID_MAX 64        /* kiln_proto_model_id's buffer, with the NUL */
#define KILN_PROTO_SLAB_MAX 64            /* shm / slab names, with the NUL */
#define KILN_PROTO_IPC_HANDLE 64          /* sizeof(cudaIpcMemHandle_t) */
/* Named tensors in one `in` / `out` map: a decode done's image references
 * (one per row, docs/ARCHITECTURE.md "Images by reference") fit for the
 * 10 images a service request may ask for (KILN_LIMITS_SERVICE). */
#define KILN_PROTO_MAX_TENSORS 16
#define KILN_PROTO_TENSOR_NAME_MAX 16     /* with the NUL */
#define KILN_PROTO_MAX_REFS 64            /* references in one release / free */
#define KILN_PROTO_MAX_PROMPTS 64         /* prompts of one encode job */
#define KILN_PROTO_MAX_ROWS 256           /* images of one denoise / decode job */
#define KILN_PROTO_MAX_TIMINGS 12          /* named timings of one done */
#define KILN_PROTO_MAX_EDIT_REFS 8        /* reference images of one encode job (KILN_MAX_REFS) */
#define KILN_PROTO_MAX_STRING (1u << 20)  /* prompts, error messages */
#define KILN_PROTO_MAX_SEQ 4096           /* encode max_seq */
#define KILN_PROTO_MAX_STEPS 1000
#define KILN_PROTO_MAX_PREVIEWS 3         /* previews of one denoise job (OpenAI's partial_images) */
#define KILN_PROTO_MAX_CREDITS 65536
#define KILN_PROTO_ALIGN 64               /* slab offsets are multiples of this */
#define KILN_PROTO_ENDPOINT_MAX 256       /* data socket endpoints, with the NUL */
#define KILN_PROTO_KEY_TEXT 41            /* a CURVE public key in Z85, with the NUL */
#define KILN_PROTO_PROCESS_MAX 33         /* hello's process token, with the NUL */

typedef enum kiln_msg_type {
    /* replica -> gateway */
    KILN_MSG_HELLO = 1,
    KILN_MSG_READY,
    KILN_MSG_HB,
    KILN_MSG_DONE,
    KILN_MSG_RELEASE,
    KILN_MSG_BYE,
    KILN_MSG_LEAVING,
    KILN_MSG_PARTIAL, /* a preview of a running job's result (kiln_msg_done's fields) */
    /* gateway -> replica */
    KILN_MSG_JOB,
    KILN_MSG_CANCEL,
    KILN_MSG_FREE,
    KILN_MSG_FENCED,
    KILN_MSG_GONE,
    /* consumer -> producer, on the producer's data socket */
    KILN_MSG_FETCH,
    KILN_MSG_TYPE_END /* one past the last type */
} kiln_msg_type;

/* The `t` string of a type ("hello", "job", ...); NULL for an invalid one. */
const char *kiln_msg_type_name(kiln_msg_type t);
/* Returns -1 for an unknown name. */
int kiln_msg_type_parse(const char *name, kiln_msg_type *out);

typedef enum kiln_stage {
    KILN_STAGE_ENCODE = 0,
    KILN_STAGE_DENOISE,
    KILN_STAGE_DECODE,
    KILN_STAGE_COUNT
} kiln_stage;

/* "encode", "denoise", "decode"; NULL for an invalid value. */
const char *kiln_stage_name(kiln_stage s);
/* Returns -1 for an unknown name. */
int kiln_stage_parse(const char *name, kiln_stage *out);

/* The model name replicas announce in `hello` (and the gateway compares
 * with its own): the base name of the checkpoint folder after resolving
 * symlinks and trailing slashes, characters outside [A-Za-z0-9._-] turned
 * into '_', at most cap - 1 bytes; both sides use cap =
 * KILN_PROTO_MODEL_ID_MAX so long names truncate alike.  "model" when
 * nothing is left. */
void kiln_proto_model_id(const char *model_dir, char *out, size_t cap);

/* The reverse of kiln_status_name (error codes travel by name); -1 when
 * unknown. */
int kiln_status_parse(const char *name, kiln_status *out);

/* ---- tensor references ---- */

typedef enum kiln_ref_kind {
    KILN_REF_INLINE = 0, /* bytes inside the message */
    KILN_REF_SHM,        /* a range of a POSIX shm slab of `owner` */
    KILN_REF_CUDA_IPC,   /* a range of a device slab of `owner`, exported once */
    KILN_REF_KIND_COUNT
} kiln_ref_kind;

/* Bit i set = kind i supported; hello's `transports`. */
#define KILN_TRANSPORT_BIT(kind) (1u << (kind))

/* "inline", "shm", "cuda_ipc"; NULL for an invalid value. */
const char *kiln_ref_kind_name(kiln_ref_kind k);
/* Returns -1 for an unknown name. */
int kiln_ref_kind_parse(const char *name, kiln_ref_kind *out);

typedef struct kiln_tensor_ref {
    kiln_ref_kind kind;
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    uint64_t len; /* bytes = numel * dtype size, checked on decode */
    /* shm and cuda_ipc: */
    char owner[KILN_PROTO_ID_MAX];   /* replica id whose pool the range returns to */
    uint64_t epoch;                  /* the owner's incarnation (kiln_msg.epoch), != 0 */
    char slab[KILN_PROTO_SLAB_MAX];  /* shm name "/kiln-..." (also names a cuda slab) */
    uint64_t off;                    /* byte offset in the slab */
    /* The range's allocation, != 0: unique within the owner's incarnation,
     * so a free or a read of a range that was freed and handed out again
     * never matches (common/slab_table.h). */
    uint64_t gen;
    /* cuda_ipc only: */
    uint8_t handle[KILN_PROTO_IPC_HANDLE];
    int device; /* producer's device ordinal */
    /* inline only: `len` bytes, borrowed (encode) or owned by the message
     * (decode). */
    const void *data;
} kiln_tensor_ref;

/* 1 when `name` is a slab name kiln creates: "/kiln-" followed by 1..56
 * characters of [A-Za-z0-9._-].  Consumers only open such names, so a
 * message cannot make them map an arbitrary shm object. */
int kiln_slab_name_valid(const char *name);

/* Named tensors: a job's `in` and a done's `out`. */
typedef struct kiln_named_ref {
    char name[KILN_PROTO_TENSOR_NAME_MAX];
    kiln_tensor_ref ref;
} kiln_named_ref;

typedef struct kiln_ref_map {
    int n;
    kiln_named_ref items[KILN_PROTO_MAX_TENSORS];
} kiln_ref_map;

/* The reference called `name`, or NULL. */
const kiln_tensor_ref *kiln_ref_map_get(const kiln_ref_map *m, const char *name);
/* Adds or replaces `name` (copying the reference struct; inline data stays
 * borrowed).  KILN_ERR_INVALID for a full map or a name too long. */
kiln_status kiln_ref_map_put(kiln_ref_map *m, const char *name, const kiln_tensor_ref *ref,
                             kiln_err *err);

/* A decode done hands the encoded file of row `row` by reference as out
 * item "image.<row>" (decimal, no leading zeros): kiln_image_ref_name
 * writes that name into out[KILN_PROTO_TENSOR_NAME_MAX];
 * kiln_image_ref_row gives the row of such a name, -1 for any other. */
void kiln_image_ref_name(int row, char *out);
int kiln_image_ref_row(const char *name);

/* Validates a reference as the decoder does (kind, dtype, shape, len
 * consistency, names).  Producers call it before sending. */
kiln_status kiln_tensor_ref_check(const kiln_tensor_ref *r, kiln_err *err);

/* ---- messages ---- */

typedef struct kiln_bytes {
    const uint8_t *data;
    size_t len;
} kiln_bytes;

typedef struct kiln_msg_hello {
    kiln_stage stage;
    const char *replica; /* "<stage>-<host>-<pid>", also the DEALER routing id */
    const char *model;   /* checkpoint folder's base name */
    const char *host;
    int max_batch;       /* >= 1 */
    unsigned transports; /* KILN_TRANSPORT_BIT mask, non-zero */
    int version;         /* KILN_PROTO_VERSION (encode writes it when 0) */
    /* Where its shm / cuda_ipc references can be opened (common/domain.h). */
    kiln_domain domain;
    /* Its data socket (consumers in other domains fetch its outputs there
     * by value), "tcp://host:port"; "" or NULL when it has none.  With
     * CURVE, data_key is its public key (Z85), else "" or NULL. */
    const char *data, *data_key;
    /* What the checkpoint it serves implies for requests (common/traits.h,
     * engine/family.h): the gateway resolves requests with the traits of
     * the replicas' hellos, never opening the checkpoint itself, and
     * refuses a replica whose traits differ from those it took first.
     * Validated: a family name of [a-z0-9_-], steps 1..1000, guidance
     * 0..100, widths 1..KILN_TRAITS_WIDEST_*. */
    kiln_model_traits traits;
    /* The replicas of one process (kiln-stages) announce the same token,
     * drawn at random when the process starts: they live and die together,
     * so the gateway ends them all when it ends one (fenced, never when one
     * left gracefully) and no job re-runs on a stage of the dying process.
     * 1..32 characters of [0-9a-f]; "" or NULL (optional): not said. */
    const char *process;
} kiln_msg_hello;

typedef struct kiln_msg_ready {
    int credits; /* >= 1: this many more jobs may be sent */
} kiln_msg_ready;

typedef struct kiln_timing {
    const char *name;
    double ms;
} kiln_timing;

typedef struct kiln_msg_done {
    uint64_t job;
    int ok;
    kiln_status code;    /* when !ok: never KILN_OK */
    const char *message; /* when !ok: safe to show a client */
    /* encode: embeds, neg, ref_tokens, ref_ids; denoise: latents; decode:
     * "image.<row>" for each row whose file travels by reference (U8, 1-D,
     * in the sender's shm pool; only where the job's image_kinds allowed
     * it) */
    kiln_ref_map out;
    /* decode: the encoded image files that travel inline, in row order,
     * the rows in `out` left out (all of them when there are none) */
    int n_images;
    kiln_bytes images[KILN_PROTO_MAX_ROWS];
    int n_ms;
    kiln_timing ms[KILN_PROTO_MAX_TIMINGS];
    /* partial only (job, out and this; always ok, no images or timings):
     * the preview's index 0 .. KILN_PROTO_MAX_PREVIEWS-1 among the job's
     * previews; out holds `latents`, the current estimate of the clean
     * latents (engine/denoise_stage.h on_preview), which the gateway
     * sends to a decoder like final latents. */
    int preview;
} kiln_msg_done;

typedef struct kiln_msg_refs {
    int n;
    kiln_tensor_ref refs[KILN_PROTO_MAX_REFS];
} kiln_msg_refs;

/* gone: an incarnation of another replica is dead; its references will
 * not be handed out again, so mappings of its slabs can go. */
typedef struct kiln_msg_gone {
    const char *replica;  /* its id */
    uint64_t incarnation; /* its epoch, != 0 */
} kiln_msg_gone;

typedef struct kiln_job_encode {
    int n_prompts; /* 1..KILN_PROTO_MAX_PROMPTS */
    const char *prompts[KILN_PROTO_MAX_PROMPTS];
    const char *negative; /* NULL: no CFG; else encode it ("" is a valid prompt) */
    int max_seq;          /* 1..512 */
    int n_refs;           /* edit references, encoded image files */
    kiln_bytes refs[KILN_PROTO_MAX_EDIT_REFS];
    /* Inpainting: the mask's PNG file (kiln_image_decode_mask) for the one
     * reference, which is then prepared as engine/inpaint.h says and the
     * job also outputs "mask" (N floats); len 0: none. */
    kiln_bytes mask;
    /* Image-to-image (strength, no mask): the one reference is the start
     * image, prepared as inpainting's (resized, not cropped:
     * engine/inpaint.h); 0: an edit reference (also when absent on the
     * wire, as from an older gateway). */
    int start;
} kiln_job_encode;

typedef struct kiln_job_denoise {
    int n;                 /* images per prompt; rows = n_seeds, prompt-major */
    int n_seeds;           /* B, a multiple of n */
    uint64_t seeds[KILN_PROTO_MAX_ROWS];
    int width, height;     /* multiples of 16 */
    int steps;
    float guidance;
    int batch_noise;
    /* Image-to-image (engine/denoise_stage.h): (0, 1], the job's
     * "ref_tokens" input is the starting image; 0 (absent on the wire):
     * text-to-image or edit. */
    double strength;
    /* Previews (OpenAI's partial_images, 0..KILN_PROTO_MAX_PREVIEWS; 0
     * when absent on the wire): the denoiser sends a `partial` with the
     * estimate of the clean latents at the steps
     * kiln_sched_preview_steps picks, before its done. */
    int previews;
} kiln_job_denoise;

typedef struct kiln_job_decode {
    int width, height;
    kiln_image_format format;
    int compression; /* 0..100, already resolved (kiln_request_resolve) */
    /* How the image files may travel besides inline (KILN_TRANSPORT_BIT
     * mask, only KILN_REF_SHM means anything): the gateway sets shm where
     * it can open the decoder's /dev/shm; 0, also when absent on the wire
     * (an older gateway): inline only. */
    unsigned image_kinds;
} kiln_job_decode;

/* Where a consumer fetches the inputs of one owner by value (a producer
 * in another transport domain): its data socket and CURVE key. */
typedef struct kiln_fetch_src {
    char owner[KILN_PROTO_ID_MAX];
    const char *endpoint; /* "tcp://host:port" */
    const char *key;      /* Z85 public key, or "" without CURVE */
} kiln_fetch_src;

typedef struct kiln_msg_job {
    uint64_t job;
    kiln_stage stage;
    /* The reference kinds the job's tensor outputs may take
     * (KILN_TRANSPORT_BIT mask; 0 = any the replica chooses): the gateway
     * leaves cuda_ipc out when no replica of the next stage could open it. */
    unsigned out_kinds;
    /* Inputs of these owners are fetched from their data socket instead
     * of opened here (another transport domain). */
    int n_src;
    kiln_fetch_src src[KILN_PROTO_MAX_TENSORS];
    union {
        kiln_job_encode encode;
        kiln_job_denoise denoise;
        kiln_job_decode decode;
    };
    kiln_ref_map in; /* denoise: embeds, neg?, ref_tokens?, ref_ids?; decode: latents */
} kiln_msg_job;

/* Every message carries `epoch`: the incarnation of the replica that
 * sends it (replica -> gateway) or that it is meant for (gateway ->
 * replica).  A replica draws a random non-zero epoch when it starts; the
 * gateway ignores whatever comes from an incarnation it has fenced, and a
 * replica drops whatever is addressed to another incarnation of its id
 * (docs/ARCHITECTURE.md, "Fencing"). */
typedef struct kiln_msg {
    kiln_msg_type type;
    uint64_t epoch; /* != 0 */
    union {
        kiln_msg_hello hello;
        kiln_msg_ready ready;
        kiln_msg_done done;
        kiln_msg_refs refs; /* release, free and fetch */
        kiln_msg_job job;
        uint64_t cancel_job; /* cancel */
        struct { /* hb */
            /* the replica's progress counter (denoising steps, batches and
             * jobs finished so far); it moves while the backend works */
            uint64_t progress;
            /* bytes of shared memory a producer needs and /dev/shm has no
             * room for (kiln_transport_stats.short_bytes while still so);
             * 0: none.  Such a replica takes no work until there is. */
            uint64_t shm_short;
            /* Memory, for /metrics (optional on the wire: 0 = not
             * reported): the process's resident set (VmRSS) and its
             * device's memory in use and in all (cudaMemGetInfo: every
             * process on that GPU; 0 on the CPU backend). */
            uint64_t rss, dev_used, dev_total;
        };
        kiln_msg_gone gone;
        /* bye: why this incarnation stops now (its device is lost: its
         * jobs will not be answered; or, after `leaving`, it has answered
         * them all and exits).  For logs, never for clients. */
        const char *bye_reason;
        /* leaving: no fields; the incarnation takes no new jobs, answers
         * those it holds, then says `bye` (a graceful stop: SIGTERM) */
        /* fenced: no fields; the epoch it names is declared dead */
    };
} kiln_msg;

/* The semantic checks encode and decode apply (ranges, counts, references,
 * stage parameters), for a message built or edited in memory.
 * KILN_ERR_INVALID naming the field. */
kiln_status kiln_msg_check(const kiln_msg *m, kiln_err *err);

/* Appends the msgpack encoding of `m` to `out`.  The message is validated
 * as the decoder would, so a bad message fails here (KILN_ERR_INVALID) and
 * never reaches a peer.  KILN_ERR_NOMEM; `out` keeps its length on failure.
 * Thread-safe on distinct buffers. */
kiln_status kiln_msg_encode(const kiln_msg *m, kiln_buf *out, kiln_err *err);

/* Decodes one frame into a new message owned by the caller (kiln_msg_free).
 * NULL with err set: KILN_ERR_INVALID for anything malformed, _NOMEM. */
kiln_msg *kiln_msg_decode(const void *frame, size_t len, kiln_err *err);
/* Accepts NULL. */
void kiln_msg_free(kiln_msg *m);

#endif
