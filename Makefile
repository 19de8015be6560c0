# ddp-deploy: every command a user or CI runs. `make train` and `make test` do their own set-up.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NPROC ?= 2
EPOCHS ?= 3
TRAIN_ARGS ?=

.PHONY: help venv azurite data train example test test-fast gpu-check lint doctor clean torchx-test

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# The example's package too, as its image has it: the Kubernetes and TorchX tests run it from this venv.
$(BIN)/ddp-train: pyproject.toml examples/forecast/pyproject.toml
	"$(PYTHON)" -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps -e examples/forecast
	@touch $@

venv: $(BIN)/ddp-train ## create .venv with the trainer and the test tools

data: ## install the full Fashion-MNIST from Debian when possible (else the shipped subset is used)
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
	  echo "full Fashion-MNIST present in /usr/share/datasets/fashion-mnist"; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null)) && \
	  echo "installed Debian's dataset-fashion-mnist"; \
	else \
	  echo "no Debian package manager: training on the Fashion-MNIST subset shipped in trainer/data"; \
	fi

train: venv data ## the main job: $(NPROC) CPU ranks on Fashion-MNIST, test accuracy and a checkpoint
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m trainer \
	  --epochs $(EPOCHS) --scale-lr --output-dir runs/main $(TRAIN_ARGS)

example: venv ## the worked example (examples/forecast): $(NPROC) CPU ranks train a user's own task, not images
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) \
	  -m trainer --task forecast:Forecast --epochs 4 --batch-size 64 --lr 3e-3 --output-dir runs/example $(TRAIN_ARGS)

# Azurite, Microsoft's Azure Blob Storage emulator (npm), which the checkpoint tests on az:// URLs start on loopback
# (devtools/azurite.py). 3.35.0: the last release that runs on Node.js before 21 (Debian 12 ships 18).
AZURITE_VERSION := 3.35.0
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob
$(AZURITE):
	npm install --quiet --no-audit --no-fund --no-save --prefix $(VENV)/azurite azurite@$(AZURITE_VERSION)

azurite: $(AZURITE) ## install Azurite (npm) for the tests of checkpoints in Azure Blob Storage

# The suite in two parts (tests/conftest.py): the multi-process tests on TEST_WORKERS pytest-xdist workers, a file
# whole on one of them (the files on fixed ports all on one), then unit/ and the timing-sensitive files (marked
# serial) alone. Both parts always run; the exit status is the first failure's. A part that PYTEST_ARGS leaves empty
# (pytest's 5: no tests) fails only if the other part is empty too.
TEST_WORKERS ?= 2
test: venv azurite ## lint, then the whole test suite (Docker tests run where an engine answers; .ci/run starts one)
	$(BIN)/ruff check .
	@parallel=0; serial=0; \
	set -x; $(BIN)/pytest -q -ra -n $(TEST_WORKERS) --dist loadfile -m "not serial and not gpu" $(PYTEST_ARGS) \
	  || parallel=$$?; \
	$(BIN)/pytest -q -ra -m "serial and not gpu" $(PYTEST_ARGS) || serial=$$?; set +x; \
	if [ $$parallel = 5 ] && [ $$serial = 5 ]; then exit 5; fi; \
	for status in $$parallel $$serial; do [ $$status = 0 ] || [ $$status = 5 ] || exit $$status; done

test-fast: venv azurite ## lint and the quick tests (unit tests and the launchers' file checks; under a minute)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -ra -m "not slow and not docker and not gpu" $(PYTEST_ARGS)

# No venv: a GPU machine brings its own CUDA build of torch, which the venv's pinned CPU wheel would replace.
gpu-check: ## the GPU suite (tests/gpu) with this machine's python3 and its CUDA torch; needs pytest there
	PYTHONPATH=. $(PYTHON) -m pytest -q -ra -m gpu -p no:cacheprovider tests/gpu $(PYTEST_ARGS)

lint: venv ## ruff over the code
	$(BIN)/ruff check .

torchx-test: venv ## TorchX: component linter, Kubernetes dry runs, real local_cwd jobs (1x2, 2x2, a killed worker)
	$(BIN)/pytest -q tests/deploy/test_torchx.py

# Benchmarks (bench/): ratios measured in one invocation; timings are reported, never asserted.
.PHONY: bench bench-quick gpu-bench gpu-bench-smoke

