"""The KV-tier guide's promises (docs/guide/kv-tiers.md) that other tests leave out: the cache
salt and the LoRA adapter are part of a tier's key, writes past the writer's backlog skip the
disk and are counted, a failed write pauses writes for 30 s, the three command-line flags reach
the engine, an update moves the disk tier to a namespace of its own, and the engine modes
tiers do not run under are refused."""

from __future__ import annotations

import errno
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from live_server import LiveServer
from lora_adapters import hf_llama, make_adapter

from deepinfer import LLM, LoRARequest, SamplingParams
from deepinfer.cache.tiers import disk as disk_tier
from deepinfer.cache.tiers import store as tier_store
from deepinfer.cli.engine_args import llm_kwargs
from deepinfer.cli.parser import build_parser
from deepinfer.server.app import build_app
from deepinfer.tiny import make_tiny_checkpoint

MIB = 1 << 20
# a pool of 16 blocks of 8 positions: one 100-token prompt fills most of it, so the next
# prompt evicts it, and sending it again can only hit a tier
SMALL_POOL = {"block_size": 8, "num_cache_blocks": 16, "compile": False}


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)


def _prompt(seed: int, length: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 200) for _ in range(length)]


def _generate(llm: LLM, prompt: list[int], lora_request: LoRARequest | None = None) -> list[int]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora_request)
    return list(out[0].outputs[0].token_ids)


def _metric(llm: LLM, name: str, **labels: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and labels.items() <= m.labels.items())


def _tier_hits(llm: LLM) -> float:
    return _metric(llm, "deepinfer:kv_tier_hit_blocks")


