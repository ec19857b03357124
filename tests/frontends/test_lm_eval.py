"""The lm-evaluation-harness backend ``deepinfer`` and the served path lm-eval's
``local-completions`` takes, on SmolLM2 in float32 with local tasks (JSON data beside a task
YAML; no hub): per-request log-likelihoods and ``is_greedy`` equal lm-eval's own ``hf``
backend on the same converted checkpoint, for a multiple-choice task and a rolling one; the
served path equals the offline backend; ``generate_until`` with a stop string equals greedy
``LLM.generate`` and transformers' generation through the ``hf`` backend. Each tolerance check
has a mutation that must break it (an off-by-one continuation, a server whose logprobs are
shifted by one position)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval  # a dev dependency: a broken install fails here rather than skipping the file
import pytest
from hypothesis import given
from hypothesis import strategies as st
from live_server import LiveServer

from deepinfer import SamplingParams
from deepinfer.weights.catalog import resolve_model

TOL = 1e-4
NAME = "smol"
# lm-eval puts its target delimiter (a space) between the question and each choice
CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a city"], "answer": 0},
    {"question": "1, 2, 3, 4,", "choices": ["5", "7", "banana"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
]
ROLLING = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Water boils at one hundred degrees Celsius at sea level."},
    {"text": "Paris is the capital and most populous city of France."},
]
GENERATE = [
    {"prompt": "The capital of France is", "answer": "Paris"},
    {"prompt": "Once upon a time", "answer": ""},
    {"prompt": "List three colors: red,", "answer": ""},
]
STOP = "."


def _task(folder: Path, name: str, rows: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
    )
    (folder / f"{name}.yaml").write_text(head + body)


def write_tasks(folder: Path) -> None:
    """Three local tasks: multiple choice (loglikelihood), rolling, and generate_until."""
    _task(
        folder,
        "di_choice",
        CHOICE,
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n',
    )
    _task(
        folder,
        "di_rolling",
        ROLLING,
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n",
    )
    _task(
        folder,
        "di_generate",
        GENERATE,
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        f'generation_kwargs:\n  until: ["{STOP}"]\n  max_gen_toks: 10\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    )


def responses(results: dict, task: str) -> list:
    """Every request's raw response, in document then request order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [r[0] for s in samples for r in s["resps"]]


def max_gap(ours: list, theirs: list) -> float:
    """The largest log-likelihood difference between two runs' responses; a differing
    ``is_greedy`` (or request count) is an infinite one."""
    if len(ours) != len(theirs):
        return float("inf")
    gap = 0.0
    for a, b in zip(ours, theirs, strict=True):
        la, lb = (a[0], b[0]) if isinstance(a, list | tuple) else (a, b)
        if isinstance(a, list | tuple) and bool(a[1]) != bool(b[1]):
            return float("inf")
        gap = max(gap, abs(float(la) - float(lb)))
    return gap


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The tasks, a task manager over them, and the offline backend built by name from a
    model_args string, as lm-eval's command line builds it."""
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import deepinfer.integrations.lm_eval_backend  # noqa: F401  registers "deepinfer"

    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        lm = get_model("deepinfer").create_from_arg_string(
            "pretrained=smollm2-135m,max_model_len=512,dtype=float32,enable_prefix_caching=true",
            {"batch_size": 1, "device": "cuda:0"},  # lm-eval's defaults: CPU stands in where no CUDA
        )
        yield folder, TaskManager(include_path=str(folder)), lm


def evaluate(model, env, tasks: list[str], **kwargs) -> dict:
    folder, manager, _ = env
    return lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=manager, log_samples=True, bootstrap_iters=0, **kwargs
    )


@pytest.fixture(scope="module")
def hf_results(env):
    """lm-eval's ``hf`` backend (transformers) on the converted checkpoint, in float32."""
    smol = resolve_model("smollm2-135m")
    return evaluate(
        "hf",
        env,
        ["di_choice", "di_rolling", "di_generate"],
        model_args={"pretrained": str(smol), "dtype": "float32"},
        device="cpu",
        batch_size=4,
    )


@pytest.fixture(scope="module")
def ours(env, hf_results):
    """The offline backend's run, a mutated run (each continuation scored from one token
    later: the off-by-one a scoring bug makes) and greedy ``LLM.generate`` for the
    generate_until prompts; all before the served fixture takes the engine."""
    from deepinfer.integrations import lm_eval_backend

    lm = env[2]
    run = evaluate(lm, env, ["di_choice", "di_rolling", "di_generate"])
    score = lm_eval_backend.continuation_score
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval_backend, "continuation_score", lambda t, e, c: score(t, e, c + 1))
        shifted = evaluate(lm, env, ["di_choice", "di_rolling"])
    greedy = SamplingParams(temperature=0.0, max_tokens=10, stop=[STOP])
    prompts = [d["prompt"] for d in GENERATE]
    direct = [o.outputs[0].text for o in lm.llm.generate(prompts, greedy)]
    unstopped = [
        o.outputs[0].text for o in lm.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    ]
    return {"run": run, "shifted": shifted, "generate": direct, "unstopped": unstopped}


def test_loglikelihoods_equal_the_hf_backend(ours, hf_results):
    for task in ("di_choice", "di_rolling"):
        got, want = responses(ours["run"], task), responses(hf_results, task)
        assert len(got) == (9 if task == "di_choice" else 3)
        assert max_gap(got, want) < TOL, (task, got, want)
    greedy = {bool(r[1]) for r in responses(hf_results, "di_choice")}
    assert greedy == {True, False}  # is_greedy is compared on both values


def test_an_off_by_one_score_breaks_the_comparison(ours, hf_results):
    """Mutation check of the test above."""
    for task in ("di_choice", "di_rolling"):
        assert max_gap(responses(ours["shifted"], task), responses(hf_results, task)) > TOL


