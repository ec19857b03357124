"""The engine's cache figures as named metrics (``LLM.get_metrics()``, and the same series on
the server's ``/metrics``): the device pool's prefix-cache queries and hits, and the host and
disk tiers' hits, bytes moved, load time and errors; with speculative decoding, acceptance by
draft position and the confidence head's predicted survival beside the observed one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.outputs import Metric

if TYPE_CHECKING:
    from deepinfer.cache.tiers import KVTiers
    from deepinfer.engine.block_pool import BlockPool
    from deepinfer.speculative.stats import SpecStats


def cache_metrics(pools: list[BlockPool], bs: int, tiers: KVTiers | None) -> list[Metric]:
    """The cache metrics as they stand: ``pools``, the device block pools (one per
    data-parallel rank) of blocks of ``bs`` tokens; ``tiers``, the host and disk tiers."""
    out = [
        Metric(
            "deepinfer:kv_cache_usage_perc",
            "gauge",
            1.0 - sum(p.num_free for p in pools) / sum(p.num_blocks for p in pools),
            doc="Share of KV cache blocks in use (0-1)",
        ),
        Metric(
            "deepinfer:prefix_cache_queries",
            "counter",
            sum(p.query_blocks for p in pools) * bs,
            doc="Prompt tokens looked up in the device pool's prefix cache (whole blocks)",
        ),
        Metric(
            "deepinfer:prefix_cache_hits",
            "counter",
            sum(p.hit_blocks for p in pools) * bs,
            doc="Prompt tokens found in the device pool's prefix cache",
        ),
    ]
    if tiers is None:
        return out
    s = tiers.stats()
    for tier in ("host", "disk", "remote"):
        labels = {"tier": tier}
        out += [
            Metric(
                "deepinfer:kv_tier_hit_blocks",
                "counter",
                s.hit_blocks[tier],
                labels,
                "Blocks loaded from a tier",
            ),
            Metric(
                "deepinfer:kv_tier_hit_tokens",
                "counter",
                s.hit_blocks[tier] * bs,
                labels,
                "Tokens loaded from a tier",
            ),
            Metric(
                "deepinfer:kv_tier_bytes",
                "counter",
                s.loaded_bytes[tier],
                {"tier": tier, "direction": "load"},
                "Bytes moved between the device pool and a tier",
            ),
            Metric(
                "deepinfer:kv_tier_bytes",
                "counter",
                s.stored_bytes[tier],
                {"tier": tier, "direction": "store"},
                "Bytes moved between the device pool and a tier",
            ),
        ]
    used = {
        "host": (s.host_used_bytes, s.host_capacity_bytes),
        "disk": (s.disk_used_bytes, s.disk_capacity_bytes),
    }
    for tier, (now, most) in used.items():
        out += [
            Metric("deepinfer:kv_tier_used_bytes", "gauge", now, {"tier": tier}, "Bytes a tier holds"),
            Metric(
                "deepinfer:kv_tier_capacity_bytes", "gauge", most, {"tier": tier}, "Bytes a tier may hold"
            ),
        ]
    out += [
        Metric(
            "deepinfer:kv_tier_loads", "counter", s.loads, doc="Loads from the tiers (one per prefix hit)"
        ),
        Metric(
            "deepinfer:kv_tier_load_seconds",
            "counter",
            s.load_seconds,
            doc="Time the loads took, summed (seconds)",
        ),
        Metric(
            "deepinfer:kv_tier_failed_loads",
            "counter",
            s.failed_loads,
            doc="Loads that met a missing or corrupt entry (the prefix is recomputed)",
        ),
        Metric(
            "deepinfer:kv_tier_corrupt_files",
            "counter",
            s.corrupt_files,
            doc="Disk tier files that failed their checksum (deleted, never loaded)",
        ),
        Metric(
            "deepinfer:kv_tier_disk_write_errors",
            "counter",
            s.disk_write_errors,
            doc="Failed disk tier writes",
        ),
        Metric(
            "deepinfer:kv_tier_disk_writes_dropped",
            "counter",
            s.disk_writes_dropped,
            doc="Blocks not written to disk because the writer fell behind",
        ),
        Metric(
            "deepinfer:kv_tier_disk_full",
            "gauge",
            float(s.disk_full),
            doc="1 while the disk tier's disk is full",
        ),
    ]
    return out


def spec_metrics(stats: SpecStats | None) -> list[Metric]:
    """Speculative decoding's per-position counters (none without it). vLLM's
    ``spec_decode_num_accepted_tokens_per_pos`` by position, the drafts verified there, and
    the confidence head's summed predicted survival: predicted / drafts against accepted /
    drafts is the head's calibration at that position."""
    if stats is None:
        return []
    out = [
        Metric(
            "deepinfer:spec_decode_num_verified_chunks",
            "counter",
            stats.verify_steps,
            doc="Drafted chunks verified (mean acceptance length: (accepted + this) / this)",
        )
    ]
    for j, drafted in enumerate(stats.position_drafted):
        pos = {"position": str(j)}
        out += [
            Metric(
                "deepinfer:spec_decode_num_drafts_per_pos",
                "counter",
                drafted,
                pos,
                "Verified chunks with a draft at this position",
            ),
            Metric(
                "deepinfer:spec_decode_num_accepted_tokens_per_pos",
                "counter",
                stats.position_survived[j],
                pos,
                "Verified chunks whose drafts up to this position were all accepted",
            ),
            Metric(
                "deepinfer:spec_decode_predicted_survival",
                "counter",
                stats.position_predicted[j],
                pos,
                "The confidence head's predicted survival up to this position, summed over scored chunks",
            ),
        ]
    return out
