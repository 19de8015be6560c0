"""TorchX: `torchx run dist.ddp` and the project's component (torchx_components/train.py) run the trainer unchanged,
render the Kubernetes job we expect, and restart a killed worker from the newest checkpoint.

Every `torchx` here is the real CLI in a child process, started from the repository root with the
repository's .torchxconfig, as a user would run it."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from torchx.specs.builders import _create_args_parser
from torchx.specs.file_linter import get_fn_docstring, validate
from torchx.specs.finder import get_component

from devtools.processes import REPO_ROOT, clean_env, free_port, run
from tests.support.checkpoint_reading import newest_checkpoint, summary
from torchx_components.train import ddp
from trainer.launchers import ELASTIC_AGENT_ENV

COMPONENT = "torchx_components/train.py:ddp"
VENV_BIN = Path(sys.executable).parent
# dist.ddp's command runs `torchrun` through bash, so the venv's bin must come first on PATH;
# TORCHXCONFIG makes TorchX read the repository's config and ignore a ~/.torchxconfig on this machine.
TORCHX_ENV = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "TORCHXCONFIG": str(REPO_ROOT / ".torchxconfig")}
# Real Fashion-MNIST (the Debian package, else the subset shipped in trainer/data): 2048 samples, 1 epoch.
TRAIN_ARGS = ["--max-train-samples", "2048", "--max-test-samples", "1000", "--batch-size", "32", "--epochs", "1",
              "--progress", "off", "--no-tensorboard"]
RUN_TIMEOUT_S = 300


def torchx(*args: str) -> subprocess.CompletedProcess[str]:
    return run([str(VENV_BIN / "torchx"), *args], env=TORCHX_ENV, timeout_s=RUN_TIMEOUT_S)


def kubernetes_dry_run(*args: str) -> dict[str, Any]:
    """The Volcano Job that `torchx run -s kubernetes --dryrun` prints (no cluster, no Docker needed)."""
    result = torchx("run", "-s", "kubernetes", "--dryrun", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load(result.stdout.split("=== SCHEDULER REQUEST ===", 1)[1])


def containers(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [task["template"]["spec"]["containers"][0] for task in job["spec"]["tasks"]]


def torchrun_command(container: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(torchrun's options, the trainer's command) of a container running `bash -c "torchrun ..."`."""
    assert container["command"][:2] == ["bash", "-c"]
    words = shlex.split(container["command"][2])
    assert words[0] == "torchrun"
    trainer_at = words.index("-m") if "-m" in words else next(i for i, w in enumerate(words) if w.endswith(".py"))
    return dict(zip(words[1:trainer_at:2], words[2:trainer_at:2], strict=True)), words[trainer_at:]


