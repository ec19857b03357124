"""What a weight update costs an RL loop on SmolLM2-135M (CPU), beside rebuilding the engine
from disk:

- ``sync_weights``: an engine over the trainer's module (``LLM.from_model``) after an AdamW
  step wrote every parameter in place: its packed copies are made again, nothing is copied
  in or read from disk;
- ``update_weights``: a checkpoint engine given the new tensors by name (copied in, then the
  same remaking);
- ``load_weights_from_disk``: the same engine reading a saved checkpoint of them;
- rebuild: writing that checkpoint, then ``LLM(path)`` and its first one-token request (what
  a loop without weight updates does each step).

Each is the median of ``--repeats`` runs; after each, a greedy request checks the engine
computes with the new weights (its tokens equal the rebuilt engine's).

    python benchmarks/rl_weight_sync.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.loading import load_model
from deepinfer.weights.catalog import resolve_model
from deepinfer.weights.writer import write_safetensors

MODEL = "smollm2-135m"
PROMPT = list(range(1000, 1032))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _median(fn: Callable[[], object], repeats: int, before: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.randint(2, 40000, (2, 32))
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _save(model: torch.nn.Module, source: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, target / f.name)
    write_safetensors({n: t.detach().clone() for n, t in model.state_dict().items()}, target)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    source = resolve_model(MODEL)
    model = load_model(MODEL, requires_grad=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    follower = LLM.from_model(model, tokenizer=source)
    _tokens(follower)  # compiled and warm
    train = lambda: _train_step(model, optimizer)  # noqa: E731
    sync_s = _median(follower.sync_weights, args.repeats, train)
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "ckpt"
        _save(model, source, saved)
        engine = LLM(saved)
        _tokens(engine)
        state = [(n, t.detach().clone()) for n, t in model.state_dict().items()]

        def next_weights() -> None:
            nonlocal state
            train()
            state = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
            _save(model, source, saved)

        update_s = _median(lambda: engine.update_weights(state), args.repeats, next_weights)
        disk_s = _median(lambda: engine.load_weights_from_disk(saved), args.repeats, next_weights)
        write_s = _median(lambda: _save(model, source, saved), args.repeats, lambda: None)
        rebuilt: list[LLM] = []

        def rebuild() -> None:
            rebuilt.append(LLM(saved))
            _tokens(rebuilt[-1])

        rebuild_s = _median(rebuild, args.repeats, lambda: rebuilt.clear())
        fresh = _tokens(rebuilt[-1])
        assert _tokens(engine) == fresh and _tokens(follower) == fresh, "an update did not land"
    print(f"{'way':<44} {'seconds':>10} {'vs rebuild':>11}")
    total_rebuild = write_s + rebuild_s
    rows = [
        ("sync_weights (engine over the trainer's module)", sync_s),
        ("update_weights (tensors by name)", update_s),
        ("load_weights_from_disk", disk_s),
        ("rebuild: write checkpoint + LLM(path) + 1st request", total_rebuild),
    ]
    for name, seconds in rows:
        print(f"{name:<44} {seconds:>10.4f} {seconds / total_rebuild:>10.3f}x")
    print(f"(of the rebuild: writing {write_s:.3f} s, LLM(path) and its first request {rebuild_s:.3f} s)")


if __name__ == "__main__":
    main()
