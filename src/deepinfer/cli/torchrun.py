"""Commands under torchrun: rank 0 runs the command, the other ranks load their share and
follow the steps it sends."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def follow(args: argparse.Namespace, rank: int, size: int) -> NoReturn:
    """A torchrun rank other than 0: load this rank's share and run the steps rank 0 sends."""
    from deepinfer.distributed.workers import parallel_mode, worker_main
    from deepinfer.llm import parse_dtype
    from deepinfer.models.llama import LlamaForCausalLM
    from deepinfer.models.registry import load_config_json, resolve
    from deepinfer.weights.catalog import resolve_model

    path = resolve_model(args.model)
    _, cls = resolve(load_config_json(path))
    mode = parallel_mode(cls is LlamaForCausalLM, args.data_parallel_size, args.enable_expert_parallel)
    load_kwargs = {
        "path": str(path),
        "dtype": parse_dtype(args.dtype),
        "device": args.device,
        "fake_quant": None,
        "keep_quantized": args.quantization in (None, "fp8"),
    }
    worker_main(rank, size, None, mode, load_kwargs)
    # Leave without running C++ static destructors: after a gloo group, one of PyTorch's can
    # destroy a still-joinable thread and abort the process (3 of 5 test runs here), which
    # torchrun reports as a failed rank. multiprocessing workers exit this way too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ranks_from_torchrun(args: argparse.Namespace) -> tuple[int, int] | None:
    """Under torchrun with several ranks: (rank, world size), the command's
    ``--tensor-parallel-size`` (or, when it asks for data parallel, ``--data-parallel-size``)
    set to the world size or checked against it."""
    from deepinfer.distributed.workers import launched_by_torchrun

    ranks = launched_by_torchrun()
    if ranks is None:
        return None
    if getattr(args, "tensor_parallel_size", None) is None or getattr(args, "model", None) is None:
        raise ValueError(
            f"'{args.command}' does not run across torchrun ranks (generate, serve and chat do, with a model)"
        )
    if args.data_parallel_size > 1:
        if args.data_parallel_size * args.tensor_parallel_size != ranks[1]:
            raise ValueError(
                f"--data-parallel-size {args.data_parallel_size} x --tensor-parallel-size "
                f"{args.tensor_parallel_size} but torchrun started {ranks[1]} ranks"
            )
    elif args.tensor_parallel_size == 1:
        args.tensor_parallel_size = ranks[1]
    elif args.tensor_parallel_size != ranks[1]:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size} but torchrun started {ranks[1]} ranks"
        )
    return ranks
