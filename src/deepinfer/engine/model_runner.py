"""Model runner: turns scheduled chunks into one flat batch, runs the model, returns logits.

It owns the physical cache pools and knows tensors, never policy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.cache.forward_batch import ForwardBatch, RoutingTrace
from deepinfer.cache.host_tensors import long_tensor, to_device
from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.engine.graph_runner import DecodeGraphRunner
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.lora.registry import LoraRegistry
from deepinfer.models.base import CausalLM
from deepinfer.platforms import GraphCapture, cpu_blas
from deepinfer.speculative.schedule import SpsTable


@dataclass
class PreparedStep:
    """A step's tensors, built before its input token values are all known (async)."""

    chunks: list[ScheduledChunk]
    positions: torch.Tensor
    batch: ForwardBatch
    sample_rows: list[int]  # row of the returned logits for each sampling chunk (-1: none);
    # a drafted chunk's rows are sample_rows[i] .. sample_rows[i] + len(draft)
    prompt_rows: list[tuple[int, int]]  # (first row, count) of prompt-logprob logits per chunk
    graph_bucket: int | None = None  # replayed from this bucket's captured graph
    # model drafters: per chunk, (first row of the returned features, chunk offset of it);
    # the chunk's features cover its offsets from there to its end
    feature_rows: list[tuple[int, int]] | None = None
    # what the step was built from (tensor-parallel workers build the same step from them)
    seq_chunks: list[SeqChunk] | None = None
    padding: StepPadding | None = None
    # data-parallel attention: each chunk's rank; positions and batch are rank 0's part only
    # (the other ranks build theirs from their seq_chunks)
    ranks: list[int] | None = None

    def on_rank(self, rank: int) -> list[int]:
        """Indices of the chunks rank ``rank`` runs."""
        if self.ranks is None:
            return list(range(len(self.chunks))) if rank == 0 else []
        return [i for i, r in enumerate(self.ranks) if r == rank]


