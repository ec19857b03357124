"""The RL control endpoints, by SGLang's and vLLM's names: ``/update_weights_from_disk``,
``/get_weight_version``, ``/pause_generation``, ``/continue_generation`` (SGLang's),
``/sleep``, ``/wake_up``, ``/is_sleeping`` (vLLM's, ``level`` as a query parameter).

Each runs on the engine thread between two steps (``AsyncLLM.between_steps``): a weight
update lands between steps, requests running meanwhile are computed again under the new
weights, and every later output carries the new ``weight_version``. They exist only with
``--enable-rl-endpoints`` (``build_app(enable_rl_endpoints=True)``); like ``/v1/*`` they take
the API key, and the POSTs take only JSON and no request from another site's page
(``asgi_guards.CONTROL_PATHS``). An action the engine refuses (a bad checkpoint,
sleep with requests running) answers 400 with the engine's reason, and changes nothing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from deepinfer.errors import CheckpointError
from deepinfer.server.protocol import RequestError
from deepinfer.server.state import StateDep

router = APIRouter()


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    weight_version: str | None = None


async def _control(server: Any, action: str, param: str | None = None, **options: Any) -> Any:
    try:
        return await server.client.control(action, **options)
    except (ValueError, RuntimeError, CheckpointError, OSError) as exc:
        raise RequestError(f"{action}: {exc}", param) from exc


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, server: StateDep) -> dict:
    version = await _control(
        server,
        "load_weights_from_disk",
        "model_path",
        path=body.model_path,
        weight_version=body.weight_version,
    )
    return {"success": True, "message": f"weights loaded from {body.model_path}", "weight_version": version}


@router.get("/get_weight_version")
async def get_weight_version(server: StateDep) -> dict:
    return {"weight_version": await _control(server, "weight_version")}


@router.post("/pause_generation")
async def pause_generation(server: StateDep) -> dict:
    await _control(server, "pause_generation")
    return {"success": True}


@router.post("/continue_generation")
async def continue_generation(server: StateDep) -> dict:
    await _control(server, "continue_generation")
    return {"success": True}


@router.post("/sleep")
async def sleep(server: StateDep, level: int = 1) -> dict:
    await _control(server, "sleep", "level", level=level)
    return {"success": True, "level": level}


@router.post("/wake_up")
async def wake_up(server: StateDep) -> dict:
    await _control(server, "wake_up")
    return {"success": True}


@router.get("/is_sleeping")
async def is_sleeping(server: StateDep) -> dict:
    return {"is_sleeping": await _control(server, "is_sleeping")}