bench: venv data ## benchmark suite, full run (about 28 min on 2 cores): table, JSON, plots in bench/results/
	$(BIN)/python -m bench.run

bench-quick: venv data ## benchmark suite, quick mode for CI (2-3 min): bench/results/raw/quick/
	$(BIN)/python -m bench.run --quick

# Like gpu-check: the GPU machine's own python3 and CUDA torch, no venv. GPU_BENCH_OUT: where the results go
# (the device tool's $$OUT); BENCH_ARGS: --only NAME to split the figures over calls.
GPU_BENCH_OUT ?= bench/results/gpu
gpu-bench: ## the GPU figures (bench/gpu.py; a CUDA GPU; scripts/gpu-call.sh: docs/benchmarks.md) to GPU_BENCH_OUT
	PYTHONPATH=. PYTHONUNBUFFERED=1 $(PYTHON) -m bench.gpu --output-dir "$(GPU_BENCH_OUT)" $(BENCH_ARGS)

gpu-bench-smoke: venv ## every GPU figure tiny, on any machine (CI: the CPU): bench/results/raw/gpu-quick/
	$(BIN)/python -m bench.gpu --quick

doctor: venv ## preflight of every collective with $(NPROC) local ranks
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m trainer.doctor

clean: ## remove runs and caches (not the venv)
	rm -rf runs .pytest_cache .ruff_cache

# Kubernetes (k8s/): offline checks here; a kind cluster on a machine with Docker and a registry.
.PHONY: ray-test
ray-test: venv ## ddp-train-ray on a real local Ray cluster: a worker, a node and the driver lost, every sample once
	$(BIN)/pytest -q -ra tests/unit/test_on_ray.py tests/unit/test_on_ray_drain.py tests/unit/launchers/test_ray_train.py tests/deploy/test_ray.py \
	  tests/deploy/test_k8s_rayjob.py $(PYTEST_ARGS)

