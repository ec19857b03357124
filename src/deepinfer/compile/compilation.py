"""``torch.compile`` wiring (docs/architecture.md, 'Compilation, passes and ops'): the model's
step compiled by Inductor with the token dimension dynamic, and our FX pass manager installed as
Inductor's post-grad custom pass.

The pass manager is a ``CustomGraphPass``: Inductor's FX-graph cache keys on its ``uuid()``,
which hashes the source of every installed pass, so editing a pass invalidates cached graphs
and nothing else does. Each pass returns how many subgraphs it rewrote; the manager logs the
counts and keeps them for tests (``PassManager.counts``).

The custom ops the model calls (``deepinfer::routed_experts``, ``deepinfer::sinkhorn``) are
opaque to the tracer, so a V4/V4.1 step traces as one graph with no graph breaks.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.models.base import CausalLM
from deepinfer.models.layers.rope import Rotary

logger = logging.getLogger(__name__)

GraphPass = Callable[[torch.fx.Graph], int]  # rewrites in place, returns the match count


class PassManager(CustomGraphPass):
    """Runs ``passes`` in order on each post-grad graph Inductor compiles."""

    def __init__(self, passes: Sequence[GraphPass] = ()) -> None:
        self.passes = list(passes)
        self.counts: Counter[str] = Counter()
        self.graphs_seen = 0
        self.record = False  # keep a copy of each graph as it was before the passes
        self.recorded_before: list[torch.fx.Graph] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs_seen += 1
        if self.record:
            copy = torch.fx.Graph()
            copy.output(copy.graph_copy(graph, {}))
            self.recorded_before.append(copy)
        for graph_pass in self.passes:
            matched = graph_pass(graph)
            self.counts[graph_pass.__name__] += matched
            logger.info("compile pass %s: %d match(es)", graph_pass.__name__, matched)
        graph.lint()

    def uuid(self) -> bytes:
        digest = hashlib.sha256(b"deepinfer-pass-manager-v1")
        for graph_pass in self.passes:
            digest.update(inspect.getsource(graph_pass).encode())
        return digest.digest()


def default_passes(device: torch.device | None = None) -> list[GraphPass]:
    """The passes installed by default for models on ``device``: the whole ``compile_passes``
    pipeline where the fused ops have fast kernels (CUDA: Triton attention, grouped-GEMM
    experts). On the CPU: the verification fusion, memory-bound ``bmm``s as reductions
    (``reduce_small_bmm``), weight projections on packed copies (``use_packed_linear``,
    where its C++ op built), the attention cores over pool gathers as a C++ op reading the
    pool rows itself (``use_row_sink_attention``) and the routed experts, Sinkhorn and CSA
    indexer as C++ ops (``use_native_cpu_ops``), where those ops built; the MoE fusion and
    ``deepinfer::sink_attention`` (after the gathers) stay off there, because Inductor's own
    C++ fusion of the plain MoE gate and of gathers into attention measured faster than those
    (benchmarks/RESULTS.md). ``compile_step(passes=...)`` overrides the choice."""
    from deepinfer.compile_passes import (
        PASSES,
        fuse_rejection_sampling,
        reduce_small_bmm,
        use_native_cpu_ops,
        use_packed_linear,
        use_row_sink_attention,
    )
    from deepinfer.kernels.cpu import linear_op as cpu_linear_op
    from deepinfer.kernels.cpu import step_ops as cpu_step_ops

    if device is not None and device.type == "cpu":
        native = cpu_step_ops.available()  # the ops those rewrites insert are registered
        passes: list[GraphPass] = [fuse_rejection_sampling]
        if native:  # before reduce_small_bmm, which rewrites the attention cores' bmms
            passes.append(use_row_sink_attention)
        passes.append(reduce_small_bmm)
        if cpu_linear_op.available():  # the op the rewrite inserts is registered
            passes.append(use_packed_linear)
        if native:
            passes.append(use_native_cpu_ops)
        return passes
    return list(PASSES)


# Graph variants one step function may compile before dynamo gives up and runs eagerly.
RECOMPILE_LIMIT = 64


def mark_step_dynamic(input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> None:
    """Mark every content-dependent size dynamic before the first trace. ``dynamic=True``
    covers the step's direct tensor arguments only; tensors inside the ForwardBatch would be
    traced static first and recompiled once each. Sizes 0 and 1 still specialise, which is
    why the runner pads the metadata (``StepPadding``).

    The metadata's fixed sizes (the window, a group's ratio) stay symbolic: marked static,
    Inductor vectorised the tiny V4's window attention along its 8 window rows, loading the
    gathered rows one element at a time, which made the throughput benchmark slower
    (benchmarks/RESULTS.md). The pools are ``mark_pools_static``'s."""
    torch._dynamo.maybe_mark_dynamic(input_ids, 0)
    torch._dynamo.maybe_mark_dynamic(positions, 0)
    for t, dims in batch.metadata():
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)


