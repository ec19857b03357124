"""``python -m deepinfer.cli``: the command line, as ``python -m deepinfer`` runs it."""

import sys

from deepinfer.cli import main

sys.exit(main())
