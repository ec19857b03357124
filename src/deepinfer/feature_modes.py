"""Which features run in which execution modes: the one table the config's checks read and the
documentation prints (``docs/guide/features-and-modes.md``, written by ``markdown``).

A cell says a feature works in a mode (its outputs equal the eager engine's), falls back (the
engine runs the feature on a slower path it names, outputs unchanged), or is refused with what
to change; ``tests/engine/test_feature_modes.py`` walks every cell. Every feature works in
eager synchronous steps on one rank, the reference the others are checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Support(StrEnum):
    WORKS = "works"
    FALLS_BACK = "falls back"
    REFUSED = "refused"
    NOT_APPLICABLE = "n/a"


@dataclass(frozen=True)
class Cell:
    """``note``: for a refusal, what to change and why; for a fallback, what runs instead."""

    support: Support
    note: str = ""


@dataclass(frozen=True)
class Axis:
    """A feature or a mode: its heading, the option that turns it on, and whether a config
    turns it on (None: not an ``EngineConfig`` option)."""

    title: str
    option: str
    on: Callable[[Any], bool] | None


FEATURES: dict[str, Axis] = {
    "lora": Axis("LoRA adapters", "enable_lora=True", lambda c: c.enable_lora),
    "kv_tiers": Axis("KV cache tiers", "kv_offload_bytes / kv_cache_dir", lambda c: c.kv_tiers),
    "speculative": Axis(
        "speculative decoding", "speculative_config", lambda c: c.speculative_config is not None
    ),
    "routed_experts": Axis(
        "routed-expert return", "enable_return_routed_experts=True", lambda c: c.enable_return_routed_experts
    ),
    "rl_updates": Axis("RL weight updates", "LLM.from_model", None),
}

MODES: dict[str, Axis] = {
    "compiled": Axis("compiled", "compile=True", lambda c: c.compile is True),
    "graphs": Axis("CUDA graphs", "capture_graphs=True", lambda c: c.capture_graphs is True),
    "async": Axis("asynchronous", "async_scheduling=True", lambda c: c.async_scheduling is True),
    "one_call": Axis("one-call CPU decode", "(automatic on the CPU)", None),
    "tp": Axis("tensor parallel", "tensor_parallel_size > 1", lambda c: c.tensor_parallel_size > 1),
    "dp": Axis("data parallel", "data_parallel_size > 1", lambda c: c.data_parallel_size > 1),
    "ep": Axis("expert parallel", "enable_expert_parallel=True", lambda c: c.enable_expert_parallel),
    "batch_invariant": Axis("batch-invariant", "batch_invariant=True", lambda c: c.batch_invariant),
}

W = Cell(Support.WORKS)
NA = Cell(Support.NOT_APPLICABLE)


def _refused(note: str) -> Cell:
    return Cell(Support.REFUSED, note)


def _one_rank(what: str) -> Cell:
    return _refused(f"run on one rank ({what})")


TABLE: dict[str, dict[str, Cell]] = {
    "lora": {
        "compiled": Cell(
            Support.WORKS,
            "each row's slot goes to one op per projection; a model whose adapters reach routed "
            "experts or other linears (DeepSeek V4) refuses it: set compile=False",
        ),
        "graphs": Cell(
            Support.WORKS,
            "each row's slot is a static input of the graph, as under compile; DeepSeek V4 refuses "
            "it as it refuses compile: set capture_graphs=False",
        ),
        "async": W,
        "one_call": W,
        "tp": Cell(
            Support.WORKS,
            "Llama-family models: each rank holds its cut of every adapter (q/k/v and gate/up by "
            "output rows, o and down by input columns); DeepSeek V4 refuses it: run on one rank",
        ),
        "dp": _one_rank("the adapters' slots are this process's"),
        "ep": _one_rank("the adapters' slots are this process's"),
        "batch_invariant": _refused(
            "set batch_invariant=False: the grouped product's form follows the batch"
        ),
    },
    "kv_tiers": {
        "compiled": W,
        "graphs": W,
        "async": W,
        "one_call": W,
        "tp": Cell(
            Support.WORKS,
            "every rank keeps its cut of each block in its own tiers (its own disk namespace); "
            "rank 0 decides, and a load counts only where every rank found its part",
        ),
        "dp": _one_rank("the tiers copy this process's pools"),
        "ep": _one_rank("the tiers copy this process's pools"),
        "batch_invariant": W,
    },
    "speculative": {
        "compiled": W,
        "graphs": Cell(Support.WORKS, "verification steps run without a graph; single-token decodes replay"),
        "async": Cell(
            Support.FALLS_BACK,
            "steps run synchronously (drafting reads each step's tokens on the host); the hardware "
            "schedule takes its lagged production form",
        ),
        "one_call": W,
        "tp": _one_rank("drafting and verification run in this process"),
        "dp": _one_rank("drafting and verification run in this process"),
        "ep": _one_rank("drafting and verification run in this process"),
        "batch_invariant": _refused("set batch_invariant=False: verification chunks follow the drafts"),
    },
    "routed_experts": {
        "compiled": W,
        "graphs": Cell(Support.WORKS, "the routing is a second output of the captured step"),
        "async": W,
        "one_call": NA,
        "tp": _one_rank("the routing record is this process's"),
        "dp": _one_rank("the routing record is this process's"),
        "ep": _one_rank("the routing record is this process's"),
        "batch_invariant": W,
    },
    "rl_updates": {
        "compiled": W,
        "graphs": W,
        "async": Cell(Support.WORKS, "an update waits for the step in flight, then applies"),
        "one_call": W,
        "tp": _one_rank("the engine shares this process's parameters with the trainer"),
        "dp": _one_rank("the engine shares this process's parameters with the trainer"),
        "ep": _one_rank("the engine shares this process's parameters with the trainer"),
        "batch_invariant": W,
    },
}


def cell(feature: str, mode: str) -> Cell:
    return TABLE[feature][mode]


def refusal(feature: str, mode: str) -> str | None:
    """The error for ``feature`` in ``mode`` (None: it runs there)."""
    c = TABLE[feature][mode]
    if c.support is not Support.REFUSED:
        return None
    return f"{FEATURES[feature].option} with {MODES[mode].option} is refused: {c.note}"


def check_config(config: Any) -> None:
    """Raise ``ValueError`` for the first feature the config turns on in a mode that refuses it."""
    for feature, f_axis in FEATURES.items():
        if f_axis.on is None or not f_axis.on(config):
            continue
        for mode, m_axis in MODES.items():
            if m_axis.on is not None and m_axis.on(config):
                error = refusal(feature, mode)
                if error is not None:
                    raise ValueError(error)


_MARKS = {
    Support.WORKS: "yes",
    Support.FALLS_BACK: "falls back",
    Support.REFUSED: "no",
    Support.NOT_APPLICABLE: "n/a",
}


def markdown() -> str:
    """The table as the documentation prints it, with its notes below."""
    head = ["feature", "eager", *(m.title for m in MODES.values())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for feature, f_axis in FEATURES.items():
        row = [f"{f_axis.title} (`{f_axis.option}`)", "yes"]
        for mode, m_axis in MODES.items():
            c = TABLE[feature][mode]
            mark = _MARKS[c.support]
            if c.note:
                notes.append(f"- **{f_axis.title}, {m_axis.title}** ({mark}): {c.note}.")
                mark += f" [{len(notes)}]"
            row.append(mark)
        lines.append("| " + " | ".join(row) + " |")
    numbered = [f"{i}. {n.removeprefix('- ')}" for i, n in enumerate(notes, start=1)]
    return "\n".join(lines) + "\n\n" + "\n".join(numbered) + "\n"
