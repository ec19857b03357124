"""Small CPU steps run MKL (and, in a compiled step, OpenMP) single-threaded, larger ones with
every thread, and the calling thread's setting is back to what it was after each step (so code
around the engine never runs with the step's setting)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from deepinfer.platforms import cpu_blas

needs_mkl = pytest.mark.skipif(not cpu_blas.available(), reason="this PyTorch build has no MKL")


def _mkl_threads() -> int:
    """Threads MKL would use for a call from this thread now."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    lib.MKL_Get_Max_Threads.restype = ctypes.c_int
    return lib.MKL_Get_Max_Threads()


@needs_mkl
def test_small_steps_run_mkl_single_threaded_and_restore(two_threads):
    before = _mkl_threads()
    assert before == 2
    with cpu_blas.threads_for_step(cpu_blas.SINGLE_THREAD_ROWS):
        assert _mkl_threads() == 1
    assert _mkl_threads() == before
    with cpu_blas.threads_for_step(cpu_blas.SINGLE_THREAD_ROWS + 1):
        assert _mkl_threads() == before
    with pytest.raises(RuntimeError), cpu_blas.threads_for_step(1):
        raise RuntimeError("a failing step")
    assert _mkl_threads() == before


@pytest.mark.skipif(not cpu_blas.openmp_available(), reason="PyTorch's OpenMP runtime not found")
def test_small_steps_run_openmp_single_threaded_and_restore(two_threads):
    with cpu_blas.openmp_for_step(cpu_blas.OPENMP_SINGLE_THREAD_ROWS):
        assert torch.get_num_threads() == 1
        assert torch.ones(1 << 20).sum().item() == 1 << 20  # ATen's parallel ops still run
    assert torch.get_num_threads() == 2
    with cpu_blas.openmp_for_step(cpu_blas.OPENMP_SINGLE_THREAD_ROWS + 1):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), cpu_blas.openmp_for_step(1):
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)  # a count the cut was not measured at: left alone
    with cpu_blas.openmp_for_step(1):
        assert torch.get_num_threads() == 3


@needs_mkl
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="MKL runs one thread on one core anyway")
def test_the_setting_is_per_thread():
    seen = []
    with cpu_blas.threads_for_step(1):
        worker = threading.Thread(target=lambda: seen.append(_mkl_threads()))
        worker.start()
        worker.join()
    assert len(seen) == 1 and seen[0] > 1  # another thread keeps MKL's own default


@needs_mkl
def test_the_engine_runs_small_steps_mkl_single_threaded(v4_ckpt, two_threads):
    """The runner's steps see MKL single-threaded while they run (a decode of one request),
    and the calling thread's setting is back once ``generate`` returns."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(v4_ckpt, compile=False)
    seen = []
    forward = llm.engine.runner.forward

    def recording(*args, **kwargs):
        seen.append(_mkl_threads())
        return forward(*args, **kwargs)

    llm.engine.runner.forward = recording
    before = _mkl_threads()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert seen and set(seen) == {1}
    assert _mkl_threads() == before == 2
