#!/usr/bin/env python3
"""Rules the schemas cannot see, over deploy/k8s/*.yaml and deploy/compose*.yaml:
every kiln container runs non-root on a read-only root file system without
privileges, with requests and limits and startup, liveness and readiness
probes on ports it declares; containers of one pod (which share its network)
use distinct ports; stages reach the gateway through the bus Service that
readiness does not gate; every process's grace period outlasts its drain; the
compose stages share a /dev/shm volume and have health checks and a restart
policy; the Grafana dashboard (deploy/grafana/kiln.json) reads only series the
gateway exports (names found in services/gateway/metrics.c and
proc_metrics.c) and each panel has a query.  Prints each broken rule and exits
1 when there is one."""
import glob
import json
import os
import re
import sys

import yaml

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy")
problems = []


def bad(where, what):
    problems.append(f"{where}: {what}")


def arg_after(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def check_pod(where, spec):
    sc = spec.get("securityContext", {})
    if not sc.get("runAsNonRoot"):
        bad(where, "pod securityContext.runAsNonRoot is not true")
    if spec.get("automountServiceAccountToken") is not False:
        bad(where, "automountServiceAccountToken is not false")
    seen_ports = {}
    for c in spec.get("containers", []):
        cw = f"{where}/{c['name']}"
        csc = c.get("securityContext", {})
        if not csc.get("readOnlyRootFilesystem"):
            bad(cw, "readOnlyRootFilesystem is not true")
        if csc.get("allowPrivilegeEscalation") is not False:
            bad(cw, "allowPrivilegeEscalation is not false")
        if "ALL" not in csc.get("capabilities", {}).get("drop", []):
            bad(cw, "capabilities are not all dropped")
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in res.get(kind, {}):
                    bad(cw, f"no {kind}.{r}")
        ports = {}
        for p in c.get("ports", []):
            if p["containerPort"] in seen_ports:
                bad(cw, f"port {p['containerPort']} also used by {seen_ports[p['containerPort']]}"
                        " (containers of a pod share its network)")
            seen_ports[p["containerPort"]] = c["name"]
            ports[p["containerPort"]] = p
            if "name" in p:
                ports[p["name"]] = p
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            pr = c.get(probe)
            if not pr:
                bad(cw, f"no {probe}")
                continue
            port = pr.get("httpGet", {}).get("port")
            if port not in ports:
                bad(cw, f"{probe} probes port {port}, which the container does not declare")
        args = c.get("args", [])
        for flag, port in (("--health-port", None), ("--data-port", None)):
            v = arg_after(args, flag)
            if v is not None and int(v) not in ports:
                bad(cw, f"{flag} {v} is not a declared container port")
        # kiln-stages with both producer stages binds --data-port P for
        # encode and P + 1 for denoise.
        stages = arg_after(args, "--stages") or "encode,denoise,decode"
        data = arg_after(args, "--data-port")
        if ("kiln-stages" in c.get("image", "") and data and int(data) > 0 and
                {"encode", "denoise"} <= set(stages.split(",")) and int(data) + 1 not in ports):
            bad(cw, f"kiln-stages binds --data-port {data} + 1 for its denoise stage, which the "
                    "container does not declare")
        bus = arg_after(args, "--bus")
        if bus and not bus.startswith("tcp://0.0.0.0") and "kiln-bus" not in bus:
            bad(cw, f"connects to the bus at {bus}, not through the kiln-bus Service")
        # The gateway drains accepted requests, a stage the jobs it holds
        # (both --drain-s, default 30) before SIGKILL comes.
        drain = float(arg_after(args, "--drain-s") or 30)
        if spec.get("terminationGracePeriodSeconds", 30) <= drain:
            bad(cw, "terminationGracePeriodSeconds does not outlast --drain-s")


def check_k8s():
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "k8s", "*.yaml"))):
        with open(path) as f:
            docs += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    services = {}
    for name, d in docs:
        where = f"{name} {d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "Deployment":
            check_pod(where, d["spec"]["template"]["spec"])
        if d["kind"] == "Service":
            services[d["metadata"]["name"]] = d
    bus = services.get("kiln-bus")
    if not bus or not bus["spec"].get("publishNotReadyAddresses"):
        bad("k8s", "the kiln-bus Service must publish not-ready addresses (readiness must not "
                   "gate the stages' way to the gateway)")


def check_compose():
    with open(os.path.join(root, "compose.yaml")) as f:
        c = yaml.safe_load(f)
    for name, s in c["services"].items():
        where = f"compose.yaml {name}"
        for key in ("restart", "healthcheck", "read_only"):
            if key not in s:
                bad(where, f"no {key}")
        if "ALL" not in s.get("cap_drop", []):
            bad(where, "cap_drop is not ALL")
        if name != "gateway" and not any(str(v).endswith(":/dev/shm") for v in s.get("volumes", [])):
            bad(where, "no shared /dev/shm volume")
        args = s.get("command", [])
        drain = float(arg_after(args, "--drain-s") or 30) if isinstance(args, list) else 30
        grace = str(s.get("stop_grace_period", "10s"))
        if not grace.endswith("s") or float(grace[:-1]) <= drain:
            bad(where, f"stop_grace_period {grace} does not outlast --drain-s {drain:g}")
        if s.get("ipc") == "host" or s.get("pid") == "host":
            bad(where, "joins the host's IPC or PID namespace (only compose.cuda.yaml may)")


def check_dashboard():
    gw = os.path.join(root, "..", "services", "gateway")
    source = ""
    for name in ("metrics.c", "proc_metrics.c"):
        with open(os.path.join(gw, name)) as f:
            source += f.read()
    with open(os.path.join(root, "grafana", "kiln.json")) as f:
        d = json.load(f)
    for p in d["panels"]:
        where = f"grafana/kiln.json panel '{p['title']}'"
        if not p.get("targets"):
            bad(where, "no query")
        for t in p.get("targets", []):
            for name in re.findall(r"\b((?:kiln|process)_[a-z_]+)\b", t["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                if f'"{base}' not in source and f"{base} " not in source:
                    bad(where, f"reads {name}, which the gateway does not export")


check_k8s()
check_compose()
check_dashboard()
for p in problems:
    print(p)
print(f"{len(problems)} problem(s)")
sys.exit(1 if problems else 0)
