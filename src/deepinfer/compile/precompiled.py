"""A compiled model step saved to disk and loaded by later processes (docs/architecture.md,
'Compilation, passes and ops').

``torch.compile`` caches Inductor's code on disk, but dynamo traces the model's ~2,000 ops
again in every process, which delays a fresh process's first compiled step. Here the
step is compiled ahead of time with dynamo's ``aot_compile`` (the whole graph: traced
bytecode, guards and the Inductor artefact) and saved with ``save_compiled_function``; a
later process loads it (``torch.compiler.load_compiled_function``) and traces nothing.

Every call still checks the saved guards. Their trees are built with dynamo's recursive dict
tags (``_TAGGED_GUARDS``): an ``nn.Module`` subtree whose ``__dict__`` (and its modules',
parameters' and buffers' dicts) is unchanged since the last check is skipped, so the ~160
parameter tensors of a tiny-V4 step are not re-examined every step. Dynamo treats the
tensors under such a subtree as immutable: replacing a parameter (``module.weight = ...``)
changes a dict and is caught, resizing one through ``p.data = t`` is not; the engine does
neither after loading. A step the guards reject (a shape specialisation the
first trace did not cover, e.g. the indexer's ``min(top-k, entries)``) is compiled as a new
variant and saved beside the others, so a loaded artefact is never wrong, and the next
process loads every variant its predecessors needed.

Artefacts are keyed by everything that changes the compiled code: the torch and Python
versions, deepinfer's own sources, the CPU's vector ISA (the artefact holds C++ built for
it), the model's class, config, parameter shapes and dtypes, and the installed passes. The
weights are graph inputs, not constants, so one artefact serves any checkpoint of the same
configuration. The Inductor artefact is its generated source: the first load on a machine
whose Inductor cache is empty builds it (about as long as a cold compile's code generation).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import deepinfer.compile.compilation as compilation
from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.compile.compilation import (
    GraphPass,
    PassManager,
    configure_dynamo,
    cpu_c_shims,
    cpu_cpp_wrapper,
    inductor_options,
    mark_pools_static,
    mark_step_dynamic,
    prepare_model,
)
from deepinfer.compile.cpp_wrapper_args import cache_scalar_args
from deepinfer.compile.gc_heap import freeze_long_lived
from deepinfer.compile.pregraph_calls import use_plain_helpers
from deepinfer.models.base import CausalLM
from deepinfer.platforms import cpu_blas

logger = logging.getLogger(__name__)

FORMAT = b"deepinfer-precompiled-step-v1"
# guard trees built with nn.Module subtrees skipped while their dicts are unchanged: the guard
# check of every step, cold after the step before or warm, gets cheaper (benchmarks/RESULTS.md)
_TAGGED_GUARDS = {"use_recursive_dict_tags_for_guards": True}
_SOURCE_ROOTS = ("deepinfer", "deepinfer.kernels", "deepinfer.compile_passes")
# the step runs the C++ kernels of ``kernels/cpu`` too: their sources count as the Python ones do
_SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def default_cache_dir(checkpoint: Path | None) -> Path:
    """Beside the checkpoint (``<checkpoint>/.deepinfer-compiled``) where that directory is
    writable, else ``$XDG_CACHE_HOME/deepinfer/compiled`` (``~/.cache`` by default)."""
    if checkpoint is not None and os.access(checkpoint, os.W_OK):
        return checkpoint / ".deepinfer-compiled"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "deepinfer" / "compiled"


# Sources that never run inside the compiled step: editing them keeps saved artefacts. The
# list names what to leave out rather than what to keep, so a new module the step calls is
# covered without anyone remembering to add it.
_NOT_IN_STEP = (
    "bench",
    # the step-metadata builder: builds the step's inputs on the host; a new input layout is
    # caught by the saved variants' guards, which then compile one for it
    "cache/full_attention_meta.py",
    "cache/group_meta.py",
    "cache/host_tensors.py",
    "cache/native_group_meta.py",
    "cache/step_chunks.py",
    "cache/step_metadata.py",
    "cache/token_layout.py",
    "chat",
    "cli",
    "compile/gc_heap.py",
    "compile/graph_dump.py",
    "compile/pregraph_calls.py",  # the loaded bytecode's size helpers, not the compiled code
    "engine",
    "llm.py",
    "outputs.py",
    "platforms/cpu_blas.py",  # sets MKL's and OpenMP's threads around a step, never inside one
    "sampling/sampler.py",  # samples a step's logits on the host, after the step
    "sampling_params.py",
    "server",
    "speculative",
    "tiny.py",
)


def _source_digest() -> bytes:
    """Digest of the sources (Python, and the kernels' C++) of deepinfer, its kernels and its
    passes that the step can run (all but ``_NOT_IN_STEP``)."""
    import importlib

    digest = hashlib.sha256()
    for name in _SOURCE_ROOTS:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
            relative = path.relative_to(root)
            if name == "deepinfer" and (
                relative.parts[0] in _NOT_IN_STEP or relative.as_posix() in _NOT_IN_STEP
            ):
                continue
            digest.update(str(relative).encode())
            digest.update(path.read_bytes())
    return digest.digest()


def artefact_key(model: CausalLM, manager: PassManager) -> str:
    """Hex digest naming the artefact of ``model``'s step compiled with ``manager``'s passes."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    device = next(model.parameters()).device
    digest = hashlib.sha256(FORMAT)
    for part in (
        torch.__version__,
        sys.version,
        str(pick_vec_isa()) if device.type == "cpu" else device.type,
        f"cpp_wrapper={cpu_cpp_wrapper()}" if device.type == "cpu" else "",
        type(model).__qualname__,
        repr(model.config),
    ):
        digest.update(part.encode() + b"\0")
    digest.update(_source_digest())
    digest.update(manager.uuid())
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type};".encode())
    return digest.hexdigest()[:32]


