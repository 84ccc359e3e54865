#!/usr/bin/env python3
"""Writes a diffusers reference case for kiln's image-to-image (strength) and
inpainting (mask) on the tiny klein checkpoint, for tests/oracle/test_edit_oracle.c.
Run by hand (not in CI) in a virtualenv with torch (CPU is enough), diffusers,
transformers, safetensors, numpy and Pillow:

    python3 -m venv venv && venv/bin/pip install torch diffusers transformers safetensors pillow
    venv/bin/python tests/oracle/gen_edit_oracle.py --mode inpaint --out tests/data/oracle/klein_inpaint_128
    build-test/tests/oracle/test_edit_oracle tests/data/oracle/klein_inpaint_128

Any size, strength, step count, seed, prompt or mask makes a new case that the
same test program checks (meta.json says everything it needs).  The image,
mask and checkpoint helpers are shared with gen_zimage_edit_oracle.py (the
Z-Image cases) in oracle_edit_common.py.

What computes the reference:
- inpaint: diffusers' Flux2KleinInpaintPipeline, as released, called with the
  image, the mask and the strength (no image_reference, no padding_mask_crop).
  kiln takes OpenAI's mask form (RGBA, alpha 0 = repaint); the pipeline gets
  the same mask as diffusers reads masks (an "L" image, white = repaint).
- img2img: diffusers has no released FLUX.2 klein img2img pipeline (0.42.1
  ships Flux2KleinInpaintPipeline only), so the reference is FLUX.1's
  FluxImg2ImgPipeline algorithm on klein's own pipeline: the image resized
  (not cropped) to its floored multiple-of-16 size (image_processor.preprocess,
  resize_mode "default"; over 1024^2 pixels first scaled down as the inpaint
  pipeline scales its image), VAE-encoded as klein encodes images
  (_encode_vae_image: argmax, patchify, BN), noised with the scheduler's
  scale_noise at the start sigma of FluxImg2ImgPipeline.get_timesteps
  (t_start = int(max(n - n * strength, 0)), set_begin_index(t_start)), then
  Flux2KleinPipeline itself runs the remaining steps: latents= that start and
  sigmas= the schedule's unshifted tail (set_timesteps shifts it with the mu of
  the full step count, giving exactly the full schedule's tail; asserted
  below).  No reference conditioning, as FluxImg2ImgPipeline has none.
  (An unreleased Flux2KleinImg2ImgPipeline draft floors n * strength, crops
  the image and resets the scheduler's begin index to 0 before its loop,
  stepping with the schedule's first sigmas; kiln does not follow it.)

Files written to --out (small: a few tens of KB at 128x128):
  meta.json         parameters, sigmas, the steps run, versions, and
                    image_latents_fp32_vs_fp64 (the reference's own error)
  input.png         the input image (RGB, deterministic from --image-seed)
  mask.png          inpaint: OpenAI's form, RGBA with alpha 0 where repainted
                    (--mask-form diffusers: grayscale, white repaints)
  ref.safetensors   prompt_embeds (1, T, 3H); image_latents_packed (1, N, C)
                    (the image encoded); noise_packed (1, N, C) (the draw);
                    mask_packed (N) (inpaint: at the latent grid);
                    latents_final (1, N, C) (after the last step, and for
                    inpaint its blend)
  image.png         the pipeline's output image
"""
import copy
import math
import os
import shutil

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from diffusers import Flux2KleinInpaintPipeline, Flux2KleinPipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from diffusers.utils.torch_utils import randn_tensor

from oracle_edit_common import make_mask, parse_args, start_case, write_meta


