"""The prefix cache's host and disk tiers (cache/tiers): a prefix the device pool evicted comes
back from a tier and changes no token (V4, V4.1, Llama; chunked prefill, preemption, batching),
the disk tier serves a new process, corrupt files are caught, and a full disk is survived."""

from __future__ import annotations

import errno
import json
import logging
import random
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from equivalence_workloads import count_preemptions

from deepinfer import LLM, SamplingParams
from deepinfer.cache.forward_batch import LayerPools
from deepinfer.cache.kv_formats import PackedRows
from deepinfer.cache.tiers import disk as disk_tier
from deepinfer.cache.tiers.codec import BlockCodec
from deepinfer.tiny import make_tiny_checkpoint

MIB = 1 << 20


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama_tiers"), arch="llama", seed=3)


def conversations(seed: int, vocab: int, count: int, turns: int) -> list[list[list[int]]]:
    """Per conversation, the user tokens of each turn; half the conversations open with one
    shared system prefix, the rest with their own."""
    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(rng.randrange(20, 40))]
    convs = []
    for i in range(count):
        opening = system if i % 2 == 0 else [rng.randrange(2, vocab) for _ in range(rng.randrange(10, 30))]
        user = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 16))] for _ in range(turns)]
        user[0] = opening + user[0]
        convs.append(user)
    return convs


