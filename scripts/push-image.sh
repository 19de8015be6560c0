#!/usr/bin/env bash
# Pushes the trainer image under two tags, the package's version and the git commit it was built from:
#
#   scripts/push-image.sh IMAGE REGISTRY       # what `make image push REGISTRY=registry.example.com/team` runs
#
# REGISTRY is what goes before the image's name: host[:port][/path]. The image goes to
# REGISTRY/ddp-deploy:VERSION and REGISTRY/ddp-deploy:sha-COMMIT. Only an image built (by `make image`)
# from this checkout's HEAD with nothing uncommitted is pushed: a tag must name exactly the code inside.
# Credentials are Docker's own (docker login HOST).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { printf 'error: %s\n' "$*" >&2; exit 2; }

image=${1:-} registry=${2:-}
registry=${registry%/}
[ -n "$registry" ] || die "set REGISTRY to where the image goes: make image push REGISTRY=registry.example.com/team"
case $registry in
  *://*) die "REGISTRY=$registry: no scheme, only host[:port][/path], e.g. REGISTRY=registry.example.com/team" ;;
esac
docker image inspect "$image" >/dev/null 2>&1 || die "no image $image here: build it with make image push REGISTRY=$registry"

head=$(scripts/image-revision.sh)
[ -n "$head" ] || die "not a git checkout: there is no commit to tag the image with"
case $head in
  *-dirty) die "the working tree has uncommitted changes: commit them, then make image push REGISTRY=$registry" ;;
esac
built_from=$(docker image inspect --format '{{index .Config.Labels "org.opencontainers.image.revision"}}' "$image")
[ "$built_from" = "$head" ] || die "$image was built from ${built_from:-an unlabelled tree}, not from HEAD \
($head): build and push together, make image push REGISTRY=$registry"

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
[ -n "$version" ] || die "no version = \"...\" line in pyproject.toml"
references=("$registry/ddp-deploy:$version" "$registry/ddp-deploy:sha-${head:0:12}")
for reference in "${references[@]}"; do
  docker tag "$image" "$reference" 2>/dev/null \
    || die "REGISTRY=$registry does not make a valid image name ($reference): host[:port][/path], lower case"
done
for reference in "${references[@]}"; do
  if ! output=$(docker push --quiet "$reference" 2>&1); then
    die "could not push $reference: $(tail -n 1 <<<"$output") (docker login ${registry%%/*} if it needs credentials)"
  fi
  echo "pushed $reference"
done
echo "point the Kubernetes manifests at it: make k8s-image IMAGE=${references[1]}"
