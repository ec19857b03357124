"""One cold start for ``bench startup``: load a model, generate one token, print the seconds
since the clock started and the peak RSS (MiB). Run as a script file
(``python -P startup_worker.py KIND MODEL COMPILE``), not with ``-m``: ``-m`` would import
``deepinfer`` (and torch) before the clock starts, hiding the imports the figure counts.

KIND is ``deepinfer`` or ``transformers``; COMPILE is deepinfer's ``--compile``
(``auto``, ``on`` or ``off``)."""

import sys
import time

_START = time.perf_counter()


def main(kind: str, model: str, compile_: str) -> None:
    """Time one process's start to its first token (``_START`` is the clock's start)."""
    compile_step = {"on": True, "off": False, "auto": None}[compile_]
    import torch

    if kind == "deepinfer":
        from deepinfer import LLM, SamplingParams

        llm = LLM(model, compile=compile_step)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    else:
        from deepinfer.bench.workloads import load_transformers_peer
        from deepinfer.weights.catalog import resolve_model

        peer = load_transformers_peer(resolve_model(model))
        with torch.no_grad():
            peer.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=1)
    from deepinfer.bench.workloads import peak_rss_mib

    print(time.perf_counter() - _START, peak_rss_mib())


if __name__ == "__main__":
    main(*sys.argv[1:4])