def _wait_for_files(directory: Path, count: int, timeout_s: float = 60.0) -> list[Path]:
    """The block files under ``directory`` once there are at least ``count`` (the disk
    writes run on a writer thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(directory.rglob("*.kvb"))
        if len(files) >= count or time.monotonic() > deadline:
            return files
        time.sleep(0.05)


# ---- the key of a tier entry ----------------------------------------------------------------


def test_the_cache_salt_is_part_of_the_tier_key(llama_ckpt):
    """A prompt evicted from the pool and sent again with another ``cache_salt`` finds
    nothing in the host tier (a salt isolates its users' prefixes); sent with its own salt, it
    comes back from the tier."""
    llm = LLM(llama_ckpt, **SMALL_POOL, kv_offload_bytes=64 * MIB)
    live = LiveServer(build_app(llm, "tiny"))
    prompt = _prompt(1)
    try:
        client = httpx.Client(base_url=live.url, timeout=120)

        def complete(tokens: list[int], salt: str) -> list[str]:
            body = {"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0.0, "logprobs": 0}
            resp = client.post("/v1/completions", json={**body, "ignore_eos": True, "cache_salt": salt})
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["logprobs"]["tokens"]

        first = complete(prompt, "alice")
        complete(_prompt(2), "alice")  # evicts the first prompt from the pool
        assert complete(prompt, "bob") == first
        assert _tier_hits(llm) == 0
        assert complete(prompt, "alice") == first
        assert _tier_hits(llm) > 0
    finally:
        live.stop()
        llm.close()


def test_the_adapter_is_part_of_the_tier_key(llama_ckpt, tmp_path):
    """A prefix computed with one adapter is never loaded from a tier for another adapter or
    for the base model; the same adapter loads it back and replies the same."""
    base = hf_llama(llama_ckpt)
    adapters = []
    for i in range(2):
        config = {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "v_proj"], "init_lora_weights": False}
        make_adapter(base, tmp_path / f"ad{i}", config, seed=i, b_scale=1.0)
        adapters.append(LoRARequest(f"ad{i}", i + 1, str(tmp_path / f"ad{i}")))
    llm = LLM(llama_ckpt, **SMALL_POOL, kv_offload_bytes=64 * MIB, enable_lora=True)
    prompt = _prompt(1)
    first = _generate(llm, prompt, adapters[0])
    _generate(llm, _prompt(2))  # evicts the first prompt from the pool
    _generate(llm, prompt, adapters[1])
    _generate(llm, prompt)
    assert _tier_hits(llm) == 0
    assert _generate(llm, prompt, adapters[0]) == first
    assert _tier_hits(llm) > 0
    llm.close()


# ---- the disk writer ------------------------------------------------------------------------


def test_writes_past_the_writers_backlog_skip_the_disk_and_are_counted(llama_ckpt, tmp_path, monkeypatch):
    """While the writer is behind by more than its backlog, newly published blocks skip the
    disk and count in ``kv_tier_disk_writes_dropped``; the blocks queued before are written
    and serve a later process, the skipped ones do not."""
    probe = LLM(llama_ckpt, **SMALL_POOL, kv_offload_bytes=64 * MIB)
    first, second = _prompt(1), _prompt(2)
    _generate(probe, first)
    first_bytes = _metric(probe, "deepinfer:kv_tier_bytes", tier="host", direction="store")
    probe.close()
    assert first_bytes > 0
    monkeypatch.setattr(tier_store, "_MAX_WRITE_BACKLOG", int(first_bytes))  # the first prompt fits
    release = threading.Event()
    real_write = disk_tier._write_file

    def slow(path: Path, chunks: list[bytes]) -> None:
        release.wait(60)  # a disk slower than the steps
        real_write(path, chunks)

    monkeypatch.setattr(disk_tier, "_write_file", slow)
    directory = tmp_path / "kv"
    llm = LLM(llama_ckpt, **SMALL_POOL, kv_cache_dir=str(directory))
    _generate(llm, first)
    assert _metric(llm, "deepinfer:kv_tier_disk_writes_dropped") == 0
    _generate(llm, second)
    dropped = _metric(llm, "deepinfer:kv_tier_disk_writes_dropped")
    release.set()
    llm.close()  # waits for the queued writes
    assert dropped >= len(second) // 8
    monkeypatch.setattr(disk_tier, "_write_file", real_write)
    later = LLM(llama_ckpt, **SMALL_POOL, kv_cache_dir=str(directory))
    _generate(later, second)
    assert _tier_hits(later) == 0
    _generate(later, first)
    assert _metric(later, "deepinfer:kv_tier_hit_blocks", tier="disk") > 0
    later.close()


def test_a_failed_write_pauses_writes_for_30_seconds(tmp_path, monkeypatch):
    """A write that fails (here ENOSPC) is counted and marks the disk full; the next writes
    within 30 s are not tried (the disk is not hammered), and once 30 s have passed a write
    is tried again, goes through, and clears the mark."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(disk_tier, "time", SimpleNamespace(monotonic=lambda: clock["now"], time=time.time))
    tried: list[Path] = []
    real_write = disk_tier._write_file

    def failing_once(path: Path, chunks: list[bytes]) -> None:
        tried.append(path)
        if len(tried) == 1:
            path.write_bytes(chunks[0][:10])  # part of the file, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, chunks)

    monkeypatch.setattr(disk_tier, "_write_file", failing_once)
    tier = disk_tier.DiskTier(tmp_path, "ns", 1 << 20)
    keys = [bytes([i]) * 32 for i in range(4)]
    assert not tier.write(keys[0], b"a" * 100, 50)
    assert tier.write_errors == 1 and tier.full and len(tried) == 1
    assert not list(tmp_path.rglob("*.tmp*")) and not list(tmp_path.rglob("*.kvb"))
    clock["now"] += 29.0
    assert not tier.write(keys[1], b"b" * 100, 50)
    assert len(tried) == 1 and tier.write_errors == 1  # paused: not tried, not another error
    clock["now"] += 2.0
    assert tier.write(keys[2], b"c" * 100, 50)
    assert len(tried) == 2 and not tier.full
    assert tier.read(keys[2], 50) == b"c" * 100 and tier.read(keys[1], 50) is None


# ---- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["generate", "--model", "MODEL", "--prompt", "hi"], ["chat", "MODEL"], ["serve", "MODEL"]],
    ids=["generate", "chat", "serve"],
)
def test_the_tier_flags_reach_the_engine(llama_ckpt, tmp_path, argv):
    """``--kv-offload-bytes``, ``--kv-cache-dir`` and ``--kv-disk-bytes`` (sizes with binary
    suffixes) become the engine's tier options on every command that builds an engine."""
    parser = build_parser()
    flags = ["--kv-offload-bytes", "8G", "--kv-cache-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "100G"]
    kwargs = llm_kwargs(parser.parse_args([*argv, *flags]))
    assert kwargs["kv_offload_bytes"] == 8 << 30 and kwargs["kv_disk_bytes"] == 100 << 30
    assert kwargs["kv_cache_dir"] == str(tmp_path / "kv")
    flags = ["--kv-offload-bytes", "1M", "--kv-cache-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "3M"]
    args = parser.parse_args(
        [a if a != "MODEL" else str(llama_ckpt) for a in argv] + flags + ["--compile", "off"]
    )
    llm = LLM(args.model, **llm_kwargs(args))
    assert (llm.config.kv_offload_bytes, llm.config.kv_disk_bytes) == (MIB, 3 * MIB)
    assert 0 < _metric(llm, "deepinfer:kv_tier_capacity_bytes", tier="host") <= MIB
    assert _metric(llm, "deepinfer:kv_tier_capacity_bytes", tier="disk") == 3 * MIB
    _generate(llm, _prompt(1, length=40))
    llm.close()
    assert list((tmp_path / "kv").rglob("*.kvb")), "nothing was written under --kv-cache-dir"


# ---- weights updated in place ---------------------------------------------------------------


def test_an_update_moves_the_disk_tier_to_a_namespace_of_its_own(llama_ckpt, tmp_path):
    """After ``update_weights`` the engine reads none of the files of the old weights and
    writes to a new namespace, whose files serve its own later hits; the old namespace stays
    for a later process over the checkpoint."""
    directory = tmp_path / "kv"
    prompt, other = _prompt(1), _prompt(2)
    llm = LLM(llama_ckpt, **SMALL_POOL, kv_cache_dir=str(directory))
    before = _generate(llm, prompt)
    blocks = len(prompt) // 8
    assert len(_wait_for_files(directory, blocks)) >= blocks
    (old_namespace,) = [d for d in directory.iterdir() if d.is_dir()]
    name, param = next((n, p) for n, p in llm.model.named_parameters() if n.endswith("q_proj.weight"))
    llm.update_weights({name: param.detach() * 1.5})
    after = _generate(llm, prompt)
    assert _tier_hits(llm) == 0  # the old weights' blocks were not read
    namespaces = [d for d in directory.iterdir() if d.is_dir()]
    assert len(namespaces) == 2
    (new_namespace,) = [d for d in namespaces if d != old_namespace]
    assert len(_wait_for_files(new_namespace, blocks)) >= blocks
    _generate(llm, other)  # evicts the prompt from the pool
    assert _generate(llm, prompt) == after
    assert _metric(llm, "deepinfer:kv_tier_hit_blocks", tier="disk") > 0
    llm.close()
    later = LLM(llama_ckpt, **SMALL_POOL, kv_cache_dir=str(directory))
    assert _generate(later, prompt) == before
    assert _metric(later, "deepinfer:kv_tier_hit_blocks", tier="disk") > 0
    later.close()


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", [{"kv_offload_bytes": MIB}, {"kv_cache_dir": "KV"}], ids=["host", "disk"])
@pytest.mark.parametrize(
    "option,match",
    [
        ({"data_parallel_size": 2}, "one rank"),
        ({"enable_return_routed_experts": True}, "enable_return_routed_experts"),
    ],
    ids=["dp", "routed_experts"],
)
def test_tiers_refuse_data_parallel_and_routed_expert_return(llama_ckpt, tmp_path, tier, option, match):
    """Data-parallel ranks hold different requests (their tiers would need rank 0's scheduler
    to place every rank's hits), and a loaded block does not keep its routing: both are refused
    with the reason before any weights are loaded (tensor parallel is served: the tiers
    tests run it)."""
    tier = {k: (str(tmp_path / "kv") if v == "KV" else v) for k, v in tier.items()}
    with pytest.raises(ValueError, match=rf"kv_offload_bytes / kv_cache_dir.*{match}"):
        LLM(llama_ckpt, **tier, **option)