def run_turns(llm: LLM, convs: list[list[list[int]]], max_tokens: int) -> list[list[int]]:
    """Every conversation's turn t as one batch, turn after turn; each prompt is the whole
    history (earlier prompts and replies) plus the new user tokens. Returns each reply."""
    history: list[list[int]] = [[] for _ in convs]
    replies = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for t in range(len(convs[0])):
        prompts = [h + c[t] for h, c in zip(history, convs, strict=True)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, out in enumerate(outs):
            reply = list(out.outputs[0].token_ids)
            replies.append(reply)
            history[i] = prompts[i] + reply
    engine = llm.engine
    assert engine.block_pools[0].num_free == engine.num_blocks, "blocks leaked"
    return replies


def tier_hits(llm: LLM) -> dict[str, float]:
    return {m.labels["tier"]: m.value for m in llm.get_metrics() if m.name == "deepinfer:kv_tier_hit_blocks"}


ARCHS = {"llama": "llama_ckpt", "v4": "v4_short_ckpt", "v41": "v41_ckpt"}


# Every tier form on Llama, and each on one of V4 and V4.1 (their runs cost the most);
# the workloads (seed, conversations, prefill chunk) differ from case to case.
TIER_CASES = [
    ("llama", "host", 0, 4, 16),
    ("llama", "disk", 1, 5, 24),
    ("llama", "both", 2, 4, 64),
    ("llama", "small host over disk", 3, 5, 16),
    ("v4", "disk", 4, 4, 24),
    ("v4", "small host over disk", 5, 3, 64),
    ("v41", "host", 6, 3, 16),
    ("v41", "both", 7, 4, 24),
]


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize(("arch", "tiers", "seed", "count", "chunk"), TIER_CASES)
def test_tiers_change_no_token(arch, tiers, seed, count, chunk, scheduling, request, tmp_path):
    """A random multi-turn workload over a pool too small for it: the run with tiers takes
    prefixes back from the tier the form reads most, and every reply equals the run without
    tiers, with synchronous or asynchronous scheduling."""
    check_tiers_change_no_token(request, tmp_path, arch, tiers, seed, count, chunk, scheduling == "async")


def test_a_request_ending_under_async_scheduling_stores_only_written_rows(request, tmp_path):
    """Under asynchronous scheduling a request that ends has its next row counted (and perhaps
    being written) by the step scheduled after it; a block that row completes must not go to
    a tier as written, or a later hit loads its stale row. Reproduction: tiny Llama, seed 331,
    six conversations, prefill chunk 16, host tier."""
    check_tiers_change_no_token(request, tmp_path, "llama", "host", 331, 6, 16, True)


def check_tiers_change_no_token(
    request, tmp_path, arch: str, tiers: str, seed: int, count: int, chunk: int, async_scheduling: bool
) -> None:
    ckpt = str(request.getfixturevalue(ARCHS[arch]))
    turns, max_tokens = 3, 6
    convs = conversations(seed, 200, count, turns)
    longest = max(sum(len(u) for u in c) for c in convs) + turns * max_tokens
    kwargs = dict(
        num_cache_blocks=-(-longest // 8) + 2,  # one conversation always fits; several preempt
        block_size=8,
        max_num_batched_tokens=chunk,
        max_num_seqs=4,
    )
    directory = str(tmp_path / "kv")
    small_host = 0
    if tiers == "small host over disk":  # a host tier of three blocks: most hits come from disk
        probe = LLM(ckpt, num_cache_blocks=64, block_size=8, kv_offload_bytes=1)
        small_host = 3 * probe.engine.tiers.codec.entry_bytes
        probe.close()
    tier_kwargs, hit_tier = {
        "host": (dict(kv_offload_bytes=64 * MIB), "host"),
        "disk": (dict(kv_cache_dir=directory), "disk"),
        "both": (dict(kv_offload_bytes=64 * MIB, kv_cache_dir=directory), "host"),
        "small host over disk": (dict(kv_offload_bytes=small_host, kv_cache_dir=directory), "disk"),
    }[tiers]
    plain = LLM(ckpt, **kwargs)
    expected = run_turns(plain, convs, max_tokens)
    plain.close()
    tiered = LLM(ckpt, **kwargs, **tier_kwargs, async_scheduling=async_scheduling)
    assert (tiered.engine.async_steps is not None) == async_scheduling
    preempted = count_preemptions(tiered)
    assert run_turns(tiered, convs, max_tokens) == expected
    hits = tier_hits(tiered)
    tiered.close()
    assert hits[hit_tier] > 0, f"no prefix came back from the {hit_tier} tier: the workload did not test it"
    assert preempted, "no request was preempted"


def _state_columns(codec: BlockCodec, pools: Sequence[LayerPools], kind: str) -> list[tuple[int, int]]:
    """The column ranges of a codec row that hold one kind of a block's state: ``snapshots``
    (the compressors' overlap snapshots) or ``window`` (the window K rows)."""
    if kind == "snapshots":
        tensors = [
            t
            for layer in pools
            for c in (layer.compressor, layer.indexer)
            if c is not None
            for t in (c.snap_kv, c.snap_gate)
            if t is not None
        ]
    else:
        tensors = [
            layer.window.data if isinstance(layer.window, PackedRows) else layer.window for layer in pools
        ]
    held = {t.data_ptr() for t in tensors}
    ranges, offset = [], 0
    for t in [*codec.main, *codec.window]:  # a row is the main part, then the window part
        if t.data_ptr() in held:
            ranges.append((offset, offset + t.shape[1]))
        offset += t.shape[1]
    return ranges


# V4's overlapping compressors keep snapshots (the tiny V4.1's compressors do not overlap)
@pytest.mark.parametrize(("arch", "kind"), [("llama", "window"), ("v4", "snapshots")])
def test_a_mutated_tier_is_caught(arch, kind, request, tmp_path, monkeypatch):
    """The mutation check of the test above: a tier that loses one kind of the block's state
    (the compressor snapshots of V4, the window rows of Llama) changes replies, whether the
    lost block came back from the host tier or from disk."""
    ckpt = str(request.getfixturevalue(ARCHS[arch]))
    init, scatter = BlockCodec.__init__, BlockCodec.scatter
    lost: list[tuple[int, int]] = []

    def record(self, layout, pools) -> None:
        init(self, layout, pools)
        lost[:] = _state_columns(self, pools, kind)

    def lossy(self, rows, blocks, window_blocks) -> None:
        rows = rows.clone()
        for start, end in lost:
            rows[:, start:end] = 0
        scatter(self, rows, blocks, window_blocks)

    monkeypatch.setattr(BlockCodec, "__init__", record)
    monkeypatch.setattr(BlockCodec, "scatter", lossy)
    convs = conversations(1, 200, 4, 3)
    kwargs = dict(num_cache_blocks=14, block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    plain = LLM(ckpt, **kwargs)
    expected = run_turns(plain, convs, 6)
    plain.close()
    for tier, tier_kwargs in (
        ("host", dict(kv_offload_bytes=64 * MIB)),
        ("disk", dict(kv_cache_dir=str(tmp_path / "kv"))),
    ):
        tiered = LLM(ckpt, **kwargs, **tier_kwargs)
        assert 0 < sum(end - start for start, end in lost) < tiered.engine.tiers.codec.entry_bytes
        got = run_turns(tiered, convs, 6)
        assert tier_hits(tiered)[tier] > 0
        tiered.close()
        assert got != expected, f"{arch}: a {tier} tier that loses state went unnoticed"


def _one_prompt(vocab: int = 200, length: int = 90, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]


def _generate(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_new_process_serves_the_prefix_from_disk(v4_short_ckpt, tmp_path):
    """A prompt run in one process, then in another over the same checkpoint and directory:
    the second loads the prefix from disk and replies the same."""
    directory = tmp_path / "kv"
    prompt = _one_prompt()
    first = LLM(str(v4_short_ckpt), kv_cache_dir=str(directory))
    expected = _generate(first, prompt)
    first.close()  # waits for the queued writes
    assert list(directory.rglob("*.kvb")), "nothing was written to disk"
    script = textwrap.dedent(
        f"""
        import json
        from deepinfer import LLM, SamplingParams
        llm = LLM({str(v4_short_ckpt)!r}, kv_cache_dir={str(directory)!r})
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate([{{"prompt_token_ids": {prompt!r}}}], params, use_tqdm=False)[0]
        hits = {{m.labels["tier"]: m.value for m in llm.get_metrics() if m.name == "deepinfer:kv_tier_hit_blocks"}}
        print(json.dumps({{"tokens": list(out.outputs[0].token_ids), "hits": hits, "cached": out.num_cached_tokens}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["hits"]["disk"] > 0 and result["cached"] > 0
    assert result["tokens"] == expected


def test_files_are_bound_to_the_weights_and_the_cache_format(llama_ckpt, tmp_path):
    """Changed weights, or another K/V element type, find none of the files of the first."""
    directory = tmp_path / "kv"
    prompt = _one_prompt()
    first = LLM(str(llama_ckpt), kv_cache_dir=str(directory), block_size=8)
    _generate(first, prompt)
    first.close()
    other_dtype = LLM(str(llama_ckpt), kv_cache_dir=str(directory), block_size=8, kv_cache_dtype="bfloat16")
    _generate(other_dtype, prompt)
    assert sum(tier_hits(other_dtype).values()) == 0
    other_dtype.close()
    changed = tmp_path / "changed"
    make_tiny_checkpoint(changed, arch="llama", seed=4)  # same shapes, other values
    other_weights = LLM(str(changed), kv_cache_dir=str(directory), block_size=8)
    _generate(other_weights, prompt)
    assert sum(tier_hits(other_weights).values()) == 0
    other_weights.close()
    same = LLM(str(llama_ckpt), kv_cache_dir=str(directory), block_size=8)
    _generate(same, prompt)
    assert tier_hits(same)["disk"] > 0
    same.close()


def _damage(path: Path, kind: int, other: Path) -> None:
    """Three kinds of damage: bytes overwritten inside the payload, a truncated file, and a
    valid file copied under another block's name."""
    data = bytearray(path.read_bytes())
    if kind == 0:
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(random.Random(0).randrange(256) for _ in range(64))
        path.write_bytes(bytes(data))
    elif kind == 1:
        path.write_bytes(bytes(data[: len(data) // 3]))
    else:
        path.write_bytes(other.read_bytes())


def test_each_kind_of_damage_fails_the_check(tmp_path, caplog):
    tier = disk_tier.DiskTier(tmp_path, "ns", 1 << 20)
    keys = [bytes([i]) * 32 for i in range(4)]
    for i, key in enumerate(keys):
        assert tier.write(key, bytes([i]) * 1000, 600)
    assert tier.read(keys[0], 600) == bytes([0]) * 1000
    assert tier.read(keys[0], 500) is None, "a main part of another size was accepted"
    assert tier.write(keys[0], bytes(1000), 600)
    for kind in range(3):
        _damage(tier.path_of(keys[kind]), kind, tier.path_of(keys[3]))
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        for kind in range(3):
            assert tier.read(keys[kind], 600) is None
            assert not tier.path_of(keys[kind]).exists() and not tier.has(keys[kind])
    assert tier.corrupt_files == 4
    assert caplog.text.count("failed its checksum or is truncated") == 4  # with the size mismatch
    assert tier.read(keys[3], 600) == bytes([3]) * 1000


def test_corrupt_files_are_ignored_with_a_warning(llama_ckpt, tmp_path, caplog, monkeypatch):
    """Every file of a prompt damaged: the engine warns, deletes what it met, and replies as
    if it had no tier."""
    directory = tmp_path / "kv"
    prompt = _one_prompt(length=120)
    plain = LLM(str(llama_ckpt), block_size=8)
    expected = _generate(plain, prompt)
    plain.close()
    first = LLM(str(llama_ckpt), kv_cache_dir=str(directory), block_size=8)
    _generate(first, prompt)
    first.close()
    files = sorted(directory.rglob("*.kvb"))
    assert len(files) >= 4
    for i, path in enumerate(files):
        _damage(path, i % 3, files[(i + 1) % len(files)])
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        second = LLM(str(llama_ckpt), kv_cache_dir=str(directory), block_size=8)
        for _ in range(3):  # the prefix is computed again and the tier refilled
            assert _generate(second, prompt) == expected
    stats = second.engine.tiers.stats()
    second.close()
    assert stats.corrupt_files >= 1 and stats.failed_loads >= 1
    assert "failed its checksum or is truncated" in caplog.text

    # the mutation: without the check, the overwritten file is loaded, and the reply changes
    first = LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path / "kv2"), block_size=8)
    _generate(first, prompt)
    first.close()
    files = sorted((tmp_path / "kv2").rglob("*.kvb"))
    data = bytearray(files[0].read_bytes())
    start = len(disk_tier.MAGIC) + disk_tier._HEADER.size
    data[start:-32] = bytes(len(data) - 32 - start)  # the payload zeroed (all its K/V)
    files[0].write_bytes(bytes(data))
    monkeypatch.setattr(
        disk_tier.DiskTier, "_check", staticmethod(lambda data, key, main: data[start:-32] or None)
    )
    unchecked = LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path / "kv2"), block_size=8)
    assert _generate(unchecked, prompt) != expected
    unchecked.close()


def test_a_full_disk_is_reported_and_serving_goes_on(llama_ckpt, tmp_path, caplog, monkeypatch):
    """Every write past the first few fails as a full disk does (part of the file written,
    then ENOSPC): the engine keeps replying correctly, reports it, leaves no partial file,
    and the host tier still serves."""
    writes = {"ok": 3}
    real_write = disk_tier._write_file

    def filling(path: Path, chunks: list[bytes]) -> None:
        if writes["ok"] > 0:
            writes["ok"] -= 1
            real_write(path, chunks)
            return
        path.write_bytes(chunks[0][:10])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(disk_tier, "_write_file", filling)
    convs = conversations(2, 200, 4, 3)
    kwargs = dict(num_cache_blocks=14, block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    plain = LLM(str(llama_ckpt), **kwargs)
    expected = run_turns(plain, convs, 6)
    plain.close()
    directory = tmp_path / "kv"
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        llm = LLM(str(llama_ckpt), **kwargs, kv_offload_bytes=64 * MIB, kv_cache_dir=str(directory))
        assert run_turns(llm, convs, 6) == expected
        llm.close()
    stats = llm.engine.tiers.stats()
    assert stats.disk_write_errors > 0 and stats.disk_full
    assert stats.hit_blocks["host"] > 0
    assert "No space left on device" in caplog.text
    assert not list(directory.rglob("*.tmp*")), "a partial file was left"
    assert len(list(directory.rglob("*.kvb"))) == 3
    metrics = {m.name: m.value for m in llm.get_metrics() if not m.labels}
    assert metrics["deepinfer:kv_tier_disk_full"] == 1.0


def test_the_disk_tier_stays_within_its_bound(llama_ckpt, tmp_path):
    directory = tmp_path / "kv"
    probe = LLM(str(llama_ckpt), block_size=8, kv_cache_dir=str(directory))
    file_bytes = probe.engine.tiers.codec.entry_bytes + 120
    probe.close()
    bound = 6 * file_bytes
    llm = LLM(str(llama_ckpt), block_size=8, kv_cache_dir=str(tmp_path / "bounded"), kv_disk_bytes=bound)
    for seed in range(4):
        _generate(llm, _one_prompt(length=60, seed=seed))
        llm.engine.tiers._writer.submit(lambda: None).result()
        files = list((tmp_path / "bounded").rglob("*.kvb"))
        assert sum(f.stat().st_size for f in files) <= bound
    llm.close()
    files = list((tmp_path / "bounded").rglob("*.kvb"))
    assert len(files) == 6 and sum(f.stat().st_size for f in files) <= bound
    # the newest prompt's blocks are the ones kept: its 60 prompt tokens fill blocks 0-6,
    # written tail first, and its reply fills block 7, written last; six files keep blocks
    # 0-4 and 7, so a new process finds five blocks of its prefix, and none of the oldest's
    again = LLM(str(llama_ckpt), block_size=8, kv_cache_dir=str(tmp_path / "bounded"), kv_disk_bytes=bound)
    _generate(again, _one_prompt(length=60, seed=3))
    newest = tier_hits(again)["disk"]
    _generate(again, _one_prompt(length=60, seed=0))
    oldest = tier_hits(again)["disk"] - newest
    again.close()
    assert (newest, oldest) == (5, 0)


def test_an_abort_while_loading_frees_the_blocks_once_the_load_ends(llama_ckpt, monkeypatch):
    import threading

    from deepinfer.cache.tiers.store import KVTiers

    llm = LLM(str(llama_ckpt), block_size=8, num_cache_blocks=16, kv_offload_bytes=64 * MIB)
    prompt = _one_prompt(length=100)
    _generate(llm, prompt)
    _generate(llm, _one_prompt(length=100, seed=9))  # evicts the first prompt's blocks
    gate = threading.Event()
    load = KVTiers.load_blocks

    def held(self, items):
        gate.wait(30)
        return load(self, items)

    monkeypatch.setattr(KVTiers, "load_blocks", held)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    assert engine.scheduler.tier_hits.num_loading == 1
    engine.abort("r")
    gate.set()
    while engine.has_unfinished() or engine.scheduler.tier_hits.loading:
        engine.step()
    assert engine.block_pools[0].num_free == engine.num_blocks
    llm.close()


def test_new_weights_never_read_the_old_weights_blocks(llama_ckpt, tmp_path):
    llm = LLM(str(llama_ckpt), block_size=8, num_cache_blocks=16, kv_offload_bytes=64 * MIB)
    prompt = _one_prompt(length=100)
    _generate(llm, prompt)
    _generate(llm, _one_prompt(length=100, seed=9))  # evicts it from the pool; the tier keeps it
    name, param = next((n, p) for n, p in llm.model.named_parameters() if n.endswith("q_proj.weight"))
    llm.update_weights({name: param.detach() * 1.5})
    got = _generate(llm, prompt)
    assert sum(tier_hits(llm).values()) == 0
    fresh = LLM(str(llama_ckpt), block_size=8, num_cache_blocks=16)
    fresh.update_weights({name: param.detach().clone()})  # the same new values, no cache
    assert _generate(fresh, prompt) == got
    llm.close()
    fresh.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kv_offload_bytes=-1), "kv_offload_bytes"),
        (dict(kv_offload_bytes="8G"), "kv_offload_bytes"),
        (dict(kv_cache_dir="/tmp/x", kv_disk_bytes=0), "kv_disk_bytes"),
        (dict(kv_cache_dir=3), "kv_cache_dir"),
        (dict(kv_offload_bytes=1 << 20, enable_prefix_caching=False), "enable_prefix_caching"),
    ],
)
def test_bad_tier_options_are_named(llama_ckpt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(llama_ckpt), **kwargs)


def test_the_server_reports_the_tiers(llama_ckpt, tmp_path):
    """``/metrics`` carries the tiers' series: a prompt evicted from the pool and sent again is
    a host-tier hit, with bytes loaded and stored, counted among the cached prompt tokens."""
    import httpx
    from live_server import LiveServer

    from deepinfer.server.app import build_app

    llm = LLM(str(llama_ckpt), block_size=8, num_cache_blocks=16, kv_offload_bytes=64 * MIB)
    live = LiveServer(build_app(llm, "tiny"))
    try:
        client = httpx.Client(base_url=live.url, timeout=60)
        prompts = [_one_prompt(length=100), _one_prompt(length=100, seed=9), _one_prompt(length=100)]
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
        text = client.get("/metrics").text
    finally:
        live.stop()
        llm.close()
    series = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("deepinfer:kv_tier")
    }
    assert series['deepinfer:kv_tier_hit_blocks_total{model_name="tiny",tier="host"}'] >= 12
    assert series['deepinfer:kv_tier_bytes_total{direction="load",model_name="tiny",tier="host"}'] > 0
    assert series['deepinfer:kv_tier_bytes_total{direction="store",model_name="tiny",tier="host"}'] > 0
    assert series['deepinfer:kv_tier_loads_total{model_name="tiny"}'] >= 1
    assert 'deepinfer:kv_tier_load_seconds_total{model_name="tiny"}' in series