class ModelRunner:
    """Owns the physical cache pools and runs steps: ``prepare`` turns scheduled chunks into a
    ``PreparedStep`` (positions and ``ForwardBatch`` index tensors), ``execute`` runs the
    eager, compiled or graph-replayed model on it. Tensors only, never policy."""

    def __init__(
        self,
        model: CausalLM,
        layout: CacheLayout,
        *,
        num_blocks: int,
        num_slots: int,
        device: torch.device,
        ced_replay: int | None = None,
        compile_model: bool = False,
        compile_backend: str = "inductor",
        graph_capture: GraphCapture | None = None,
        max_model_len: int = 0,
        max_graph_batch: int = 0,
        feature_offsets: Callable[[int, int], list[int]] | None = None,
        feature_layers: tuple[int, ...] = (),
        kv_cache_dtype: torch.dtype | None = None,
        compile_cache_dir: Path | None = None,
        compile_missing: bool = True,
        compile_after_s: float | None = None,
        num_window_blocks: int | None = None,
        eager_step: Callable[..., Any] | None = None,
        batch_invariant: bool = False,
        record_routing: bool = False,
        lora: LoraRegistry | None = None,
    ) -> None:
        """``ced_replay``: with CED prefill, how many trailing prompt tokens run the decoder.
        ``compile_model``: run the step through ``torch.compile`` (``deepinfer.compile.compilation``).
        ``graph_capture``: replay pure-decode steps of up to ``max_graph_batch`` sequences
        from graphs captured by this platform backend (``DecodeGraphRunner``).
        ``feature_offsets``: (chunk tokens, drafts) -> chunk offsets whose draft features a
        step returns, for a model drafter (None: logits only), and ``feature_layers``: the
        layers whose entering hidden states they are, where the drafter chooses them (a
        separately trained DSpark head; empty: the model's own). ``kv_cache_dtype``: the pools'
        dtype (None: the model's compute dtype). ``compile_cache_dir``: where a CPU step
        compiled by Inductor is saved and found again (``precompiled.py``; None: not saved);
        ``compile_missing=False``: a step none of the saved variants covers runs eagerly,
        and with ``compile_after_s`` is compiled once such steps have taken that long.
        ``num_window_blocks``: the window pool's blocks when ``layout.bounded_window``.
        ``eager_step``: what an eager step calls instead of ``model.step`` (a platform's
        backend, such as the CPU's one-call decode). ``batch_invariant`` and
        ``record_routing``: every step's ``ForwardBatch`` says so (``invariant``, a
        ``RoutingTrace`` to record the MoE layers' choices in). ``lora``: the served
        adapters, whose slots each step's rows run with (``ForwardBatch.lora``)."""
        self.model = model
        self.batch_invariant = batch_invariant
        self.record_routing = record_routing
        self.lora = lora
        self.feature_offsets = feature_offsets
        self.feature_layers = feature_layers
        self.ced_replay = ced_replay
        self.forward = eager_step or model.step
        self.layout = layout
        self.device = device
        dtype = kv_cache_dtype or model.compute_dtype
        self.pools = allocate_pools(layout, num_blocks, num_slots, dtype, device, num_window_blocks)
        self.num_slots = num_slots
        self.null_block, self.null_slot = num_blocks, num_slots  # reserved by allocate_pools
        # the window pool's null block (reserved too) when the window is bounded
        self.null_window_block = num_window_blocks if layout.bounded_window else None
        # Compiled steps get padded metadata (never sizes 0 or 1) so shapes stay symbolic.
        self.padding: StepPadding | None = None
        if compile_model:
            self.forward = self._compiled_step(
                model, compile_backend, compile_cache_dir, compile_missing, compile_after_s
            )
            self.padding = StepPadding.for_pools(
                num_blocks, num_slots, null_window_block=self.null_window_block
            )
        self.graphs: DecodeGraphRunner | None = None
        # a model drafter's steps all return draft features, which no captured graph does
        if graph_capture is not None and feature_offsets is None:
            self.graphs = DecodeGraphRunner(
                self.forward,
                layout,
                self.pools,
                num_blocks,
                num_slots,
                max_model_len,
                max_graph_batch,
                graph_capture,
                device,
                self.null_window_block,
                lora=lora is not None,
                record_routing=record_routing,
            )

    @staticmethod
    def _compiled_step(
        model: CausalLM,
        backend: str,
        cache_dir: Path | None,
        compile_missing: bool,
        compile_after_s: float | None,
    ) -> Callable[..., Any]:
        """The step compiled ahead of time and saved (CPU + Inductor, with a cache directory;
        ``compile_missing=False``: only the saved variants, other steps eager, or compiled
        after ``compile_after_s`` of them), else compiled by ``torch.compile`` in this process."""
        device = next(model.parameters()).device
        if cache_dir is not None and backend == "inductor" and device.type == "cpu":
            from deepinfer.compile.precompiled import PrecompiledStep

            return PrecompiledStep(
                model, cache_dir, compile_missing=compile_missing, compile_after_s=compile_after_s
            )
        from deepinfer.compile.compilation import compile_step

        return compile_step(model, backend=backend)

    def idle_padding(self) -> StepPadding:
        """A step of one null token, for a data-parallel rank with nothing scheduled (its
        MoE layers still take part in the exchange)."""
        return StepPadding(self.null_block, self.null_slot, 1, null_window_block=self.null_window_block)

    def prepare(self, chunks: list[ScheduledChunk], data_parallel: bool = False) -> PreparedStep:
        """``data_parallel``: the chunks belong to several ranks (``ScheduledChunk.dp_rank``,
        grouped in rank order); the tensors are built for rank 0's chunks only."""
        seq_chunks, sample_rows, prompt_rows = [], [], []
        feature_rows: list[tuple[int, int]] | None = [] if self.feature_offsets is not None else None
        row = feature_row = 0
        # the usual chunk (no prompt logprobs, draft, features or CED replay) takes the short
        # path: at most its last row's logits (this loop runs for every sequence of every step)
        plain = feature_rows is None and self.ced_replay is None
        window_null = self.null_window_block  # a bounded window's tables are aligned in the builder
        for c in chunks:
            req = c.request
            replay_from, features = 0, None
            if plain and not c.draft and req.params.prompt_logprobs is None:
                prompt_rows.append((row, 0))
                offsets = [c.num_tokens - 1] if c.samples else []
                sample_rows.append(row if c.samples else -1)
                row += len(offsets)
            else:
                offsets = []
                prompt_len = len(req.prompt_token_ids)
                if req.params.prompt_logprobs is not None and c.start < prompt_len - 1:
                    # logits at positions p predict token p + 1 of the prompt
                    offsets = list(range(min(c.num_tokens, prompt_len - 1 - c.start)))
                prompt_rows.append((row, len(offsets)))
                if c.samples and c.draft:  # verification needs the logits of every drafted position
                    first = c.num_tokens - len(c.draft) - 1
                    sample_rows.append(row + len(offsets))
                    offsets += list(range(first, c.num_tokens))
                elif c.samples:
                    if not offsets or offsets[-1] != c.num_tokens - 1:
                        offsets.append(c.num_tokens - 1)
                    sample_rows.append(row + len(offsets) - 1)
                else:
                    sample_rows.append(-1)
                row += len(offsets)
                if self.ced_replay is not None and req.params.prompt_logprobs is None:
                    replay_from = max(0, prompt_len - self.ced_replay)  # prompt logprobs need every row
                if self.feature_offsets is not None and feature_rows is not None:
                    features = self.feature_offsets(c.num_tokens, len(c.draft))
                    feature_rows.append((feature_row, features[0] if features else c.num_tokens))
                    feature_row += len(features)
            seq_chunks.append(
                SeqChunk(
                    c.block_ids,
                    c.slot,
                    c.start,
                    c.num_tokens,
                    c.restore_overlap,
                    offsets,
                    replay_from,
                    features,
                    None if window_null is None else c.window_block_ids,
                    window_null,
                )
            )
        if data_parallel:
            ranks = [c.dp_rank for c in chunks]
            local = [sc for sc, r in zip(seq_chunks, ranks, strict=True) if r == 0]
            padding = self.padding if local else self.idle_padding()
            positions, batch = self._forward_batch(local, padding)
            return PreparedStep(
                chunks,
                positions,
                batch,
                sample_rows,
                prompt_rows,
                seq_chunks=seq_chunks,
                padding=padding,
                ranks=ranks,
            )
        # steps that return draft features run outside the captured graphs
        use_graphs = self.graphs is not None and feature_rows is None
        bucket = self.graphs.bucket_for(seq_chunks) if use_graphs and self.graphs is not None else None
        padding = self.graphs.padding(bucket) if self.graphs is not None and bucket else self._step_padding()
        positions, batch = self._forward_batch(seq_chunks, padding)
        if self.lora is not None:  # each row's adapter slot
            lengths = [s.num_tokens for s in seq_chunks]
            batch.lora = self.lora.step([c.request.lora for c in chunks], lengths, positions.shape[0])
            # a compiled or replayed step's form
            if batch.lora is not None and (self.padding is not None or bucket is not None):
                batch.lora_slots = batch.lora.slots.to(self.device)
        return PreparedStep(
            chunks,
            positions,
            batch,
            sample_rows,
            prompt_rows,
            graph_bucket=bucket,
            feature_rows=feature_rows,
            seq_chunks=seq_chunks,
            padding=padding,
        )

    def _forward_batch(
        self, seq_chunks: list[SeqChunk], padding: StepPadding | None
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """Positions and the ``ForwardBatch`` of ``seq_chunks``, with this engine's per-step
        switches in it."""
        positions, batch = build_forward_batch(self.layout, self.pools, seq_chunks, self.device, padding)
        batch.invariant = self.batch_invariant
        batch.routing = RoutingTrace() if self.record_routing else None
        if batch.feature_idx is not None:
            batch.feature_layers = self.feature_layers
        return positions, batch

    def _step_padding(self) -> StepPadding | None:
        """Compiled steps need padded metadata; a step the saved-step wrapper will run
        eagerly (nothing loaded, compile budget not spent) is prepared unpadded, which is
        faster."""
        if self.padding is None:
            return None
        needs_padding = getattr(self.forward, "needs_padding", None)
        return self.padding if needs_padding is None or needs_padding() else None

    def _slot_rows(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-slot compressor tensor (partial-group buffers, live overlap) and its
        rows per slot."""
        out = []
        for pools in self.pools:
            for comp in (pools.compressor, pools.indexer):
                if comp is None:
                    continue
                for t in (comp.buf_kv, comp.buf_gate, comp.ovl_kv, comp.ovl_gate):
                    if t is not None:
                        out.append((t, t.shape[0] // (self.num_slots + 1)))
        return out

    def save_slot(self, slot: int) -> list[torch.Tensor]:
        """A copy of a sequence slot's compressor state (speculative steps roll back to it)."""
        return [t[slot * r : (slot + 1) * r].clone() for t, r in self._slot_rows()]

    def restore_slot(self, slot: int, saved: list[torch.Tensor]) -> None:
        for (t, r), rows in zip(self._slot_rows(), saved, strict=True):
            t[slot * r : (slot + 1) * r] = rows

    def input_ids(self, step: PreparedStep, rank: int = 0) -> torch.Tensor:
        """Token ids of the step (of rank ``rank``'s chunks under data parallel); read at
        launch time so async steps see fresh tokens. Rank 0's are padded to its step's rows
        (another rank pads its own). A token not on the host yet is a null token: that of a
        request that failed after this step was scheduled, whose row's output is dropped."""
        ids, _ = self._token_ids(step, rank, None)
        if self.device.type == "cpu":
            return long_tensor(ids)
        return to_device(long_tensor(ids), self.device)

    def fed_input_ids(self, step: PreparedStep, fed: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` for a step launched before the last step's tokens reach the host:
        each token still missing here whose request ``fed`` maps (request identity -> row of
        the last step's sampled tokens) is taken from that row on the device by ``feed``.
        Returns the ids with those tokens null, and the (positions, rows) pairs to fill, both
        from one host buffer in one copy."""
        ids, pairs = self._token_ids(step, 0, fed)
        host = np.empty(len(ids) + 2 * len(pairs), dtype=np.int64)
        host[: len(ids)] = ids
        if pairs:
            host[len(ids) :] = np.asarray(pairs, dtype=np.int64).T.reshape(-1)
        moved = to_device(torch.from_numpy(host), self.device)
        return moved[: len(ids)], moved[len(ids) :].view(2, len(pairs))

    @staticmethod
    def feed(ids: torch.Tensor, pairs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Fill ``ids`` at ``pairs[0]`` with the last step's sampled ``tokens`` at ``pairs[1]``
        (device ops only; a failed row's ``INVALID_ROW`` becomes the null token)."""
        if pairs.shape[1]:
            ids.index_copy_(0, pairs[0], tokens.index_select(0, pairs[1]).clamp_min(0))
        return ids

    def _token_ids(
        self, step: PreparedStep, rank: int, fed: dict[int, int] | None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The step's token ids from the requests' host lists, and (with ``fed``) the
        (position, fed row) of each token the host does not hold yet."""
        ids: list[int] = []
        pairs: list[tuple[int, int]] = []
        chunks = step.chunks
        for i in step.on_rank(rank):
            c = chunks[i]
            req = c.request
            if c.num_tokens == 1 and not c.draft:  # a decode: the one token at its start
                start = c.start
                prompt, out = req.prompt_token_ids, req.output_token_ids
                k = start - len(prompt)
                if k < 0 or k < len(out):
                    ids.append(prompt[start] if k < 0 else out[k])
                    continue
                if fed is not None and k == len(out) and id(req) in fed:
                    pairs.append((len(ids), fed[id(req)]))
                ids.append(0)
                continue
            span = req.token_slice(c.start, c.end - len(c.draft))
            missing = c.end - len(c.draft) - c.start - len(span)
            ids += span
            if missing:
                if fed is not None and missing == 1 and id(req) in fed:
                    pairs.append((len(ids), fed[id(req)]))
                ids += [0] * missing
            ids += c.draft
        if rank == 0:
            ids += [0] * (step.positions.shape[0] - len(ids))  # padded null tokens
        return ids, pairs

    def steps_per_second(self, max_tokens: int, repeats: int = 3) -> SpsTable:
        """Steps per second at batch sizes 1, 2, 4, ... up to ``max_tokens`` tokens (for the
        hardware verification schedule), measured on steps of null tokens (they touch only
        the null block and slot). Decode cost at short context: the schedule needs the shape
        of the curve."""
        sizes, b = [], 1
        while b < max_tokens:
            sizes.append(b)
            b *= 2
        sizes.append(max_tokens)
        rates = []
        for size in sizes:
            padding = StepPadding(
                self.null_block, self.null_slot, size, null_window_block=self.null_window_block
            )
            positions, batch = build_forward_batch(self.layout, self.pools, [], self.device, padding)
            ids = torch.zeros(size, dtype=torch.long, device=self.device)
            best = float("inf")
            with torch.inference_mode():
                for _ in range(repeats):
                    start = time.perf_counter()
                    with self._blas_threads(size):  # as ``execute`` runs a step of this size
                        self.forward(ids, positions, batch)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    best = min(best, time.perf_counter() - start)
            rates.append(1.0 / best)
        return SpsTable(tuple(sizes), tuple(rates))

    def _blas_threads(self, rows: int) -> contextlib.AbstractContextManager[None]:
        """MKL's threads for a step of ``rows`` token rows (``cpu_blas``; CPU only). OpenMP's
        are set by ``PrecompiledStep`` around a compiled variant's call, after its guards."""
        return cpu_blas.threads_for_step(rows) if self.device.type == "cpu" else contextlib.nullcontext()

    @torch.inference_mode()
    def execute(
        self, step: PreparedStep, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits, and its draft features when the batch asked for them."""
        if step.graph_bucket is not None and self.graphs is not None:
            return self.graphs.run(step.graph_bucket, input_ids, step.positions, step.batch), None
        with self._blas_threads(input_ids.shape[0]):
            out = self.forward(input_ids, step.positions, step.batch)
        if isinstance(out, tuple):
            return out[0], out[1]
        return out, None
