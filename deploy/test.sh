#!/usr/bin/env bash
# The container end-to-end test (docs/OPERATIONS.md, "Container test"):
#  1. a Debian bookworm base image made with debootstrap (no registry);
#  2. the CPU images of deploy/Dockerfile built with Podman;
#  3. a tiny checkpoint made with the image's `kiln make-checkpoint`, bus keys
#     with its `kiln keygen`;
#  4. the compose stack (deploy/compose.yaml) up with podman-compose;
#  5. requests whose images must be the bytes of the image's `kiln generate`
#     for the same request: at start, after restarting the denoiser, after
#     killing the decoder (restart policy), with the denoiser scaled to 2,
#     and with a second denoiser + decoder in a pod of their own (own IPC
#     namespace and /dev/shm) while the compose ones are stopped;
#  6. tear-down.
# Needs root; installs podman, podman-compose, debootstrap and runc with
# apt-get when they are missing.  Work files go to $KILN_CT_DIR (default
# /var/tmp/kiln-ct).  The base image and the build cache are Podman's
# images, reused by later runs: from the machine's Podman storage, or when
# $KILN_CT_PODMAN_DIR is set, from a Podman storage of the run's own under
# that folder (images, build cache, containers, volumes, network
# definitions and libpod's state; Podman 4.3 keeps IP allocations and
# aardvark-dns's files in /run/containers/networks whatever the settings),
# e.g. to time CI's run from nothing on a machine with earlier runs' images
# (with a $KILN_CT_DIR and $KILN_CT_PORT of its own: default 18480).
# `podman system reset` under those settings, then removing the folder,
# forgets it all.
# Ends with "N passed, N failed".
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=${KILN_CT_DIR:-/var/tmp/kiln-ct}
port=${KILN_CT_PORT:-18480}
project=kiln
passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok   $*"; }
bad() { failed=$((failed + 1)); echo "FAIL $*"; }
finish() {
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit
}
die() {
  bad "$*"
  finish
}

[ "$(id -u)" -eq 0 ] || die "deploy/test.sh needs root (rootful Podman, debootstrap)"
# One run at a time on a machine: runs share the project's container
# names, the port and $work (CI and a developer's run, several worktrees).
exec 9>"$work.lock"
flock 9
# Debian's packages for rootful Podman: runc (crun is not installed),
# catatonit (a pod's infra container), netavark and aardvark-dns (the
# compose network's DNS: without them Podman falls back to CNI, whose
# networks resolve no service names, so the stages never find "gateway").
packages=(podman podman-compose debootstrap runc catatonit netavark aardvark-dns uidmap
  slirp4netns fuse-overlayfs iptables curl python3 ca-certificates)
need=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } \
    >"${KILN_CT_DIR:-/var/tmp/kiln-ct}.apt.log" 2>&1 ||
    die "cannot install ${need[*]} (see ${KILN_CT_DIR:-/var/tmp/kiln-ct}.apt.log)"
fi
mkdir -p "$work"

# Podman on these machines: runc (crun is not installed), cgroupfs, and
# ulimits within the session's own hard limits (the defaults exceed them).
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
own_engine="" own_network=""
if [ -n "${KILN_CT_PODMAN_DIR:-}" ]; then
  pd=$KILN_CT_PODMAN_DIR
  mkdir -p "$pd/storage" "$pd/run" "$pd/tmp" "$pd/networks" || die "mkdir $pd"
  cat >"$work/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$pd/storage"
runroot = "$pd/run"
EOF
  export CONTAINERS_STORAGE_CONF=$work/storage.conf
  # libpod's own state and the compose network's definition
  own_engine="tmp_dir = \"$pd/tmp\""
  own_network="network_config_dir = \"$pd/networks\""
fi
cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
$own_engine
[network]
network_backend = "netavark"
$own_network
EOF
export CONTAINERS_CONF=$work/containers.conf
ulimits=(--ulimit "nofile=$nofile:$nofile" --ulimit nproc=4096:4096)

