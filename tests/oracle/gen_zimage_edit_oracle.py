#!/usr/bin/env python3
"""Writes a diffusers reference case for kiln's Z-Image image-to-image
(strength) and inpainting (mask) on the tiny Z-Image checkpoint
(shared/oracle/ckpt/zimage-tiny).  Run by hand (not in CI) in a virtualenv
with torch (CPU is enough), diffusers 0.42.1, transformers, safetensors,
numpy and Pillow; the helpers it shares with gen_edit_oracle.py (klein) live
in oracle_edit_common.py.  The cases in tests/data/oracle were made with:

    python3 -m venv venv && venv/bin/pip install torch diffusers==0.42.1 transformers safetensors pillow
    venv/bin/python tests/oracle/gen_zimage_edit_oracle.py --mode img2img \\
        --out tests/data/oracle/zimage_img2img_128
    venv/bin/python tests/oracle/gen_zimage_edit_oracle.py --mode img2img \\
        --out tests/data/oracle/zimage_img2img_112x80 --size 112x80 --strength 0.75 \\
        --steps 6 --seed 11 --image-seed 2 --prompt "a lighthouse at dusk, oil painting"
    venv/bin/python tests/oracle/gen_zimage_edit_oracle.py --mode inpaint \\
        --out tests/data/oracle/zimage_inpaint_128 --strength 1.0
    venv/bin/python tests/oracle/gen_zimage_edit_oracle.py --mode inpaint \\
        --out tests/data/oracle/zimage_inpaint_120x88 --size 120x88 --strength 0.8 \\
        --steps 4 --seed 3 --image-seed 3 --prompt "a cat asleep on a wooden table" \\
        --mask ellipse:30,18,95,69 --mask-form diffusers --mask-blur 3
    venv/bin/python tests/oracle/gen_zimage_edit_oracle.py --mode inpaint \\
        --out tests/data/oracle/zimage_inpaint_144x96 --size 144x96 --strength 0.6 \\
        --steps 5 --seed 21 --image-seed 4 --prompt "a garden path in spring" \\
        --mask rect:20,10,100,70

Any size, strength, step count, seed, prompt or mask makes a new case
(meta.json says everything it needs).

What computes the reference: diffusers' ZImageImg2ImgPipeline and
ZImageInpaintPipeline as released in 0.42.1, fp32 on the CPU, called with
the PIL image (and for inpaint the "L" mask, white = repaint), strength,
num_inference_steps, guidance_scale=0.0 (the Turbo recipe: no CFG, no
negative prompt encoded), max_sequence_length, a CPU torch.Generator seeded
with --seed, and no height/width.  Nothing is re-implemented: the tensors are
captured by wrapping vae.encode/decode, scheduler.scale_noise/step,
prepare_mask_latents, randn_tensor (in the pipeline's and the VAE's
modules), forward pre-hooks on the text encoder and the transformer, and
callback_on_step_end; the script then asserts that they fit together.

What the pipelines do (read in diffusers 0.42.1, and asserted below where a
tensor shows it):
1. Image: image_processor.preprocess, .to(float32), then VAE-encoded
   (AutoencoderKL, encoder only, no quant_conv) and the posterior SAMPLED
   (retrieve_latents' default sample_mode "sample"):
   mean + exp(0.5 * clamp(logvar, -30, 20)) * eps, eps = randn(mean.shape,
   generator) in the posterior's dtype -- the FIRST draw from the generator;
   then (x - shift_factor) * scaling_factor.
2. Noise: the SECOND draw from the same generator, randn((B, C, H/8, W/8))
   in prompt_embeds[0].dtype (fp32 here), drawn after the image is encoded.
3. Schedule: sigmas = linspace(1, 1/n, n) (torch, fp32, via .tolist());
   the scheduler (FlowMatchEulerDiscreteScheduler, use_dynamic_shifting
   false) applies its static shift s = 3.0 in fp32: s*x / (1 + (s-1)*x) --
   the pipeline computes a mu (calculate_shift) and passes it, but it is
   unused without dynamic shifting; a terminal 0 is appended; timesteps =
   sigmas * 1000.  SD3's get_timesteps: t_start = int(max(n - min(n *
   strength, n), 0)), set_begin_index(t_start), steps_run = n - t_start
   (< 1 is an error).  The start is scheduler.scale_noise(image_latents,
   timesteps[t_start], noise) = sigmas[t_start] * noise + (1 -
   sigmas[t_start]) * image_latents (the index is begin_index; the timestep
   value is not looked up).  The transformer gets t = (1000 - timestep) /
   1000 in fp32 (recorded as transformer_t) and its output is negated
   before the Euler step x += (sigma_next - sigma) * v.
4. Size: preprocess(image) is called WITHOUT height/width, so the image is
   always resized (PIL LANCZOS, whole image, no crop, aspect not kept) to
   its size floored to a multiple of 16 (vae_scale_factor 8 * 2); a size
   already a multiple of 16 is left as is (PIL's resize copies); large
   images are NOT shrunk (no 1024^2 cap, unlike klein's inpaint pipeline).
   height/width, when given, only have to be multiples of 16 (else
   ValueError) and set the noise and mask size; they do not resize the image,
   so anything but the floored image size fails on a shape mismatch.
5. Mask (inpaint): mask_processor (do_normalize False, do_binarize True,
   do_convert_grayscale True, resample lanczos) resizes the PIL mask to the
   image's floored size with LANCZOS first (a copy when the size is the
   same), then converts it to "L", scales by 1/255 and binarizes (< 0.5 -> 0,
   >= 0.5 -> 1, i.e. pixel >= 128 repaints); not normalised.  It is brought
   to the latent grid by torch.nn.functional.interpolate(mode="nearest"),
   which at a factor of 8 takes the top-left pixel of each 8x8 block
   (mask[..., ::8, ::8]); it has ONE channel, (B, 1, H/8, W/8), broadcast
   over the latent channels.  (An RGBA mask given to diffusers would be
   converted to "L" ignoring alpha: the OpenAI form must be turned into
   alpha-0 -> white first, as make_mask does.)
6. Masked image: init_image * (mask < 0.5) is VAE-encoded and sampled too --
   a THIRD generator draw, after the noise -- and scaled, but the
   masked_image_latents are never used by the loop (only offered to the
   step callback).  The draw does not change any output.
7. Inpaint blend: after EVERY step (scheduler.step first), latents = (1 -
   mask) * init + mask * latents, where init = scale_noise(image_latents,
   timesteps[i + 1], noise) -- the same noise as the start, at the NEXT
   sigma (the scheduler's step_index, i.e. sigmas[t_start + i + 1]) -- for
   every step but the last, and the clean image_latents at the last step
   (no re-noising).  latents_final is after that last blend.  The inpaint
   pipeline conditions the transformer on nothing else (no masked-image or
   mask channels: in_channels 4).
8. Defaults: strength 0.6 (img2img), 1.0 (inpaint); guidance_scale 5.0,
   num_inference_steps 50, max_sequence_length 512 (64 accepted: the
   tokenizer pads to it and truncates).  strength must be in [0, 1]; the
   only rounding is int() in get_timesteps (n * strength = 3.2 of 4 gives
   t_start 0, all 4 steps).

Prompt: Qwen3 chat template (user message, add_generation_prompt,
enable_thinking=True: no empty think block), padded to max_sequence_length,
hidden_states[-2] of the text encoder (the output of its last-but-one
layer, no final norm), real tokens only (one row per token, T < max_seq).

Files written to --out (small: a few tens of KB at 128x128):
  meta.json         parameters, sigmas (the full schedule with its terminal
                    0, before the begin index), t_start, steps_run,
                    transformer_t, prompt_token_ids, the generator's draws
                    in order, versions, and image_latents_fp32_vs_fp64 (the
                    fp32 posterior mean's relative error against a float64
                    copy of the VAE on the same preprocessed image; 3.8e-5
                    on the 128x128 image-seed 1 input, 1e-5 and 3e-6 on the
                    smaller ones: a test's latents bar must allow for it)
  input.png         the input image (RGB, deterministic from --image-seed)
  mask.png          inpaint: OpenAI's form, RGBA with alpha 0 where repainted
                    (--mask-form diffusers: grayscale, white repaints)
  ref.safetensors   fp32, B = 1: prompt_embeds (T, D); posterior_mean,
                    posterior_logvar (1, C, h, w) (raw, unclamped);
                    sample_eps, image_latents, noise, latents_start,
                    latents_final (1, C, h, w); mask (h*w) (inpaint, at the
                    latent grid, row-major); h, w = H/8, W/8
  image.png         the pipeline's output image
"""
import copy
import os
import shutil

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

