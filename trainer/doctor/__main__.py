"""``python -m trainer.doctor``."""

import sys

from trainer.doctor.cli import main

sys.exit(main())