def assert_trained(result: subprocess.CompletedProcess[str], output_dir: Path, nodes: int) -> dict[str, Any]:
    """The job succeeded and every rank of every node trained one epoch together, evaluated and checkpointed."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in result.stderr
    final = summary(output_dir)
    world_size = nodes * 2
    assert final["world_size"] == world_size
    assert sorted((rank["node_rank"], rank["local_rank"]) for rank in final["ranks"]) == \
        [(node, local) for node in range(nodes) for local in range(2)]
    assert {rank["launcher"] for rank in final["ranks"]} == {"torchrun"}
    assert final["epochs_completed"] == 1 and final["global_step"] == 2048 // (world_size * 32)
    assert final["test_samples"] == 1000 and final["test_accuracy"] > 0.5, "ten classes: chance is 0.1"
    assert f"final test accuracy {final['test_accuracy']:.4f}" in result.stderr, "rank 0's result reaches the user"
    name, manifest, state = newest_checkpoint(output_dir / "checkpoints")
    assert name == f"step-{final['global_step']:08d}" and manifest["world_size"] == world_size
    assert "model" in state and "optimizer" in state
    return final


# The component as TorchX sees it: linter, --help, the job it renders.

def test_component_passes_the_torchx_linter_and_documents_every_argument():
    assert validate(str(REPO_ROOT / COMPONENT.split(":")[0]), "ddp") == []
    assert get_component(str(REPO_ROOT / COMPONENT)).validation_errors == []
    _, argument_docs = get_fn_docstring(ddp)
    undocumented = [name for name, doc in argument_docs.items() if not doc.strip()]
    assert not undocumented
    help_text = _create_args_parser(ddp).format_help()
    assert "--checkpoint_volume" in help_text and "(default: ddp-deploy:latest)" in help_text


def test_torchx_help_of_the_component_lists_its_options():
    result = torchx("run", COMPONENT, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    for option in ("--image", "-j", "--memMB", "--output_dir", "--checkpoint_volume", "--max_restarts",
                   "--max_retries", "--rdzv_port", "--env"):
        assert option in result.stdout


def test_kubernetes_job_of_the_component_has_the_image_resources_command_and_mounts():
    job = kubernetes_dry_run("--workspace", "", "-cfg", "queue=default", COMPONENT, "-j", "2x2",
                             "--checkpoint_volume", "ckpt", "--output_dir", "runs/fmnist", "--max_retries", "3",
                             "--", "--epochs", "3")
    assert (job["apiVersion"], job["kind"]) == ("batch.volcano.sh/v1alpha1", "Job")
    assert job["spec"]["queue"] == "default" and job["spec"]["maxRetry"] == 3
    tasks = job["spec"]["tasks"]
    assert len(tasks) == 2
    for task in tasks:
        assert task["maxRetry"] == 3
        assert {"event": "PodFailed", "action": "RestartJob"} in task["policies"]
    for node, container in enumerate(containers(job)):
        assert container["image"] == "ddp-deploy:latest"
        options, trainer = torchrun_command(container)
        assert (options["--nnodes"], options["--nproc_per_node"], options["--rdzv_backend"]) == ("2", "2", "c10d")
        rank0_host = "TORCHX_RANK0_HOST" if node == 0 else "VC_TRAINER_0_HOSTS"  # Volcano's name for node 0
        assert options["--rdzv_endpoint"] == f"${{{rank0_host}:=localhost}}:29500"
        assert trainer == ["-m", "trainer", "--output-dir", "runs/fmnist", "--epochs", "3"]
        env = {item["name"]: item["value"] for item in container["env"]}
        assert env["PET_MAX_RESTARTS"] == "2" and env["PYTHONUNBUFFERED"] == "1"
        assert container["resources"]["limits"] == {"cpu": "2000m", "memory": "4096M"}
        assert container["ports"] == [{"containerPort": 29500, "name": "c10d"}]
        pod = tasks[node]["template"]["spec"]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"] == {"medium": "Memory"}, "DataLoader workers need more than 64 MB"
        assert mounts["/workspace/runs"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
        assert pod["restartPolicy"] == "Never"


def test_bare_dist_ddp_gets_the_project_image_and_memory_from_the_torchxconfig():
    job = kubernetes_dry_run("dist.ddp", "-j", "2x2", "--script", "trainer/main.py")  # queue, workspace: config
    for container in containers(job):
        assert container["image"] == "ddp-deploy:latest"
        assert container["resources"]["limits"]["memory"] == "4096M"
        assert torchrun_command(container)[1] == ["trainer/main.py"]


def test_dist_ddp_as_the_design_card_writes_it_renders_the_script_and_its_flags():
    job = kubernetes_dry_run("dist.ddp", "-j", "2x4", "trainer/main.py", "--epochs", "3")
    assert len(job["spec"]["tasks"]) == 2
    for container in containers(job):
        assert container["image"] == "ddp-deploy:latest"
        options, trainer = torchrun_command(container)
        assert (options["--nnodes"], options["--nproc_per_node"]) == ("2", "4")
        assert trainer == ["trainer/main.py", "--epochs", "3"]


def test_our_dist_ddp_is_torchxs_plus_a_bare_script_and_every_other_builtin_is_torchxs_own():
    from torchx.components import dist as torchx_dist
    from torchx.specs import finder

    from torchx_components import dist as ours

    components = {name: component.fn for name, component in finder._load_components().items()}
    assert components["dist.ddp"] is ours.ddp
    builtins = finder.ModuleComponentsFinder("torchx.components", "").find()
    for builtin in builtins:
        if builtin.name != "dist.ddp":
            assert components[builtin.name] is builtin.fn, builtin.name  # re-exported as it was
    assert components["dist.spmd"] is torchx_dist.spmd
    for kwargs in ({"script": "trainer/main.py"}, {"m": "trainer"}):
        assert ours.ddp("--epochs", "1", j="2x2", **kwargs) == torchx_dist.ddp("--epochs", "1", j="2x2", **kwargs)
    assert ours.ddp("trainer/main.py", "--epochs", "1", j="2x2") == \
        torchx_dist.ddp("--epochs", "1", script="trainer/main.py", j="2x2")
    with pytest.raises(ValueError, match="exactly one of --script and -m"):
        ours.ddp("--epochs", "1")  # no script at all: TorchX's own message


def test_torchx_run_without_a_component_runs_the_project_component():
    job = kubernetes_dry_run("--", "-j", "2x2", "--", "--epochs", "3")  # the component's flags after `--`
    for container in containers(job):
        assert container["image"] == "ddp-deploy:latest"
        assert torchrun_command(container)[1] == ["-m", "trainer", "--output-dir", "runs/torchx", "--epochs", "3"]


def test_image_script_and_restarts_can_be_overridden():
    role = ddp("--epochs", "1", image="registry.example.com/ddp-deploy:1.0", script="trainer/main.py",
               max_restarts=0, env={"LOGLEVEL": "INFO"}).roles[0]
    assert role.image == "registry.example.com/ddp-deploy:1.0"
    assert role.args[1].endswith("trainer/main.py --output-dir runs/torchx --epochs 1")
    assert (role.env["PET_MAX_RESTARTS"], role.env["LOGLEVEL"]) == ("0", "INFO")
    assert ELASTIC_AGENT_ENV.items() <= role.env.items()  # a node can join an elastic job (-j MIN:MAXxN)


def test_a_users_task_reaches_the_trainer_in_the_derived_image():
    job = kubernetes_dry_run("--workspace", "", "-cfg", "queue=default", COMPONENT, "-j", "2x1", "--task",
                             "forecast:Forecast", "--image", "registry.example.com/ddp-forecast:1.0", "--",
                             "--window", "24")
    for container in containers(job):
        assert container["image"] == "registry.example.com/ddp-forecast:1.0"
        assert torchrun_command(container)[1] == ["-m", "trainer", "--task", "forecast:Forecast", "--output-dir",
                                                  "runs/torchx", "--window", "24"]
    with pytest.raises(ValueError, match="--task given twice"):
        ddp("--task", "classification", task="forecast:Forecast")


def test_an_output_dir_off_the_checkpoint_volume_is_refused():
    with pytest.raises(ValueError, match="outside /workspace/runs.*use runs/NAME"):
        ddp(checkpoint_volume="ckpt", output_dir="/tmp/out")
    with pytest.raises(ValueError, match="outside /workspace/runs"):
        ddp(checkpoint_volume="ckpt", output_dir="runs/../elsewhere")


def test_the_trainers_own_output_dir_flag_is_refused_for_the_components():
    with pytest.raises(ValueError, match="set the component's --output_dir"):
        ddp("--epochs", "1", "--output-dir=/tmp/out")


# Real jobs on this machine (local_cwd): every node is a torchrun agent on localhost. Each job gets its own
# rendezvous port, so that jobs running beside the tests cannot join it.

@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_dist_ddp_from_the_repository_root_trains_the_script_unchanged(nodes, tmp_path):
    # No -s: the .torchxconfig makes local_cwd the default.
    result = torchx("run", "-cfg", f"log_dir={tmp_path / 'logs'}", "dist.ddp", "-j", f"{nodes}x2",
                    "--rdzv_port", str(free_port()), "--script", "trainer/main.py",
                    "--", *TRAIN_ARGS, "--output-dir", str(tmp_path / "out"))
    assert_trained(result, tmp_path / "out", nodes)


@pytest.mark.slow
def test_the_design_cards_command_trains_two_nodes_of_four_ranks(tmp_path):
    """`torchx run dist.ddp -j 2x4 trainer/main.py [TRAINER FLAGS]`, exactly so (local_cwd from .torchxconfig)."""
    flags = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64", "--epochs",
             "1", "--batch-size", "8", "--progress", "off", "--no-tensorboard", "--output-dir", str(tmp_path / "out")]
    result = torchx("run", "dist.ddp", "-j", "2x4", "trainer/main.py", *flags)
    assert result.returncode == 0 and "Job finished: SUCCEEDED" in result.stderr, result.stderr[-3000:]
    final = summary(tmp_path / "out")
    assert final["world_size"] == 8 and sorted(rank["rank"] for rank in final["ranks"]) == list(range(8))
    assert final["global_step"] == 256 // (8 * 8)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_project_component_trains_and_checkpoints(nodes, tmp_path):
    result = torchx("run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}", COMPONENT, "-j", f"{nodes}x2",
                    "--rdzv_port", str(free_port()), "--output_dir", str(tmp_path / "out"), "--", *TRAIN_ARGS)
    final = assert_trained(result, tmp_path / "out", nodes)
    assert final["resumed_from"] is None
    replica_logs = sorted(tmp_path.glob("logs/torchx/*/trainer/*/combined.log"))
    assert len(replica_logs) == nodes, "the per-node logs are kept in log_dir"


def run_killing(cmd: list[str], after: str, kill: Callable[[int], None], env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """`torchx run` to its end, ``kill(torchx's pid)`` called once a line of its log holds ``after``."""
    process = subprocess.Popen(cmd, env=clean_env({**TORCHX_ENV, **(env or {})}), cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        seen = []
        for line in process.stderr:  # TorchX streams every rank's log here as it is written
            seen.append(line)
            if after in line:
                break
        else:
            raise AssertionError(f"the job ended before {after!r}:\n" + "".join(seen[-50:]))
        kill(process.pid)
        stdout, rest = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.terminate()  # TorchX stops the job's replicas when it gets SIGTERM
            process.wait(timeout=60)
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, "".join(seen) + rest)


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True,
                              check=False).stdout.split()
    return [grandchild for child in map(int, children) for grandchild in (child, *_descendants(child))]


