"""The two servers' exchange in vLLM's field: a request to a prefill server carries
``kv_transfer_params: {"do_remote_decode": true}``; its answer carries, under the same name,
what the decode server needs to take the prompt's blocks (``handover``). The decode server's
side is ``PrefillClient``: it asks its peer to prefill each prompt before queueing it here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from deepinfer.cache.prefix_hash import prompt_block_hashes
from deepinfer.cache.tiers import KVTiers
from deepinfer.disagg.remote_blocks import RemoteBlocks
from deepinfer.disagg.transfer import BlockSender

logger = logging.getLogger("deepinfer")


def asks_handover(kv_transfer_params: dict[str, Any] | None) -> bool:
    return bool(kv_transfer_params and kv_transfer_params.get("do_remote_decode"))


def handover(
    sender: BlockSender, tiers: KVTiers, namespace: str, ids: Sequence[int], block_size: int, salt: str | None
) -> dict[str, Any]:
    """A prefill answer's ``kv_transfer_params``: the prompt's full blocks this server keeps
    (by hash, in prompt order, up to the first it lacks) and where to fetch them."""
    held = []
    for key in prompt_block_hashes(ids, block_size, salt):
        if not tiers.has(key):
            break
        held.append(key.hex())
    return {
        "do_remote_prefill": True,
        "block_hashes": held,
        "remote_host": sender.host,
        "remote_port": sender.port,
        "namespace": namespace,
    }


def take_offer(remote: RemoteBlocks, params: dict[str, Any]) -> bool:
    """Offer ``remote`` the blocks a prefill answer's ``kv_transfer_params`` names; False
    (nothing offered: the prompt is computed here) when they are malformed or of another
    model or format."""
    try:
        keys = [bytes.fromhex(h) for h in params["block_hashes"]]
        host, port, namespace = (
            str(params["remote_host"]),
            int(params["remote_port"]),
            str(params["namespace"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("kv_transfer_params without a usable block offer (%s); computing the prompt here", exc)
        return False
    return remote.offer(keys, host, port, namespace)


class PrefillClient:
    """A decode server's calls to its prefill peer (``--kv-peer``)."""

    def __init__(
        self,
        peer: str,
        remote: RemoteBlocks,
        timeout_s: float,
        api_key: str | None = None,
        min_tokens: int = 0,
    ) -> None:
        """``min_tokens``: shorter prompts are prefilled here (the round trip to the peer
        costs more than their prefill)."""
        self.url = peer.rstrip("/") + "/v1/completions"
        self.remote, self.timeout_s, self.min_tokens = remote, timeout_s, min_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.failed = 0  # prefills the peer did not answer: computed here instead

    async def prefill_all(self, prompts: Sequence[Sequence[int]], salt: str | None) -> None:
        await asyncio.gather(*(self.prefill(p, salt) for p in prompts if len(p) >= self.min_tokens))

    async def prefill(self, ids: Sequence[int], salt: str | None) -> bool:
        """Have the peer prefill ``ids`` and note the blocks it offers; False (nothing offered,
        this server computes the prompt) when the peer fails or does not answer in time."""
        body: dict[str, Any] = {
            "prompt": list(ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        if salt is not None:
            body["cache_salt"] = salt
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                response = await client.post(self.url, json=body, headers=self.headers)
            response.raise_for_status()
            return take_offer(self.remote, response.json()["kv_transfer_params"])
        except Exception as exc:
            self.failed += 1
            logger.warning(
                "prefill server %s did not prefill a prompt (%s); computing it here", self.url, exc
            )
            return False
