"""``ddp-torchrun``: torchrun, with what an elastic job (``--nnodes=MIN:MAX``) needs that torch 2.14's lacks.

- A store per rendezvous round (trainer.launchers.ELASTIC_AGENT_ENV), unless the environment says otherwise:
  without it, a node that joins a running job never completes the round.
- A rendezvous that ends without the job is one line naming what it waited for, never torchrun's bare traceback
  of ``RendezvousTimeoutError`` (no message at all): fewer than MIN nodes came within ``join_timeout``, at the
  start or after nodes were lost; the round was closed (the job had ended) when this node came; or the node that
  hosted the rendezvous ended while this one waited (exit 3 for each).
- ``--nnodes`` that torchrun would refuse with a bare assert (a minimum above the maximum, or below 1) or a parse
  error, said in one line (exit 2).

Every argument is torchrun's, passed on unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from trainer.errors import EXIT_RENDEZVOUS, EXIT_USAGE
from trainer.launchers import ELASTIC_AGENT_ENV

# torch.distributed.elastic.rendezvous.dynamic_rendezvous's, when --rdzv-conf has none.
DEFAULT_JOIN_TIMEOUT_S, DEFAULT_LAST_CALL_S = 600, 30


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here: torch's launcher is only for this command, not for whoever imports the trainer.
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import parse_args, run

    for name, value in ELASTIC_AGENT_ENV.items():
        os.environ.setdefault(name, value)  # the workers inherit it too, harmlessly
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    unusable = node_bounds_error(args.nnodes)
    if unusable:
        print(f"ddp-torchrun: error: {unusable}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    job = f"the rendezvous of job {args.rdzv_id!r} at {args.rdzv_endpoint}"
    try:
        record(run)(args)  # as torchrun's own main: a failure's error file for launchers that read it
    except RendezvousTimeoutError:
        said = waited_for(args.nnodes, job, args.rdzv_conf)
    except RendezvousClosedError:
        said = (f"{job} is closed: that job has ended (finished, or failed on its other nodes); start a new job "
                f"with another --rdzv-id")
    except RendezvousConnectionError as error:
        cause = " ".join(str(error.__cause__ or error).split())[:200].rstrip(".") or type(error).__name__
        said = (f"{job} cannot be reached ({cause}): a wrong --rdzv-endpoint, a host that does not accept "
                f"connections on that port, or the node that hosted it ended while this one waited (as a node "
                f"beyond the maximum of --nnodes={args.nnodes} does: it waits as a spare until the job ends); check "
                f"the endpoint, start the host's node first, and start no more nodes than the maximum")
    else:
        return 0
    print(f"ddp-torchrun: error: {said}. The checkpoints are intact: a job started again with the same "
          f"--rdzv-id resumes from the newest", file=sys.stderr, flush=True)
    return EXIT_RENDEZVOUS


def node_bounds_error(nnodes: str) -> str | None:
    """What is wrong with --nnodes (or PET_NNODES), which torchrun checks with a bare assert (a traceback, no
    message) or a parse error; None when it is usable."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        least, most = parse_min_max_nnodes(nnodes)
    except (RuntimeError, ValueError):
        return f"--nnodes={nnodes} is neither a number of nodes nor MIN:MAX; give one, such as 2 or 1:4"
    if not 0 < least <= most:
        return (f"--nnodes={nnodes}: the minimum must be at least 1 and at most the maximum (MIN:MAX, such as "
                f"1:{max(most, 1)}); under compose.yaml, MIN_NODES at most NODES")
    return None


def waited_for(nnodes: str, job: str, rdzv_conf: str) -> str:
    """What a rendezvous that timed out was waiting for, and the fix."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    least = nnodes.split(":")[0]
    conf = _parse_rendezvous_config(rdzv_conf)  # torch's own reading of it: spaces, separators
    join_timeout = float(conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S))
    last_call = float(conf.get("last_call_timeout", DEFAULT_LAST_CALL_S))
    if last_call >= join_timeout:
        return (f"{job} waited {join_timeout:g} s (join_timeout) and no round closed: fewer than {least} node(s) "
                f"came (--nnodes={nnodes}), or they came but the last call for more ({last_call:g} s, "
                f"last_call_timeout) outlasts join_timeout; make --rdzv-conf's last_call_timeout shorter than its "
                f"join_timeout, and start more nodes if fewer came")
    return (f"{job} waited {join_timeout:g} s (join_timeout) for at least {least} node(s) (--nnodes={nnodes}), "
            f"and fewer came; start more nodes, lower the minimum of --nnodes, or raise --rdzv-conf=join_timeout")


if __name__ == "__main__":
    sys.exit(main())
