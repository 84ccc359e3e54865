/* kiln request plans: a request resolved once against the served model's
 * traits into everything the stages need to agree on: the resolved
 * parameters, the rows and their seeds, whether classifier-free guidance
 * runs and with which negative prompt, the steps that run and the cost.
 * The CLI, the gateway, the stages' inputs, the bench and the tests all
 * take these from a plan (or from the helpers below), so no front end
 * re-derives a family's rules.
 *
 *   kiln_request req;
 *   kiln_request_init(&req);
 *   req.prompt = "a cat";
 *   kiln_plan plan;
 *   kiln_limits lim = KILN_LIMITS_SERVICE;
 *   if (kiln_plan_make(&plan, &req, NULL, 1, &traits, &lim, &err)) -> 400 with err.msg
 *   for (int64_t b = 0; b < plan.rows; b++)
 *       ... prompt kiln_plan_row_prompt(b, plan.req.n), seed kiln_plan_row_seed(&plan, b)
 *   if (plan.cfg) ... encode plan.negative too
 *
 * The row layout is prompt-major: row b is image b % n of prompt b / n and
 * takes seed + b; under CFG every row's negative is the one negative
 * prompt's embedding.  A plan borrows the request's strings; it owns
 * nothing.  Everything here is pure (no I/O, no backend) and thread-safe
 * on distinct plans, so the gateway links it without any model code.
 */
#ifndef KILN_ENGINE_PLAN_H
#define KILN_ENGINE_PLAN_H

#include <stdint.h>

#include "common/error.h"
#include "common/traits.h"
#include "request.h"

typedef struct kiln_plan {
    kiln_request req;     /* resolved (kiln_request_resolve): defaults filled, validated */
    int n_prompts;        /* P: the prompts of the run (the service's requests have 1) */
    int64_t rows;         /* P x n images, in the row layout above */
    int cfg;              /* classifier-free guidance runs (kiln_model_cfg_runs) */
    /* The negative prompt the encoder encodes when cfg: req.negative_prompt,
     * or "" (diffusers' default) when none was given; NULL without CFG. */
    const char *negative;
    int first_step;       /* where the loop starts (kiln_request_first_step): img2img and
                             inpainting skip steps */
    int run_steps;        /* req.steps - first_step: the DiT steps that run (>= 1) */
    double cost;          /* kiln_request_cost of every prompt's rows, Mtok */
} kiln_plan;

/* Resolves `req` (copied into plan->req) against the model and the limits
 * for each of the n_prompts prompts (prompts NULL: req->prompt alone;
 * plan->req.prompt is then prompts[0]) and fills the rest of the plan.
 * Returns kiln_request_resolve's KILN_ERR_INVALID with a message naming
 * the field; KILN_ERR_INVALID too for more than KILN_PLAN_MAX_ROWS rows. */
#define KILN_PLAN_MAX_ROWS 65536
kiln_status kiln_plan_make(kiln_plan *plan, const kiln_request *req, const char *const *prompts,
                           int n_prompts, const kiln_model_traits *model, const kiln_limits *lim,
                           kiln_err *err);

/* 1 when a request with this guidance runs classifier-free guidance: a
 * model with CFG (klein base checkpoints, Z-Image) when guidance > 1
 * (Flux2KleinPipeline), or > 0 for cfg_above_zero (ZImagePipeline).  The
 * one place that rule is written; plans and the denoise stage use it. */
int kiln_model_cfg_runs(const kiln_model_traits *model, float guidance);

/* The prompt of row `row` when each prompt has n images. */
static inline int64_t kiln_plan_row_prompt(int64_t row, int n) { return row / n; }

/* The seed of row `row`: req.seed + row (wrapping as uint64). */
uint64_t kiln_plan_row_seed(const kiln_plan *plan, int64_t row);

/* Each row's real text tokens from each prompt's (prompt_lens[P]) and
 * the negative's (neg_len; 0 without CFG), for `rows` rows of n images
 * per prompt: row_lens[b] = prompt_lens[b / n], neg_lens[b] = neg_len.
 * Z-Image's DiT reads those rows only (engine/denoise_stage.h). */
void kiln_plan_row_lens(int64_t rows, int n, const int *prompt_lens, int neg_len, int *row_lens,
                        int *neg_lens);

#endif
