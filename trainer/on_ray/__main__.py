import sys

from trainer.on_ray.cli import main

sys.exit(main())
