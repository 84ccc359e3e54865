/* Progress of `kiln generate` / `kiln edit` on stderr: the stage running,
 * each denoising step and the time since the start.
 *
 *   cli_progress p;
 *   cli_progress_init(&p, CLI_PROGRESS_AUTO, stderr);   // on when stderr is a terminal
 *   cli_progress_stage(&p, "encode");
 *   job.on_step = cli_progress_step, job.user = &p;      // "denoise: step 2/4"
 *   cli_progress_end(&p);
 *
 * On a terminal one line is rewritten in place (\r); with --progress on a
 * pipe or file every event is a line of its own, so logs keep them.  Not
 * thread-safe: one progress per run, used from the thread that runs it.
 */
#ifndef KILN_TOOLS_CLI_PROGRESS_H
#define KILN_TOOLS_CLI_PROGRESS_H

#include <stdio.h>

typedef enum cli_progress_mode {
    CLI_PROGRESS_AUTO = 0, /* on when the stream is a terminal */
    CLI_PROGRESS_ON,       /* --progress */
    CLI_PROGRESS_OFF,      /* -q */
} cli_progress_mode;

typedef struct cli_progress {
    FILE *f;
    int on, tty, open; /* open: a \r line waits for its newline */
    double t0, step_t0;
    int steps;
    const char *stage;
} cli_progress;

void cli_progress_init(cli_progress *p, cli_progress_mode mode, FILE *f);
/* A stage starts ("encode", "denoise", "decode", "write"); steps: the
 * denoising steps that follow (0 for the other stages). */
void cli_progress_stage(cli_progress *p, const char *stage, int steps);
/* kiln_denoise_job.on_step: step `step` (0-based) starts; user is the
 * cli_progress. */
void cli_progress_step(void *user, int step);
/* Ends the open line, with the total time. */
void cli_progress_end(cli_progress *p);

#endif
