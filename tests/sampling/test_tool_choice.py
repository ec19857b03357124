"""``tool_choice`` "required", a named function, and "auto" with strict tools, enforced by an
xgrammar structural tag over DeepSeek-V4's DSML tool-call block (``chat/tool_choice.py``).

The server runs a tiny V4 checkpoint with the real V4 tokenizer. Its random weights would never
write markup, so the sampler is swapped for a token bigram model counted from DSML renderings of
random calls: it writes text that looks like DSML and closes what it opens, but its calls name
arbitrary parameters with values of arbitrary types, so its raw samples break the schemas.
Hypothesis draws the tools (schemas, names, strictness), the choice, thinking and
``parallel_tool_calls``; every forced call must parse and validate against its tool's schema,
streamed or not. The mutation check runs the same check with a tag that leaves the arguments
free: some call must parse and fail its schema (not merely fail some other assertion).
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict

import httpx
import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from live_server import LiveServer
from scripted_sampling import scripted_sampler
from tiny_v4_chat import V4_VOCAB, tiny_v4_checkpoint, v4_tokenizer_dir

from deepinfer import LLM
from deepinfer.chat import formats
from deepinfer.chat.deepseek import V4, encode_deepseek
from deepinfer.server.app import build_app

NAME = "tiny-v4"
FLOOR = -14.0  # the bigram's logit for a pair it never saw
THOUGHT = 8  # reasoning tokens before the model favours ending its reasoning
ASK = [{"role": "user", "content": "Use a tool."}]


# ---- the bigram "model" ---------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "str", "int", "float", "bool", "null", "list", "dict"][: 8 if depth < 1 else 6])
    if kind == "str":
        return rng.choice(["Paris", "a", "ok", "x y", "42", "north", "2024-01-01", "yes"])
    if kind == "int":
        return rng.randint(-50, 500)
    if kind == "float":
        return round(rng.uniform(-10, 10), rng.randint(0, 3))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(["a", "b", "id", "name"]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))
    }


def _corpus(rng: random.Random, count: int) -> list[str]:
    """Replies as the format renders them: reasoning or none, text or none, DSML calls of
    random names with random arguments (no schema behind them)."""
    words = ["city", "days", "query", "unit", "id", "count", "flag", "items", "mode", "q"]
    replies = []
    for _ in range(count):
        thinking = rng.random() < 0.5
        calls = [
            {
                "id": "c",
                "type": "function",
                "function": {
                    "name": rng.choice(["get_weather", "search", "f", "lookup_item", "run"]),
                    "arguments": json.dumps(
                        {rng.choice(words): _random_value(rng) for _ in range(rng.randint(0, 3))}
                    ),
                },
            }
            for _ in range(rng.randint(1, 2))
        ]
        turn = {
            "role": "assistant",
            "content": rng.choice(["", "", "Sure.", "Let me check."]),
            "reasoning_content": rng.choice(["Need a tool.", "Think.", "Hmm ok"]),
            "tool_calls": calls,
        }
        pre = encode_deepseek(ASK, V4, thinking=thinking).render()
        full = encode_deepseek([*ASK, turn], V4, thinking=thinking).render()
        opener = "<think>" if thinking else "</think>"  # the prompt's last token
        replies.append(opener + full[len(pre) :])
    return replies


class BigramModel:
    """Next-token logits from pair counts over the corpus (log frequency; unseen pairs at
    ``FLOOR``; an unseen previous token falls back to the unigram counts). Rows are kept
    sparse (the corpus' few hundred tokens) and spread over the vocabulary per step."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        pairs: dict[int, Counter] = defaultdict(Counter)
        unigram: Counter = Counter()
        for text in _corpus(random.Random(0), 400):
            ids = tokenizer(text, add_special_tokens=False).input_ids
            unigram.update(ids)
            for a, b in zip(ids, ids[1:], strict=False):
                pairs[a][b] += 1
        self.vocab_size = vocab_size
        self.end_think = tokenizer.convert_tokens_to_ids("</think>")
        self.rows = {a: self._sparse(c) for a, c in pairs.items()}
        self.unigram = self._sparse(unigram)

    @staticmethod
    def _sparse(counts: Counter) -> tuple[torch.Tensor, torch.Tensor]:
        total = sum(counts.values())
        return torch.tensor(list(counts)), torch.tensor([c / total for c in counts.values()]).log()

    def __call__(self, allowed: torch.Tensor, rows, **_options) -> list[int]:
        """``allowed``: the engine's logits after the grammar mask (-inf where it forbids)."""
        tokens = []
        for i, row in enumerate(rows):
            history = row.output_ids or row.prompt_ids
            ids, logprobs = self.rows.get(history[-1], self.unigram)
            logits = torch.full((self.vocab_size,), FLOOR)
            logits[ids] = logprobs
            if len(row.output_ids) >= THOUGHT and self.end_think not in row.output_ids:
                logits[self.end_think] = 0.0  # it thinks briefly (a bigram never stops on its own)
            logits[allowed[i, : self.vocab_size] == float("-inf")] = float("-inf")
            probs = torch.softmax(logits, dim=0)
            tokens.append(int(torch.multinomial(probs, 1, generator=row.generator)))
        return tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_tools"))
    llm = LLM(str(path), max_num_seqs=4, max_model_len=4096)
    with scripted_sampler(BigramModel(llm.tokenizer, V4_VOCAB)):
        live = LiveServer(build_app(llm, NAME, max_queued_requests=16))
        yield live
        live.stop()


# ---- drawn tools ----------------------------------------------------------------------------

_IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,9}", fullmatch=True)
_SCALARS = st.one_of(
    st.just({"type": "string"}),
    st.lists(st.sampled_from(["red", "green", "blue", "x y", "42"]), min_size=1, max_size=3, unique=True).map(
        lambda vs: {"type": "string", "enum": vs}
    ),
    st.tuples(st.integers(-100, 100), st.integers(0, 200)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
)


def _object(props: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(_IDENT, props, max_size=3).flatmap(
        lambda ps: st.lists(st.sampled_from(sorted(ps)) if ps else st.nothing(), unique=True).map(
            lambda req: {"type": "object", "properties": ps, "required": req, "additionalProperties": False}
        )
    )


_VALUES = st.one_of(
    _SCALARS,
    st.sampled_from([{"type": "array"}, {"type": "object"}]),  # any items, any properties
    _SCALARS.map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
    _object(_SCALARS),
)


_TOOL = st.fixed_dictionaries(
    {"name": _IDENT, "parameters": _object(_VALUES), "strict": st.sampled_from([True, False, None])}
)
_TOOLS = st.lists(_TOOL, min_size=1, max_size=3, unique_by=lambda t: t["name"])


@st.composite
def _cases(draw):
    tools = draw(_TOOLS)
    choice = draw(
        st.sampled_from(
            ["required", {"type": "function", "function": {"name": draw(st.sampled_from(tools))["name"]}}]
        )
    )
    return tools, choice, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def _request(tools, choice, thinking: bool, parallel: bool, seed: int, stream: bool) -> dict:
    return {
        "model": NAME,
        "messages": ASK,
        "tools": [
            {"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in tools
        ],
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": {"thinking": thinking},
        "max_tokens": 400,
        "seed": seed,
        "temperature": 1.0,
        "stream": stream,
    }


def _whole(live, body) -> tuple[list[tuple[str, dict]], str, str | None]:
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls") or []
    ]
    return calls, choice["finish_reason"], choice["message"]["content"]


def _streamed(live, body) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for part in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                entry = calls.setdefault(part["index"], {"name": "", "arguments": ""})
                entry["name"] += part.get("function", {}).get("name") or ""
                entry["arguments"] += part.get("function", {}).get("arguments") or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


class SchemaBroken(AssertionError):
    """A reply's calls parsed, to tools it may call, and one's arguments break its tool's
    schema: the failure a mutation check must show, apart from any other (no call, text)."""


def _schema_check(name: str, args: dict, schema: dict) -> None:
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(args)]
    if errors:
        raise SchemaBroken((name, args, errors))


def _schema_break(check, cases: st.SearchStrategy) -> SchemaBroken | None:
    """Runs ``check`` on the drawn cases until one fails with ``SchemaBroken``, passing over
    other failures; that failure, or None."""
    found: list[SchemaBroken] = []

    @_SETTINGS
    @given(case=cases)
    def run(case):
        if found:
            return
        try:
            check(*case)
        except SchemaBroken as failure:
            found.append(failure)
        except AssertionError:
            pass

    run()
    return found[0] if found else None


def _check_forced_calls(live, tools, choice, thinking, parallel, seed) -> None:
    """The reply is tool calls only, to the allowed tools, each valid for its schema; the
    stream carries the same calls."""
    body = _request(tools, choice, thinking, parallel, seed, stream=False)
    calls, finish, content = _whole(live, body)
    assert finish == "tool_calls", (finish, content)
    assert calls and not content
    schemas = {t["name"]: t["parameters"] for t in tools}
    allowed = set(schemas) if choice == "required" else {choice["function"]["name"]}
    if not parallel or choice != "required":
        assert len(calls) == 1
    for name, args in calls:
        assert name in allowed
        _schema_check(name, args, schemas[name])
    assert _streamed(live, {**body, "stream": True}) == calls


_SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)


