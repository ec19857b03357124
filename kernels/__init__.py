"""Custom ops with a reference implementation everywhere and faster ones per platform
(import name ``deepinfer.kernels``). Empty until the compiler issue."""
