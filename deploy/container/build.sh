#!/usr/bin/env bash
# Build encoderd's container image in one command, base included, without any container registry:
#   deploy/container/build.sh            # CPU image  encoderd:0.1.0
#   deploy/container/build.sh --cuda     # CUDA image encoderd:0.1.0-cuda (torch's CUDA wheels from PyPI)
# Options: --tag NAME, --rebuild-base, --base-only.
# The base (Debian bookworm + python3, python3-venv, ca-certificates, tini) is made by mmdebstrap from
# Debian's mirror and imported once as localhost/encoderd-base:bookworm (--rebuild-base to redo it).
# Environment: CONTAINER_ENGINE (podman, else docker), DEBIAN_MIRROR, ENCODERD_WHEELS (folders of local
# wheels to prefer, default $PIP_FIND_LINKS; a torch wheel there is used instead of torch's CPU index),
# ENCODERD_BUILD_CA (a CA bundle pip must trust during the build, default $PIP_CERT; not in the image).
# podman on a host that refuses its defaults (no systemd, no CAP_SYS_RESOURCE, hybrid cgroups): the script
# writes a containers.conf that works there and prints `export CONTAINERS_CONF=...` for `podman run`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VERSION=0.1.0
BASE=localhost/encoderd-base:bookworm
variant=cpu rebuild_base=0 base_only=0 tag=""
while (($#)); do
  case $1 in
    --cuda) variant=cuda ;;
    --rebuild-base) rebuild_base=1 ;;
    --base-only) base_only=1 ;;
    --tag) tag=$2; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $variant == cuda ]] && tag=${tag:-encoderd:$VERSION-cuda} || tag=${tag:-encoderd:$VERSION}
engine=${CONTAINER_ENGINE:-$(command -v podman || command -v docker || true)}
[[ -n $engine ]] || { echo "no container engine: apt-get install podman (or docker.io)" >&2; exit 1; }

build_base() {
  command -v mmdebstrap >/dev/null || { echo "mmdebstrap is missing: apt-get install mmdebstrap" >&2; exit 1; }
  echo "==> base image $BASE from Debian packages (mmdebstrap, ~2 min)"
  # Docs, man pages and locales are left out: nothing in the image reads them.
  mmdebstrap --variant=apt --include=python3,python3-venv,ca-certificates,tini \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm - "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
    | "$engine" import --change 'CMD ["/bin/bash"]' - "$BASE"
}
if ((rebuild_base)) || ! "$engine" image inspect "$BASE" >/dev/null 2>&1; then
  build_base
fi

# podman's defaults fail on some hosts: crun refuses hybrid cgroups ("cgroups in hybrid mode not supported"),
# a sandbox without CAP_SYS_RESOURCE refuses its rlimits ("setrlimit RLIMIT_NOFILE: Operation not
# permitted"), and without systemd there is no systemd cgroup manager or journal. Probe with a throwaway
# container; where it fails, write a containers.conf that fits this host and use it from here on.
podman_conf() {
  local conf=${XDG_CONFIG_HOME:-$HOME/.config}/encoderd/containers.conf hard_nofile hard_nproc
  hard_nofile=$(ulimit -Hn); [[ $hard_nofile == unlimited ]] && hard_nofile=1048576
  hard_nproc=$(ulimit -Hu); [[ $hard_nproc == unlimited || $hard_nproc -gt 4096 ]] && hard_nproc=4096
  mkdir -p "$(dirname "$conf")"
  {
    echo "# written by encoderd's deploy/container/build.sh for this host: podman's defaults fail here"
    echo "[containers]"
    echo "default_ulimits = [\"nofile=$hard_nofile:$hard_nofile\", \"nproc=$hard_nproc:$hard_nproc\"]"
    echo "[engine]"
    if command -v runc >/dev/null; then echo 'runtime = "runc"'; fi
    if [[ ! -d /run/systemd/system ]]; then printf 'cgroup_manager = "cgroupfs"\nevents_logger = "file"\n'; fi
  } >"$conf"
  echo "$conf"
}
probe() { "$engine" run --rm --network host "$BASE" true 2>&1 >/dev/null; }
if [[ $(basename "$engine") == podman && -z ${CONTAINERS_CONF:-} ]] && ! why=$(probe); then
  CONTAINERS_CONF=$(podman_conf); export CONTAINERS_CONF
  if ! second=$(probe); then
    echo "podman cannot run a container here: $why" >&2
    echo "with $CONTAINERS_CONF: $second" >&2
    exit 1
  fi
  echo "==> podman's defaults fail here (${why##*$'\n'}); $CONTAINERS_CONF works. Before podman run:"
  echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
fi
((base_only)) && exit 0

# The build context: the checkout's tracked and untracked-but-not-ignored files, and local wheels.
context=$(mktemp -d "${TMPDIR:-/tmp}/encoderd-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
mkdir -p "$context/src" "$context/wheels" "$context/certs"
ca=${ENCODERD_BUILD_CA:-${PIP_CERT:-}}
[[ -n $ca && -f $ca ]] && cp "$ca" "$context/certs/pip-ca.pem"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
   [[ -e $f ]] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$context/src")
torch_index=https://download.pytorch.org/whl/cpu
for dir in ${ENCODERD_WHEELS:-${PIP_FIND_LINKS:-}}; do
  [[ -d $dir ]] || continue
  for wheel in "$dir"/*.whl; do
    [[ -e $wheel ]] || continue
    ln "$wheel" "$context/wheels/" 2>/dev/null || cp "$wheel" "$context/wheels/"
  done
done
[[ $variant == cuda ]] && torch_index=""
ls "$context/wheels"/torch-*+cpu-*.whl >/dev/null 2>&1 && [[ $variant == cpu ]] && torch_index=""
[[ $variant == cuda ]] && rm -f "$context/wheels"/torch-*+cpu-*.whl   # never the CPU build in the CUDA image

echo "==> image $tag ($variant) with $engine"
format=(); [[ $(basename "$engine") == podman ]] && format=(--format docker)   # OCI has no HEALTHCHECK
revision=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
previous=$("$engine" image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
"$engine" build "${format[@]}" --network host -f "$ROOT/deploy/container/Containerfile" -t "$tag" \
  --build-arg BASE="$BASE" --build-arg VARIANT="$variant" --build-arg DEVICE="$variant" \
  --build-arg TORCH_INDEX_URL="$torch_index" --build-arg VERSION="$VERSION" --build-arg REVISION="$revision" \
  "$context"
# The build stage's image is no use once the runtime stage has copied the venv out of it.
"$engine" image prune -f --filter label=io.encoderd.stage=build >/dev/null
# A rebuild moves the tag; the image it named before would stay behind unnamed (~1.3 GB each time).
# rmi without -f leaves it where a container still uses it or another tag still names it.
current=$("$engine" image inspect --format '{{.Id}}' "$tag")
if [[ -n $previous && $previous != "$current" ]] && "$engine" rmi "$previous" >/dev/null 2>&1; then
  echo "==> removed the image $tag named before (${previous:0:12})"
fi
echo "==> built $tag"