def mark_pools_static(batch: ForwardBatch) -> None:
    """Mark the cache pools' widths static before a trace; their row counts stay symbolic,
    so a saved step serves any cache size. ``dynamic=True`` would trace the widths as symbols,
    and symbolic widths made sympy the trace's main cost (static widths trace a V4.1 step
    several times faster; benchmarks/RESULTS.md). The pools persist across steps, so marking
    them once per pool list is enough; the call is not free."""
    for t in batch.pool_tensors():
        for d in range(1, t.dim()):
            torch._dynamo.mark_static(t, d)


def prepare_model(model: CausalLM, mark_static: bool = True) -> None:
    """Create per-device tables the step would otherwise create lazily inside the trace;
    ``mark_static`` (before a trace) keeps their sizes constants in the graph."""
    device = next(model.parameters()).device
    tables = list(model.step_tables(device))  # the model's own tables
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Rotary):  # fixed-size table
                tables.append(value.inv_freq(device))
    if mark_static:
        for table in tables:
            torch._dynamo.mark_static(table)


def inductor_options(manager: PassManager, device: torch.device | None = None) -> dict[str, object]:
    """Inductor settings of every compiled step: our passes, and no ``reorder_for_locality``.
    That pass moves a read of a cache pool below the write that follows it in the model (the
    compressor reads its state rows, then stores new ones); Inductor then cannot write the
    pool in place and copies the whole pool twice per write, every step, which for a large
    cache costs more than the rest of a decode step.

    On the CPU the step's wrapper is C++ (``cpp_wrapper``): the Python wrapper spends part of
    every decode step allocating buffers, checking strides and calling ~100 kernels, and the
    C++ one cuts the step's forward time (benchmarks/RESULTS.md). That wrapper calls our CPU
    ops through their C shims (``cpu_c_shims``). CPU loops go parallel from
    ``CPU_MIN_CHUNK_SIZE`` elements a thread."""
    options: dict[str, object] = {"post_grad_custom_post_pass": manager, "reorder_for_locality": False}
    if device is not None and device.type == "cpu":
        options["cpp.min_chunk_size"] = CPU_MIN_CHUNK_SIZE
        if cpu_cpp_wrapper():
            options["cpp_wrapper"] = True
            # no size/stride check of every input and op output at every call (hundreds a
            # tiny-V4 step, each building a message stream; measured: benchmarks/RESULTS.md).
            # Dynamo's guards check the inputs; our ops' fakes give their outputs' exact
            # layouts, which the Python-wrapper compiles of the test suite still assert
            options["size_asserts"] = False
            shims = cpu_c_shims()
            if shims:
                options["aot_inductor.custom_ops_to_c_shims"] = shims
    return options


def cpu_c_shims() -> dict:
    """Our C++ CPU ops' C shims (Inductor's ``aot_inductor.custom_ops_to_c_shims``), their
    libraries loaded first, which makes the shims' symbols global. A C++ wrapper then calls each
    op's kernel directly, without the dispatcher's per-call schema lookup and argument boxing,
    which shortens small decode steps most (benchmarks/RESULTS.md). Empty where the ops did not
    build."""
    from deepinfer.kernels.cpu import linear_op as cpu_linear_op
    from deepinfer.kernels.cpu import step_ops as cpu_step_ops

    return {**cpu_linear_op.c_shims(), **cpu_step_ops.c_shims()}