# ---- 1. the base image ----
base=localhost/kiln-base:bookworm
t0=$(date +%s)
made=present
if ! podman image exists "$base"; then
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian \
    >"$work/debootstrap.log" 2>&1 || die "debootstrap (see $work/debootstrap.log)"
  tar -C "$work/rootfs" -c . | podman import - "$base" >"$work/import.log" 2>&1 || die "podman import"
  rm -rf "$work/rootfs"
  made="made in $(($(date +%s) - t0)) s"
fi
ok "base image $base ($made)"

# ---- 2. the images ----
# The build's RUN steps (apt-get) use the host's network: Podman's default
# bridge (10.88.0.0/16) is not always routable here (a CNI bridge left from
# an earlier Podman setup holding the same subnet swallows the replies, so
# nothing resolves), and the build needs nothing from a container network.
t0=$(date +%s)
for target in gateway encoder denoiser decoder kiln; do
  name=localhost/kiln-$target:latest
  [ "$target" = kiln ] && name=localhost/kiln:latest
  podman build --format docker --network host "${ulimits[@]}" -f "$src/deploy/Dockerfile" --target "$target" \
    --build-arg BASE="$base" --build-arg RUNTIME_BASE="$base" -t "$name" "$src" \
    >"$work/build-$target.log" 2>&1 || die "podman build --target $target (see $work/build-$target.log)"
done
ok "images built in $(($(date +%s) - t0)) s"
user=$(podman image inspect localhost/kiln-denoiser:latest --format '{{.Config.User}}')
[ "$user" = 10001:10001 ] && ok "images run as $user" || bad "images run as '$user'"

# ---- 3. checkpoint and keys, made by the image ----
rm -rf "$work/model" "$work/keys" "$work/out"
mkdir -p "$work/model" "$work/keys" "$work/out"
chmod 0777 "$work/model" "$work/keys" "$work/out"
kiln() { podman run --rm "${ulimits[@]}" --read-only -v "$work/model:/models:ro" \
  -v "$work/out:/out" localhost/kiln:latest "$@"; }
podman run --rm "${ulimits[@]}" --read-only -v "$work/model:/models" localhost/kiln:latest \
  make-checkpoint --preset tiny --out /models/klein >"$work/make-checkpoint.log" 2>&1 &&
  [ -f "$work/model/klein/tokenizer/vocab.json" ] &&
  ok "kiln make-checkpoint in the image (tokenizer found)" ||
  die "kiln make-checkpoint in the image (see $work/make-checkpoint.log)"
for k in gateway replica; do
  podman run --rm "${ulimits[@]}" --read-only -v "$work/keys:/keys" localhost/kiln:latest \
    keygen --out "/keys/$k" >/dev/null || die "kiln keygen $k"
done
cp "$work/keys/replica.pub" "$work/keys/replicas.allow"
ok "bus keys"

# ---- 4. the compose stack ----
cat >"$work/compose.test.yaml" <<'EOF'
# The tiny checkpoint has 4 text encoder layers; small images for speed.
services:
  gateway:
    command: ["--model", "/models/klein", "--host", "0.0.0.0", "--port", "8000",
              "--bus", "tcp://0.0.0.0:8001", "--bus-key", "/keys/gateway.key",
              "--bus-allow", "/keys/replicas.allow", "--admin-port", "9090",
              "--min-size", "64", "--drain-s", "10"]
  encoder:
    command: ["--model", "/models/klein", "--bus", "tcp://gateway:8001",
              "--bus-key", "/keys/replica.key", "--bus-server-key", "/keys/gateway.pub",
              "--bus-allow", "/keys/replicas.allow", "--data-port", "7001",
              "--health-port", "9091", "--text-encoder-out-layers", "1,2,3"]
