"""A server's part in a prefill/decode pair (``deepinfer serve --kv-role``): what the routes
call, over the engine's KV tiers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer.cache.tiers import KVTiers
from deepinfer.disagg.handover import PrefillClient, asks_handover, handover, take_offer
from deepinfer.disagg.remote_blocks import RemoteBlocks
from deepinfer.disagg.transfer import BlockSender


class KVRoles:
    """A prefill server's block sender, or a decode server's remote blocks (and prefill client)."""

    def __init__(
        self,
        tiers: KVTiers,
        block_size: int,
        sender: BlockSender | None = None,
        client: PrefillClient | None = None,
        remote: RemoteBlocks | None = None,
    ) -> None:
        self.tiers, self.block_size, self.sender, self.client = tiers, block_size, sender, client
        self.remote = remote

    @classmethod
    def prefill(cls, tiers: KVTiers, block_size: int, host: str, port: int) -> KVRoles:
        """Serve this engine's kept blocks to decode servers from ``host:port`` (0: any free port)."""

        def read(key: bytes) -> Any:
            entry = tiers.read_entry(key)
            return None if entry is None else entry[0]

        return cls(tiers, block_size, sender=BlockSender(read, tiers.codec.entry_bytes, host, port))

    @classmethod
    def decode(
        cls,
        tiers: KVTiers,
        block_size: int,
        peer: str | None,
        timeout_s: float,
        api_key: str | None = None,
        trusted_hosts: Sequence[str] = ("127.0.0.1", "localhost"),
        min_remote_tokens: int = 0,
    ) -> KVRoles:
        """Take prefill servers' blocks as a remote tier: those a request's own
        ``kv_transfer_params`` name (a proxy prefilled it), else those ``peer`` offers after
        prefilling it (None: only the former; prompts shorter than ``min_remote_tokens`` are
        prefilled here); only from ``trusted_hosts``."""
        remote = RemoteBlocks(tiers.codec.entry_bytes, tiers.namespace, timeout_s, frozenset(trusted_hosts))
        tiers.remote = remote
        client = None if peer is None else PrefillClient(peer, remote, timeout_s, api_key, min_remote_tokens)
        return cls(tiers, block_size, client=client, remote=remote)

    async def before_queueing(
        self,
        prompts: Sequence[Sequence[int]],
        salt: str | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """A decode server's step before queueing a request: the blocks a prefill answer's
        ``kv_transfer_params`` names (vLLM's proxy form), or its peer's prefill."""
        if self.remote is None:
            return
        if kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
            take_offer(self.remote, kv_transfer_params)
        elif self.client is not None:
            await self.client.prefill_all(prompts, salt)

    def answer(
        self, kv_transfer_params: dict[str, Any] | None, ids: Sequence[int], salt: str | None
    ) -> dict | None:
        """The ``kv_transfer_params`` of a prefill answer, where the request asked for them."""
        if self.sender is None or not asks_handover(kv_transfer_params):
            return None
        return handover(self.sender, self.tiers, self.tiers.namespace, ids, self.block_size, salt)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.remote is not None:
            self.remote.close()
