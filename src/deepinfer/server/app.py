"""The OpenAI-compatible HTTP app (FastAPI): ``deepinfer serve``.

Endpoints and field names follow vLLM's OpenAI-compatible server:
``/v1/completions`` and ``/v1/chat/completions`` (streaming as ``data: {...}`` events ending in
``data: [DONE]``), ``/v1/models`` (``routes_openai.py``), ``/tokenize``, ``/detokenize``,
``/health``, ``/version``, ``/metrics`` (``routes_admin.py``), with ``--enable-rl-endpoints``
the RL control endpoints (weight updates, sleep, pausing: ``routes_rl.py``), and, with
``--enable-lora``, LoRA adapters chosen by ``model``, loaded at start (``--lora-modules``) or,
with ``--allow-runtime-lora-updating`` too, while serving (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``: ``routes_lora.py``), and a chat page at ``/`` unless turned off
(``routes_ui.py``). The control endpoints change what the server is, so they are absent (404)
unless their flag asks for them, as vLLM serves them only in its development mode and with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``. Every error is OpenAI's JSON shape ``{"error":
{"message", "type", "param", "code"}}``, ``param`` naming the field (``error_handlers.py``):
400 for bad input (and for a request that could never run: more sequences than the server
runs at once, or more tokens than the context holds), 401 for a wrong key, 403 for a request
a browser sent from another site's page, 404 for an unknown model or route, 405 for a wrong
method, 408 for a body too slow to arrive, 413 for one too large, 415 for a control request
that is not JSON, 429 with ``Retry-After`` only when the waiting queue is full, 500
for a request that failed inside the engine (alone: the others go on), 503 while shutting down.

One request cannot stall the others: prompts are tokenized and rendered on worker threads
within size and time budgets (``prompts.py``), the site, key and body checks are pure ASGI so that
abandoned requests are aborted (``asgi_guards.py``), and slow headers time out
(``http_protocol.py``). The routes reach the engine only through ``EngineClient``
(``engine_client.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

import deepinfer
from deepinfer.disagg.roles import KVRoles
from deepinfer.llm import LLM
from deepinfer.server import routes_admin, routes_lora, routes_openai, routes_rl
from deepinfer.server.asgi_guards import RequestGuard
from deepinfer.server.async_llm import AsyncLLM
from deepinfer.server.engine_client import LocalEngineClient
from deepinfer.server.error_handlers import install_error_handlers
from deepinfer.server.limits import ServerLimits
from deepinfer.server.lora_modules import LoraModule
from deepinfer.server.routes_ui import mount_ui
from deepinfer.server.state import ServerState


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine loop with the app when it owns one; stop it and the prompt workers after."""
    server: ServerState = app.state.server
    if app.state.engine_thread:
        server.async_llm.start()
    yield
    server.async_llm.stop()
    server.prompts.close()
    if server.kv_roles is not None:
        server.kv_roles.close()


def build_app(
    llm: LLM,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int = 256,
    engine_thread: bool = True,
    limits: ServerLimits | None = None,
    lora_modules: Sequence[LoraModule] = (),
    ui: bool = True,
    enable_rl_endpoints: bool = False,
    allow_runtime_lora_updating: bool = False,
    kv_roles: Callable[[LLM], KVRoles] | None = None,
) -> FastAPI:
    """The app over ``llm``. ``engine_thread``: run the engine loop on a background thread
    started with the app; False leaves it to the caller (``AsyncLLM.run_here`` on
    ``app.state.server.async_llm``). ``lora_modules``: adapters served from the start (the
    engine needs ``enable_lora``); one that cannot be served is a ``ValueError`` naming it.
    ``ui``: serve the chat page at ``/`` (``routes_ui.py``). ``enable_rl_endpoints``: serve
    the RL control endpoints (``routes_rl.py``); ``allow_runtime_lora_updating``: serve the
    adapter load / unload endpoints (``routes_lora.py``). Off, those routes do not exist.
    ``kv_roles``: makes this server's part in a prefill/decode pair over ``llm``
    (``deepinfer.disagg.roles``)."""
    limits = limits or ServerLimits()
    async_llm = AsyncLLM(llm, max_queued_requests)
    client = LocalEngineClient(llm, async_llm)
    state = ServerState(async_llm, client, served_model_name, api_key, limits)
    _load_lora_modules(state, client, lora_modules)
    if kv_roles is not None:
        state.kv_roles = kv_roles(llm)
    app = FastAPI(title="deepinfer", version=deepinfer.__version__, lifespan=_lifespan)
    app.state.server = state
    app.state.engine_thread = engine_thread
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        max_body_bytes=limits.max_request_bytes,
        body_timeout_s=limits.body_timeout_s,
    )
    install_error_handlers(app)
    app.include_router(routes_admin.router)
    app.include_router(routes_openai.router)
    if enable_rl_endpoints:
        app.include_router(routes_rl.router)
    if allow_runtime_lora_updating:
        app.include_router(routes_lora.router)
    if ui:
        mount_ui(app)
    return app


def _load_lora_modules(state: ServerState, client: LocalEngineClient, modules: Sequence[LoraModule]) -> None:
    """Load the start-up adapters before the engine loop runs (so on this thread); a bad one
    stops the start with its reason rather than serving without it."""
    for module in modules:
        try:
            state.check_lora_name(module.name)
            client.load_lora_now(module.name, module.path, module.base_model_name)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
