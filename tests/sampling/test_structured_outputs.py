"""Structured outputs on SmolLM2 (xgrammar against its tokenizer): hypothesis-generated JSON
schemas and regexes (51 and 30 in random batches) plus hand-written nested schemas; every output parses and validates or
fully matches, greedy and seeded temperature 1, with n-gram speculation on too, under
chunked prefill and preemption; bad constraints are refused at submission without touching
the engine; the server's ``response_format`` and ``structured_outputs``."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from live_server import LiveServer

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.server.app import build_app

NAMES = st.from_regex(r"[a-z][a-z_]{0,6}", fullmatch=True)
LEAVES = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(
        st.one_of(st.text(alphabet="abcxyz", min_size=1, max_size=4), st.integers(-9, 9)),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(lambda values: {"enum": values}),
    st.sampled_from(["^[a-z]{1,3}$", "^[0-9]{2}-[0-9]{2}$", "^(yes|no)$"]).map(
        lambda p: {"type": "string", "pattern": p}
    ),
)


def _objects(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)}
    )


def _arrays(children):
    return st.builds(
        lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
        children,
        st.integers(0, 2),
        st.integers(0, 2),
    )


# A JSON string character costs at most 12 bytes ("\ud83d\ude00" is one character), and a
# token carries at least one byte, so an instance's byte bound is a token bound.
_CHAR_BYTES = 12
_PATTERN_BYTES = {"^[a-z]{1,3}$": 3, "^[0-9]{2}-[0-9]{2}$": 5, "^(yes|no)$": 3, "^[a-z]{2}$": 2}
MAX_JSON_TOKENS = 900


def max_json_bytes(schema: dict, root: dict | None = None) -> int:
    """The longest serialization of any instance of ``schema`` (the generated subset of JSON
    Schema) as xgrammar writes it without "any whitespace" (separators ", " and ": "), so a
    request given this many tokens plus one must stop by its grammar: finishing by length
    would be a real failure, never a long draw."""
    root = schema if root is None else root
    if "$ref" in schema:
        return max_json_bytes(root["$defs"][schema["$ref"].rsplit("/", 1)[-1]], root)
    if "anyOf" in schema:
        return max(max_json_bytes(s, root) for s in schema["anyOf"])
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    # without "any whitespace" xgrammar still writes json.dumps' separators, ", " and ": "
    if kind == "object":
        fields = [len(json.dumps(k)) + 2 + max_json_bytes(v, root) for k, v in schema["properties"].items()]
        return 2 + sum(fields) + 2 * (len(fields) - 1)
    if kind == "array":
        most = schema["maxItems"]
        return 2 + most * max_json_bytes(schema["items"], root) + 2 * max(most - 1, 0)
    if kind == "integer":
        return 1 + max(len(str(schema["minimum"])), len(str(schema["maximum"])))  # "-0"
    if kind == "string":
        if "pattern" in schema:
            return 2 + _PATTERN_BYTES[schema["pattern"]]
        return 2 + _CHAR_BYTES * schema["maxLength"]
    return {"boolean": 5, "null": 4}[kind]


SCHEMAS = _objects(st.recursive(LEAVES, lambda c: st.one_of(_objects(c), _arrays(c)), max_leaves=5)).filter(
    lambda s: max_json_bytes(s) < MAX_JSON_TOKENS
)

ATOMS = st.sampled_from(["[a-z]", "[0-9]", "[A-F]", "x", "ab", r"\.", "-", "(cat|dog)", "[aeiou]", " "])
QUANTIFIERS = st.sampled_from(["", "?", "{2}", "{1,3}", "{0,2}"])
SEQUENCES = st.lists(st.tuples(ATOMS, QUANTIFIERS).map("".join), min_size=1, max_size=6).map("".join)
REGEXES = st.one_of(SEQUENCES, st.tuples(SEQUENCES, SEQUENCES).map(lambda ab: f"({ab[0]}|{ab[1]})"))

NESTED = [
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                },
                "required": ["name", "tags"],
            },
            "scores": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "k": {"type": "string", "pattern": "^[a-z]{2}$"},
                        "v": {"type": "boolean"},
                    },
                    "required": ["k", "v"],
                },
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["user", "scores"],
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
            }
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "b": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
        },
        "required": ["a", "b"],
    },
]

PROMPT = 'Answer in JSON, for example {"name": "cat", "size": 3, "ok": true}. '


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m", max_model_len=1024, max_num_seqs=64)


@pytest.fixture(scope="module")
def smol_ngram():
    return LLM(
        "smollm2-135m",
        max_model_len=1024,
        max_num_seqs=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )


def _json_params(schemas: list[dict]) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=max_json_bytes(schema) + 1,
            temperature=0.0 if i % 2 == 0 else 1.0,
            seed=i,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for i, schema in enumerate(schemas)
    ]


def _check_json(outs, schemas) -> None:
    for out, schema in zip(outs, schemas, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def _check_regex(outs, regexes) -> None:
    for out, regex in zip(outs, regexes, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (regex, completion.text)
        assert re.fullmatch(regex, completion.text), (regex, completion.text)


def _batches(examples: int):
    """``examples`` hypothesis examples, each one batch through the engine. Hypothesis's
    first example is its minimal one (every schema ``{"a": 0}``), so the random ones are
    the rest: the counts below are per random example."""
    return settings(
        max_examples=examples,
        deadline=None,
        # No shrinking: one engine batch takes seconds, and the unshrunk failing batch is
        # printed whole (a CI run spent five minutes shrinking one).
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


@_batches(4)
@given(
    schemas=st.lists(SCHEMAS, min_size=17, max_size=17), regexes=st.lists(REGEXES, min_size=10, max_size=10)
)
def test_every_output_validates_or_matches(smol, schemas, regexes):
    """Three random batches (51 generated schemas and 30 generated regexes in all) plus the
    nested schemas, greedy and seeded temperature 1 alternating: all stop by the grammar
    and validate or fully match."""
    schemas = schemas + NESTED
    params = _json_params(schemas) + [
        SamplingParams(
            max_tokens=64, temperature=1.0 if i % 2 else 0.0, seed=i, structured_outputs={"regex": r}
        )
        for i, r in enumerate(regexes)
    ]
    prompts = [PROMPT] * len(schemas) + ["Write something: "] * len(regexes)
    outs = smol.generate(prompts, params, use_tqdm=False)
    _check_json(outs[: len(schemas)], schemas)
    _check_regex(outs[len(schemas) :], regexes)


@_batches(2)
@given(
    schemas=st.lists(SCHEMAS, min_size=20, max_size=20), regexes=st.lists(REGEXES, min_size=10, max_size=10)
)
def test_with_ngram_speculation(smol_ngram, schemas, regexes):
    """The same under n-gram speculation (one random batch of 20 schemas and 10 regexes):
    drafts are cut at the grammar's first rejection and verified against masked rows;
    drafts were proposed, outputs still validate."""
    schemas = schemas + NESTED
    params = _json_params(schemas) + [
        SamplingParams(max_tokens=64, temperature=0.0, structured_outputs={"regex": r}) for r in regexes
    ]
    prompts = [PROMPT * 3] * len(schemas) + ["abab cat dog 12-34 " * 3] * len(regexes)
    # through the engine's API, not LLM.generate: a generate call is a closed batch, where only
    # requests that could be the last to finish verify drafts, and which those are depends on
    # when each grammar finished compiling (a thread's timing), so the drafted path might not
    # run at all; here every request may verify its drafts
    engine = smol_ngram.engine
    ids = [f"ngram-{uuid.uuid4().hex}" for _ in prompts]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, smol_ngram.tokenizer(prompt).input_ids, p)
    while engine.has_unfinished():
        engine.step()
    outs = [engine.make_output(engine.pop_finished(rid)) for rid in ids]
    _check_json(outs[: len(schemas)], schemas)
    _check_regex(outs[len(schemas) :], regexes)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def _broken(schema: dict) -> dict:
    """``schema`` with its leaves' types changed (strings and enums to integers in 10..99,
    integers to 10..99 past the original range): every instance of it is JSON that the
    original schema rejects."""
    if "$defs" in schema:
        return {**schema, "$defs": {k: _broken(v) for k, v in schema["$defs"].items()}}
    if "anyOf" in schema:
        return {"anyOf": [_broken(s) for s in schema["anyOf"]]}
    if "$ref" in schema:
        return schema
    if schema.get("type") == "object":
        return {**schema, "properties": {k: _broken(v) for k, v in schema["properties"].items()}}
    if schema.get("type") == "array":
        return {**schema, "items": _broken(schema["items"])}
    if schema.get("type") == "null":
        return {"type": "boolean"}
    return {"type": "integer", "minimum": 10, "maximum": 99}


def test_a_wrong_grammar_fails_the_schema_check(smol):
    """Mutation check: outputs constrained by a broken grammar (each nested schema with its
    leaves' types changed) stop by that grammar and parse as JSON, so the check above gets
    as far as ``jsonschema.validate``, and there each fails."""
    broken = [_broken(s) for s in NESTED]
    outs = smol.generate([PROMPT] * len(broken), _json_params(broken), use_tqdm=False)
    for out, schema, wrong in zip(outs, NESTED, broken, strict=True):
        _check_json([out], [wrong])  # stopped by its grammar, valid for what it was given
        with pytest.raises(jsonschema.ValidationError):
            _check_json([out], [schema])


def test_choice_grammar_and_json_object(smol):
    params = [
        SamplingParams(
            max_tokens=16, temperature=1.0, seed=s, structured_outputs={"choice": ["Paris", "Lyon", 'a "q"']}
        )
        for s in range(6)
    ]
    params.append(
        SamplingParams(max_tokens=16, structured_outputs={"grammar": 'root ::= "yes" | "no" | [0-9] [0-9]'})
    )
    params.append(SamplingParams(max_tokens=200, temperature=0.0, structured_outputs={"json_object": True}))
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<city>",
            "content": {"type": "json_schema", "json_schema": {"type": "string", "enum": ["Paris", "Lyon"]}},
            "end": "</city>",
        },
    }
    params.append(
        SamplingParams(max_tokens=32, temperature=1.0, seed=3, structured_outputs={"structural_tag": tag})
    )
    outs = smol.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    assert re.fullmatch(r'<city>"(Paris|Lyon)"</city>', outs[8].outputs[0].text)
    assert all(o.outputs[0].text in ("Paris", "Lyon", 'a "q"') for o in outs[:6])
    assert re.fullmatch(r"yes|no|[0-9]{2}", outs[6].outputs[0].text)
    assert outs[7].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outs[7].outputs[0].text), dict)


def test_chunked_prefill_and_preemption_keep_outputs_valid(tmp_path):
    """A small token budget (prefills chunked) and a cache small enough to preempt."""
    llm = LLM(
        "smollm2-135m", max_model_len=1024, max_num_batched_tokens=24, num_cache_blocks=24, block_size=16
    )
    schemas = NESTED * 4
    outs = llm.generate([PROMPT * 2] * len(schemas), _json_params(schemas), use_tqdm=False)
    _check_json(outs, schemas)


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        ({"regex": "("}, "structured_outputs.regex"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar"),
        ({"regex": "a", "choice": ["b"]}, "set exactly one"),
        ({"choice": []}, "structured_outputs.choice"),
        (
            {"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
            "structured_outputs.structural_tag",
        ),
        ({"structural_tag": 3}, "structured_outputs.structural_tag"),
        ({"jsn": {}}, "unknown structured_outputs field"),
    ],
)
def test_bad_constraints_are_refused_at_submission(smol, structured, field):
    good = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match=re.escape(field)):
        smol.generate(
            ["a", "b"],
            [good, SamplingParams(max_tokens=4, structured_outputs=structured)],
            use_tqdm=False,
        )
    assert not smol.engine.has_unfinished() and not smol.engine.requests
    assert len(smol.generate(["a"], good, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_server_response_format_and_structured_outputs(smol):
    live = LiveServer(build_app(smol, "smol"))
    try:
        schema = NESTED[0]
        body = {
            "model": "smol",
            "messages": [{"role": "user", "content": "Describe a user as JSON."}],
            "max_tokens": 300,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": schema}},
        }
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
        body = {
            "model": "smol",
            "prompt": "Pick:",
            "max_tokens": 8,
            "structured_outputs": {"choice": ["red", "blue"]},
        }
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("red", "blue")
        body["structured_outputs"] = {"regex": "(("}
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
        body = {"model": "smol", "prompt": "x", "response_format": {"type": "xml"}}
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        # a chat template with no tool-call format cannot force a call
        body = {"model": "smol", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert httpx.get(f"{live.url}/health").status_code == 200
    finally:
        live.stop()
