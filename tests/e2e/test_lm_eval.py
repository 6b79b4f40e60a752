"""lm-evaluation-harness, unmodified, against the shared `hf2q serve`: small tasks defined here on local JSONL
files (no network), run through `lm_eval.simple_evaluate`. `local-completions` with its default arguments
tokenizes through the server's /tokenizer_info and /tokenize as a user's run would, and runs a generation
task and a multiple-choice (log-likelihood) task; `local-chat-completions` runs the generation task as chat.

The model has random weights, so each task's data is made from the server's own answers, fetched here
independently (text prompts one at a time, where lm_eval sends token ids in batches of two): the generation
targets are the greedy answer for half the questions, and each multiple-choice question's gold answer is its
best-scored choice for all but one question. The metrics lm_eval reports must then come out at the known
fractions, and every log-likelihood it recorded must equal the one from `echo` + `logprobs`."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import PLAIN_FLAGS

lm_eval = pytest.importorskip("lm_eval")

MODEL = "tiny"  # conftest's plain server
MAX_MODEL_LEN = int(PLAIN_FLAGS[PLAIN_FLAGS.index("--max-model-len") + 1])
MAX_GEN_TOKS = 4
UNTIL = ["\n"]
QUESTIONS = ["2 + 2 =", "The sky is", "Hello", "One, two,"]
MULTIPLE_CHOICE = [("The cat sat on the", ["mat", "moon", "river"]), ("Water is", ["wet", "dry"]),
                   ("Paris is in", ["France", "Spain", "Peru"])]
LOGPROB_TOLERANCE = 1e-4  # the same server, prompts batched differently


def completion(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def greedy_answer(server, question: str, eos: str) -> str:
    """What lm_eval's generate_until request asks for (its stop list is `until` plus the EOS text)."""
    body = {"prompt": question, "max_tokens": MAX_GEN_TOKS, "temperature": 0, "stop": [*UNTIL, eos]}
    return completion(server, body)["choices"][0]["text"]


def choice_score(server, context: str, choice: str) -> tuple[float, bool]:
    """(sum of the choice's token log-probabilities, whether each was the top token) after `context`, from the
    echoed prompt's logprobs; the context's tokens are counted through /tokenize, as lm_eval splits the pair."""
    ctxlen = len(httpx.post(server.url + "/tokenize", json={"prompt": context}, timeout=60).json()["tokens"])
    body = {"prompt": f"{context} {choice}", "max_tokens": 0, "echo": True, "logprobs": 1}
    logprobs = completion(server, body)["choices"][0]["logprobs"]
    tokens = list(zip(logprobs["token_logprobs"], logprobs["top_logprobs"]))[ctxlen:]
    assert tokens
    return sum(lp for lp, _ in tokens), all(lp == max(top.values()) for lp, top in tokens)


def write_task(folder, name: str, docs: list[dict], spec: str) -> None:
    """Task `name`: `spec` (its YAML lines) over `docs` as a JSONL file, read by datasets' own `json` loader."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        f"  cache_dir: {json.dumps(str(folder / 'datasets'))}\ntest_split: test\n{spec}")


GENERATION_SPEC = ("output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                   f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN_TOKS}\n"
                   "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


def half_right(answers: list[str]) -> list[dict]:
    """Generation docs whose target is the server's answer for the even questions: exact match 0.5."""
    return [{"question": q, "answer": a if i % 2 == 0 else "certainly not this"}
            for i, (q, a) in enumerate(zip(QUESTIONS, answers))]


@pytest.fixture
def offline(monkeypatch):
    """No Hub access for datasets or huggingface_hub, whichever of them another test imported first."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def local_tasks(folder):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)  # not lm_eval's thousands of tasks


def test_generation_and_log_likelihood_tasks(plain_server, offline, tmp_path):
    eos = httpx.get(plain_server.url + "/tokenizer_info", timeout=30).json()["eos_token"]
    answers = [greedy_answer(plain_server, q, eos) for q in QUESTIONS]
    scores = [[choice_score(plain_server, ctx, c) for c in choices] for ctx, choices in MULTIPLE_CHOICE]
    best = [max(range(len(s)), key=lambda j: s[j][0]) for s in scores]
    labels = [b if i else (b + 1) % len(s) for i, (b, s) in enumerate(zip(best, scores))]  # the first is wrong
    write_task(tmp_path, "hf2q_generate", half_right(answers), GENERATION_SPEC)
    write_task(tmp_path, "hf2q_choice", [{"question": ctx, "choices": choices, "label": label}
                                         for (ctx, choices), label in zip(MULTIPLE_CHOICE, labels)],
               "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{label}}'\n"
               "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n")

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": plain_server.url + "/v1/completions", "model": MODEL, "batch_size": 2,
                    "max_length": MAX_MODEL_LEN, "max_retries": 1},
        tasks=["hf2q_generate", "hf2q_choice"], task_manager=local_tasks(tmp_path), log_samples=True)

    generated = sorted(out["samples"]["hf2q_generate"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in generated] == answers
    assert out["results"]["hf2q_generate"]["exact_match,none"] == pytest.approx(0.5)
    chosen = sorted(out["samples"]["hf2q_choice"], key=lambda s: s["doc_id"])
    assert len(chosen) == len(MULTIPLE_CHOICE)
    for sample, expected in zip(chosen, scores):
        recorded = [resp[0] for resp in sample["resps"]]
        assert [greedy for _, greedy in recorded] == [greedy for _, greedy in expected]
        assert [lp for lp, _ in recorded] == pytest.approx([lp for lp, _ in expected], abs=LOGPROB_TOLERANCE)
    assert out["results"]["hf2q_choice"]["acc,none"] == pytest.approx(2 / 3)


def test_chat_generation_with_thinking_off(plain_server, offline, tmp_path):
    """`local-chat-completions` sends each question as a user turn; `reasoning_effort=minimal` in gen_kwargs
    turns thinking off (lm_eval reads `none` as null), so the answer is the message's content."""
    def chat_answer(question: str) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_GEN_TOKS,
                "temperature": 0, "stop": UNTIL, "reasoning_effort": "minimal"}
        r = httpx.post(plain_server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    answers = [chat_answer(q) for q in QUESTIONS]
    assert any(answers)
    write_task(tmp_path, "hf2q_chat", half_right(answers), GENERATION_SPEC)
    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"base_url": plain_server.url + "/v1/chat/completions", "model": MODEL, "max_retries": 1},
        tasks=["hf2q_chat"], task_manager=local_tasks(tmp_path), apply_chat_template=True,
        gen_kwargs="reasoning_effort=minimal", log_samples=True)

    generated = sorted(out["samples"]["hf2q_chat"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in generated] == answers
    assert out["results"]["hf2q_chat"]["exact_match,none"] == pytest.approx(0.5)
