"""The same training as ``ddp-train --task forecast:Forecast``, as a script of one's own.

Run it as a module wherever the package is installed (or on PYTHONPATH), under any launcher:

    python -m forecast.train --epochs 2                                    # one process
    torchrun --standalone --nproc-per-node 2 -m forecast.train            # 2 ranks
    torchx run -s local_cwd dist.ddp -j 1x2 -m forecast.train -- --epochs 2

The settings below are this script's defaults; command-line flags override them.
"""

import sys

import trainer
from forecast.task import Forecast


def main() -> int:
    return trainer.run(Forecast, epochs=4, batch_size=64, lr=3e-3)


if __name__ == "__main__":
    sys.exit(main())
