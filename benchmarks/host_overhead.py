"""Host work per decode step: the engine driven over a stand-in forward that costs nothing.

On a GPU a decode step is host-bound when the host's work for a step (scheduling, building
the step's tensors, sampling's bookkeeping, output processing) outlasts the device's step.
This measures that work on the CPU: a tiny Llama whose forward is replaced by one that returns
a fixed logits buffer (no model math; a 256-token vocabulary keeps the argmax negligible),
B requests decoding together, synchronous and asynchronous engines.

Two figures per row:
- ``host us/step``: the step period with a free forward: all of it is host work;
- ``hidden at D``: with a forward that sleeps D ms (a device step of D ms that releases the
  GIL, as a CUDA launch's wait does), the step period minus D, as a share of the host work:
  0% means the host work adds to every device step, 100% that it hides behind it.

Run: ``python benchmarks/host_overhead.py [--batches 1 64 256] [--steps 64] [--device-ms 2]``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.engine import Engine
from deepinfer.models.loading import load_model
from deepinfer.sampling_params import SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

VOCAB = 256


class StandInForward:
    """A forward that returns fixed logits for the rows the step asks for, after sleeping
    ``device_s`` (the stand-in device step; ``slept`` adds up what the sleeps really took)."""

    def __init__(self, vocab: int, device_s: float) -> None:
        self.logits = torch.zeros(4096, vocab)
        self.logits[:, 7] = 1.0  # every row's argmax is one ordinary token
        self.device_s = device_s
        self.slept = 0.0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        if self.device_s:
            start = time.perf_counter()
            time.sleep(self.device_s)
            self.slept += time.perf_counter() - start
        rows = input_ids.shape[0] if batch.logits_idx is None else batch.logits_idx.shape[0]
        return self.logits[:rows]


def build_engine(checkpoint: Path, batch: int, asynchronous: bool, forward: StandInForward) -> Engine:
    model = load_model(checkpoint)
    config = EngineConfig(
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(1024, batch * 16),
        max_model_len=2048,
        compile=False,
        async_scheduling=asynchronous,
        num_cache_blocks=batch * 8 + 16,
    )
    engine = Engine(model, config)
    engine.runner.forward = forward
    return engine


def step_period(
    engine: Engine, forward: StandInForward, batch: int, steps: int, params: SamplingParams
) -> tuple[float, float]:
    """Seconds per step over ``steps`` pure-decode steps of ``batch`` requests (prefill and
    the first steps are run first and not counted), and the stand-in device's seconds per
    step in that time."""
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i + j) % (VOCAB - 2) for j in range(8)], params)
    for _ in range(4):  # prefill, then the pipeline fills
        engine.step()
    forward.slept = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    period = (time.perf_counter() - start) / steps
    device = forward.slept / steps
    while engine.has_unfinished():
        engine.step()
    return period, device


def measure(
    checkpoint: Path, batch: int, asynchronous: bool, steps: int, device_s: float, sampled: bool
) -> tuple[float, float]:
    """(seconds per step, the stand-in device's seconds per step) of one engine."""
    forward = StandInForward(VOCAB, device_s)
    engine = build_engine(checkpoint, batch, asynchronous, forward)
    extra = {"temperature": 0.8, "top_p": 0.9, "seed": 1} if sampled else {"temperature": 0.0}
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, **extra)
    try:
        return step_period(engine, forward, batch, steps, params)
    finally:
        engine.shutdown()
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--device-ms", type=float, default=2.0, help="the stand-in device step")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    parser.add_argument("--label", default="", help="a column naming the code measured (A/B runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(
            Path(tmp) / "llama", arch="llama", vocab_size=VOCAB, tokenizer=False
        )
        print(
            f"| code | batch | sampling | engine | host us/step | period at {args.device_ms:g} ms | hidden |"
        )
        print("|---|---|---|---|---|---|---|")
        for batch in args.batches:
            for sampled in (False, True):
                for asynchronous in (False, True):
                    free = min(
                        measure(checkpoint, batch, asynchronous, args.steps, 0.0, sampled)[0]
                        for _ in range(args.repeats)
                    )
                    loaded, device = min(
                        measure(checkpoint, batch, asynchronous, args.steps, args.device_ms / 1e3, sampled)
                        for _ in range(args.repeats)
                    )
                    added = loaded - device  # the host work the device step did not hide
                    hidden = min(1.0, max(0.0, 1.0 - added / free)) if free > 0 else 0.0
                    print(
                        f"| {args.label} | {batch} | {'seeded top-p' if sampled else 'greedy'} "
                        f"| {'async' if asynchronous else 'sync'} | {free * 1e6:.0f} "
                        f"| {loaded * 1e3:.2f} ms | {hidden:.0%} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
