/* kiln supervisor: runs a set of child processes (the gateway and the
 * stage replicas of `kiln serve`), restarts one that dies, and stops them
 * in order on SIGINT/SIGTERM.
 *
 *   kiln_supervisor *s = kiln_supervisor_create(&err);
 *   kiln_supervisor_add(s, "kiln-gateway", KILN_CHILD_FRONT, gw_argv, &err);
 *   kiln_supervisor_add(s, "kiln-denoiser[0]", KILN_CHILD_BACK, dn_argv, &err);
 *   int rc = kiln_supervisor_run(s);     // until SIGINT / SIGTERM
 *   kiln_supervisor_destroy(s);
 *
 * Children run in their own process group (a terminal's Ctrl-C reaches
 * only the supervisor, which then stops them in order) and get SIGTERM if
 * the supervisor itself dies (PR_SET_PDEATHSIG).  A child that exits is
 * logged and restarted after a backoff that doubles from 250 ms to 30 s
 * while it keeps dying within 10 s of its start, and resets once it has
 * run longer; shm slabs a dead child leaves behind are removed.  A child
 * that exits with status 2 (usage) or 78 (EX_CONFIG: its checkpoint or
 * options are unusable) is not restarted: restarting cannot help, so the
 * supervisor shuts everything down and returns 1.
 *
 * Shutdown: the first SIGINT/SIGTERM sends SIGTERM to the front children
 * (the gateway drains its accepted requests, which still need the
 * replicas), then to the back children once the front ones are gone; a
 * second signal sends SIGTERM to everyone at once; children still alive
 * after grace_s get SIGKILL.
 *
 * Not thread-safe; kiln_supervisor_run blocks SIGINT, SIGTERM and SIGCHLD
 * in the calling thread (call it from the main thread of a
 * single-threaded process).
 */
#ifndef KILN_TOOLS_SUPERVISOR_H
#define KILN_TOOLS_SUPERVISOR_H

#include "common/error.h"

typedef struct kiln_supervisor kiln_supervisor;

typedef enum kiln_child_role {
    KILN_CHILD_FRONT, /* stopped first (the gateway) */
    KILN_CHILD_BACK,  /* stopped once the front children have exited */
} kiln_child_role;

kiln_supervisor *kiln_supervisor_create(kiln_err *err);
void kiln_supervisor_destroy(kiln_supervisor *s);

/* Seconds a child gets to exit after SIGTERM before SIGKILL (default 60). */
void kiln_supervisor_set_grace(kiln_supervisor *s, double grace_s);

/* Registers a child; argv[0] must be an executable path, argv is copied.
 * KILN_ERR_NOT_FOUND when argv[0] is not executable, _NOMEM. */
kiln_status kiln_supervisor_add(kiln_supervisor *s, const char *name, kiln_child_role role,
                                const char *const *argv, kiln_err *err);

/* Starts every child and supervises them until a shutdown completes.
 * Returns 0 after a signal-driven shutdown, 1 after a child's
 * configuration error or when the signals cannot be set up. */
int kiln_supervisor_run(kiln_supervisor *s);

/* The path of executable `name` for `kiln serve`: next to the running
 * binary (an installation), else in the build tree's services/ or
 * services/gateway/ beside tools/.  KILN_ERR_NOT_FOUND naming it. */
kiln_status kiln_supervisor_find_exe(const char *name, char *out, size_t cap, kiln_err *err);

#endif