EOF
compose() {
  KILN_MODEL=$work/model/klein KILN_KEYS=$work/keys KILN_PORT=$port \
    podman-compose -p "$project" -f "$src/deploy/compose.yaml" -f "$work/compose.test.yaml" "$@"
}
# podman-compose 1.0 `down` leaves the project's network: removed here.
# After a failure the containers' logs are kept in $work/logs first.
cleanup() {
  if [ "$failed" -gt 0 ]; then
    mkdir -p "$work/logs"
    for c in $(podman ps -a --format '{{.Names}}' | grep "^${project}[_-]"); do
      podman logs "$c" >"$work/logs/$c.log" 2>&1
    done
  fi
  podman pod rm -f kiln-pod2 >/dev/null 2>&1
  compose down -v >/dev/null 2>&1
  podman rm -f "${project}_denoiser_2" >/dev/null 2>&1
  podman volume rm -f "${project}_kiln-shm" >/dev/null 2>&1
  podman network rm -f "${project}_default" >/dev/null 2>&1
}
cleanup
trap cleanup EXIT
# podman-compose 1.0 creates volumes without their driver_opts, which would
# leave the stages a root-owned directory for /dev/shm: make the shared
# tmpfs first (2 GiB in 4 KiB pages: Podman takes size= for a quota; it
# applies mode= only with uid=/gid=).  docker compose honours driver_opts.
podman volume create --opt type=tmpfs --opt device=tmpfs \
  --opt o=nr_blocks=524288,mode=1777,uid=10001,gid=10001 \
  --label io.podman.compose.project="$project" "${project}_kiln-shm" >/dev/null ||
  die "podman volume create"
compose up -d >"$work/compose-up.log" 2>&1 || die "podman-compose up (see $work/compose-up.log)"

ready() { # waits up to $1 s for /readyz
  local until=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$until" ]; do
    curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}
t_checks=$(date +%s)
ready 300 && ok "compose stack ready" || { podman ps -a; die "compose stack not ready"; }

# ---- 5. requests against the CLI's bytes ----
# check TAG SEED N: one request; every image must be `kiln generate`'s bytes
# for the same request (the image's own CLI: the same compiled code).
compare_py='
import base64, json, sys
out, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = json.load(sys.stdin)
imgs = [base64.b64decode(d["b64_json"]) for d in r["data"]]
assert len(imgs) == n, f"{len(imgs)} images"
for i, img in enumerate(imgs):
    ref = f"{out}/cli-{seed}-{n}.png" if n == 1 else f"{out}/cli-{seed}-{n}-{i}.png"
    assert open(ref, "rb").read() == img, f"image {i} differs from {ref}"
'
check() {
  local tag=$1 seed=$2 n=$3
  local body
  body=$(curl -sS -m 300 "http://127.0.0.1:$port/v1/images/generations" \
    -d "{\"prompt\":\"a red kiln\",\"size\":\"64x64\",\"seed\":$seed,\"n\":$n,\"num_inference_steps\":2}") ||
    { bad "$tag: request failed"; return; }
  if [ ! -f "$work/out/cli-$seed-$n.png" ] && [ ! -f "$work/out/cli-$seed-$n-0.png" ]; then
    kiln generate --model /models/klein --text-encoder-out-layers 1,2,3 --prompt "a red kiln" \
      --seed "$seed" -n "$n" --width 64 --height 64 --steps 2 --no-metadata \
      --out "/out/cli-$seed-$n.png" \
      >>"$work/cli.log" 2>&1 || { bad "$tag: kiln generate"; return; }
  fi
  if python3 -c "$compare_py" "$work/out" "$seed" "$n" <<<"$body" 2>"$work/compare.err"; then
    ok "$tag: $n image(s) = kiln generate's bytes"
  else
    bad "$tag: $(cat "$work/compare.err" | tail -1) (response: ${body:0:200})"
  fi
}

check "compose" 1 1
check "compose" 2 2

c() { echo "${project}_$1_1"; }
# The gateway's count of live replicas of stage $1 (denoise, decode...).
replicas() { curl -fsS "http://127.0.0.1:$port/metrics" |
  sed -n "s/^kiln_replicas{stage=\"$1\"} \([0-9]*\).*/\1/p"; }
