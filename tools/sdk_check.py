#!/usr/bin/env python3
"""The official openai Python SDK against a running kiln service, as a
client would use it (tooling, run by hand; not part of the test suite, which
checks the same wire format over raw HTTP in tests/service).

    python3 -m venv build-sdk && build-sdk/bin/pip install openai
    kiln serve --model ckpt/tiny --port 8080 --min-size 64 &
    build-sdk/bin/python tools/sdk_check.py --base-url http://127.0.0.1:8080/v1

Checks: images.generate (usage, size, quality, request_id), the same with
stream=True and partial_images=2 (two image_generation.partial_image
events with partial_image_index 0 and 1 and PNG previews of the size, then
one image_generation.completed whose image is the non-streamed one, byte
for byte), images.edit with an OpenAI mask (alpha 0 = repaint), the same
edit streamed without and with partial_images=2 (image_edit.* events; the
completed image is the non-streamed edit's), strength (extra_body), and
that bad requests raise
BadRequestError with OpenAI's codes (unknown_parameter, empty_string,
integer_above_max_value).  Prints one line per check and exits non-zero
when one fails.
"""
import argparse
import base64
import io
import struct
import sys
import zlib

import openai


def png_rgba(w, h, alpha_of):
    """A w x h RGBA PNG (grey pixels) whose alpha is alpha_of(x, y)."""
    raw = b"".join(b"\0" + b"".join(bytes((128, 128, 128, alpha_of(x, y))) for x in range(w))
                   for y in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--size", default="64x64")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key)
    # 4 steps: previews come from the steps before the last (up to 3 of 4)
    extra = {"seed": 7, "num_inference_steps": 4}
    failed = 0

    def check(name, ok, detail=""):
        nonlocal failed
        print("%s %s %s" % ("ok  " if ok else "FAIL", name, detail))
        failed += not ok

    r = client.images.generate(prompt="a lighthouse", size=a.size, extra_body=extra)
    check("generate", r.data and r.data[0].b64_json and r.usage and r.usage.total_tokens > 0,
          "usage %s quality %s size %s" % (r.usage, r.quality, r.size))
    check("request_id", bool(getattr(r, "_request_id", None)), str(getattr(r, "_request_id", None)))
    plain = base64.b64decode(r.data[0].b64_json)

    def stream_ok(events, kind, previews, final):
        """previews partial events (indices 0..previews-1, PNGs) then one
        completed event whose image is `final`."""
        types = [e.type for e in events]
        want = ["%s.partial_image" % kind] * previews + ["%s.completed" % kind]
        if types != want:
            return False, str(types)
        parts = events[:previews]
        if [e.partial_image_index for e in parts] != list(range(previews)):
            return False, "indices %s" % [e.partial_image_index for e in parts]
        for e in parts:
            png = base64.b64decode(e.b64_json)
            if png[:8] != b"\x89PNG\r\n\x1a\n" or e.size != a.size or e.output_format != "png":
                return False, "preview %d is not a %s PNG" % (e.partial_image_index, a.size)
        done = events[-1]
        if base64.b64decode(done.b64_json) != final:
            return False, "the completed image differs from the non-streamed one"
        if not done.usage or done.usage.total_tokens <= 0:
            return False, "no usage"
        return True, "%d events" % len(events)

    events = list(client.images.generate(prompt="a lighthouse", size=a.size, stream=True,
                                         partial_images=2, extra_body=extra))
    check("generate stream", *stream_ok(events, "image_generation", 2, plain))

    w, h = (int(v) for v in a.size.split("x"))
    image = png_rgba(w, h, lambda x, y: 255)
    mask = png_rgba(w, h, lambda x, y: 0 if x < w // 2 else 255)
    r = client.images.edit(image=("in.png", io.BytesIO(image), "image/png"),
                           mask=("m.png", io.BytesIO(mask), "image/png"), prompt="a red door",
                           extra_body=extra)
    check("edit with mask", r.data and r.data[0].b64_json, "usage %s" % r.usage)
    edited = base64.b64decode(r.data[0].b64_json)
    events = list(client.images.edit(image=("in.png", io.BytesIO(image), "image/png"),
                                     mask=("m.png", io.BytesIO(mask), "image/png"),
                                     prompt="a red door", stream=True, extra_body=extra))
    check("edit stream", *stream_ok(events, "image_edit", 0, edited))
    # the mask's default strength 0.8 still runs all 4 steps (diffusers' inpaint
    # get_timesteps): room for 2 previews
    events = list(client.images.edit(image=("in.png", io.BytesIO(image), "image/png"),
                                     mask=("m.png", io.BytesIO(mask), "image/png"),
                                     prompt="a red door", stream=True, partial_images=2,
                                     extra_body=extra))
    check("edit stream partial_images=2", *stream_ok(events, "image_edit", 2, edited))
    r = client.images.edit(image=("in.png", io.BytesIO(image), "image/png"), prompt="blue",
                           extra_body={**extra, "strength": 0.5})
    check("edit strength", r.data and r.data[0].b64_json)

    for name, kwargs, code in [
            ("unknown field", {"extra_body": {"sise": "64x64"}}, "unknown_parameter"),
            ("empty prompt", {"prompt": ""}, "empty_string"),
            ("n too large", {"n": 11}, "integer_above_max_value")]:
        args = {"prompt": "x", "size": a.size, **kwargs}
        try:
            client.images.generate(**args)
            check(name, False, "accepted")
        except openai.BadRequestError as e:
            check(name, e.code == code and e.request_id, "%s %s" % (e.code, e.request_id))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
