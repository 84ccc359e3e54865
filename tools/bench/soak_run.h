/* kiln-soak's run: the traffic from several connections for the given
 * time, the replica faults on the way, and the tally.
 *
 *   kiln_soak_run run;
 *   kiln_soak_run_do(&opts, traffic, verify, &run, &err);   // verify may be NULL
 *   kiln_soak_run_classify(&run, &opts);   // which answers were errors
 *   ... kiln_soak_report_*(&run) ...; kiln_soak_run_free(&run);
 *
 * Each of opts.concurrency threads owns one connection and sends request
 * k = 0, 1, 2, ... (shared counter) until the duration is over; a request
 * whose client leaves (kiln_soak_req.leave) is sent on a connection of its
 * own that is closed (half of them with an RST) before the answer.  Every
 * 200 is checked (kiln_soak_check) and, with `verify`, each image compared
 * with the CLI's bytes.  A faults thread (with opts.serve_pid) sends
 * SIGKILL to one replica of the kill stage and SIGSTOP (then SIGCONT) to
 * one of the stop stage at their times, one after the other, and notes
 * when the service healed: /metrics showed the stage's replicas drop
 * below their number before the fault and come back, and /readyz answers
 * 200 (or, for a stop too short to be noticed, the replica still runs 2 s
 * after SIGCONT).  The run functions are called from one thread.
 */
#ifndef KILN_SOAK_RUN_H
#define KILN_SOAK_RUN_H

#include <stddef.h>
#include <sys/types.h>

#include "common/error.h"
#include "soak_mem.h"
#include "soak_opts.h"
#include "soak_traffic.h"
#include "soak_verify.h"

enum { KILN_SOAK_LEFT = -1, KILN_SOAK_NO_ANSWER = 0 };

typedef struct kiln_soak_record {
    uint64_t k;
    double t0, t1;   /* seconds since the traffic began */
    int status;      /* HTTP status, KILN_SOAK_NO_ANSWER, or KILN_SOAK_LEFT */
    int edit, width, height, n, n_refs;
    kiln_image_format format;
    int bad;         /* a 200 whose body or image was malformed */
    int verified, wrong; /* its images identical to the CLI's / not */
    int unexpected;  /* set by kiln_soak_run_classify */
} kiln_soak_record;

typedef struct kiln_soak_fault {
    char what[8];     /* "kill" or "stop" */
    char stage[16];
    pid_t pid;        /* 0: no replica of the stage was found */
    double at_s;      /* when the signal went (seconds since the traffic began) */
    double cont_s;    /* stop: when SIGCONT went */
    double healed_s;  /* -1: not healed by the end */
    int before;       /* the stage's live replicas before the fault */
} kiln_soak_fault;

#define KILN_SOAK_ERRORS_KEPT 20

typedef struct kiln_soak_run {
    double wall_s;                /* from the traffic's start to the last answer */
    kiln_soak_record *rec;
    size_t n_rec, cap_rec;
    kiln_soak_fault faults[2];
    int n_faults;
    int first_status;             /* --first: its status (0: not sent) */
    double first_s;
    char first_error[KILN_ERR_MSG_MAX];
    char errors[KILN_SOAK_ERRORS_KEPT][256]; /* the first unexpected answers' reasons */
    int n_errors;
    kiln_soak_mem *mem;           /* NULL without --serve-pid */
    double mem_end_s;             /* the traffic's end on the sampler's clock */
    /* Set by kiln_soak_run_classify: */
    long requests, answered, left, no_answer, ok, allowed_503, unexpected;
    long images, verified, wrong, bad;
} kiln_soak_run;

/* Runs the soak (--first, then the traffic with the faults).  Fails only
 * for its own resources (_NOMEM, threads) or a service that never became
 * ready (_UNAVAILABLE); failed requests are tallied, not returned. */
kiln_status kiln_soak_run_do(const kiln_soak_opts *o, const kiln_soak_traffic *t,
                             const kiln_soak_verify *v, kiln_soak_run *run, kiln_err *err);
/* Marks each record unexpected or not and fills the counters: statuses
 * other than 200 are unexpected, except 503s of requests that overlapped
 * a fault (from its signal to its healing plus opts.heal_grace_s, or to
 * the end when it did not heal); transport failures are unexpected; the
 * client's own leaving is not. */
void kiln_soak_run_classify(kiln_soak_run *run, const kiln_soak_opts *o);
void kiln_soak_run_free(kiln_soak_run *run);

#endif