# The oldest Ray the `ray` extra admits (trainer/on_ray/ray_internals.py SUPPORTED_RAY), in a venv of its own above
# the dev venv: that venv's packages beneath its own (a .pth), Ray's oldest release and what it needs installed
# here, from the extra's own requirement, so the job server comes as a user's install brings it.
RAY_OLDEST := 2.58.0
RAY_OLDEST_VENV := $(VENV)/ray-oldest
# Stamped only once its Ray is that release: a failed build is built again, never tested on another Ray.
RAY_OLDEST_STAMP := $(RAY_OLDEST_VENV)/.ray-$(RAY_OLDEST)
$(RAY_OLDEST_STAMP): $(BIN)/ddp-train
	rm -rf $(RAY_OLDEST_VENV)
	"$(PYTHON)" -m venv --without-pip $(RAY_OLDEST_VENV)
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(RAY_OLDEST_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dev-venv.pth"
	$(BIN)/pip --python $(RAY_OLDEST_VENV)/bin/python install --quiet --ignore-installed --no-deps ray==$(RAY_OLDEST)
	$(BIN)/pip --python $(RAY_OLDEST_VENV)/bin/python install --quiet 'ray[default,train]==$(RAY_OLDEST)'
	$(BIN)/pip --python $(RAY_OLDEST_VENV)/bin/python install --quiet --no-deps --no-build-isolation -e .
	$(RAY_OLDEST_VENV)/bin/python -c 'import ray; assert ray.__version__ == "$(RAY_OLDEST)", ray.__version__'
	@touch $@

.PHONY: ray-oldest-test
ray-oldest-test: $(RAY_OLDEST_STAMP) ## ddp-train-ray's unit tests and a `ray job submit` run on Ray's oldest supported release
	$(RAY_OLDEST_VENV)/bin/python -c 'import ray; from trainer.on_ray.ray_internals import SUPPORTED_RAY; \
	  assert ray.__version__ == SUPPORTED_RAY[0] == "$(RAY_OLDEST)", (ray.__version__, SUPPORTED_RAY)'
	$(RAY_OLDEST_VENV)/bin/python -m pytest -q -ra tests/unit/test_on_ray.py tests/unit/test_on_ray_drain.py tests/unit/launchers/test_ray_train.py \
	  tests/deploy/test_ray.py -k "not loses_a_worker" $(PYTEST_ARGS)

.PHONY: k8s-validate k8s-test k8s-image kind-up kind-test kind-down

k8s-validate: venv ## render every manifest and overlay; check them against the APIs, operator rules, kind scripts
	$(BIN)/pytest -q tests/deploy/test_k8s_manifests.py tests/deploy/test_k8s_operator.py tests/deploy/test_k8s_kind.py \
	  tests/deploy/test_k8s_rayjob.py

k8s-test: venv ## k8s-validate, then every PyTorchJob executed: its pods as processes (root) and containers
	$(BIN)/pytest -q -ra tests/deploy/test_k8s_manifests.py tests/deploy/test_k8s_operator.py \
	  tests/deploy/test_k8s_kind.py tests/deploy/test_k8s_rayjob.py tests/deploy/test_k8s_jobs.py $(PYTEST_ARGS)

kind-up: ## kind cluster + training operator v1.9.4 + image, then apply k8s/overlays/kind
	scripts/kind-cluster.sh up

kind-test: ## wait for the kind job to succeed or fail, print its logs
	scripts/kind-cluster.sh test

kind-down: ## delete the kind cluster
	scripts/kind-cluster.sh down

# IMAGE and CUDA_IMAGE only when given (command line or environment), not their defaults below: without
# either, k8s/pytorchjob.yaml is brought in line; IMAGE alone points the GPU overlays at its tag with -cuda.
k8s-image: ## point every Kubernetes manifest, GPU overlays included, at IMAGE: make k8s-image IMAGE=registry.example.com/team/ddp-deploy:0.1.0
	"$(PYTHON)" scripts/k8s_image.py $(if $(filter-out default file,$(origin IMAGE)),--image '$(IMAGE)') \
	  $(if $(and $(CUDA_IMAGE),$(filter-out default file,$(origin CUDA_IMAGE))),--cuda-image '$(CUDA_IMAGE)')

# Slurm (slurm/train.sbatch). A local cluster: two emulated nodes on this machine, as CI runs the tests on.
.PHONY: slurm-up slurm-down slurm-test
slurm-up: ## a local Slurm cluster to submit to (as root; nodes n1 and n2, 2 CPUs each): sbatch slurm/train.sbatch
	scripts/slurm-local.sh

slurm-down: ## stop the local Slurm cluster
	scripts/slurm-local.sh stop

slurm-test: venv ## slurm/train.sbatch on the cluster: 2 nodes x 2 tasks, requeued twice, torchrun per node, bad inputs
	$(BIN)/pytest -q -ra tests/deploy/test_slurm.py

# Containers (docker/, compose.yaml). Compose settings (NODES, RANKS_PER_NODE, EPOCHS, DATASET, ...) come from
# the environment, the command line (make compose-up NODES=3) or .env; see .env.example.
.PHONY: image push compose-up compose-down compose-test
IMAGE ?= ddp-deploy:latest
# The CUDA build the GPU overlays run (docs/containers.md builds it under this name); empty: `make push` pushes
# the CPU image alone.
CUDA_IMAGE ?= ddp-deploy:cuda
REGISTRY ?=

# Through compose.yaml's build section, so that `make image`, `docker compose up` and CI build alike; its
# BUILD_* settings pick the base, the torch variant and pip's index (.env.example). The image is labelled
# with the commit it was built from (with -dirty for uncommitted changes), which `make push` checks.
image: ## build the trainer image IMAGE: CPU torch by default; GPU and offline builds: BUILD_* in .env.example
	GIT_COMMIT=$$(scripts/image-revision.sh) IMAGE=$(IMAGE) docker compose build node

push: ## push IMAGE as REGISTRY/ddp-deploy:VERSION and :sha-COMMIT, CUDA_IMAGE as :VERSION-cuda and :sha-COMMIT-cuda
	scripts/push-image.sh "$(IMAGE)" "$(REGISTRY)" "$(CUDA_IMAGE)"

compose-up: ## NODES (2) containers x RANKS_PER_NODE (2) ranks train together; run again to resume
	IMAGE=$(IMAGE) docker compose up

compose-down: ## remove the compose containers, network and volumes (checkpoints included)
	docker compose down --volumes

compose-test: venv ## the image and compose tests, nodes killed included (needs the engine and the image)
	IMAGE=$(IMAGE) $(BIN)/pytest -q tests/deploy/test_docker.py