class PrecompiledStep:
    """``model.step(input_ids, positions, batch)`` from compiled variants saved in
    ``cache_dir``. The first call loads every saved variant of this model's key; a step that
    none of their guards accept is compiled ahead of time as a new variant and saved beside
    them, so the next process starts with it, or, with ``compile_missing=False``, runs eagerly.

    ``compile_after_s`` (with ``compile_missing=False``; the CPU's default mode) buys the
    compile the way the ski-rental rule buys skis: steps no variant covers run eagerly until
    they have taken that many seconds, about what one compile costs, and the next such step
    compiles a variant. A short run then never stalls on a compile it cannot earn back, and a
    long one loses at most the compile's cost to eager steps (total time within 2x of the
    better choice made in hindsight). The count restarts after each compile, so a rare step
    shape buys its own variant only once it has cost as much.

    ``loaded`` / ``compiled`` count variants, ``eager_steps`` / ``eager_seconds`` the steps no
    variant took and their time since the last compile (tests, logs)."""

    def __init__(
        self,
        model: CausalLM,
        cache_dir: Path,
        passes: Sequence[GraphPass] | None = None,
        compile_missing: bool = True,
        compile_after_s: float | None = None,
    ) -> None:
        device = next(model.parameters()).device
        self.model = model
        self.compile_missing = compile_missing
        self.compile_after_s = compile_after_s
        self.eager_steps = 0
        self.eager_seconds = 0.0
        self._padded = True  # the last ``needs_padding`` answer (callers that never ask pad)
        self.cache_dir = Path(cache_dir)
        self.pass_manager = PassManager(compilation.default_passes(device) if passes is None else passes)
        self.key = artefact_key(model, self.pass_manager)
        self.loaded = 0
        self.compiled = 0
        # C++-wrapper entry functions given cached scalar arguments (cpp_wrapper_args.py)
        self.scalar_args_cached = 0
        self.plain_helpers = 0  # variants whose pregraph helpers run unwrapped (pregraph_calls.py)
        self._variants: list[Any] | None = None  # AOTCompiledFunction, guards checked here
        self._last = 0  # the variant the previous step ran: tried first

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> Any:
        args = (self.model, input_ids, positions, batch)
        if self._variants is None:
            self._variants = self._load()
            if self._variants:
                freeze_long_lived()  # the model and its compiled steps live as long as the process
        n = len(self._variants)
        for i in (*range(self._last, n), *range(self._last)):
            if self._variants[i].guard_check(*args):
                self._last = i
                return self._run(i, args)
        if not self._compile_now():
            if not self.eager_steps:  # once: say why the default mode is not running compiled
                logger.info(
                    "no saved compiled variant accepts this step (guards on shapes, the thread "
                    "count, ...); running it eagerly%s",
                    ""
                    if self.compile_after_s is None
                    else f" until such steps have taken {self.compile_after_s:g} s, then compiling one",
                )
            self.eager_steps += 1
            start = time.perf_counter()
            out = self.model.step(input_ids, positions, batch)
            self.eager_seconds += time.perf_counter() - start
            return out
        self._variants.append(self._compile(args, n))
        freeze_long_lived()
        self.eager_seconds = 0.0
        self._last = n
        return self._run(n, args)

    def _run(self, index: int, args: tuple) -> Any:
        """Call a variant whose guards passed; a small step's kernels run on this thread
        alone (``cpu_blas.openmp_for_step``: after the guards, which record the thread count)."""
        with cpu_blas.openmp_for_step(args[1].shape[0]):
            return self._variants[index](*args)

    def needs_padding(self) -> bool:
        """Whether the next step should be prepared with padded metadata: a compiled variant
        may run it (one is saved, or this step may be compiled). A step that will run eagerly
        is faster unpadded. Before the first call has loaded the saved
        variants (inside the step's inference mode, which their guards check), it looks for
        them on disk. An asynchronous engine may prepare a step before the previous one spends
        the budget; such a step runs eagerly and the next, padded one compiles."""
        saved = bool(self._variants) if self._variants is not None else self.has_saved_variants()
        self._padded = saved or self.compile_missing or self._budget_spent()
        return self._padded

    def _budget_spent(self) -> bool:
        return self.compile_after_s is not None and self.eager_seconds >= self.compile_after_s

    def _compile_now(self) -> bool:
        """Whether a step no variant covers is compiled (else it runs eagerly)."""
        if self.compile_missing:
            return True
        if not (self._budget_spent() and self._padded):
            return False
        logger.info(
            "steps no compiled variant covers have run eagerly for %.1f s (compile_after_s=%g): "
            "compiling one",
            self.eager_seconds,
            self.compile_after_s,
        )
        return True

    def has_saved_variants(self) -> bool:
        """Whether an earlier process saved a compiled variant of this model's step here."""
        return self.cache_dir.is_dir() and bool(self.variant_paths())

    def variant_paths(self) -> list[Path]:
        """The saved variants of this model's key, oldest first."""
        found = [p for p in self.cache_dir.glob(f"{self.key}-*.step") if p.stem.rsplit("-", 1)[1].isdigit()]
        return sorted(found, key=lambda p: int(p.stem.rsplit("-", 1)[1]))

    def _load(self) -> list[Any]:
        variants = []
        paths = self.variant_paths() if self.cache_dir.is_dir() else []
        if paths:
            prepare_model(self.model, mark_static=False)
            if next(self.model.parameters()).device.type == "cpu":
                cpu_c_shims()  # a C++ wrapper's library resolves our ops' shims as it loads
        for path in paths:
            try:
                with path.open("rb") as f, torch._dynamo.config.patch(_TAGGED_GUARDS):
                    compiled = torch.compiler.load_compiled_function(f, external_data={"model": self.model})
            except Exception as exc:  # a damaged artefact is compiled again, never fatal
                logger.warning("compiled step %s unusable (%s); skipped", path, exc)
                continue
            compiled.disable_guard_check()  # __call__ checks them itself
            self.scalar_args_cached += cache_scalar_args(compiled)
            self.plain_helpers += use_plain_helpers(compiled)
            variants.append(compiled)
        self.loaded = len(variants)
        if variants:
            logger.info("loaded %d compiled step variant(s) from %s", len(variants), self.cache_dir)
        return variants

    def _compile(self, args: tuple, index: int) -> Any:
        """Trace and compile the whole step for these inputs, then save it (best effort)."""
        model, input_ids, positions, batch = args
        logger.info("compiling a step variant (%d so far)", index)
        configure_dynamo()
        prepare_model(model, mark_static=True)
        mark_step_dynamic(input_ids, positions, batch)
        mark_pools_static(batch)
        options = inductor_options(self.pass_manager, input_ids.device)
        compiled_fn = torch.compile(model.step, fullgraph=True, dynamic=True, options=options)
        with torch._dynamo.config.patch(_TAGGED_GUARDS):
            compiled = compiled_fn.aot_compile(((input_ids, positions, batch), {}))
        self.compiled += 1
        partial: Path | None = None
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            number = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in self.variant_paths()), default=-1)
            path = self.cache_dir / f"{self.key}-{number}.step"
            # written whole under another name first: replica processes may compile the same
            # variant at once, and a reader must never load half a file
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            compiled.save_compiled_function(str(partial), external_data={"model": model})
            os.replace(partial, path)
            logger.info("compiled step variant saved to %s", path)
        except Exception as exc:
            logger.warning("compiled step variant not saved in %s (%s)", self.cache_dir, exc)
            if partial is not None:
                partial.unlink(missing_ok=True)  # nothing half-written left behind
        compiled.disable_guard_check()
        self.scalar_args_cached += cache_scalar_args(compiled)
        self.plain_helpers += use_plain_helpers(compiled)
        return compiled
