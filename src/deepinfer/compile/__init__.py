"""The compile machinery around the model step (docs/architecture.md, 'Compilation, passes and
ops'): ``torch.compile`` wiring and the FX pass manager (``compilation``), steps compiled ahead
of time and saved to disk (``precompiled``), the C++ wrapper's cached scalar arguments
(``cpp_wrapper_args``) and the loaded bytecode's unwrapped size helpers (``pregraph_calls``),
the garbage collector's freeze after the first compiled step (``gc_heap``), and the traced
graphs' text dumps in ``fx_graphs/`` (``graph_dump``). The passes themselves live in
``deepinfer.compile_passes``."""