@pytest.mark.parametrize("mutant", [False, True])
def test_a_block_handed_out_before_its_copy_is_not_kept(llama_ckpt, mutant):
    """A published block's copy waits for the step that may still write its last row; if the
    pool hands the block to a new owner first (its request ended or was preempted, and a full
    pool takes it at once), the copy is dropped: the new owner's step could write it before
    the copy runs. Mutation: a pool that does not tell the tiers keeps the block's new rows
    under the old prefix."""
    llm = LLM(str(llama_ckpt), num_cache_blocks=16, block_size=8, kv_offload_bytes=64 * MIB)
    tiers, pool = llm.engine.tiers, llm.engine.block_pools[0]
    if mutant:
        pool.on_allocate = None
    key = b"\x01" * 32
    tiers.store(key, 5, None)  # published, its copy queued
    tiers.flush(complete=False)  # held: the step scheduled meanwhile may write its last row
    taken = pool.allocate(pool.num_free)  # the pool hands every block out, block 5 among them
    assert taken is not None and 5 in taken
    tiers.flush()
    assert tiers.has(key) == mutant
    llm.close()


def _tensor_parallel_turns(llama_ckpt, tier_kwargs: dict, seed: int) -> tuple[list, list, LLM]:
    """A multi-turn workload over a small pool: the replies of one rank without tiers, and of
    two tensor-parallel ranks with ``tier_kwargs`` (that engine left open)."""
    convs = conversations(seed, 200, 4, 3)
    longest = max(sum(len(u) for u in c) for c in convs) + 3 * 6
    kwargs = dict(
        num_cache_blocks=-(-longest // 8) + 2, block_size=8, max_num_batched_tokens=16, max_num_seqs=4
    )
    plain = LLM(str(llama_ckpt), **kwargs)
    expected = run_turns(plain, convs, 6)
    plain.close()
    tiered = LLM(str(llama_ckpt), **kwargs, **tier_kwargs, tensor_parallel_size=2)
    try:
        return expected, run_turns(tiered, convs, 6), tiered
    except BaseException:
        tiered.close()
        raise


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tensor_parallel_ranks_each_keep_their_cut(llama_ckpt, tier, tmp_path):
    """Two tensor-parallel ranks, each with its own tiers over its own pools (its own disk
    namespace): prefixes come back from the tier and every reply equals one rank's without
    tiers."""
    directory = tmp_path / "kv"
    options = {"host": {"kv_offload_bytes": 64 * MIB}, "disk": {"kv_cache_dir": str(directory)}}[tier]
    expected, got, llm = _tensor_parallel_turns(llama_ckpt, options, seed=11)
    hits = tier_hits(llm)
    llm.close()
    assert got == expected
    assert hits[tier] > 0, f"no prefix came back from the {tier} tier"
    if tier == "disk":
        spaces = {p.relative_to(directory).parts[0] for p in directory.rglob("*.kvb")}
        assert {s.rsplit("-", 1)[1] for s in spaces} == {"tp0of2", "tp1of2"}, spaces


@pytest.mark.parametrize("mutant", [False, True])
def test_a_load_counts_only_where_every_rank_found_its_part(llama_ckpt, monkeypatch, mutant):
    """Rank 0 withholds its copies from the workers, so a worker's tier never has the blocks
    rank 0's has: every load is agreed missing and the prefix is computed again, changing no
    reply. Mutation: rank 0 taking its own finding as the answer serves blocks the worker
    never filled, and replies change."""
    from deepinfer.cache.tiers import KVTiers
    from deepinfer.distributed import tiers as tp_tiers

    def copy_without_sending(self, items):
        KVTiers.copy_blocks(self, items)

    monkeypatch.setattr(tp_tiers.TensorParallelTiers, "copy_blocks", copy_without_sending)
    if mutant:
        agree = tp_tiers.agree
        monkeypatch.setattr(tp_tiers, "agree", lambda found, group: agree(found, group) or found)
    expected, got, llm = _tensor_parallel_turns(llama_ckpt, {"kv_offload_bytes": 64 * MIB}, seed=12)
    stats = llm.engine.tiers.stats()
    llm.close()
    assert stats.loads + stats.failed_loads > 0, "the workload loaded nothing from the tier"
    assert (got == expected) != mutant