def test_generate_until_equals_llm_generate_and_hf(ours, hf_results):
    got = responses(ours["run"], "di_generate")
    assert got == ours["generate"]
    assert got == responses(hf_results, "di_generate")
    assert all(STOP not in text for text in got)
    assert got != ours["unstopped"]  # the stop string cut at least one generation


def contexts(results: dict, task: str) -> list[str]:
    """Every request's first argument (the text scored or continued), in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [str(a[0] if isinstance(a, list | tuple) else a) for s in samples for a in s["arguments"]]


def test_chat_templates_score_as_the_hf_backend(env, monkeypatch):
    """With ``apply_chat_template``, each question goes through SmolLM2's template (its turn
    markers in every context), the contexts equal the ``hf`` backend's, and so do the
    loglikelihoods (1e-4). Mutation check: a backend that renders without the generation
    prompt scores other contexts past the tolerance."""
    from deepinfer.integrations import lm_eval_backend

    smol = resolve_model("smollm2-135m")
    hf = evaluate(
        "hf",
        env,
        ["di_choice"],
        model_args={"pretrained": str(smol), "dtype": "float32"},
        device="cpu",
        batch_size=4,
        apply_chat_template=True,
    )
    run = evaluate(env[2], env, ["di_choice"], apply_chat_template=True)
    assert len(contexts(run, "di_choice")) == 9 and contexts(run, "di_choice") == contexts(hf, "di_choice")
    assert all("<|im_start|>assistant" in c for c in contexts(run, "di_choice"))
    assert max_gap(responses(run, "di_choice"), responses(hf, "di_choice")) < TOL
    real = lm_eval_backend.DeepInferLM.apply_chat_template
    monkeypatch.setattr(
        lm_eval_backend.DeepInferLM,
        "apply_chat_template",
        lambda self, history, add_generation_prompt=True: real(self, history, False),
    )
    broken = evaluate(env[2], env, ["di_choice"], apply_chat_template=True)
    assert max_gap(responses(broken, "di_choice"), responses(hf, "di_choice")) > TOL


@pytest.fixture(scope="module")
def served(env, ours):
    """``deepinfer serve``'s app over the backend's engine (after its offline runs)."""
    from deepinfer.server.app import build_app

    live = LiveServer(build_app(env[2].llm, NAME))
    yield live
    live.stop()


def served_run(env, live: LiveServer, tasks: list[str]) -> dict:
    smol = resolve_model("smollm2-135m")
    args = {
        "base_url": f"{live.url}/v1/completions",
        "model": NAME,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(smol),
        "tokenized_requests": True,
        "max_length": 512,
        "max_retries": 1,
    }
    return evaluate("local-completions", env, tasks, model_args=args)


def test_local_completions_equals_the_offline_backend(env, ours, served):
    run = served_run(env, served, ["di_choice", "di_rolling"])
    for task in ("di_choice", "di_rolling"):
        assert max_gap(responses(run, task), responses(ours["run"], task)) < TOL, task


def test_a_shifted_echo_breaks_the_served_comparison(env, ours, served):
    """Mutation check of the test above: a server whose echoed logprobs sit one position
    late (each token reported with its predecessor's logprob)."""
    from deepinfer.server import routes_openai

    real = routes_openai.completion_logprobs

    def shifted(token_text, ids, entries, start):
        out = real(token_text, ids, entries, start)
        out["token_logprobs"] = [None, *out["token_logprobs"][:-1]]
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routes_openai, "completion_logprobs", shifted)
        run = served_run(env, served, ["di_choice"])
    assert max_gap(responses(run, "di_choice"), responses(ours["run"], "di_choice")) > TOL


@pytest.mark.slow
def test_the_command_line_finds_the_backend(env, hf_results, tmp_path):
    """``python -m deepinfer.integrations.lm_eval_cli`` is lm-eval's command line with the
    backend registered; model_args text is converted per engine option."""
    folder = env[0]
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "deepinfer.integrations.lm_eval_cli",
        "run",
        "--model",
        "deepinfer",
        "--model_args",
        "pretrained=smollm2-135m,max_model_len=256,enable_prefix_caching=false",
        "--tasks",
        "di_choice",
        "--include_path",
        str(folder),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted(out.rglob("samples_di_choice_*.jsonl"))
    assert found, proc.stderr[-2000:]
    rows = [json.loads(line) for line in found[0].read_text().splitlines()]
    got = [r[0] for row in sorted(rows, key=lambda r: r["doc_id"]) for r in row["resps"]]
    got = [(float(lp), greedy in (True, "True")) for lp, greedy in got]
    assert max_gap(got, responses(hf_results, "di_choice")) < TOL


@given(length=st.integers(1, 10**6), flag=st.sampled_from(["true", "False", "1", "no"]))
def test_model_args_text_becomes_each_options_type(length, flag):
    from deepinfer.integrations.model_args import engine_options, split_arg_string

    text = f"kv_cache_dtype=fp8,max_model_len={length},enable_prefix_caching={flag},quantization=none"
    assert engine_options(split_arg_string(text)) == {
        "kv_cache_dtype": "fp8",
        "max_model_len": length,
        "enable_prefix_caching": flag.lower() in ("true", "1"),
        "quantization": "none",
    }


@pytest.mark.parametrize(
    "text,field",
    [
        ("max_model_len=big", "max_model_len"),
        ("enable_prefix_caching=maybe", "enable_prefix_caching"),
        ("warp=9", "warp"),
    ],
)
def test_bad_model_args_name_the_field(text, field):
    from deepinfer.integrations.model_args import engine_options, split_arg_string

    with pytest.raises(ValueError, match=field):
        engine_options(split_arg_string(text))
