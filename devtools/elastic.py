"""Elastic torchrun agents on this machine, one agent standing for one node: started, lost and joined while the
job runs (tests/integration/test_elastic.py, bench/figures/elastic.py)."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from devtools.processes import (
    DDP_TORCHRUN,
    REPO_ROOT,
    clean_env,
    free_port,
    kill_marked,
    kill_tree,
    marked,
    python_stacks,
)

# The round closes 1 s after the smallest size is there (30 s by default); a lost agent is dropped after 3 missed
# keep-alives 1 s apart (5 s apart by default: 15 s).
FAST_RENDEZVOUS = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class ElasticJob:
    """One job's agents (``ddp-torchrun``, trainer.elastic_agent): the same rendezvous (on a free loopback port), run
    id and trainer arguments."""

    folder: Path  # the agents' logs; the trainer's output folder is given in trainer_args
    trainer_args: Sequence[str]
    nnodes: str = "1:2"
    rdzv_conf: str = FAST_RENDEZVOUS
    run_id: str = "elastic-test"
    module: str = "trainer"  # what the workers run: the trainer, or a test's wrapper of it
    env: Mapping[str, str] = field(default_factory=dict)
    endpoint: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    agents: list[Agent] = field(default_factory=list)
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)  # in every process of the job, for stop()

    def start(self, name: str, env: Mapping[str, str] | None = None) -> Agent:
        """A new agent (node) of one rank, ``env`` added to the job's. The first one started serves the rendezvous
        (every agent on a loopback endpoint would try): it must stay."""
        host = "1" if not self.agents else "0"
        command = [*DDP_TORCHRUN, f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}", "--max-restarts=4",
                   f"--rdzv-conf={self.rdzv_conf},is_host={host}", "-m", self.module, *self.trainer_args]
        agent = Agent(name, self.folder / f"agent-{name}.log", command,
                      {**self.env, **(env or {}), "DDP_DEVTOOLS_MARK": self.mark})
        self.agents.append(agent)
        return agent

    def stop(self) -> None:
        """Every process of the job, whatever state it is in (also workers whose agent is gone)."""
        for agent in self.agents:
            agent.process.kill()
        for _ in range(3):  # again: a process may have started during a pass
            kill_marked(self.mark)
        for agent in self.agents:
            agent.process.wait(timeout=30)

    def logs(self) -> str:
        return "\n".join(f"--- {agent.log.name}\n{agent.text()[-3000:]}" for agent in self.agents)

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
        """Until ``condition()`` holds; TimeoutError naming ``what``, with the end of every agent's log."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}; the agents said:\n{self.logs()}\n"
                                   f"and their processes were at:\n{python_stacks(marked(self.mark))}")
            time.sleep(0.2)


class Agent:
    """One torchrun agent, its output in a file (a pipe nobody reads would stall it)."""

    def __init__(self, name: str, log: Path, command: list[str], env: Mapping[str, str]) -> None:
        self.name, self.log = name, log
        with log.open("w") as out:
            self.process = subprocess.Popen(command, env=clean_env(env), cwd=REPO_ROOT, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def lose(self) -> None:
        """What losing its node does: the agent and its workers (in sessions of their own) killed at once."""
        kill_tree(self.process.pid)
        self.process.wait()

    def events(self, pattern: str) -> list[float]:
        """The times (Unix seconds) of the agent's own log lines (glog style, to the microsecond) that match."""
        found = []
        for match in AGENT_LINE.finditer(self.text()):
            if re.search(pattern, match.group("message")):
                month_day, clock = match.group("date"), match.group("clock")
                stamp = datetime.strptime(f"{datetime.now().year}{month_day} {clock}", "%Y%m%d %H:%M:%S.%f")
                found.append(stamp.timestamp())
        return found


AGENT_LINE = re.compile(r"^[IWE](?P<date>\d{4}) (?P<clock>\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] (?P<message>.*)$",
                        re.MULTILINE)
