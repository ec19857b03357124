"""``python -m deepinfer`` (and ``torchrun ... -m deepinfer``): the command line."""

import sys

from deepinfer.cli import main

sys.exit(main())