# Inductor runs a CPU loop nest in parallel only when it holds at least this many elements per
# thread, judged by the sizes of the step that was traced (Inductor's default: 512). The steps
# a variant serves differ from the traced one, and ours are small: 64 gave the best tiny-V4
# offline throughput of the values tried (benchmarks/RESULTS.md). Small steps run the
# parallel loops on one thread anyway (``cpu_blas.openmp_for_step``).
CPU_MIN_CHUNK_SIZE = 64


CPP_WRAPPER_ENV = "DEEPINFER_CPU_CPP_WRAPPER"


def cpu_cpp_wrapper() -> bool:
    """Whether CPU steps compile with the C++ wrapper: yes unless ``$DEEPINFER_CPU_CPP_WRAPPER``
    is ``0``. The Python wrapper compiles faster and runs slower (benchmarks/RESULTS.md): the
    test suite uses it, where it compiles many models but runs each for a few steps."""
    value = os.environ.get(CPP_WRAPPER_ENV, "1").strip().lower()
    if value not in ("0", "1"):
        raise ValueError(f"${CPP_WRAPPER_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def configure_dynamo() -> None:
    """Process-wide dynamo settings every compiled step is traced under. Duck sizing is off:
    two metadata tensors that happen to share a size must not be traced as always equal.
    Floats are specialised: the model's floats (eps, scales, limits) are constants, and traced
    as symbols they make dynamo restart its analysis once per compile and add guards."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch.fx.experimental._config.use_duck_shape = False
    torch._dynamo.config.specialize_float = True


class PostGradBackend:
    """A ``torch.compile`` backend that stops after Inductor's post-grad passes (ours
    included) and runs the resulting ATen graph eagerly: no code generation, so it is much
    faster to compile than Inductor. The graphs it keeps are exactly what
    Inductor would lower; tests count pass matches with it and ``deepinfer dump-graphs``
    prints them. Select it with ``compile_backend="post_grad"``."""

    def __init__(self, manager: PassManager) -> None:
        self.manager = manager
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        return aot_autograd(fw_compiler=self._forward, decompositions=select_decomp_table())(
            gm, example_inputs
        )

    def _forward(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._guards import detect_fake_mode
        from torch._inductor import config
        from torch._inductor.fx_passes.post_grad import post_grad_passes
        from torch._inductor.virtualized import V

        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            with config.patch(post_grad_custom_post_pass=self.manager):
                post_grad_passes(gm, is_inference=True)
        gm.recompile()
        self.graphs.append(gm)
        return gm


def compile_step(
    model: CausalLM, backend: str = "inductor", passes: Sequence[GraphPass] | None = None
) -> Callable[..., torch.Tensor]:
    """A compiled ``model.step(input_ids, positions, batch)`` with every content-dependent size
    symbolic, traced under ``configure_dynamo``'s process-wide settings. With the runner's
    ``StepPadding`` (no size below 2, one-token steps padded to two) an engine workload compiles one graph;
    guards the model's own shape logic adds (e.g. the indexer's ``min(top-k, entries)``) may
    add a variant the first time they flip."""
    device = next(model.parameters()).device
    manager = PassManager(default_passes(device) if passes is None else passes)
    options = inductor_options(manager, device) if backend == "inductor" else None
    post_grad = PostGradBackend(manager) if backend == "post_grad" else None
    configure_dynamo()
    prepare_model(model)
    compiled = torch.compile(model.step, backend=post_grad or backend, dynamic=True, options=options)

    marked: list[object] = []  # the pool list last marked static

    def step(input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mark_step_dynamic(input_ids, positions, batch)
        if not marked or marked[0] is not batch.pools:
            mark_pools_static(batch)
            marked[:] = [batch.pools]
        return compiled(input_ids, positions, batch)

    step.pass_manager = manager  # type: ignore[attr-defined]
    step.post_grad = post_grad  # type: ignore[attr-defined]  (graphs, with backend="post_grad")
    return step