import diffusers.models.autoencoders.vae as vae_module
import diffusers.pipelines.z_image.pipeline_z_image_img2img as img2img_module
import diffusers.pipelines.z_image.pipeline_z_image_inpaint as inpaint_module
from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline

from oracle_edit_common import make_mask, parse_args, start_case, write_meta


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    a = parse_args(__doc__, 5, "ckpt/zimage-tiny")
    w, h, ckpt, image = start_case(a)
    n, strength, guidance = a.steps, a.strength, 0.0
    W, H = w // 16 * 16, h // 16 * 16
    meta = {"mode": a.mode, "checkpoint": a.checkpoint, "prompt": a.prompt, "seed": a.seed,
            "steps": n, "strength": strength, "guidance": guidance, "max_seq": a.max_seq,
            "input_wh": [w, h], "output_wh": [W, H], "image_seed": a.image_seed}
    inpaint = a.mode == "inpaint"
    if inpaint:
        spec = a.mask or f"rect:{w // 4},{h // 4},{w * 5 // 8},{h * 3 // 4}"
        mask_file, l_mask = make_mask(w, h, spec, a.mask_form, a.mask_blur)
        mask_file.save(os.path.join(a.out, "mask.png"), optimize=True)
        meta.update({"mask": spec, "mask_form": a.mask_form, "mask_blur": a.mask_blur})
        cls, module = ZImageInpaintPipeline, inpaint_module
    else:
        cls, module = ZImageImg2ImgPipeline, img2img_module
    pipe = cls.from_pretrained(ckpt, torch_dtype=torch.float32)
    meta["pipeline_class"] = cls.__name__
    vae, sched = pipe.vae, pipe.scheduler
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    C = pipe.transformer.config.in_channels
    meta.update({"latent_channels": C, "vae_shift_factor": shift, "vae_scaling_factor": scale})

    # --- capture -----------------------------------------------------------
    draws, encodes, decodes, noisings, steps, cbs, te_in, tr_in, masks = ([] for _ in range(9))

    def recording(fn, who):
        def randn_tensor(shape, *args, **kw):
            t = fn(shape, *args, **kw)
            draws.append((who, t.detach().clone()))
            return t
        return randn_tensor

    saved_randn = (vae_module.randn_tensor, module.randn_tensor)
    vae_module.randn_tensor = recording(vae_module.randn_tensor, "posterior")
    module.randn_tensor = recording(module.randn_tensor, "pipeline")
    orig_encode, orig_decode = vae.encode, vae.decode

    def encode(x, *args, **kw):
        out = orig_encode(x, *args, **kw)
        encodes.append((x.detach().clone(), out.latent_dist.parameters.detach().clone(), len(draws)))
        return out

    def decode(z, *args, **kw):
        decodes.append(z.detach().clone())
        return orig_decode(z, *args, **kw)

    orig_scale_noise, orig_step = sched.scale_noise, sched.step

    def scale_noise(sample, timestep, noise=None):
        out = orig_scale_noise(sample, timestep, noise)
        noisings.append({"sample": sample.detach().clone(), "timestep": timestep.detach().clone(),
                         "noise": noise.detach().clone(), "out": out.detach().clone(),
                         "step_index": sched.step_index, "begin_index": sched.begin_index,
                         "draws": len(draws)})
        return out

    def step(model_output, timestep, sample, *args, **kw):
        out = orig_step(model_output, timestep, sample, *args, **kw)
        steps.append(out[0].detach().clone())
        return out

    vae.encode, vae.decode = encode, decode
    sched.scale_noise, sched.step = scale_noise, step
    if inpaint:
        orig_pml = pipe.prepare_mask_latents

        def prepare_mask_latents(mask, masked_image, *args, **kw):
            m, mil = orig_pml(mask, masked_image, *args, **kw)
            masks.append((mask.detach().clone(), masked_image.detach().clone(), m.detach().clone()))
            return m, mil

        pipe.prepare_mask_latents = prepare_mask_latents
    h_te = pipe.text_encoder.register_forward_pre_hook(
        lambda mod, args, kw: te_in.append((kw["input_ids"].clone(), kw["attention_mask"].clone())),
        with_kwargs=True)
    h_tr = pipe.transformer.register_forward_pre_hook(
        lambda mod, args, kw: tr_in.append((args[1].detach().clone(), [p.detach().clone() for p in args[2]])),
        with_kwargs=True)

    def on_step(p, i, t, kw):
        cbs.append((i, float(t), kw["latents"].detach().clone()))
        return {}

    gen = torch.Generator("cpu").manual_seed(a.seed)
    kw = dict(prompt=a.prompt, image=image, strength=strength, num_inference_steps=n,
              guidance_scale=guidance, generator=gen, max_sequence_length=a.max_seq,
              callback_on_step_end=on_step)
    if inpaint:
        kw["mask_image"] = l_mask
    out = pipe(**kw).images[0]

    h_te.remove()
    h_tr.remove()
    del vae.encode, vae.decode, sched.scale_noise, sched.step
    if inpaint:
        del pipe.prepare_mask_latents
    vae_module.randn_tensor, module.randn_tensor = saved_randn

    # --- what was captured, and that it fits together ------------------------
    sigmas = sched.sigmas.clone()
    t_start = int(sched.begin_index)
    steps_run = n - t_start
    hl, wl = H // 8, W // 8
    assert len(sigmas) == n + 1 and float(sigmas[-1]) == 0.0, sigmas
    assert t_start == int(max(n - min(n * strength, n), 0)), t_start
    # The generator's draws, in order: image posterior, noise (and for
    # inpaint the masked image's posterior); replayed from a fresh
    # generator they are the same numbers and leave it in the same state.
    kinds = [k for k, _ in draws]
    assert kinds == (["posterior", "pipeline", "posterior"] if inpaint else ["posterior", "pipeline"]), kinds
    replay = torch.Generator("cpu").manual_seed(a.seed)
    for _, t in draws:
        assert torch.equal(torch.randn(t.shape, generator=replay, dtype=t.dtype), t)
    assert torch.equal(replay.get_state(), gen.get_state())
    assert len(encodes) == (2 if inpaint else 1), len(encodes)
    pre, params, ndraws = encodes[0]
    assert ndraws == 0 and pre.shape == (1, 3, H, W) and pre.dtype == torch.float32, (ndraws, pre.shape)
    mean, logvar = params.chunk(2, dim=1)
    eps = draws[0][1]
    noise = draws[1][1]
    assert mean.shape == eps.shape == noise.shape == (1, C, hl, wl), (mean.shape, noise.shape)
    start = noisings[0]
    assert start["draws"] == 2 and start["step_index"] is None and start["begin_index"] == t_start
    image_latents = start["sample"]
    assert torch.equal(start["noise"], noise)
    want = (mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps - shift) * scale
    assert rel(image_latents, want) < 1e-6, rel(image_latents, want)
    sig0 = sigmas[t_start]
    assert float(start["timestep"][0]) == float(sched.timesteps[t_start])
    latents_start = start["out"]
    want = sig0 * noise + (1.0 - sig0) * image_latents
    assert rel(latents_start, want) < 1e-6, rel(latents_start, want)
    assert len(steps) == len(cbs) == len(tr_in) == steps_run, (len(steps), len(cbs), len(tr_in))
    assert [i for i, _, _ in cbs] == list(range(steps_run))
    assert [t for _, t, _ in cbs] == [float(t) for t in sched.timesteps[t_start:]]
    transformer_t = [float(t[0]) for t, _ in tr_in]
    assert transformer_t == [float((1000 - t) / 1000) for t in sched.timesteps[t_start:]]
    tensors = {}
    if inpaint:
        assert len(noisings) == steps_run, len(noisings)  # the start, then one per step but the last
        pix, masked_image, m = masks[0]
        assert pix.shape == (1, 1, H, W) and m.shape == (1, 1, hl, wl), (pix.shape, m.shape)
        assert set(torch.unique(m).tolist()) <= {0.0, 1.0}
        # Resized to the image's floored size with LANCZOS, then >= 0.5 of 255.
        lanczos = np.asarray(l_mask.resize((W, H), Image.Resampling.LANCZOS), np.float32) / 255.0
        assert torch.equal(pix[0, 0], torch.from_numpy((lanczos >= 0.5).astype(np.float32)))
        # Nearest at a factor of 8: the top-left pixel of each 8x8 block.
        assert torch.equal(m, pix[:, :, ::8, ::8])
        assert torch.equal(masked_image, pre * (pix < 0.5))
        assert torch.equal(encodes[1][0], masked_image) and encodes[1][2] == 2
        for i in range(steps_run):
            init = image_latents
            if i < steps_run - 1:
                r = noisings[i + 1]
                assert torch.equal(r["sample"], image_latents) and torch.equal(r["noise"], noise)
                assert r["step_index"] == t_start + i + 1
                assert float(r["timestep"][0]) == float(sched.timesteps[t_start + i + 1])
                init = r["out"]
                want = sigmas[t_start + i + 1] * noise + (1.0 - sigmas[t_start + i + 1]) * image_latents
                assert rel(init, want) < 1e-6
            want = (1 - m) * init + m * steps[i]
            assert torch.equal(cbs[i][2], want), i
        tensors["mask"] = m.reshape(-1)
        repaint = m.reshape(-1).sum().item()
        meta["mask_latent_repaint"] = int(repaint)
    else:
        assert len(noisings) == 1, len(noisings)
        for i in range(steps_run):
            assert torch.equal(cbs[i][2], steps[i]), i
    latents_final = cbs[-1][2]
    assert len(decodes) == 1 and torch.equal(decodes[0], latents_final / scale + shift)
    ids, attn = te_in[0]
    assert len(te_in) == 1 and ids.shape == (1, a.max_seq), ids.shape
    prompt_embeds = tr_in[0][1][0]
    T = int(attn[0].sum())
    assert prompt_embeds.shape[0] == T and bool(attn[0, :T].all()), (prompt_embeds.shape, T)
    assert all(torch.equal(p[0], prompt_embeds) for _, p in tr_in)

    # The reference's own fp32 error: the posterior mean of the same
    # preprocessed image through a float64 copy of the VAE.
    vae64 = copy.deepcopy(vae).to(torch.float64)
    with torch.no_grad():
        mean64 = vae64.encode(pre.double()).latent_dist.mean
    drift = rel(mean, mean64)
    del vae64

    tensors.update({"prompt_embeds": prompt_embeds, "posterior_mean": mean,
                    "posterior_logvar": logvar, "sample_eps": eps,
                    "image_latents": image_latents, "noise": noise,
                    "latents_start": latents_start, "latents_final": latents_final})
    save_file({k: v.contiguous().to(torch.float32) for k, v in tensors.items()},
              os.path.join(a.out, "ref.safetensors"))
    out.save(os.path.join(a.out, "image.png"), optimize=True)
    meta.update({
        "t_start": t_start, "steps_run": steps_run,
        "image_latents_fp32_vs_fp64": drift,
        "sigmas": [float(s) for s in sigmas],
        "transformer_t": transformer_t,
        "prompt_token_ids": ids[0, :T].tolist(),
        "draws": (["posterior_eps (image)", "noise", "posterior_eps (masked image, unused)"]
                  if inpaint else ["posterior_eps (image)", "noise"]),
    })
    write_meta(a.out, meta, tensors)
    shutil.rmtree(ckpt)
    print(f"{a.out}: {a.mode} {w}x{h} -> {W}x{H}, strength {strength}, {steps_run} of {n} steps, T {T}")


if __name__ == "__main__":
    main()
