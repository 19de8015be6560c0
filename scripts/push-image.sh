#!/usr/bin/env bash
# Pushes the trainer image under two tags, the package's version and the git commit it was built from, and its
# CUDA build beside it:
#
#   scripts/push-image.sh IMAGE REGISTRY [CUDA_IMAGE]   # what `make image push REGISTRY=registry.example.com/team` runs
#
# REGISTRY is what goes before the image's name: host[:port][/path]. The image goes to
# REGISTRY/ddp-deploy:VERSION and REGISTRY/ddp-deploy:sha-COMMIT, CUDA_IMAGE (when given) to the same tags with
# -cuda appended, which is where `make k8s-image IMAGE=...` points the GPU overlays. Only images built (by
# `make image`) from this checkout's HEAD with nothing uncommitted are pushed, and nothing is pushed unless every
# one is: a tag must name exactly the code inside, and the CPU and GPU jobs must run the same code.
# Credentials are Docker's own (docker login HOST).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { printf 'error: %s\n' "$*" >&2; exit 2; }

image=${1:-} registry=${2:-} cuda_image=${3:-}
registry=${registry%/}
[ -n "$registry" ] || die "set REGISTRY to where the image goes: make image push REGISTRY=registry.example.com/team"
case $registry in
  *://*) die "REGISTRY=$registry: no scheme, only host[:port][/path], e.g. REGISTRY=registry.example.com/team" ;;
esac
docker image inspect "$image" >/dev/null 2>&1 || die "no image $image here: build it with make image push REGISTRY=$registry"
if [ -n "$cuda_image" ]; then
  docker image inspect "$cuda_image" >/dev/null 2>&1 || die "no image $cuda_image here: build the CUDA image \
(docs/containers.md), or push the CPU image alone with make push REGISTRY=$registry CUDA_IMAGE="
fi

head=$(scripts/image-revision.sh)
[ -n "$head" ] || die "not a git checkout: there is no commit to tag the image with"
case $head in
  *-dirty) die "the working tree has uncommitted changes: commit them, then make image push REGISTRY=$registry" ;;
esac
for built in "$image" ${cuda_image:+"$cuda_image"}; do
  built_from=$(docker image inspect --format '{{index .Config.Labels "org.opencontainers.image.revision"}}' "$built")
  [ "$built_from" = "$head" ] || die "$built was built from ${built_from:-an unlabelled tree}, not from HEAD \
($head): build and push together, make image push REGISTRY=$registry"
done

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
[ -n "$version" ] || die "no version = \"...\" line in pyproject.toml"
tags=("$version" "sha-${head:0:12}")
references=() sources=()
for tag in "${tags[@]}"; do
  references+=("$registry/ddp-deploy:$tag") sources+=("$image")
  if [ -n "$cuda_image" ]; then
    references+=("$registry/ddp-deploy:$tag-cuda") sources+=("$cuda_image")
  fi
done
for i in "${!references[@]}"; do
  docker tag "${sources[$i]}" "${references[$i]}" 2>/dev/null \
    || die "REGISTRY=$registry does not make a valid image name (${references[$i]}): host[:port][/path], lower case"
done
for reference in "${references[@]}"; do
  if ! output=$(docker push --quiet "$reference" 2>&1); then
    die "could not push $reference: $(tail -n 1 <<<"$output") (docker login ${registry%%/*} if it needs credentials)"
  fi
  echo "pushed $reference"
done
commit_image="$registry/ddp-deploy:sha-${head:0:12}"
if [ -n "$cuda_image" ]; then
  echo "point the Kubernetes manifests at them (the GPU overlays at $commit_image-cuda): make k8s-image IMAGE=$commit_image"
else
  echo "point the Kubernetes manifests at it: make k8s-image IMAGE=$commit_image CUDA_IMAGE=<your CUDA build>"
fi
