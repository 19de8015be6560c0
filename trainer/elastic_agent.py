"""``ddp-torchrun``: torchrun, with what an elastic job (``--nnodes=MIN:MAX``) needs that torch 2.14's lacks.

- A store per rendezvous round (trainer.launchers.ELASTIC_AGENT_ENV), unless the environment says otherwise:
  without it, a node that joins a running job never completes the round.
- A rendezvous that ends without the job is one line naming what it waited for, never torchrun's bare traceback
  of ``RendezvousTimeoutError`` (no message at all): fewer than MIN nodes came within ``join_timeout``, at the
  start or after nodes were lost; or the round was closed (the job had ended) when this node came.

Every argument is torchrun's, passed on unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from trainer.errors import EXIT_RENDEZVOUS
from trainer.launchers import ELASTIC_AGENT_ENV

DEFAULT_JOIN_TIMEOUT_S = 600  # torch.distributed.elastic.rendezvous.dynamic_rendezvous's, when --rdzv-conf has none


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here: torch's launcher is only for this command, not for whoever imports the trainer.
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    for name, value in ELASTIC_AGENT_ENV.items():
        os.environ.setdefault(name, value)  # the workers inherit it too, harmlessly
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except RendezvousTimeoutError:
        print(f"ddp-torchrun: error: {waited_for(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf)}",
              file=sys.stderr, flush=True)
        return EXIT_RENDEZVOUS
    except RendezvousClosedError:
        print(f"ddp-torchrun: error: the rendezvous of job {args.rdzv_id!r} at {args.rdzv_endpoint} is closed: "
              f"that job has ended (finished, or failed on its other nodes); start a new job with another "
              f"--rdzv-id", file=sys.stderr, flush=True)
        return EXIT_RENDEZVOUS
    return 0


def waited_for(nnodes: str, endpoint: str, run_id: str, rdzv_conf: str) -> str:
    """What a rendezvous that timed out was waiting for, and the fix."""
    least = nnodes.split(":")[0]
    conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
    join_timeout = conf.get("join_timeout", str(DEFAULT_JOIN_TIMEOUT_S))
    return (f"the rendezvous of job {run_id!r} at {endpoint} waited {join_timeout} s (join_timeout) for at least "
            f"{least} node(s) (--nnodes={nnodes}), and fewer came; start more nodes, lower the minimum of "
            f"--nnodes, or raise --rdzv-conf=join_timeout. The checkpoints are intact: a job started again with "
            f"the same --rdzv-id resumes from the newest")


if __name__ == "__main__":
    sys.exit(main())