@_SETTINGS
@given(case=_cases())
def test_forced_tool_calls_follow_their_schemas(served, case):
    _check_forced_calls(served, *case)


def _tag_without_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: the tag keeps the DSML block and the tools' names but lets every call's
    arguments be any object (the bigram's own arguments then reach the schema check)."""
    real = formats.tool_call_tag

    def tag(dialect, functions, *args, **kwargs):
        return real(dialect, [{**fn, "parameters": {"type": "object"}} for fn in functions], *args, **kwargs)

    monkeypatch.setattr(formats, "tool_call_tag", tag)


def test_a_tag_without_the_schemas_fails_the_same_check(served, monkeypatch):
    """The mutation check: calls that parse, to the allowed tools, but whose arguments only
    the bigram chose fail the schema check of the test above."""
    _tag_without_schemas(monkeypatch)
    assert _schema_break(lambda *case: _check_forced_calls(served, *case), _cases()) is not None


def _check_auto_strict(live, tools, thinking: bool, seed: int) -> bool:
    """Under "auto" the model may answer in text; a tool-call block it opens is well-formed
    (so it never reaches the content) and a strict tool's arguments follow its schema.
    Whether the reply made calls."""
    tools = [{**tools[0], "strict": True}, *tools[1:]]
    body = {**_request(tools, "auto", thinking, True, seed, stream=False), "max_tokens": 800}
    calls, finish, content = _whole(live, body)
    assert V4.calls_open not in (content or "")
    assert (finish == "tool_calls") == bool(calls), (finish, calls)
    schemas = {t["name"]: t for t in tools}
    for name, args in calls:
        assert name in schemas
        if schemas[name]["strict"] is True:
            _schema_check(name, args, schemas[name]["parameters"])
    return bool(calls)


_AUTO_CASES = st.tuples(_TOOLS, st.booleans(), st.integers(0, 2**31 - 1))


def _auto_strict_examples(live) -> int:
    """Runs the drawn "auto" cases; how many of them made calls."""
    made = []

    @settings(_SETTINGS, max_examples=12)
    @given(tools=_TOOLS, thinking=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def run(tools, thinking, seed):
        made.append(_check_auto_strict(live, tools, thinking, seed))

    run()
    return sum(made)


def test_auto_with_a_strict_tool_keeps_any_call_to_its_schema(served):
    assert _auto_strict_examples(served) > 0  # some replies made calls: the schemas were tested


def test_auto_with_a_tag_without_the_schemas_fails_the_same_check(served, monkeypatch):
    """The mutation check of the "auto" case: some of the bigram's calls parse and break a
    strict tool's schema."""
    _tag_without_schemas(monkeypatch)
    assert _schema_break(lambda *case: _check_auto_strict(served, *case), _AUTO_CASES) is not None


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "must be 'none'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "no tool is named",
        ),
        ({"tools": None}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
        (
            {"tools": [{"type": "function", "function": {"name": 'say"hi'}}]},
            "tools",
            "cannot be written in a DSML call",
        ),
    ],
)
def test_a_bad_tool_choice_is_a_400_naming_the_field(served, change, param, words):
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {}}, "strict": None}]
    body = {**_request(tools, "required", False, True, 0, stream=False), **change}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.fixture(scope="module")
