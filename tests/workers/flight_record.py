"""The trainer, then this rank's flight record written out (trainer.flight_recorder): every collective the run
made on every process group, with its sizes, for tests that count them.

``torchrun ... -m tests.workers.flight_record [trainer flags]``: writes OUTPUT_DIR/flight-recorder/rank-N.
"""

from __future__ import annotations

import os
import sys

import trainer
from trainer.flight_recorder import dump_flight_recorder

if __name__ == "__main__":
    code = trainer.run()
    if dump_flight_recorder(os.environ, int(os.environ.get("RANK", "0"))) is None:
        print("flight_record: no flight recorder to dump", file=sys.stderr)
        code = code or 1
    sys.exit(code)
