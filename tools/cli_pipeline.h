/* The in-process pipeline behind `kiln generate` and `kiln edit`: parses the
 * shared options, runs the encode, denoise and decode stages of engine/ in
 * sequence (the same functions the services run), and writes the images. */
#ifndef KILN_TOOLS_CLI_PIPELINE_H
#define KILN_TOOLS_CLI_PIPELINE_H

#include "cli_progress.h"
#include "engine/denoise_stage.h"
#include "engine/request.h"

#define CLI_MAX_PROMPTS 64

typedef struct cli_gen_opts {
    const char *model;
    const char *device; /* "cpu" or "cuda" */
    int gpu;
    const char *prompts[CLI_MAX_PROMPTS];
    int n_prompts;
    kiln_request req; /* seed, size, steps, guidance, n, ... (prompt set per row) */
    int out_layers[KILN_MAX_OUT_LAYERS];
    int n_out_layers;
    const char *out;
    const char *latents_out;
    const char *latents_in;
    const char *images[KILN_MAX_REFS];
    int n_images;
    const char *mask;         /* edit --mask: inpainting (engine/inpaint.h) */
    int fp32_noise;
    kiln_precision precision; /* --precision exact|fp8 (engine/denoise_stage.h) */
    int seed_given;           /* else a random seed is drawn and printed */
    cli_progress_mode progress; /* -q, --progress, or on a terminal */
    int no_metadata;          /* --no-metadata: PNGs without the request's text chunks */
} cli_gen_opts;

/* Parses argv for `generate` (edit = 0) or `edit` (edit = 1).  Returns 0, or
 * 2 after printing a usage error (also for an --out whose extension is not
 * .png, .jpg, .jpeg or .webp). */
int cli_parse_gen_args(int argc, char **argv, int edit, cli_gen_opts *o);

/* Runs the pipeline and writes the outputs, printing each path written and
 * its seed on stdout ("cat-0.png: seed 42") and the progress on stderr;
 * returns the process exit status (0, or 1 with the error printed as
 * "kiln <cmd>: message"). */
int cli_run_pipeline(const char *cmd, cli_gen_opts *o);

#endif
