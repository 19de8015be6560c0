#!/usr/bin/env bash
# A kind cluster with the Kubeflow training operator, running k8s/overlays/kind.
#   scripts/kind-cluster.sh up     create the cluster, install the operator, build and load the image, apply
#   scripts/kind-cluster.sh test   wait until the PyTorchJob succeeds or fails, print its logs
#   scripts/kind-cluster.sh down   delete the cluster
# Needs docker, kind and kubectl. Settings: IMAGE, DOCKERFILE, JOB_TIMEOUT_S.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=ddp-deploy  # the name in k8s/kind/cluster.yaml
context=kind-$cluster
job=ddp-train
image=${IMAGE:-ddp-deploy:latest}
dockerfile=${DOCKERFILE:-$repo/docker/Dockerfile}
# The operator release whose environment the tests reproduce (tests/k8s_operator.py).
operator="github.com/kubeflow/trainer.git/manifests/overlays/standalone?ref=v1.9.4"

kc() { kubectl --context "$context" "$@"; }

up() {
  if ! kind get clusters | grep -qx "$cluster"; then
    kind create cluster --config "$repo/k8s/kind/cluster.yaml"
  fi
  kc apply --server-side -k "$operator"
  kc wait --for=condition=Established --timeout=2m crd/pytorchjobs.kubeflow.org
  # The job is admitted by the operator's webhook: it must be serving before the apply.
  kc -n kubeflow rollout status deployment/training-operator --timeout=5m
  docker build -t "$image" -f "$dockerfile" "$repo"
  kind load docker-image --name "$cluster" "$image"
  kc apply -k "$repo/k8s/overlays/kind"
}

test_job() {
  local state='' deadline=$((SECONDS + ${JOB_TIMEOUT_S:-1800}))
  while [[ $state != Succeeded && $state != Failed ]]; do
    if ((SECONDS > deadline)); then
      state="still ${state:-pending} after ${JOB_TIMEOUT_S:-1800} s"
      break
    fi
    sleep 5
    state=$(kc get pytorchjob "$job" -o jsonpath='{.status.conditions[-1:].type}')
  done
  kc get pytorchjob "$job"
  kc get pods -l "training.kubeflow.org/job-name=$job"
  kc logs -l "training.kubeflow.org/job-name=$job" --prefix --tail=-1
  echo "PyTorchJob $job: $state"
  [[ $state == Succeeded ]]
}

down() {
  kind delete cluster --name "$cluster"
}

case ${1:-} in
  up) up ;;
  test) test_job ;;
  down) down ;;
  *) echo "usage: $0 up|test|down" >&2; exit 2 ;;
esac
