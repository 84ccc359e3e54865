"""Helpers shared by the diffusers edit-oracle generators (gen_edit_oracle.py
for FLUX.2 klein, gen_zimage_edit_oracle.py for Z-Image): the loadable
checkpoint folder, the deterministic input image, the two mask forms and the
versions recorded in meta.json.  Run by hand, not in CI."""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import PIL
from PIL import Image, ImageDraw, ImageFilter

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.environ.get("KILN_SHARED", os.path.join(HERE, "..", "..", "..", "shared"))


def checkpoint_copy(src):
    """A folder diffusers can load: the shared checkpoint's files linked, and
    the tokenizer files that are stored as relative-path text (symbolic links
    flattened) replaced by links to what they name."""
    dst = tempfile.mkdtemp(prefix="kiln-oracle-ckpt-")
    for root, _, files in os.walk(src):
        rel = os.path.relpath(root, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for f in files:
            p = os.path.join(root, f)
            target = p
            if os.path.getsize(p) < 256 and f in ("vocab.json", "merges.txt"):
                with open(p) as fh:
                    text = fh.read().strip()
                if text.startswith(".."):
                    target = os.path.normpath(os.path.join(root, text))
            os.symlink(os.path.abspath(target), os.path.join(dst, rel, f))
    return dst


def make_image(w, h, seed):
    """Smooth colour fields and a few flat shapes: compresses well, and has
    edges for the VAE to see."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    for c in range(3):
        fx, fy, ph = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * math.pi)
        img[..., c] = 127.5 + 100 * np.sin(2 * math.pi * (fx * x / w + fy * y / h) + ph)
    im = Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(im)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
        x1, y1 = x0 + int(rng.integers(6, w // 2)), y0 + int(rng.integers(6, h // 2))
        d.rectangle([x0, y0, x1, y1], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return im


def make_mask(w, h, spec, form, blur):
    """spec: 'rect:x0,y0,x1,y1' or 'ellipse:x0,y0,x1,y1' (pixels, inclusive
    box) marks the repainted region.  Returns (the mask file kiln reads, the
    "L" mask diffusers gets), white where repainted.  form "openai": the
    file is RGBA, alpha 0 where repainted (OpenAI's masks).  form
    "diffusers": the file is that grayscale image itself (kiln reads masks
    without alpha as diffusers does), blurred with the mask processor's blur
    (GaussianBlur(blur)) when blur > 0, so it has grey edges."""
    kind, coords = spec.split(":")
    box = [int(v) for v in coords.split(",")]
    region = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(region)
    (d.rectangle if kind == "rect" else d.ellipse)(box, fill=255)
    if form == "diffusers":
        if blur > 0:
            region = region.filter(ImageFilter.GaussianBlur(blur))
        return region, region
    r = np.asarray(region)
    rgba = np.zeros((h, w, 4), np.uint8)
    rgba[..., :3] = 255
    rgba[..., 3] = np.where(r == 255, 0, 255)
    # As kiln_image_decode_mask reads OpenAI masks: 255 (repaint) where alpha is 0.
    l_mask = Image.fromarray(np.where(rgba[..., 3] == 0, 255, 0).astype(np.uint8), "L")
    return Image.fromarray(rgba, "RGBA"), l_mask


def versions():
    """The library versions meta.json records."""
    import diffusers
    import torch
    import transformers
    return {"torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__,
            "pillow": PIL.__version__, "python": sys.version.split()[0]}


def parse_args(doc, steps, checkpoint):
    """The generators' shared command line (--mode, --out, sizes, strength,
    steps, seeds, prompt, mask, sequence length, checkpoint)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--mode", choices=["inpaint", "img2img"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="128x128", help="input image WxH (any; floored to 16)")
    ap.add_argument("--strength", type=float, default=0.6)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--image-seed", type=int, default=1)
    ap.add_argument("--prompt", default="a red boat on a lake")
    ap.add_argument("--mask", default=None, help="rect:x0,y0,x1,y1 or ellipse:...; default: the middle")
    ap.add_argument("--mask-form", choices=["openai", "diffusers"], default="openai")
    ap.add_argument("--mask-blur", type=float, default=0, help="diffusers form: GaussianBlur radius")
    ap.add_argument("--max-seq", type=int, default=64)
    ap.add_argument("--checkpoint", default=checkpoint, help="relative to shared/oracle")
    return ap.parse_args()


def write_meta(out, meta, tensors):
    """meta.json in folder out, with the tensors' shapes and the versions."""
    meta = dict(meta, tensors={k: list(v.shape) for k, v in tensors.items()}, versions=versions())
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def start_case(a):
    """The case's set-up shared by the generators: torch seeded and kept to
    two threads, a loadable copy of the checkpoint, the out folder with
    input.png.  Returns (w, h, checkpoint folder, input image)."""
    import torch  # the generators' own dependency, not this module's
    w, h = (int(v) for v in a.size.lower().split("x"))
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    ckpt = checkpoint_copy(os.path.join(SHARED, "oracle", a.checkpoint))
    os.makedirs(a.out, exist_ok=True)
    image = make_image(w, h, a.image_seed)
    image.save(os.path.join(a.out, "input.png"), optimize=True)
    return w, h, ckpt, image
