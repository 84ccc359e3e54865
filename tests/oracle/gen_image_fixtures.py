#!/usr/bin/env python3
"""Writes the Pillow reference fixtures of tests/unit/test_image.c into
tests/data/image/.  Run by hand (not in CI) with Pillow and numpy installed:

    /work/venv/bin/python tests/oracle/gen_image_fixtures.py

For each input it stores what Pillow computes from it, as an 8-bit RGB PNG
named <input>.expected.png:
  - LANCZOS resizes (Image.resize(size, LANCZOS)) of a 1100x1000 source: to
    the FLUX.2 edit size (1073x976, the >1024^2 path of spec/pipeline.md
    section 8), a strong downscale, and an upscale of a small crop;
  - Image.open(f).convert("RGB") of PNGs in every colour type and bit depth
    (written by hand below, since Pillow cannot write 16-bit RGB, short
    palettes or tRNS on every type), of JPEGs (YCbCr 4:2:0, 4:4:4,
    progressive, gray, Adobe CMYK) and of WebPs (lossy, lossless with alpha).
The source images are deterministic (fixed seeds), so rerunning rewrites the
same files unless Pillow itself changed.
"""
import io
import os
import struct
import sys
import zlib

import numpy as np
from PIL import Image

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "image")


def save_png_rgb(arr, name):
    Image.fromarray(arr, "RGB").save(os.path.join(OUT, name), optimize=True)


def expected(im, name):
    save_png_rgb(np.asarray(im.convert("RGB")), name + ".expected.png")


