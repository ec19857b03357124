"""The block transfer channel alone (``disagg/transfer.py``), both ends in this process: rows
come back as sent, a key the sender lacks comes back None, a checksum that disagrees drops
every row, and a sender that is gone fails the fetch."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.disagg import transfer
from deepinfer.disagg.handover import PrefillClient
from deepinfer.disagg.remote_blocks import RemoteBlocks
from deepinfer.disagg.transfer import BlockReceiver, BlockSender

ENTRY = 48


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@pytest.fixture(scope="module")
def channel():
    rows = {
        _key(i): torch.randint(
            0, 256, (ENTRY,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)
        )
        for i in range(20)
    }
    sender = BlockSender(rows.get, ENTRY, "127.0.0.1", 0)
    receiver = BlockReceiver(sender.host, sender.port, ENTRY, timeout_s=10)
    yield rows, sender, receiver
    receiver.close()
    sender.close()


@settings(max_examples=15, deadline=None)
@given(asked=st.lists(st.integers(0, 39), min_size=1, max_size=12))
def test_rows_come_back_as_held(channel, asked):
    rows, _, receiver = channel
    got, intact = receiver.fetch([_key(i) for i in asked])
    assert intact
    for i, row in zip(asked, got, strict=True):
        if i < 20:
            assert row is not None and torch.equal(row, rows[_key(i)])
        else:
            assert row is None


def test_a_checksum_that_disagrees_drops_every_row(channel, monkeypatch):
    _, _, receiver = channel
    real = transfer.digest

    def receiver_disagrees(data):  # the sender's thread computes the true digest
        sending = threading.current_thread().name.startswith("deepinfer-kv-send")
        return real(data) if sending else real(data).flip(0)

    monkeypatch.setattr(transfer, "digest", receiver_disagrees)
    got, intact = receiver.fetch([_key(1), _key(2)])
    assert not intact and got == [None, None]


def test_remote_blocks_take_what_was_offered_and_report_a_gone_sender_as_missing(channel):
    rows, sender, _ = channel
    remote = RemoteBlocks(ENTRY, "ns", timeout_s=3)
    try:
        assert not remote.offer([_key(1)], sender.host, sender.port, "other-namespace")
        assert not remote.offer([_key(1)], "10.0.0.99", sender.port, "ns")  # not a trusted host
        assert not remote.has(_key(1))
        assert remote.offer([_key(1)], sender.host, sender.port, "ns") and remote.has(_key(1))
        assert torch.equal(remote.fetch([_key(1)])[0], rows[_key(1)])
        assert not remote.has(_key(1))  # taken: the block lives in this server now
        with socket.socket() as unused:  # a port nobody listens on
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        remote.offer([_key(2)], "127.0.0.1", port, "ns")
        assert remote.fetch([_key(2)]) == [None]
        assert remote.stats.failed == 1 and remote.stats.offers_refused == 2
    finally:
        remote.close()


def test_prompts_under_the_threshold_are_not_sent_to_the_peer():
    """``min_tokens``: a short prompt never reaches the peer (here nobody listens, so every
    prompt that is sent counts as a failed prefill)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    client = PrefillClient(f"http://127.0.0.1:{port}", RemoteBlocks(ENTRY, "ns", 3), 3, min_tokens=10)
    asyncio.run(client.prefill_all([[1] * 9, [1] * 10, [1] * 30], None))
    assert client.failed == 2
