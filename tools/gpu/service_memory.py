#!/usr/bin/env python3
"""GPU memory of kiln serve per process, at rest and at the peak of each of a
sequence of requests (tools/gpu/check.sh section servemem; standard library
only, so it runs on a bare GPU host).

    tools/gpu/service_memory.py --kiln .devbuild/tools/kiln --model /tmp/kiln-klein-4b \
        [--port 18600] [--out DIR] [--steps 4] [-- extra kiln serve args]

Starts `kiln serve --device cuda` on the checkpoint, waits until it is ready,
samples `nvidia-smi --query-compute-apps` every 0.2 s throughout, and sends,
one at a time: 1024x1024 n=1, 1024x1024 n=4, 2048x2048 n=1, 2048x2048 n=4.
For the rest period (5 s after ready) and each request (from sending it to
1 s after its answer) it prints the peak of the processes' summed memory,
"+X GiB over the peak before it" (the highest sum of any earlier period),
and each stage's own peak.  Writes DIR/service_memory.json (the periods)
and DIR/service_memory.csv (every sample).  Exits non-zero when a request
fails or the service does not come up.
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

GIB = 1024.0  # nvidia-smi reports MiB

REQUESTS = [(1024, 1024, 1), (1024, 1024, 4), (2048, 2048, 1), (2048, 2048, 4)]


def query_apps():
    """[(pid, name, MiB)] of the GPU's compute processes, or [] on failure."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    apps = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[2].isdigit():
            continue
        apps.append((parts[0], os.path.basename(parts[1]), int(parts[2])))
    return apps


class Sampler(threading.Thread):
    """Samples per-process memory; a period's peaks are read with mark()."""

    def __init__(self, csv_path):
        super().__init__(daemon=True)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.csv = open(csv_path, "w")
        self.csv.write("t_s,period,process,pid,mib\n")
        self.t0 = time.time()
        self.period = "start"
        self.reset()

    def reset(self):
        self.peak_sum = 0
        self.peak_proc = {}

    def run(self):
        while not self.stop.is_set():
            apps = query_apps()
            now = time.time() - self.t0
            with self.lock:
                total = 0
                for pid, name, mib in apps:
                    total += mib
                    self.peak_proc[name] = max(self.peak_proc.get(name, 0), mib)
                    self.csv.write("%.2f,%s,%s,%s,%d\n" % (now, self.period, name, pid, mib))
                self.peak_sum = max(self.peak_sum, total)
            self.stop.wait(0.2)

    def begin(self, period):
        with self.lock:
            self.period = period
            self.reset()

    def mark(self):
        with self.lock:
            return self.peak_sum, dict(self.peak_proc)


def wait_ready(base, proc, timeout_s):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if urllib.request.urlopen(base + "/readyz", timeout=2).status == 200:
                return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    return False


def generate(base, w, h, n, steps, seed):
    body = {"prompt": "a red fox sitting in fresh snow, soft winter light", "size": "%dx%d" % (w, h),
            "n": n, "seed": seed, "num_inference_steps": steps, "output_format": "png"}
    req = urllib.request.Request(base + "/v1/images/generations", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    try:
        reply = json.load(urllib.request.urlopen(req, timeout=900))
        images = [base64.b64decode(d["b64_json"]) for d in reply["data"]]
        return 200, time.time() - t0, "%d images" % len(images)
    except urllib.error.HTTPError as e:
        return e.code, time.time() - t0, e.read().decode(errors="replace")[:300]
    except Exception as e:  # a dropped connection, a timeout
        return 0, time.time() - t0, str(e)[:300]


def fmt_procs(procs):
    return ", ".join("%s %.2f" % (k, v / GIB) for k, v in sorted(procs.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if query_apps():
        print("note: other processes already use the GPU; they are counted too")
    log = open(os.path.join(a.out, "serve.log"), "w")
    proc = subprocess.Popen([a.kiln, "serve", "--model", a.model, "--device", "cuda",
                             "--port", str(a.port)] + a.serve_args,
                            stdout=log, stderr=subprocess.STDOUT)
    sampler = Sampler(os.path.join(a.out, "service_memory.csv"))
    sampler.start()
    base = "http://127.0.0.1:%d" % a.port
    periods, failed = [], 0
    try:
        if not wait_ready(base, proc, 600):
            print("kiln serve did not become ready (see %s/serve.log)" % a.out)
            return 1
        sampler.begin("rest")
        time.sleep(5)
        rest, rest_procs = sampler.mark()
        print("at rest: %.2f GiB (%s)" % (rest / GIB, fmt_procs(rest_procs)))
        periods.append({"period": "rest", "peak_mib": rest, "per_process_mib": rest_procs})
        before = rest
        for i, (w, h, n) in enumerate(REQUESTS):
            name = "%dx%d n=%d" % (w, h, n)
            sampler.begin(name)
            status, dt, detail = generate(base, w, h, n, a.steps, 100 + i)
            time.sleep(1.0)
            peak, procs = sampler.mark()
            failed += status != 200
            print("%-16s HTTP %d in %5.1f s | peak %.2f GiB, %+.2f GiB over the peak before it"
                  " | %s%s" % (name, status, dt, peak / GIB, (peak - before) / GIB,
                               fmt_procs(procs), "" if status == 200 else " | " + detail))
            sys.stdout.flush()
            periods.append({"period": name, "status": status, "seconds": round(dt, 2),
                            "peak_mib": peak, "over_before_mib": peak - before,
                            "per_process_mib": procs})
            before = max(before, peak)
    finally:
        sampler.stop.set()
        sampler.join()
        sampler.csv.close()
        proc.terminate()  # kiln serve stops its replicas
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        with open(os.path.join(a.out, "service_memory.json"), "w") as f:
            json.dump(periods, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
