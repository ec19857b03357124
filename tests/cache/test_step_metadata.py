"""Both builders of the compressor bookkeeping (the compiled one, ``native_group_meta``, and
the NumPy one) equal the plain Python walk they replaced (``step_metadata_reference``), field
for field, on generated steps: decodes and prefill chunks mixed, groups closing anywhere in a
chunk, prefix-hit restores, every padding mode. So does a dense step's attention metadata."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from step_metadata_reference import reference_full_attention_meta, reference_group_meta

from deepinfer.cache import full_attention_meta, group_meta, native_group_meta
from deepinfer.cache.forward_batch import GroupMeta
from deepinfer.cache.step_chunks import MIN_ROWS, SeqChunk, StepPadding, padded_chunks
from deepinfer.cache.token_layout import align_window_tables, build_token_layout, padded_table


@st.composite
def steps(draw):
    """(block size, ratio, chunks, padding) of one valid step."""
    bs = draw(st.sampled_from([4, 8, 16]))
    ratio = draw(st.sampled_from([r for r in (1, 2, 4, 8, 128) if bs % r == 0 or r == 128]))
    if ratio > bs:
        bs = ratio  # a group never spans blocks: the entry pool holds bs // ratio per block
    decode_only = draw(st.booleans())
    num_seqs = draw(st.integers(1, 6))
    slots = draw(st.permutations(range(8)))[:num_seqs]
    blocks = iter(draw(st.permutations(range(64))))
    chunks = []
    for slot in slots:
        start = draw(st.integers(0, 3 * bs))
        num_tokens = 1 if decode_only else draw(st.integers(1, 2 * bs))
        table = [next(blocks) for _ in range(-(-(start + num_tokens) // bs))]
        restore = start >= bs and draw(st.booleans())
        chunks.append(SeqChunk(table, slot, start, num_tokens, restore_overlap=restore))
    mode = draw(
        st.sampled_from(["none", "padded", "tokens", "bucket"] if decode_only else ["none", "padded"])
    )
    padding = None
    if mode != "none":
        total = sum(c.num_tokens for c in chunks)
        num_tokens = total + draw(st.integers(0, 3)) if mode in ("tokens", "bucket") else None
        max_len = 4 * bs if mode == "bucket" else None
        padding = StepPadding(null_block=64, null_slot=8, num_tokens=num_tokens, max_model_len=max_len)
    return bs, ratio, chunks, padding


def _native(layout, ratio, tokens, padding):
    fields = native_group_meta.build(layout.block_size, ratio, tokens, padding, MIN_ROWS)
    assert fields is not None  # every generated step fits its padding
    return GroupMeta(**fields)


BUILDERS = {"native": _native, "numpy": group_meta.build_numpy}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_group_meta_equals_the_python_walk(name):
    if name == "native" and not native_group_meta.available():
        pytest.skip("no C++ compiler on this machine: the NumPy builder runs instead")
    _check_builder(BUILDERS[name])


def _check_builder(builder) -> None:
    @settings(max_examples=300, deadline=None)
    @given(steps())
    def check(step):
        _check_step(builder, step)

    check()


def _check_step(builder, step) -> None:
    bs, ratio, chunks, padding = step
    layout = SimpleNamespace(block_size=bs)
    chunks = padded_chunks(chunks, padding)
    tokens = build_token_layout(chunks, padding)
    got = builder(layout, ratio, tokens, padding)
    as_torch = SimpleNamespace(
        **{k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in vars(tokens).items()}
    )
    want = reference_group_meta(layout, chunks, ratio, as_torch, padding)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name


@settings(max_examples=200, deadline=None)
@given(steps())
def test_full_attention_meta_equals_the_row_walk(step):
    """A dense (Llama) step's decode rows, their pool rows and masks, and its prefill spans
    equal a walk over each row and position, in every padding mode (a graph bucket's compact
    form expanded by its device ops)."""
    bs, _, chunks, padding = step
    chunks = padded_chunks(chunks, padding)
    tokens = build_token_layout(chunks, padding)
    got = full_attention_meta.build(SimpleNamespace(block_size=bs), chunks, tokens, padding)
    compact = padding is not None and padding.max_model_len is not None
    assert (got.decode_kv is None) == compact
    got = got.expand()
    want = reference_full_attention_meta(bs, chunks, padding)
    dtypes = {"decode_valid": torch.bool}
    for name, values in want.items():
        tensor = getattr(got, name)
        assert tensor.dtype == dtypes.get(name, torch.long), name
        if name == "span_meta":
            assert tensor.shape == (len(values), 4)
        elif name.startswith("decode_") and name != "decode_rows":
            assert tensor.shape == (len(values), len(values[0]) if values else tensor.shape[1]), name
        assert tensor.tolist() == values, name


def test_native_builder_leaves_out_of_table_steps_to_numpy():
    """Steps the scheduler never makes, whose block reads fall outside a chunk's table (a
    restore before the first block boundary, a table shorter than the chunk), are not read
    out of bounds by the compiled builder: it declines them and the NumPy rules apply."""
    if not native_group_meta.available():
        pytest.skip("no C++ compiler on this machine: the NumPy builder runs instead")
    layout = SimpleNamespace(block_size=4)
    restore_early = [SeqChunk([7, 9], 1, 2, 5, restore_overlap=True)]
    short_table = [SeqChunk([3], 0, 0, 16)]
    for chunks in (restore_early, short_table):
        tokens = build_token_layout(chunks, None)
        assert native_group_meta.build(4, 2, tokens, None, MIN_ROWS) is None
    tokens = build_token_layout(restore_early, None)
    got = group_meta.build(layout, 2, tokens, None)
    want = group_meta.build_numpy(layout, 2, tokens, None)
    for f in dataclasses.fields(want):
        assert torch.equal(getattr(got, f.name), getattr(want, f.name)), f.name
    with pytest.raises(IndexError):
        group_meta.build(layout, 2, build_token_layout(short_table, None), None)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_window_tables_align_held_blocks_with_the_block_table(data):
    """Each chunk's window table as its request holds it (given-back or missing blocks < 0,
    shorter or longer than its block table) reads, column for column of the step's block
    tables, its held block where one is held and its null block elsewhere."""
    n = data.draw(st.integers(1, 5))
    chunks = []
    for i in range(n):
        blocks = data.draw(st.integers(1, 6))
        held = data.draw(st.lists(st.one_of(st.just(-1), st.integers(0, 50)), max_size=blocks + 2))
        null = data.draw(st.sampled_from([99, 100 + i]))
        chunks.append(SeqChunk(list(range(blocks)), i, 0, 1, window_table=held, window_null=null))
    tables, sizes = padded_table([c.block_table for c in chunks])
    got = align_window_tables(chunks, [c.window_table for c in chunks], tables.shape[1], sizes)
    for row, c in zip(got.tolist(), chunks, strict=True):
        held = c.window_table[: len(c.block_table)]
        aligned = [b if b >= 0 else c.window_null for b in held]
        aligned += [c.window_null] * (len(row) - len(aligned))
        assert row == aligned


def test_window_tables_need_the_null_block():
    chunk = SeqChunk([0, 1], 0, 0, 1, window_table=[3, -1])
    with pytest.raises(ValueError, match="window_null"):
        build_token_layout([chunk], None)
    with_null = SeqChunk([0, 1], 0, 0, 1, window_table=[3, -1], window_null=9)
    for table in ([9], None):  # a chunk without its table, with or without a null block
        other = SeqChunk([2], 1, 0, 1, window_table=None, window_null=table and table[0])
        with pytest.raises(ValueError, match="window table"):
            build_token_layout([with_null, other], None)


def test_metadata_moves_in_one_copy_per_dtype():
    """``to_device_together`` hands back every tensor equal and in order, each dtype's as
    views of one buffer (one copy), whatever the shapes (empty ones included)."""
    from deepinfer.cache.host_tensors import to_device_together

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 9, (3, 4), generator=gen),
        torch.rand(5, generator=gen) > 0.5,
        torch.randint(0, 9, (0,), generator=gen),
        torch.randint(0, 9, (7,), generator=gen, dtype=torch.int32),
        torch.randint(0, 9, (2, 2, 2), generator=gen),
    ]
    moved = to_device_together(tensors, torch.device("cpu"))
    assert len(moved) == len(tensors)
    for a, b in zip(moved, tensors, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    longs = [t for t in moved if t.dtype == torch.long and t.numel()]
    assert len({t.untyped_storage().data_ptr() for t in longs}) == 1