def _worker(torchx_pid: int, rank: int) -> int:
    """The trainer process with RANK=rank somewhere below the torchx CLI (CLI, bash, torchrun agent, worker)."""
    for pid in _descendants(torchx_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            return pid
    raise AssertionError(f"no trainer process with RANK={rank} below torchx pid {torchx_pid}")


@pytest.mark.slow
def test_a_killed_worker_is_restarted_by_torchrun_and_the_job_resumes_from_the_checkpoint(tmp_path):
    # One node: after a failure only that node's torchrun restarts, so its restart count is the job's.
    # 512 steps leave time after the first checkpoint (step 20) to kill a worker mid-run.
    cmd = [str(VENV_BIN / "torchx"), "run", "-cfg", f"log_dir={tmp_path / 'logs'}", COMPONENT, "-j", "1x2",
           "--output_dir", str(tmp_path / "out"), "--",
           "--max-train-samples", "4096", "--max-test-samples", "1000", "--batch-size", "8", "--epochs", "2",
           "--checkpoint-every", "20", "--progress", "off", "--no-tensorboard"]
    result = run_killing(cmd, "step-00000020 written", lambda torchx: os.kill(_worker(torchx, rank=1), signal.SIGKILL))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in result.stderr
    final = summary(tmp_path / "out")
    assert final["resumed_from"] is not None, "the restarted workers loaded the checkpoint"
    assert [rank["restart_count"] for rank in final["ranks"]] == [1, 1]
    assert final["world_size"] == 2 and final["epochs_completed"] == 2
    assert final["global_step"] == 2 * 4096 // (2 * 8) and final["test_accuracy"] > 0.5
    name, manifest, _ = newest_checkpoint(tmp_path / "out" / "checkpoints")
    assert name == f"step-{final['global_step']:08d}"


@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_goes_on_alone_and_trains_every_sample_once(tmp_path):
    """`-j 1:2x1`: two replicas (nodes) whose torchrun agents meet in a c10d rendezvous, --nnodes=1:2. One replica's
    agent and worker are killed mid-epoch (its node lost): the other's agent restarts its worker at one rank, which
    resumes from the newest checkpoint and ends the epoch. TorchX itself calls the app FAILED (a replica exited on
    SIGKILL) and cannot add a replica to a running app: docs/elastic.md."""
    samples, batch, rendezvous_port = 2048, 8, free_port()
    cmd = [str(VENV_BIN / "torchx"), "run", "-cfg", f"log_dir={tmp_path / 'logs'}", COMPONENT, "-j", "1:2x1",
           "--rdzv_port", str(rendezvous_port), "--output_dir", str(tmp_path / "out"), "--",
           "--dataset", "synthetic", "--synthetic-train-size", str(samples), "--synthetic-test-size", "64",
           "--batch-size", str(batch), "--epochs", "1", "--checkpoint-every", "10", "--progress", "off",
           "--no-tensorboard", "--threads-per-rank", "1", "--log-every", "1000"]
    def lose_node(torchx: int) -> None:
        # The node that does not host the rendezvous: on local_cwd both replicas name localhost, and whichever
        # agent binds the port first serves it (a cluster puts it on replica 0's host).
        host = _listening_pid(rendezvous_port)
        agent = next(pid for pid in map(lambda replica: _replica_agent(torchx, replica), (0, 1)) if pid != host)
        for pid in (agent, *_descendants(agent)):
            os.kill(pid, signal.SIGKILL)

    # The survivor's round closes 3 s after it is in, not torchrun's 30 s: local_cwd's replicas inherit the CLI's
    # environment, and torchrun reads PET_RDZV_CONF (TorchX's --env cannot carry a value with '=' in it).
    result = run_killing(cmd, "step-00000010 written", lose_node,
                         {"PET_RDZV_CONF": "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"})
    final = summary(tmp_path / "out")
    assert final["world_size"] == 1 and final["epochs_completed"] == 1, result.stderr[-3000:]
    resumed = int(final["resumed_from"].rsplit("step-", 1)[1])
    # Each step before the checkpoint resumed trained 2 x 8 samples, each one after it 8: the epoch's samples once.
    assert final["global_step"] == resumed + (samples - resumed * 2 * batch) // batch, (final, resumed)
    assert "Job finished: FAILED" in result.stderr, result.stderr[-3000:]


def _listening_pid(port: int) -> int:
    """The process that listens on a local TCP port (from /proc: the socket's inode, then whose fd it is)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].rsplit(":", 1)[1] == f"{port:04X}" and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for process in Path("/proc").iterdir():
        if process.name.isdigit():
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in inodes for fd in (process / "fd").iterdir()):
                    return int(process.name)
    raise AssertionError(f"nothing listens on port {port}")


def _replica_agent(torchx_pid: int, replica: int) -> int:
    """The torchrun agent of one replica (node) below the torchx CLI: its environment names the replica's logs."""
    for pid in _descendants(torchx_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if f"/trainer/{replica}/".encode() in environ and b"torchrun" in command:
            return pid
    raise AssertionError(f"no torchrun agent of replica {replica} below torchx pid {torchx_pid}")


# The worked example (examples/forecast, installed in this venv as in its image) through TorchX: the
# component's --task, and the example's own script (trainer.run) under TorchX's dist.ddp.
EXAMPLE_ARGS = ["--epochs", "1", "--train-series", "8", "--eval-series", "4", "--length", "48", "--window", "16",
                "--batch-size", "16", "--progress", "off", "--no-tensorboard"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["component --task", "dist.ddp -m script"])
def test_the_example_task_trains_under_torchx(how, tmp_path):
    logs, port = f"log_dir={tmp_path / 'logs'}", str(free_port())
    if how == "component --task":
        result = torchx("run", "-s", "local_cwd", "-cfg", logs, COMPONENT, "-j", "1x2", "--rdzv_port", port,
                        "--task", "forecast:Forecast", "--output_dir", str(tmp_path / "out"), "--", *EXAMPLE_ARGS)
    else:
        result = torchx("run", "-s", "local_cwd", "-cfg", logs, "dist.ddp", "-j", "1x2", "--rdzv_port", port,
                        "-m", "forecast.train", "--", *EXAMPLE_ARGS, "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0 and "Job finished: SUCCEEDED" in result.stderr, result.stderr[-3000:]
    final = summary(tmp_path / "out")
    assert (final["task"], final["world_size"], final["test_samples"]) == ("forecast", 2, 128)
    assert final["global_step"] == 256 // (2 * 16) and final["test_r2"] > 0.0
