"""Readable dumps of what the compiler sees (``fx_graphs/``).

``trace_tiny(arch)`` compiles a tiny model's step with ``PostGradBackend`` (no code
generation) over two fixed steps (a two-sequence prefill, then decodes beside a prefill) and
records each post-grad graph before and after our passes. ``deepinfer dump-graphs`` writes
them to ``fx_graphs/``; a test re-traces and fails when the text differs from the committed
files, so a change to the model or a pass shows up as a graph diff in review. Thanks to
``StepPadding`` and dynamic shapes both steps (prefill and decode) run one graph.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.compile.compilation import compile_step
from deepinfer.compile_passes import PASSES

GRAPH_ARCHS = ("deepseek_v4", "deepseek_v41", "llama")
# (chunk lengths, chunk starts) per step; chosen so both steps stay in one top-k regime
STEPS = (([11, 5], [0, 0]), ([1, 1, 12], [0, 0, 0]))
BLOCKS, SLOTS = 32, 4


def _short_target(target) -> str:
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        packet = target.name().split("::")[1]
        return f"{ns}.{packet}"
    module = getattr(target, "__module__", "")
    return f"{module.rsplit('.', 1)[-1]}.{name}" if module else name


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__ if value is not None else "?"


def _arg(value) -> str:
    if isinstance(value, torch.fx.Node):
        return value.name
    if isinstance(value, tuple | list):
        inner = ", ".join(_arg(v) for v in value)
        return f"[{inner}]"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def format_graph(graph: torch.fx.Graph) -> str:
    """One line per node: ``name: type = op(args)``; inputs list their shapes."""
    lines = []
    for node in graph.nodes:
        shape = _describe(node.meta.get("val"))
        if node.op == "placeholder":
            lines.append(f"{node.name}: {shape} = input")
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
        else:
            args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.name}: {shape} = {_short_target(node.target)}({', '.join(args)})")
    return "\n".join(lines) + "\n"


@dataclass
class TracedTiny:
    arch: str
    num_layers: int
    counts: dict[str, int]
    before: list[str] = field(default_factory=list)  # one text per graph compiled
    after: list[str] = field(default_factory=list)
    max_logit_diff: float = 0.0  # compiled (passes applied) vs eager, over the steps
    graph_targets: list[list] = field(default_factory=list)


def _step_inputs(model, lengths: list[int], starts: list[int]):
    layout = CacheLayout.from_specs(model.cache_spec(), 16)
    pools = allocate_pools(layout, BLOCKS, SLOTS, torch.float32, torch.device("cpu"))
    chunks = [
        SeqChunk([i * 8 + b for b in range(8)], i, s, n, logits_offsets=list(range(n)))
        for i, (n, s) in enumerate(zip(lengths, starts, strict=True))
    ]
    padding = StepPadding.for_pools(BLOCKS, SLOTS)
    positions, batch = build_forward_batch(layout, pools, chunks, torch.device("cpu"), padding)
    ids = (torch.arange(positions.shape[0]) * 37) % 200 + 3
    return ids, positions, batch


def trace_tiny(arch: str, workdir: Path | None = None) -> TracedTiny:
    from deepinfer.models import prepare
    from deepinfer.models.loading import load_model
    from deepinfer.tiny import make_tiny_checkpoint

    workdir = Path(workdir or tempfile.mkdtemp(prefix="deepinfer-graphs-"))
    model = load_model(make_tiny_checkpoint(workdir / arch, arch=arch, seed=0))
    prepare.quantize(model, None)  # the projections as an engine's compiled step runs them
    torch._dynamo.reset()
    compiled = compile_step(model, backend="post_grad", passes=PASSES)  # the full pipeline
    manager = compiled.pass_manager
    manager.record = True
    diff = 0.0
    with torch.inference_mode():
        for lengths, starts in STEPS:
            got = compiled(*_step_inputs(model, lengths, starts))
            ref = model.step(*_step_inputs(model, lengths, starts))
            diff = max(diff, float((got - ref).abs().max()))
    return TracedTiny(
        arch=arch,
        num_layers=model.config.num_hidden_layers,
        counts=dict(manager.counts),
        before=[format_graph(g) for g in manager.recorded_before],
        after=[format_graph(g.graph) for g in compiled.post_grad.graphs],
        max_logit_diff=diff,
        graph_targets=[[n.target for n in g.graph.nodes] for g in compiled.post_grad.graphs],
    )


def golden_files(traced: TracedTiny) -> dict[str, str]:
    """File name -> text for ``fx_graphs/``."""
    files = {}
    for i, (before, after) in enumerate(zip(traced.before, traced.after, strict=True)):
        suffix = "" if i == 0 else f".{i}"
        files[f"{traced.arch}{suffix}.before.txt"] = before
        files[f"{traced.arch}{suffix}.after.txt"] = after
    return files


def dump_graphs(out_dir: Path, archs=GRAPH_ARCHS) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for arch in archs:
        for name, text in golden_files(trace_tiny(arch)).items():
            path = out_dir / name
            path.write_text(text)
            written.append(path)
    return written
