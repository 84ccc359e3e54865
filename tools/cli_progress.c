#include "cli_progress.h"

#include <unistd.h>

#include "common/log.h"

void cli_progress_init(cli_progress *p, cli_progress_mode mode, FILE *f)
{
    *p = (cli_progress){.f = f, .t0 = kiln_now_ms()};
    p->tty = isatty(fileno(f));
    p->on = mode == CLI_PROGRESS_ON || (mode == CLI_PROGRESS_AUTO && p->tty);
}

static void line(cli_progress *p, const char *text)
{
    double s = (kiln_now_ms() - p->t0) / 1000.0;
    if (p->tty) /* rewrite the line: \r, the text, erase the rest */
        fprintf(p->f, "\r[%6.1f s] %s\033[K", s, text);
    else
        fprintf(p->f, "[%6.1f s] %s\n", s, text);
    p->open = p->tty;
    fflush(p->f);
}

void cli_progress_stage(cli_progress *p, const char *stage, int steps)
{
    if (!p->on)
        return;
    p->stage = stage, p->steps = steps;
    line(p, stage);
}

void cli_progress_step(void *user, int step)
{
    cli_progress *p = user;
    if (!p->on)
        return;
    double now = kiln_now_ms();
    if (step == 0)
        p->step_t0 = now;
    char text[128];
    if (step > 0) /* the mean of the steps done so far */
        snprintf(text, sizeof text, "%s: step %d/%d (%.2f s/step)", p->stage, step + 1, p->steps,
                 (now - p->step_t0) / 1000.0 / step);
    else
        snprintf(text, sizeof text, "%s: step %d/%d", p->stage, step + 1, p->steps);
    line(p, text);
}

void cli_progress_end(cli_progress *p)
{
    if (!p->on)
        return;
    line(p, "done");
    if (p->open)
        fputc('\n', p->f);
    p->open = 0;
    fflush(p->f);
}
