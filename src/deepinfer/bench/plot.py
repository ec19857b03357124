"""``bench latency --plot``: output tokens/s against concurrency, one line per engine. Its own
module so matplotlib is imported only when a plot is asked for."""

from __future__ import annotations


def plot_latency(rows: list[tuple[str, int, dict]], model_name: str, out: str) -> None:
    """Write ``rows`` (engine, concurrency, figures with ``tok_s``) as a PNG to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in ("deepinfer", "transformers"):
        xs = [c for n, c, _ in rows if n == name]
        ys = [r["tok_s"] for n, _, r in rows if n == name]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{model_name}: output tokens/s (prefill + decode)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
