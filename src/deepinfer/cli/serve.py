"""``deepinfer serve``: the OpenAI-compatible app under uvicorn, the engine loop on the main
thread, a graceful drain on SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from deepinfer.cli.engine_args import llm_kwargs
from deepinfer.server.limits import ServerLimits

PREFILL_HOST_BYTES = 1 << 30  # a prefill server's host tier unless --kv-offload-bytes says otherwise


def kv_roles(args: argparse.Namespace, kwargs: dict[str, Any]) -> Callable[[Any], Any] | None:
    """This server's part in a prefill/decode pair (``--kv-role``), made over its ``LLM``; sets
    the engine options the role needs in ``kwargs``."""
    from deepinfer.disagg.roles import KVRoles

    if args.kv_role is None:
        if args.kv_peer is not None:
            raise ValueError("--kv-peer needs --kv-role decode")
        return None
    kwargs["kv_role"] = args.kv_role
    if args.kv_role == "prefill":
        if args.kv_peer is not None:
            raise ValueError("--kv-peer is the decode server's option (its prefill server's URL)")
        kwargs.setdefault("kv_offload_bytes", PREFILL_HOST_BYTES)
        return lambda llm: KVRoles.prefill(
            llm.engine.tiers, llm.engine.config.block_size, args.kv_transfer_host, args.kv_transfer_port
        )
    trusted = [h.strip() for h in args.kv_trusted_hosts.split(",") if h.strip()]
    if args.kv_peer is not None:  # the peer's own host is trusted
        trusted.append(urlparse(args.kv_peer).hostname or "")
    return lambda llm: KVRoles.decode(
        llm.engine.tiers,
        llm.engine.config.block_size,
        args.kv_peer,
        args.kv_transfer_timeout,
        args.api_key,
        trusted,
        args.kv_remote_min_tokens,
    )


def serve(args: argparse.Namespace) -> int:
    """Load the model, serve it until a signal, let running requests finish, exit."""
    try:
        import uvicorn

        from deepinfer.server.app import build_app
        from deepinfer.server.http_protocol import header_timeout_protocol
    except ImportError as exc:
        raise ValueError(f"serve needs the serve extra: pip install 'deepinfer[serve]' ({exc})") from exc
    from deepinfer import LLM
    from deepinfer.compile.gc_heap import freeze_long_lived

    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_messages=args.max_messages,
        prompt_timeout_s=args.prompt_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    kwargs = llm_kwargs(args)
    roles = kv_roles(args, kwargs)
    llm = LLM(args.model, **kwargs)
    # the model's objects live as long as the server: out of the collector's full passes,
    # which would otherwise walk them all while every request waits (gc_heap.py)
    freeze_long_lived()
    name = args.served_model_name or args.model
    app = build_app(
        llm,
        name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        engine_thread=False,
        limits=limits,
        lora_modules=args.lora_modules or (),
        ui=not args.no_ui,
        enable_rl_endpoints=args.enable_rl_endpoints,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        kv_roles=roles,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=header_timeout_protocol(limits.header_timeout_s),
        # our own drain ends every response within shutdown_timeout_s; this is the backstop
        timeout_graceful_shutdown=int(limits.shutdown_timeout_s) + 5,
    )
    web = uvicorn.Server(config)
    async_llm = app.state.server.async_llm
    # HTTP on a background thread, the engine loop here: the thread that loaded the model
    # drives its kernels (AsyncLLM.run_here says why)
    http = threading.Thread(target=web.run, name="deepinfer-http", daemon=True)
    http.start()

    def graceful(signum: int, _frame: object) -> None:
        """SIGTERM / Ctrl-C: stop accepting, let running requests finish within the grace
        period (then end them with an error event), exit. A second signal exits at once."""
        if async_llm.shutting_down:
            raise KeyboardInterrupt
        web.should_exit = True
        async_llm.begin_shutdown(limits.shutdown_timeout_s)

    signal.signal(signal.SIGTERM, graceful)
    signal.signal(signal.SIGINT, graceful)
    print(f"deepinfer serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    if not args.no_ui:
        print(f"chat page: http://{args.host}:{args.port}/", flush=True)
    try:
        async_llm.run_here(until=lambda: not http.is_alive() or async_llm.drained)
    except KeyboardInterrupt:  # a second signal: no more waiting
        pass
    web.should_exit = True
    try:
        http.join(timeout=limits.shutdown_timeout_s + 10)
    except KeyboardInterrupt:
        pass
    return 0
