/* kiln-soak: line plots drawn into an RGB canvas and written as a PNG
 * (through common/image.h, i.e. libpng), with axes, ticks, labels, a legend
 * and vertical markers, in a built-in 5x7 pixel font (upper case, digits
 * and a few signs; lower case is drawn as upper case).
 *
 *   kiln_plot *p = kiln_plot_new(1200, 800, &err);
 *   kiln_plot_series s[] = {{"gateway", x, y, n}};
 *   kiln_plot_mark m[] = {{"kill", 200.0}};
 *   kiln_plot_panel(p, 0, 400, "RssAnon per process (MiB)", "seconds", s, 1, m, 1);
 *   kiln_plot_write(p, "memory.png", &err);
 *   kiln_plot_free(p);
 *
 * A panel fills the canvas's width and rows [top, top + height); its axes
 * start at 0 (x) and 0 (y) and end past the largest value, with 4-6 round
 * ticks.  Not thread-safe on one canvas.
 */
#ifndef KILN_SOAK_PLOT_H
#define KILN_SOAK_PLOT_H

#include <stddef.h>

#include "common/error.h"

typedef struct kiln_plot kiln_plot;

typedef struct kiln_plot_series {
    const char *label;
    const double *x, *y;
    size_t n;
} kiln_plot_series;

typedef struct kiln_plot_mark {
    const char *label;
    double x;
} kiln_plot_mark;

/* A white canvas (width, height 64..8192).  NULL with err: _INVALID, _NOMEM. */
kiln_plot *kiln_plot_new(int width, int height, kiln_err *err);
void kiln_plot_free(kiln_plot *p);
/* Draws one panel; series beyond the palette's 10 colours reuse them. */
void kiln_plot_panel(kiln_plot *p, int top, int height, const char *title, const char *xlabel,
                     const kiln_plot_series *s, size_t n, const kiln_plot_mark *marks,
                     size_t n_marks);
/* Writes the canvas as a PNG file.  The encoder's errors, _IO. */
kiln_status kiln_plot_write(const kiln_plot *p, const char *path, kiln_err *err);

#endif
