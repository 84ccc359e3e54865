#!/usr/bin/env python3
"""Draws one request's stage trace (the Chrome trace-event JSON of
GET /v1/traces/<id> or one line of --trace-file) as a picture: one band per
track (the gateway, then each replica), spans nested by containment, each
labelled with its name, its wall time and, where the replica measured one,
its GPU time (args.gpu_ms).  The SVG is written beside the PNG; headless
Chromium (Debian's `chromium`, as tests/docs/check_playground.py uses)
turns it into the PNG.  Tooling only: docs/OPERATIONS.md's trace picture
comes from it.

Usage: tools/trace_png.py TRACE.json OUT.png [--title TEXT] [--width PX]
Exit 0 when the PNG was written."""
import argparse
import html
import json
import os
import shutil
import subprocess
import sys
import tempfile

COLORS = {"encode": "#8fbcd4", "denoise": "#e3a857", "decode": "#9cc98b"}
ROW_H, BAND_GAP, LABEL_W, TOP, AXIS_H = 22, 10, 190, 58, 30


def fmt_ms(ms):
    if ms >= 1000:
        return "%.1f s" % (ms / 1000)
    if ms >= 10:
        return "%.0f ms" % ms
    if ms >= 1:
        return "%.1f ms" % ms
    return "%.2f ms" % ms


def color(name):
    for stage, c in COLORS.items():
        if name.startswith(stage):
            return c
    return "#c9c3e6"


def nice_step(total_ms, ticks=8):
    raw = total_ms / ticks
    for m in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
              100000, 200000, 500000):
        if m >= raw:
            return m
    return raw


def layout(trace):
    """Tracks in pid order, each a list of (depth, event)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    tracks = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault(e["pid"], []).append(e)
    out = []
    for pid in sorted(tracks):
        evs = sorted(tracks[pid], key=lambda e: (e["ts"], -e["dur"]))
        stack, rows = [], []
        for e in evs:
            # a span nests in the open one that contains it (1 us of slack:
            # times are rounded to microseconds)
            while stack and not (e["ts"] >= stack[-1]["ts"] - 1 and
                                 e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + 1):
                stack.pop()
            rows.append((len(stack), e))
            stack.append(e)
        out.append((names.get(pid, "pid %d" % pid), rows))
    return out


def svg(trace, title, width):
    tracks = layout(trace)
    end_us = max(e["ts"] + e["dur"] for _, rows in tracks for _, e in rows)
    plot_w = width - LABEL_W - 20
    x = lambda us: LABEL_W + us / end_us * plot_w
    height = TOP + sum((max(d for d, _ in rows) + 1) * ROW_H + BAND_GAP for _, rows in tracks)
    height += AXIS_H + 10
    p = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
         'font-family="DejaVu Sans, sans-serif" font-size="11">' % (width, height),
         '<rect width="100%" height="100%" fill="white"/>',
         '<text x="10" y="22" font-size="15" font-weight="bold">%s</text>' % html.escape(title)]
    other = trace.get("otherData", {})
    p.append('<text x="10" y="42" fill="#444">request %s, status %s, %s from its first byte '
             'to its answer; GPU times (CUDA events) where the replica measured them</text>'
             % (html.escape(str(other.get("request_id", "?"))),
                html.escape(str(other.get("status", "?"))), fmt_ms(end_us / 1000)))
    y = TOP
    for name, rows in tracks:
        depth = max(d for d, _ in rows) + 1
        band_h = depth * ROW_H
        p.append('<rect x="0" y="%d" width="%d" height="%d" fill="#f4f4f4"/>'
                 % (y - 3, width, band_h + 6))
        p.append('<text x="10" y="%d" font-weight="bold">%s</text>'
                 % (y + 15, html.escape(name)))
        for d, e in rows:
            x0, x1 = x(e["ts"]), x(e["ts"] + e["dur"])
            w = max(x1 - x0, 1.0)
            ry = y + d * ROW_H
            p.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s" stroke="#555" '
                     'stroke-width="0.4"/>' % (x0, ry, w, ROW_H - 3, color(e["name"])))
            label = "%s %s" % (e["name"], fmt_ms(e["dur"] / 1000))
            gpu = e.get("args", {}).get("gpu_ms")
            if gpu is not None:
                label += " (GPU %s)" % fmt_ms(gpu)
            # a label goes where it fits: inside its span, else not at all
            # (Perfetto shows every span; the picture shows the large ones)
            if len(label) * 6.2 + 6 < w:
                p.append('<text x="%.1f" y="%d">%s</text>' % (x0 + 3, ry + 13, html.escape(label)))
            elif len(e["name"]) * 6.2 + 6 < w:
                p.append('<text x="%.1f" y="%d">%s</text>' % (x0 + 3, ry + 13,
                                                              html.escape(e["name"])))
        y += band_h + BAND_GAP
    step = nice_step(end_us / 1000)
    t = 0.0
    while t * 1000 <= end_us:
        tx = x(t * 1000)
        p.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#bbb" stroke-width="0.5"/>'
                 % (tx, TOP - 4, tx, y))
        p.append('<text x="%.1f" y="%d" text-anchor="middle" fill="#444">%s</text>'
                 % (tx, y + 14, fmt_ms(t) if t else "0"))
        t += step
    p.append("</svg>")
    return "\n".join(p), height


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--title", default="kiln stage trace")
    ap.add_argument("--width", type=int, default=1400)
    a = ap.parse_args()
    with open(a.trace) as f:
        trace = json.loads(f.readline() if a.trace.endswith(".jsonl") else f.read())
    text, height = svg(trace, a.title, a.width)
    svg_path = os.path.splitext(a.out)[0] + ".svg"
    with open(svg_path, "w") as f:
        f.write(text)
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(n)), None)
    if not exe:
        print("no chromium installed (apt-get install chromium); the SVG is " + svg_path)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "trace.html")
        with open(page, "w") as f:
            f.write('<!doctype html><html><body style="margin:0">%s</body></html>' % text)
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--no-first-run", "--hide-scrollbars",
                            "--window-size=%d,%d" % (a.width, height),
                            "--screenshot=" + os.path.abspath(a.out), "file://" + page],
                           capture_output=True, text=True, timeout=120)
    if not os.path.exists(a.out) or os.path.getsize(a.out) == 0:
        print("chromium wrote no PNG:\n" + r.stderr[-2000:])
        return 1
    print("wrote %s (%dx%d) and %s" % (a.out, a.width, height, svg_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
