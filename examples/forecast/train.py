"""The same training as ``ddp-train --task forecast:Forecast``, as a script of one's own.

    torchrun --standalone --nproc-per-node 2 train.py --epochs 3
    torchx run dist.ddp -j 1x2 --script train.py -- --epochs 3
"""

import sys

from forecast import Forecast

import trainer

if __name__ == "__main__":
    sys.exit(trainer.run(Forecast, epochs=4, batch_size=64, lr=3e-3))
