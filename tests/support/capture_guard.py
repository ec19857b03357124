"""A CPU stand-in for CUDA-graph capture's rules: code run under ``CaptureGuard`` on the
``meta`` device must neither read device values on the host nor copy host data in.

During ``torch.cuda.graph`` capture a host sync (``.item()``, ``nonzero``, ``bool(tensor)``,
``.tolist()``) or a host-to-device copy (``torch.tensor(..., device=)``, ``cpu.to(device)``,
an op mixing a host tensor into device work) either raises "operation not permitted when
stream is capturing" or bakes a stale value into the graph. The meta device has no values,
so the step runs its full shape logic; this guard records each forbidden operation with the
Python line that made it, so a test can name the culprit on a machine without a GPU.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
META = torch.device("meta")

# ops whose result size or value needs the device's data on the host (``bincount`` sizes its
# output by the ids' maximum, even with ``minlength``)
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}
# Python-level calls that make a host copy of device values, or build device data from host
# values; checked in ``_Functions`` because they never reach the dispatcher as such
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__}
_HOST_BUILDS = {torch.tensor, torch.as_tensor}


def _host_args() -> dict:
    """Arguments that live on the host by design, by op and position: Llama's
    ``paged_attention`` loops over ``span_meta`` (prefill spans) on the host; a decode step,
    the only kind captured, holds nothing but padding spans there."""
    import deepinfer.kernels.paged_attention  # noqa: F401  (registers the op)

    return {torch.ops.deepinfer.paged_attention.default: {6}}


def _python_kernel(func, args: list) -> Callable | None:
    """The Python function a ``torch.library.custom_op`` runs for ``args``' device (its kernel
    registered for that device, else its default), or None for other ops: the guard checks
    the ops inside a custom op, which the dispatcher would otherwise hide."""
    opdef = _maybe_get_opdef(func)
    if opdef is None:
        return None
    device = next((t.device.type for a in args for t in _flat(a) if isinstance(t, torch.Tensor)), None)
    if device in opdef._backend_fns and device not in opdef._disabled_kernel:
        return opdef._backend_fns[device]
    return opdef._init_fn


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _where() -> str:
    """The innermost frame outside torch and this file: the line to fix."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if "/torch/" not in path and not path.endswith("capture_guard.py"):
            return f"{path}:{frame.lineno} ({frame.line})"
    return "?"


class _Functions(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS and args and _on_device(args[0]):
            self.found.append(f"host read {func.__name__} at {_where()}")
        if func in _HOST_BUILDS:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self.found.append(f"host data copied in by torch.{func.__name__} at {_where()}")
        return func(*args, **kwargs)


def _flat(a) -> tuple:
    return tuple(a) if isinstance(a, list | tuple) else (a,)


class _Dispatch(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found
        self.host_args = _host_args()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kernel = _python_kernel(func, [*args, *kwargs.values()])
        if kernel is not None:  # walk the op's own ops, as a capture records them
            with self:
                return kernel(*args, **kwargs)
        if func in _SYNC_OPS and args and _on_device(args[0]):
            self.found.append(f"device sync {func} at {_where()}")
        if func is aten._to_copy.default and not _on_device(args[0]):
            if kwargs.get("device") is not None and kwargs["device"].type != "cpu":
                self.found.append(f"host tensor {tuple(args[0].shape)} copied in at {_where()}")
        if func is aten.copy_.default and _on_device(args[0]) and not _on_device(args[1]):
            self.found.append(f"host tensor {tuple(args[1].shape)} copied in at {_where()}")
        if not any(_on_device(t) for a in [*args, *kwargs.values()] for t in _flat(a)):
            return func(*args, **kwargs)  # host-only work (e.g. step metadata) is not captured
        host_ok = self.host_args.get(func, ())
        for i, a in enumerate([*args, *kwargs.values()]):
            if i in host_ok:
                continue
            for t in _flat(a):
                # a 0-d host tensor is a scalar argument, which capture allows
                if isinstance(t, torch.Tensor) and t.device != META and t.dim() > 0:
                    self.found.append(f"{func} reads a host tensor {tuple(t.shape)} at {_where()}")
        return func(*args, **kwargs)


class CaptureGuard:
    """``with CaptureGuard() as found: ...`` runs the block and lists what capture forbids."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._modes = (_Functions(self.found), _Dispatch(self.found))

    def __enter__(self) -> list[str]:
        for mode in self._modes:
            mode.__enter__()
        return self.found

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def guarded_capture(fn):
    """A graph backend for ``DecodeGraphRunner`` that checks capture's rules: one unguarded
    warm-up run (as a real capture makes: lazy per-device caches fill there), then the
    recorded run under the guard; any violation fails the capture."""
    try:
        fn()
    except Exception:  # reported by the guarded run below
        pass
    error: Exception | None = None
    with CaptureGuard() as found:
        try:
            out = fn()
        except Exception as e:  # a host read on meta raises after the guard recorded it
            error = e
    if found or error is not None:
        lines = list(dict.fromkeys(found)) + ([f"raised {error!r}"] if error is not None else [])
        raise AssertionError("not capturable:\n  " + "\n  ".join(lines))

    def replay():
        return out

    return replay
