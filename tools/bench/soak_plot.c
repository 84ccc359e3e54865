#include "soak_plot.h"

#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"

struct kiln_plot {
    kiln_image img;
};

/* 5x7 glyphs, one row per byte, the leftmost pixel in bit 4. */
static const struct glyph {
    char c;
    uint8_t rows[7];
} font[] = {
    {'#', {0x0a, 0x0a, 0x1f, 0x0a, 0x1f, 0x0a, 0x0a}},
    {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
    {'+', {0x00, 0x04, 0x04, 0x1f, 0x04, 0x04, 0x00}},
    {',', {0x00, 0x00, 0x00, 0x00, 0x0c, 0x04, 0x08}},
    {'-', {0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0c, 0x0c}},
    {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
    {'0', {0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e}},
    {'1', {0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e}},
    {'2', {0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f}},
    {'3', {0x1e, 0x01, 0x01, 0x0e, 0x01, 0x01, 0x1e}},
    {'4', {0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02}},
    {'5', {0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e}},
    {'6', {0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e}},
    {'7', {0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e}},
    {'9', {0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c}},
    {':', {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x0c, 0x00}},
    {'=', {0x00, 0x00, 0x1f, 0x00, 0x1f, 0x00, 0x00}},
    {'A', {0x0e, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11}},
    {'B', {0x1e, 0x11, 0x11, 0x1e, 0x11, 0x11, 0x1e}},
    {'C', {0x0e, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0e}},
    {'D', {0x1e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1e}},
    {'E', {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x1f}},
    {'F', {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x10}},
    {'G', {0x0e, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0f}},
    {'H', {0x11, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11}},
    {'I', {0x0e, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e}},
    {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0c}},
    {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}},
    {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1f}},
    {'M', {0x11, 0x1b, 0x15, 0x15, 0x11, 0x11, 0x11}},
    {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
    {'O', {0x0e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e}},
    {'P', {0x1e, 0x11, 0x11, 0x1e, 0x10, 0x10, 0x10}},
    {'Q', {0x0e, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0d}},
    {'R', {0x1e, 0x11, 0x11, 0x1e, 0x14, 0x12, 0x11}},
    {'S', {0x0f, 0x10, 0x10, 0x0e, 0x01, 0x01, 0x1e}},
    {'T', {0x1f, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
    {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e}},
    {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0a, 0x04}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0a}},
    {'X', {0x11, 0x11, 0x0a, 0x04, 0x0a, 0x11, 0x11}},
    {'Y', {0x11, 0x11, 0x0a, 0x04, 0x04, 0x04, 0x04}},
    {'Z', {0x1f, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1f}},
    {'[', {0x0e, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0e}},
    {']', {0x0e, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0e}},
    {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1f}},
};

static const uint8_t palette[10][3] = {
    {31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}, {148, 103, 189},
    {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207},
};

#define SCALE 2 /* each font pixel is 2x2 */
#define CHAR_W (6 * SCALE)
#define CHAR_H (8 * SCALE)

kiln_plot *kiln_plot_new(int width, int height, kiln_err *err)
{
    if (width < 64 || height < 64 || width > 8192 || height > 8192) {
        kiln_err_set(err, KILN_ERR_INVALID, "plot of %dx%d", width, height);
        return NULL;
    }
    kiln_plot *p = calloc(1, sizeof *p);
    if (!p) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (kiln_image_alloc(&p->img, width, height, err)) {
        free(p);
        return NULL;
    }
    memset(p->img.pixels, 255, (size_t)width * (size_t)height * 3);
    return p;
}

void kiln_plot_free(kiln_plot *p)
{
    if (!p)
        return;
    kiln_image_free(&p->img);
    free(p);
}

static void px(kiln_plot *p, int x, int y, const uint8_t *c)
{
    if (x < 0 || y < 0 || x >= p->img.width || y >= p->img.height)
        return;
    memcpy(p->img.pixels + 3 * ((size_t)y * (size_t)p->img.width + (size_t)x), c, 3);
}

static void rect(kiln_plot *p, int x0, int y0, int w, int h, const uint8_t *c)
{
    for (int y = y0; y < y0 + h; y++)
        for (int x = x0; x < x0 + w; x++)
            px(p, x, y, c);
}

/* Bresenham, 2 px wide. */
static void line(kiln_plot *p, int x0, int y0, int x1, int y1, const uint8_t *c)
{
    int dx = abs(x1 - x0), dy = -abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int e = dx + dy;
    for (;;) {
        px(p, x0, y0, c);
        px(p, x0 + 1, y0, c);
        px(p, x0, y0 + 1, c);
        if (x0 == x1 && y0 == y1)
            break;
        int e2 = 2 * e;
        if (e2 >= dy)
            e += dy, x0 += sx;
        if (e2 <= dx)
            e += dx, y0 += sy;
    }
}

