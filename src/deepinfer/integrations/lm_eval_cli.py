"""``python -m deepinfer.integrations.lm_eval_cli ARGS``: lm-eval's own command line (the
``lm_eval`` command, same arguments) with the ``deepinfer`` backend registered. lm-eval 0.4.x
finds out-of-tree backends only when something imports them first; this does."""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

import deepinfer.integrations.lm_eval_backend  # noqa: F401  registers the "deepinfer" backend


def main() -> None:
    cli_evaluate()


if __name__ == "__main__":
    main()