def packed(x):
    """(B, C, h, w) -> (B, h*w, C), diffusers' _pack_latents."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1).contiguous()


def main():
    a = parse_args(__doc__, 4, "ckpt/klein-tiny")
    w, h, ckpt, image = start_case(a)
    strength = a.strength
    layers = (1, 2, 3)  # the tiny Qwen3's stacked layers (shared/oracle/README.md)
    # Flux2KleinInpaintPipeline's step 2: over 1024^2 pixels the image is
    # first LANCZOS-resized to int(side x sqrt(1024^2 / area)), then both
    # modes work at the floored multiple-of-16 size (img2img prepares its
    # image the same way; the inpaint pipeline does all of this itself).
    sized = image
    if w * h > 1024 * 1024:
        scale = math.sqrt(1024 * 1024 / (h * w))
        sized = image.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)
    W, H = sized.width // 16 * 16, sized.height // 16 * 16
    n = a.steps
    gen = torch.Generator("cpu").manual_seed(a.seed)
    steps_out = {}

    def on_step(pipe, i, t, kw):
        steps_out[i] = kw["latents"].detach().clone()
        return {}

    tensors = {}
    meta = {"mode": a.mode, "checkpoint": a.checkpoint, "prompt": a.prompt, "seed": a.seed,
            "steps": n, "strength": strength, "max_seq": a.max_seq,
            "text_encoder_out_layers": list(layers), "input_wh": [w, h], "output_wh": [W, H],
            "image_seed": a.image_seed}
    if a.mode == "inpaint":
        spec = a.mask or f"rect:{w // 4},{h // 4},{w * 5 // 8},{h * 3 // 4}"
        mask_file, l_mask = make_mask(w, h, spec, a.mask_form, a.mask_blur)
        mask_file.save(os.path.join(a.out, "mask.png"), optimize=True)
        meta.update({"mask": spec, "mask_form": a.mask_form, "mask_blur": a.mask_blur})
        pipe = Flux2KleinInpaintPipeline.from_pretrained(ckpt, torch_dtype=torch.float32)
        meta["pipeline_class"] = "Flux2KleinInpaintPipeline"
        got = {}
        prep_latents, prep_mask = pipe.prepare_latents, pipe.prepare_mask_latents

        def prepare_latents(*args, **kw):
            r = prep_latents(*args, **kw)
            got["noise"], got["image"] = r[1], r[2]
            return r

        def prepare_mask_latents(*args, **kw):
            got["mask"] = prep_mask(*args, **kw)
            return got["mask"]

        pipe.prepare_latents, pipe.prepare_mask_latents = prepare_latents, prepare_mask_latents
        out = pipe(prompt=a.prompt, image=image, mask_image=l_mask, strength=strength,
                   num_inference_steps=n, guidance_scale=1.0, generator=gen,
                   max_sequence_length=a.max_seq, text_encoder_out_layers=layers,
                   callback_on_step_end=on_step).images[0]
        tensors["image_latents_packed"] = got["image"]
        tensors["noise_packed"] = got["noise"]
        tensors["mask_packed"] = got["mask"].reshape(-1)
        sigmas = pipe.scheduler.sigmas
        t_start = pipe.scheduler.begin_index
    else:
        pipe = Flux2KleinPipeline.from_pretrained(ckpt, torch_dtype=torch.float32)
        meta["pipeline_class"] = "Flux2KleinPipeline (FluxImg2ImgPipeline's algorithm, see above)"
        init = pipe.image_processor.preprocess(sized, height=H, width=W).to(torch.float32)
        image_latents = pipe._encode_vae_image(init, generator=gen)
        N = (H // 16) * (W // 16)
        mu = compute_empirical_mu(image_seq_len=N, num_steps=n)
        base = np.linspace(1.0, 1 / n, n)
        sched = pipe.scheduler
        sched.set_timesteps(sigmas=base, mu=mu)
        full = sched.sigmas.clone()
        # FluxImg2ImgPipeline.get_timesteps
        init_timestep = min(n * strength, n)
        t_start = int(max(n - init_timestep, 0))
        sched.set_begin_index(t_start)
        latent_timestep = sched.timesteps[t_start:t_start + 1]
        noise = randn_tensor(image_latents.shape, generator=gen, dtype=torch.float32)
        start = sched.scale_noise(image_latents, latent_timestep, noise)
        sched._begin_index = None  # the pipeline call below sets its own schedule
        out = pipe(prompt=a.prompt, height=H, width=W, num_inference_steps=n,
                   sigmas=list(base[t_start:]), latents=start, guidance_scale=1.0,
                   max_sequence_length=a.max_seq, text_encoder_out_layers=layers,
                   callback_on_step_end=on_step).images[0]
        sigmas = sched.sigmas
        assert torch.equal(sigmas, full[t_start:]), (sigmas, full)
        tensors["image_latents_packed"] = packed(image_latents)
        tensors["noise_packed"] = packed(noise)
        sigmas = full

    # The reference's own fp32 error in the image latents: the same image
    # through a float64 copy of the VAE.  The tiny random-weight VAE is
    # ill-conditioned on large images (about 6e-4 at 1072x976, 1e-6 at
    # 128x128), so test_edit_oracle widens its 1e-4 latents bar to twice
    # this where it is larger.
    vae64 = copy.deepcopy(pipe.vae).to(torch.float64)
    with torch.no_grad():
        pre = pipe.image_processor.preprocess(sized, height=H, width=W).to(torch.float64)
        lat64 = pipe._patchify_latents(vae64.encode(pre).latent_dist.mode())
        bn_mean = vae64.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(vae64.bn.running_var.view(1, -1, 1, 1) + vae64.config.batch_norm_eps)
        lat64 = packed((lat64 - bn_mean) / bn_std)
    drift = ((tensors["image_latents_packed"].double() - lat64).norm() / lat64.norm()).item()
    del vae64

    pe = pipe._get_qwen3_prompt_embeds(pipe.text_encoder, pipe.tokenizer, [a.prompt],
                                       max_sequence_length=a.max_seq, hidden_states_layers=layers)
    tensors["prompt_embeds"] = pe
    assert sorted(steps_out) == list(range(n - t_start)), sorted(steps_out)
    tensors["latents_final"] = steps_out[n - t_start - 1]
    save_file({k: v.contiguous().to(torch.float32) for k, v in tensors.items()},
              os.path.join(a.out, "ref.safetensors"))
    out.save(os.path.join(a.out, "image.png"), optimize=True)
    meta.update({
        "t_start": int(t_start), "steps_run": n - int(t_start),
        "image_latents_fp32_vs_fp64": drift,
        "sigmas": [float(s) for s in sigmas],
    })
    write_meta(a.out, meta, tensors)
    shutil.rmtree(ckpt)
    print(f"{a.out}: {a.mode} {w}x{h} -> {W}x{H}, strength {strength}, {n - t_start} of {n} steps")


if __name__ == "__main__":
    main()