# The slabs in the stages' shared /dev/shm as seen from the encoder, one
# "live NAME" (a process holds its owner lock, common/transport_shm.c) or
# "dead NAME" (nobody does: left behind) a line; "unknown NAME" when flock
# fails otherwise.
slabs() {
  podman exec "$(c encoder)" sh -c 'cd /dev/shm || exit 1
    for f in kiln-*; do
      [ -e "$f" ] || continue
      flock -n -E 75 "$f" true; rc=$?
      case $rc in 0) echo "dead $f" ;; 75) echo "live $f" ;; *) echo "unknown $f" ;; esac
    done'
}
# no_dead_slabs TAG: every slab in the shared /dev/shm has a live owner.
no_dead_slabs() {
  local s
  s=$(slabs) || { bad "$1: cannot list /dev/shm"; return; }
  local dead
  dead=$(grep -v '^live ' <<<"$s" | grep . | tr '\n' ' ')
  if [ -n "$dead" ]; then
    bad "$1: slabs left behind: $dead"
  else
    ok "$1: no slab left behind ($(grep -c '^live ' <<<"$s") live)"
  fi
}
# crash SERVICE: the container's process dies of SIGKILL (not `podman
# kill`, which Podman counts as a user's stop); its restart policy must
# bring it back as a new process.
crash() {
  local name pid0 pid until_
  name=$(c "$1")
  pid0=$(podman inspect -f '{{.State.Pid}}' "$name")
  kill -KILL "$pid0"
  until_=$(($(date +%s) + 120))
  while [ "$(date +%s)" -lt "$until_" ]; do
    pid=$(podman inspect -f '{{.State.Running}} {{.State.Pid}}' "$name")
    [ "${pid% *}" = true ] && [ "${pid#* }" != "$pid0" ] && [ "${pid#* }" != 0 ] && break
    sleep 1
  done
  if [ "${pid% *}" = true ] && [ "${pid#* }" != "$pid0" ]; then
    ok "killed $1 restarted by its restart policy (pid $pid0 -> ${pid#* })"
  else
    bad "killed $1 not restarted by the restart policy; starting it"
    podman start "$name" >/dev/null
  fi
}

podman restart "$(c denoiser)" >/dev/null && ready 120 && check "denoiser restarted" 3 1 ||
  bad "denoiser restart"
no_dead_slabs "after the denoiser restart"
# A crashed producer: the denoiser's slabs (it made some for seed 3's
# latents) stay until its next start-up, whose cleanup must remove them
# (their owner lock died with it), and the restarted one must not be
# mistaken for the old one by the decoder that mapped its slabs.
den_before=$(slabs | sed -n 's/^live \(kiln-denoise-.*\)/\1/p')
[ -n "$den_before" ] || bad "the denoiser holds no slab before its crash (nothing to test)"
crash denoiser
ready 120 && check "after a killed denoiser" 11 1 || bad "not ready after the denoiser kill"
left=$(slabs | awk '{print $2}' | grep -Fx -f <(printf '%s\n' $den_before) | tr '\n' ' ')
[ -z "$left" ] && ok "the killed denoiser's slabs are gone" || bad "the killed denoiser's slabs left: $left"
no_dead_slabs "after the denoiser kill"
crash decoder
ready 120 && check "after a killed decoder" 4 2 || bad "not ready after the decoder kill"
no_dead_slabs "after the decoder kill"

compose up -d --scale denoiser=2 >"$work/compose-scale.log" 2>&1
if [ "$(podman ps --filter "name=${project}_denoiser" --format '{{.Names}}' | wc -l)" -lt 2 ]; then
  # podman-compose 1.0 does not create the second container of --scale:
  # clone the first (same image, command, network, volumes, policy).
  podman container clone "$(c denoiser)" "${project}_denoiser_2" >/dev/null &&
    podman start "${project}_denoiser_2" >/dev/null
fi
n_den=$(podman ps --filter "name=${project}_denoiser" --format '{{.Names}}' | wc -l)
until_=$(($(date +%s) + 120))
while [ "$(replicas denoise)" != 2 ] && [ "$(date +%s)" -lt "$until_" ]; do sleep 1; done
[ "$n_den" -ge 2 ] && [ "$(replicas denoise)" = 2 ] &&
  ok "denoiser scaled to $n_den containers, 2 registered" ||
  bad "denoiser not scaled ($n_den running, $(replicas denoise) registered)"
