"""Peak RAM while loading stays under ~1.3x the checkpoint size (tensors stream in one by one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from deepinfer.tiny import make_tiny_checkpoint

_MEASURE = textwrap.dedent(
    """
    import sys
    from deepinfer import load_model
    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))
    load_model(sys.argv[2])  # warm up: first-use allocations of torch/safetensors are not loading
    before = status_kib("VmRSS")
    model = load_model(sys.argv[1])
    # VmHWM, not ru_maxrss: ru_maxrss survives exec and would report the parent's size
    peak = status_kib("VmHWM")
    print(before, peak)
    """
)


def test_peak_ram_while_loading(tmp_path):
    path = make_tiny_checkpoint(
        tmp_path / "big", hidden_size=256, n_routed_experts=32, moe_intermediate_size=256, tokenizer=False
    )
    size_kib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1024
    assert size_kib > 100 * 1024  # big enough that the interpreter's own noise is small
    warm = make_tiny_checkpoint(tmp_path / "warm", tokenizer=False)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), str(warm)], capture_output=True, text=True, check=True
    )
    before, peak = (int(x) for x in out.stdout.split())
    assert (peak - before) < 1.3 * size_kib, (
        f"loading took {(peak - before) / size_kib:.2f}x the checkpoint size"
    )
