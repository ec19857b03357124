"""Loading and unloading LoRA adapters while serving, by vLLM's routes:
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and ``POST
/v1/unload_lora_adapter`` (``{"lora_name"}``).

Each runs on the engine thread between two steps (``AsyncLLM.between_steps``), so no step
sees an adapter half loaded. Success is a 200 with a plain-text message, as vLLM answers; an
adapter that cannot be served (no such directory, a rank above ``--max-lora-rank``, a module
the model has no adapter slot for, shapes of another model) is a 400 naming the problem, and
leaves the served adapters as they were; unloading a name that is not loaded is a 404. A
server started without ``--enable-lora`` answers 400. Requests running with an adapter being
unloaded finish with it. The routes exist only with ``--allow-runtime-lora-updating``
(``build_app(allow_runtime_lora_updating=True)``), as vLLM serves them only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; like the RL control endpoints they take the API key,
only JSON, and no request from another site's page (``asgi_guards.CONTROL_PATHS``).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from deepinfer.server.engine_client import UnknownAdapterError
from deepinfer.server.protocol import RequestError, param_of
from deepinfer.server.state import ServerState, StateDep

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str


def _require_lora(server: ServerState) -> None:
    if not server.client.lora_enabled:
        raise RequestError("LoRA is not enabled on this server (start it with --enable-lora)")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, server: StateDep) -> PlainTextResponse:
    _require_lora(server)
    server.check_lora_name(body.lora_name)
    try:
        await server.client.load_lora(body.lora_name, body.lora_path)
    except (ValueError, OSError) as exc:  # the registry's reason names the field it found wrong
        raise RequestError(str(exc), param_of(str(exc)) or "lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' loaded from {body.lora_path}.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, server: StateDep) -> PlainTextResponse:
    _require_lora(server)
    try:
        await server.client.unload_lora(body.lora_name)
    except UnknownAdapterError as exc:
        raise RequestError(str(exc), "lora_name", 404) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' unloaded.")