# Jobs each denoiser replica answered (replica count), to see both serve:
# the gateway gives idle replicas turns (services/gateway/scheduler.c).
den_jobs() { curl -fsS "http://127.0.0.1:$port/metrics" |
  sed -n 's/^kiln_replica_jobs_total{stage="denoise",replica="\([^"]*\)"} \([0-9]*\).*/\1 \2/p' |
  sort; }
jobs0=$(den_jobs)
for s in 5 6 7 8; do check "2 denoisers" "$s" 1; done
served=$(join -a 2 <(echo "$jobs0") <(den_jobs) | awk 'NF == 3 && $3 > $2 || NF == 2 && $2 > 0' | wc -l)
[ "$served" = 2 ] && ok "both denoisers served" || bad "$served denoiser(s) served: $(den_jobs | tr '\n' ' ')"
no_dead_slabs "with 2 denoisers"

# A second "stage pod": its own IPC namespace and /dev/shm (a Podman pod
# shares one among its containers), on the compose network; the compose
# denoisers and decoder stop, so all work goes through the pod.
net=$(podman network ls --format '{{.Name}}' | grep "^${project}" | head -1)
podman pod create --name kiln-pod2 --network "$net" --shm-size 512m >/dev/null ||
  bad "podman pod create"
for st in denoiser decoder; do
  podman run -d --pod kiln-pod2 --name "kiln-pod2-$st" "${ulimits[@]}" --read-only \
    --tmpfs /tmp --cap-drop ALL -v "$work/model/klein:/models/klein:ro" -v "$work/keys:/keys:ro" \
    "localhost/kiln-$st:latest" --model /models/klein --bus tcp://gateway:8001 \
    --bus-key /keys/replica.key --bus-server-key /keys/gateway.pub \
    --bus-allow /keys/replicas.allow --data-port 7002 >/dev/null || bad "pod2 $st"
done
sleep 5
podman stop -t 20 $(podman ps --filter "name=${project}_denoiser" --format '{{.Names}}') \
  "$(c decoder)" >/dev/null
ipc_pod=$(podman exec kiln-pod2-denoiser readlink /proc/1/ns/ipc 2>/dev/null)
ipc_enc=$(podman exec "$(c encoder)" readlink /proc/1/ns/ipc 2>/dev/null)
[ -n "$ipc_pod" ] && [ "$ipc_pod" != "$ipc_enc" ] &&
  ok "pod2 has its own IPC namespace ($ipc_pod vs $ipc_enc)" || bad "pod2 IPC namespace"
# The gateway drops the stopped replicas once their heartbeats stop (2 s).
until_=$(($(date +%s) + 60))
while { [ "$(replicas denoise)" != 1 ] || [ "$(replicas decode)" != 1 ]; } &&
  [ "$(date +%s)" -lt "$until_" ]; do sleep 1; done
[ "$(replicas denoise)" = 1 ] && [ "$(replicas decode)" = 1 ] &&
  ok "only pod2's denoiser and decoder left" || bad "replicas left: $(replicas denoise)/$(replicas decode)"
for s in 9 10; do check "pod2 stages" "$s" 2; done
podman stop -t 20 kiln-pod2-denoiser >/dev/null
fetched=$(podman logs kiln-pod2-denoiser 2>&1 | sed -n 's/.*by value: \([0-9]*\) input(s) fetched.*/\1/p' | tail -1)
[ "${fetched:-0}" -ge 2 ] && ok "pod2 denoiser fetched $fetched inputs by value" ||
  bad "pod2 denoiser fetched '${fetched:-none}' inputs by value"
# The compose denoisers and decoder stopped: what is left in the shared
# /dev/shm must be the running encoder's, every one held.
s=$(slabs)
if [ -n "$s" ] && ! grep -qv '^live kiln-encode-' <<<"$s"; then
  ok "only the encoder's live slabs left in the shared /dev/shm ($(wc -l <<<"$s"))"
else
  bad "shared /dev/shm with only the encoder running: $(tr '\n' ' ' <<<"$s")"
fi

echo "checks took $(($(date +%s) - t_checks)) s; work files in $work (the containers' logs in $work/logs after a failure)"
finish