def lanczos_source(w, h):
    """Flat tiles and rectangles with hard edges (ringing reaches both clip
    limits through the negative lobes), one smooth gradient and one patch of
    full-range noise (every rounding path), so the PNGs stay small."""
    rng = np.random.default_rng(1234)
    img = np.zeros((h, w, 3))
    tile = 97
    for ty in range(0, h, tile):
        for tx in range(0, w, tile):
            img[ty:ty + tile, tx:tx + tile] = rng.integers(0, 256, size=3)
    for _ in range(40):
        x0, y0 = rng.integers(0, w - 3), rng.integers(0, h - 3)
        bw, bh = rng.integers(1, max(2, w // 8)), rng.integers(1, max(2, h // 8))
        img[y0:y0 + bh, x0:x0 + bw] = rng.choice([0, 255], size=3)
    n = min(64, w // 4, h // 4)
    y, x = np.mgrid[0:n, 0:n]
    img[h // 5:h // 5 + n, w // 5:w // 5 + n] = np.stack([x * 255 / n, y * 255 / n, (x + y) * 127 / n], -1)
    img[h // 3:h // 3 + n, w // 2:w // 2 + n] = rng.integers(0, 256, size=(n, n, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_lanczos():
    src = lanczos_source(1100, 1000)
    save_png_rgb(src, "lanczos_src.png")
    im = Image.fromarray(src, "RGB")
    # The FLUX.2 edit size of a 1100x1000 reference.
    s = (1024 * 1024 / (1100 * 1000)) ** 0.5
    size = (int(1100 * s), int(1000 * s))
    assert size == (1073, 976), size
    save_png_rgb(np.asarray(im.resize(size, Image.Resampling.LANCZOS)),
                 "lanczos_src.1073x976.expected.png")
    save_png_rgb(np.asarray(im.resize((317, 211), Image.Resampling.LANCZOS)),
                 "lanczos_src.317x211.expected.png")
    small = im.crop((530, 320, 580, 360))  # noise patch corner and a tile edge
    save_png_rgb(np.asarray(small), "lanczos_small.png")
    save_png_rgb(np.asarray(small.resize((123, 97), Image.Resampling.LANCZOS)),
                 "lanczos_small.123x97.expected.png")
    # The height shrinks by more than twice the width's pixels: Pillow 13
    # runs the vertical pass first (its PR #9549); Pillow 12 and older did not.
    assert int(Image.__version__.split(".")[0]) >= 13, Image.__version__
    save_png_rgb(np.asarray(small.resize((46, 24), Image.Resampling.LANCZOS)),
                 "lanczos_small.46x24.expected.png")


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def png_bytes(w, h, depth, ctype, rows, plte=None, trns=None, interlaced_passes=None):
    """A PNG with filter type 0 on every row.  `rows` are packed rows, or
    with `interlaced_passes` a list of the seven Adam7 passes' packed rows
    (empty passes contribute nothing)."""
    def chunk(tag, data):
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))
    if interlaced_passes is not None:
        rows = [r for p in interlaced_passes for r in p]
    raw = b"".join(b"\x00" + r for r in rows)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, ctype, 0, 0, 1 if interlaced_passes is not None else 0)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    if plte is not None:
        out += chunk(b"PLTE", plte)
    if trns is not None:
        out += chunk(b"tRNS", trns)
    return out + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def pack_bits(samples, depth):
    """One row of samples (< 2^depth each) packed MSB first."""
    if depth == 8:
        return bytes(samples.astype(np.uint8))
    if depth == 16:
        return samples.astype(">u2").tobytes()
    per = 8 // depth
    padded = np.zeros((len(samples) + per - 1) // per * per, dtype=np.int64)
    padded[:len(samples)] = samples
    out = bytearray()
    for i in range(0, len(padded), per):
        b = 0
        for s in padded[i:i + per]:
            b = (b << depth) | int(s)
        out.append(b)
    return bytes(out)


def write_png_modes():
    rng = np.random.default_rng(99)
    w, h = 13, 7
    cases = []
    for depth in (1, 2, 4, 8):
        s = rng.integers(0, 1 << depth, size=(h, w))
        cases.append((f"png_gray{depth}", depth, 0, s, None, None))
    s = rng.integers(0, 256, size=(h, w))
    cases.append(("png_gray8_trns", 8, 0, s, None, struct.pack(">H", int(s[0, 0]))))
    # Mostly small values so PIL's clamp of mode I;16 to 255 shows both ways.
    s = np.where(rng.random((h, w)) < 0.5, rng.integers(0, 256, (h, w)), rng.integers(0, 65536, (h, w)))
    cases.append(("png_gray16", 16, 0, s, None, None))
    cases.append(("png_rgb8_trns", 8, 2, rng.integers(0, 256, (h, w * 3)), None, b"\x00\x01\x00\x02\x00\x03"))
    cases.append(("png_rgb16", 16, 2, rng.integers(0, 65536, (h, w * 3)), None, None))
    cases.append(("png_ga8", 8, 4, rng.integers(0, 256, (h, w * 2)), None, None))
    cases.append(("png_ga16", 16, 4, rng.integers(0, 65536, (h, w * 2)), None, None))
    cases.append(("png_rgba8", 8, 6, rng.integers(0, 256, (h, w * 4)), None, None))
    cases.append(("png_rgba16", 16, 6, rng.integers(0, 65536, (h, w * 4)), None, None))
    plte = bytes(rng.integers(0, 256, 3 * 5).astype(np.uint8))
    for depth in (1, 2, 4, 8):
        # Indices up to 2^depth - 1 with only 5 palette entries: Pillow maps
        # missing entries to black.
        s = rng.integers(0, min(1 << depth, 8), size=(h, w))
        cases.append((f"png_pal{depth}", depth, 3, s, plte[:3 * min(5, 1 << depth)], b"\x10\x80"))
    for name, depth, ctype, s, pal, trns in cases:
        data = png_bytes(w, h, depth, ctype, [pack_bits(r, depth) for r in s], pal, trns)
        with open(os.path.join(OUT, name + ".png"), "wb") as f:
            f.write(data)
        expected(Image.open(io.BytesIO(data)), name + ".png")
    # Adam7 interlacing, 8-bit RGB and 16-bit RGBA (channels per pixel c).
    for name, depth, ctype, c in (("png_rgb8_adam7", 8, 2, 3), ("png_rgba16_adam7", 16, 6, 4)):
        px = rng.integers(0, 1 << depth, size=(h, w, c))
        passes = [[pack_bits(r.reshape(-1), depth) for r in px[y0::dy, x0::dx]]
                  if px[y0::dy, x0::dx].size else [] for x0, y0, dx, dy in ADAM7]
        data = png_bytes(w, h, depth, ctype, None, interlaced_passes=passes)
        with open(os.path.join(OUT, name + ".png"), "wb") as f:
            f.write(data)
        expected(Image.open(io.BytesIO(data)), name + ".png")


def write_jpeg_webp():
    src = Image.fromarray(lanczos_source(96, 72), "RGB")
    variants = [
        ("jpeg_420.jpg", src, dict(quality=85)),
        ("jpeg_444.jpg", src, dict(quality=92, subsampling=0)),
        ("jpeg_422_progressive.jpg", src, dict(quality=75, subsampling=1, progressive=True)),
        ("jpeg_gray.jpg", src.convert("L"), dict(quality=90)),
        ("jpeg_cmyk.jpg", src.convert("CMYK"), dict(quality=90)),
        ("webp_lossy.webp", src, dict(quality=80)),
        ("webp_lossless_alpha.webp", src.convert("RGBA"), dict(lossless=True)),
    ]
    for name, im, kw in variants:
        if name == "webp_lossless_alpha.webp":
            a = np.asarray(im).copy()
            a[..., 3] = np.arange(a.shape[1], dtype=np.uint8)[None, :] * 2
            im = Image.fromarray(a, "RGBA")
        path = os.path.join(OUT, name)
        im.save(path, **kw)
        expected(Image.open(path), name)


def main():
    os.makedirs(OUT, exist_ok=True)
    write_lanczos()
    write_png_modes()
    write_jpeg_webp()
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {len(os.listdir(OUT))} files, {total} bytes, to {os.path.normpath(OUT)}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
