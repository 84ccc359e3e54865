#!/usr/bin/env python3
"""The diffusers side of the side-by-side in docs/PERFORMANCE.md: times
diffusers' Flux2KleinPipeline or ZImagePipeline (model_index.json's
_class_name; Z-Image with guidance_scale 0, the Turbo recipe kiln uses,
not the pipeline's call default of 5) on the same checkpoint folder kiln serves, the
way kiln-bench times kiln (B=1, one request at a time, the same prompts with
seed = prompt index, PNG bytes at the end).

  python3 tools/bench/diffusers_bench.py --model DIR [--size 1024x1024]
      [--steps 4] [--n 20] [--warmup 3] [--compile] [--json FILE]

Per request: pipe(...) to a PIL image (bf16, CUDA, torch.Generator("cpu")
seeded with the prompt index, as diffusers' docs do), then PNG encoding with
Pillow's defaults into memory.  Stage times come from CUDA-synchronised
wrappers around text_encoder.forward, transformer.forward and vae.decode
(the syncs cost microseconds against stages of milliseconds).  Statistics as
kiln-bench: median of the sorted sample (mean of the middle two for even n),
p95 nearest-rank.  Peak memory: torch.cuda.max_memory_allocated over the
timed requests, and the device's used memory (torch.cuda.mem_get_info) at
the end.  Tooling only: kiln itself needs no Python.
"""
import argparse
import io
import json
import math
import os
import statistics
import sys
import time


def nearest_rank(v, pct):
    s = sorted(v)
    return s[max(1, min(len(s), math.ceil(pct / 100.0 * len(s)))) - 1]


def summary(v):
    return {"n": len(v), "median": statistics.median(v), "p95": nearest_rank(v, 95),
            "min": min(v), "max": max(v), "mean": statistics.fmean(v)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true",
                    help="transformer.compile_repeated_blocks(fullgraph=True), as spec section 12")
    ap.add_argument("--prompts", default=os.path.join(os.path.dirname(__file__), "prompts.txt"))
    ap.add_argument("--json")
    a = ap.parse_args()
    width, height = (int(x) for x in a.size.split("x"))
    prompts = [l.rstrip("\r\n") for l in open(a.prompts, encoding="utf-8") if l.strip()]

    import torch
    import diffusers
    with open(os.path.join(a.model, "model_index.json")) as f:
        cls = json.load(f)["_class_name"]
    zimage = cls == "ZImagePipeline"
    pipe_cls = getattr(diffusers, cls)
    extra = {"guidance_scale": 0.0} if zimage else {}

    t0 = time.time()
    pipe = pipe_cls.from_pretrained(a.model, torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    load_s = time.time() - t0
    if a.compile:
        pipe.transformer.compile_repeated_blocks(fullgraph=True)

    times = {"text_encoder": [], "transformer": [], "vae_decode": []}

    def timed(name, fn):
        def wrapper(*args, **kw):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*args, **kw)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
            return out
        return wrapper

    pipe.text_encoder.forward = timed("text_encoder", pipe.text_encoder.forward)
    pipe.transformer.forward = timed("transformer", pipe.transformer.forward)
    pipe.vae.decode = timed("vae_decode", pipe.vae.decode)

    def one(k):
        idx = k % len(prompts)
        t = time.perf_counter()
        img = pipe(prompt=prompts[idx], height=height, width=width, num_inference_steps=a.steps,
                   generator=torch.Generator("cpu").manual_seed(idx), **extra).images[0]
        t_pipe = time.perf_counter() - t
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return t_pipe, time.perf_counter() - t

    for k in range(a.warmup):
        one(k)
    for v in times.values():
        v.clear()
    torch.cuda.reset_peak_memory_stats()
    pipe_s, total_s = [], []
    for k in range(a.warmup, a.warmup + a.n):
        p, t = one(k)
        pipe_s.append(p)
        total_s.append(t)
    free, total = torch.cuda.mem_get_info()
    res = {
        "diffusers": diffusers.__version__, "torch": torch.__version__,
        "pipeline": cls, "gpu": torch.cuda.get_device_name(), "size": a.size, "steps": a.steps,
        "compiled": a.compile, "load_s": load_s,
        "latency_ms": {k: v * 1e3 for k, v in summary(total_s).items() if k != "n"},
        "pipeline_to_pil_ms": {k: v * 1e3 for k, v in summary(pipe_s).items() if k != "n"},
        "stages_ms": {k: statistics.median(v) * 1e3 for k, v in times.items() if v},
        "calls_per_request": {k: len(v) / a.n for k, v in times.items()},
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device_used_gib": (total - free) / 2**30,
        "n": a.n, "warmup": a.warmup,
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