def v4_compiler():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(v4_tokenizer_dir())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=V4_VOCAB, stop_token_ids=[1])
    return tokenizer, xgr.GrammarCompiler(info)


@pytest.mark.parametrize("thinking", [True, False])
def test_the_tag_accepts_the_formats_own_calls_in_each_dialect(v4_compiler, thinking):
    """V4 and V4.1 name their tags differently: each dialect's tag takes the calls its own
    encoder renders (what the parser reads back) and refuses the other dialect's."""
    import xgrammar as xgr

    from deepinfer.chat.deepseek import V41
    from deepinfer.chat.tool_choice import tool_call_tag

    tokenizer, compiler = v4_compiler
    tool = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "tags": {"type": "array"},
            },
            "required": ["city"],
        },
    }
    args = [{"city": "Paris", "days": 3}, {"city": "Nice", "tags": ["a", 1]}]
    calls = [
        {"id": str(i), "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(a)}}
        for i, a in enumerate(args)
    ]
    turn = {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": calls}

    def reply(dialect) -> list[int]:
        pre = encode_deepseek(ASK, dialect, tools=[tool], thinking=thinking).render()
        full = encode_deepseek([*ASK, turn], dialect, tools=[tool], thinking=thinking).render()
        return tokenizer(full[len(pre) :], add_special_tokens=False).input_ids

    def accepts(tag: str, ids: list[int]) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
        return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()

    for dialect, other in ((V4, V41), (V41, V4)):
        tag = tool_call_tag(dialect, [tool], "required", thinking)
        assert accepts(tag, reply(dialect))
        assert not accepts(tag, reply(other))
        single = tool_call_tag(dialect, [tool], "required", thinking, parallel_tool_calls=False)
        assert not accepts(single, reply(dialect))  # two calls where one is allowed