static void text(kiln_plot *p, int x, int y, const char *s, const uint8_t *c)
{
    for (; *s; s++, x += CHAR_W) {
        char ch = (char)toupper((unsigned char)*s);
        for (size_t g = 0; g < sizeof font / sizeof font[0]; g++) {
            if (font[g].c != ch)
                continue;
            for (int r = 0; r < 7; r++)
                for (int b = 0; b < 5; b++)
                    if (font[g].rows[r] >> (4 - b) & 1)
                        rect(p, x + b * SCALE, y + r * SCALE, SCALE, SCALE, c);
        }
    }
}

static int text_w(const char *s) { return (int)strlen(s) * CHAR_W; }

/* A round tick step giving 4-6 ticks up to max. */
static double tick_step(double max)
{
    double raw = max / 5, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

static void fmt_tick(char *buf, size_t cap, double v)
{
    if (fabs(v) >= 10000)
        snprintf(buf, cap, "%.0fK", v / 1000);
    else
        snprintf(buf, cap, "%g", v);
}

void kiln_plot_panel(kiln_plot *p, int top, int height, const char *title, const char *xlabel,
                     const kiln_plot_series *s, size_t n, const kiln_plot_mark *marks,
                     size_t n_marks)
{
    static const uint8_t black[3] = {0, 0, 0}, grid[3] = {225, 225, 225}, mark[3] = {200, 0, 0};
    double xmax = 0, ymax = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < s[i].n; j++) {
            xmax = s[i].x[j] > xmax ? s[i].x[j] : xmax;
            ymax = s[i].y[j] > ymax ? s[i].y[j] : ymax;
        }
    for (size_t i = 0; i < n_marks; i++)
        xmax = marks[i].x > xmax ? marks[i].x : xmax;
    xmax = xmax > 0 ? xmax : 1;
    ymax = ymax > 0 ? ymax * 1.05 : 1;
    double xs = tick_step(xmax), ys = tick_step(ymax);
    xmax = ceil(xmax / xs) * xs;
    ymax = ceil(ymax / ys) * ys;
    int left = 10 + 7 * CHAR_W, right = p->img.width - 20;
    int y0 = top + 2 * CHAR_H + 10, y1 = top + height - 2 * CHAR_H - 16; /* plot rows */
    int w = right - left, h = y1 - y0;
    if (w < 16 || h < 16)
        return;
    text(p, left, top + 8, title, black);
    for (double v = 0; v <= ymax + ys / 2; v += ys) {
        int y = y1 - (int)lround(v / ymax * h);
        char b[32];
        rect(p, left, y, w, 1, grid);
        fmt_tick(b, sizeof b, v);
        text(p, left - 8 - text_w(b), y - CHAR_H / 2 + 2, b, black);
    }
    for (double v = 0; v <= xmax + xs / 2; v += xs) {
        int x = left + (int)lround(v / xmax * w);
        char b[32];
        rect(p, x, y0, 1, h, grid);
        fmt_tick(b, sizeof b, v);
        text(p, x - text_w(b) / 2, y1 + 8, b, black);
    }
    text(p, left + w / 2 - text_w(xlabel) / 2, y1 + 8 + CHAR_H + 4, xlabel, black);
    rect(p, left, y0, 2, h + 1, black);
    rect(p, left, y1, w, 2, black);
    for (size_t i = 0; i < n_marks; i++) {
        int x = left + (int)lround(marks[i].x / xmax * w);
        for (int y = y0; y < y1; y += 6)
            rect(p, x, y, 2, 3, mark);
        text(p, x + 4, y0 + 2 + (int)i * CHAR_H, marks[i].label, mark);
    }
    for (size_t i = 0; i < n; i++) {
        const uint8_t *c = palette[i % 10];
        for (size_t j = 0; j < s[i].n; j++) {
            int x = left + (int)lround(s[i].x[j] / xmax * w);
            int y = y1 - (int)lround(s[i].y[j] / ymax * h);
            if (j) {
                int xp = left + (int)lround(s[i].x[j - 1] / xmax * w);
                int yp = y1 - (int)lround(s[i].y[j - 1] / ymax * h);
                line(p, xp, yp, x, y, c);
            } else {
                rect(p, x - 1, y - 1, 3, 3, c);
            }
        }
        /* Legend: right-aligned column at the panel's top. */
        int ly = y0 + 4 + (int)i * (CHAR_H + 2), lx = right - 8 - text_w(s[i].label);
        rect(p, lx - 22, ly + 4, 16, 6, c);
        text(p, lx, ly, s[i].label, c);
    }
}

kiln_status kiln_plot_write(const kiln_plot *p, const char *path, kiln_err *err)
{
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    return kiln_image_write_file(path, &p->img, &o, err);
}
