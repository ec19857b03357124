"""The commands that run no engine: ``make-tiny`` (a random checkpoint), ``plan`` (memory
from a config alone) and ``dump-graphs`` (the tiny models' compiled graphs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.cache import kv_dtypes


def make_tiny(args: argparse.Namespace) -> int:
    """Write a tiny random checkpoint (tests and examples without a network)."""
    from deepinfer.tiny import make_tiny_checkpoint

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    quant = None if args.quant == "none" else args.quant
    path = make_tiny_checkpoint(
        args.path, arch=args.arch, seed=args.seed, dtype=dtype, quant=quant, shards=args.shards
    )
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """Weights and KV cache per device, from the model's config on the meta device."""
    from deepinfer.engine.memory import GIB, format_plan
    from deepinfer.engine.memory import plan as memory_plan
    from deepinfer.models.registry import load_config_json, resolve
    from deepinfer.models.released_configs import RELEASED_CONFIGS
    from deepinfer.weights.catalog import resolve_model

    source = args.model
    if source in RELEASED_CONFIGS:
        raw = RELEASED_CONFIGS[source]
    elif Path(source).is_file():
        raw = json.loads(Path(source).read_text())
    else:
        raw = load_config_json(resolve_model(source))
    cfg, cls = resolve(raw)
    with torch.device("meta"):
        model = cls(cfg)
    quantization = getattr(cfg, "quantization", None) or raw.get("quantization_config")
    result = memory_plan(
        model,
        quantization,
        args.max_model_len,
        name=source,
        tensor_parallel_size=args.tensor_parallel_size,
        memory_bytes=None if args.memory_gib is None else int(args.memory_gib * GIB),
        utilization=args.memory_utilization,
        block_size=args.block_size,
        kv_dtype=kv_dtypes.pool_dtype(args.kv_cache_dtype, torch.bfloat16),
        packed_kv=args.kv_cache_dtype == "auto",
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0


def dump_graphs(args: argparse.Namespace) -> int:
    """Write the tiny models' compiled graphs and print each file written."""
    from deepinfer.compile.graph_dump import GRAPH_ARCHS
    from deepinfer.compile.graph_dump import dump_graphs as dump

    for path in dump(Path(args.out), tuple(args.arch or GRAPH_ARCHS)):
        print(path)
    return 0
