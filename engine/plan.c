#include "plan.h"

#include <string.h>

int kiln_model_cfg_runs(const kiln_model_traits *model, float guidance)
{
    return model->cfg && guidance > (model->cfg_above_zero ? 0.0f : 1.0f);
}

uint64_t kiln_plan_row_seed(const kiln_plan *plan, int64_t row)
{
    return plan->req.seed + (uint64_t)row;
}

void kiln_plan_row_lens(int64_t rows, int n, const int *prompt_lens, int neg_len, int *row_lens,
                        int *neg_lens)
{
    for (int64_t b = 0; b < rows; b++) {
        row_lens[b] = prompt_lens[kiln_plan_row_prompt(b, n)];
        neg_lens[b] = neg_len;
    }
}

kiln_status kiln_plan_make(kiln_plan *plan, const kiln_request *req, const char *const *prompts,
                           int n_prompts, const kiln_model_traits *model, const kiln_limits *lim,
                           kiln_err *err)
{
    memset(plan, 0, sizeof *plan);
    plan->req = *req;
    kiln_request *q = &plan->req;
    if (n_prompts < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "prompt is required");
    /* Each prompt is validated; resolving again after the first only
     * checks (the defaults are filled by then). */
    for (int p = n_prompts - 1; p >= 0; p--) {
        if (prompts)
            q->prompt = prompts[p];
        if (kiln_request_resolve(q, model, lim, err))
            return err ? err->code : KILN_ERR_INVALID;
    }
    plan->n_prompts = n_prompts;
    plan->rows = (int64_t)n_prompts * q->n;
    if (plan->rows > KILN_PLAN_MAX_ROWS)
        return kiln_err_set(err, KILN_ERR_INVALID, "%lld images are more than %d",
                            (long long)plan->rows, KILN_PLAN_MAX_ROWS);
    plan->cfg = kiln_model_cfg_runs(model, q->guidance);
    if (plan->cfg)
        plan->negative = q->negative_prompt ? q->negative_prompt : "";
    plan->first_step = kiln_request_first_step(q->steps, q->strength);
    plan->run_steps = q->steps - plan->first_step;
    plan->cost = n_prompts * kiln_request_cost(q, model, plan->cfg);
    return KILN_OK;
}
