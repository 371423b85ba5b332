"""A context and a question: the default mode is the press as before, ``after`` compresses
the context alone (kvpress' pipeline), ``aware`` scores the context with the question as
SnapKV's observation window and keeps the question; errors for modes that do not apply."""

import pytest
import torch
import torch.nn.functional as F

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.inference import AdaKV, LazyLLM, SnapKV, press
from prunelab.inference.query import answer, needle_retrieval
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

C, Q = 20, 4


def _inputs():
    return tiny_tokens(1, C), tiny_tokens(1, Q, seed=7)


def test_query_aware_keeps_the_question_and_scores_with_it():
    """By hand from the plain model's attention: the 4 question queries' attention summed,
    max-pooled over 5 tokens, averaged over each KV group's 2 query heads; the group keeps
    the top 10 of the 20 context tokens (half the context) and all 4 question tokens."""
    m = tiny_model("llama")
    ctx, qst = _inputs()
    ids = torch.cat([ctx, qst], 1)
    with torch.no_grad():
        att = m(ids, output_attentions=True).attentions
    with press(m, SnapKV(ratio=0.5)) as s:
        out, rep = answer(m, ctx, qst, 3, "aware")
    assert rep["prompt"] == C + Q and rep["kept"] == 10 + Q and rep["question"] == Q
    assert s.question == 0 and out.shape == (1, 3)
    for layer, idx in rep["keep"].items():
        score = F.max_pool1d(att[layer][0, :, -Q:].sum(1)[:, None], 5, 1, 2)[:, 0]  # [4, 24]
        for g in range(2):
            group = score[2 * g:2 * g + 2].mean(0)
            top = torch.sort(group[:C], descending=True, stable=True).indices[:10]
            want = sorted(top.tolist() + list(range(C, C + Q)))  # ties: earlier first
            assert idx[0, g].tolist() == want


def test_question_after_compresses_the_context_alone():
    """kvpress' pipeline: the press sees only the context (its report: 20 prompt tokens,
    10 kept); the question joins the compressed cache whole; the answer equals the press
    on the context, then the question, then greedy tokens, fed by hand."""
    m = tiny_model("llama")
    ctx, qst = _inputs()
    cfg = SnapKV(ratio=0.5, window=4)
    out, rep = answer(m, ctx, qst, 4, "after", cfg)
    assert rep["prompt"] == C and rep["kept"] == 10
    with torch.no_grad(), press(m, cfg):
        o = m(ctx, use_cache=True)
        o = m(qst, cache=o.cache, use_cache=True)
        assert o.cache.get_seq_length() == 10 + Q
        toks = []
        for _ in range(4):
            toks.append(o.logits[:, -1].argmax(-1, keepdim=True))
            o = m(toks[-1], cache=o.cache, use_cache=True)
    assert torch.equal(out, torch.cat(toks, 1))


def test_default_mode_is_the_press_as_before():
    """Mode prompt: the same tokens as ``generate`` under the press on context + question."""
    m = tiny_model("llama")
    ctx, qst = _inputs()
    for cfg in (SnapKV(ratio=0.5, window=4), AdaKV(ratio=0.5, scorer="knorm")):
        out, rep = answer(m, ctx, qst, 5, config=cfg)
        with torch.no_grad(), press(m, cfg):
            gen = m.generate(torch.cat([ctx, qst], 1), max_new_tokens=5, do_sample=False,
                             pad_token_id=0)
        assert torch.equal(out, gen[:, C + Q:]) and rep["prompt"] == C + Q


@pytest.mark.parametrize("mode", ["prompt", "after", "aware"])
def test_ratio_zero_is_plain_greedy_generation(mode):
    m = tiny_model("llama")
    ctx, qst = _inputs()
    with torch.no_grad():
        gen = m.generate(torch.cat([ctx, qst], 1), max_new_tokens=5, do_sample=False,
                         pad_token_id=0)[:, C + Q:]
    for cfg in (None, SnapKV(ratio=0.0), AdaKV(ratio=0.0)):
        out, _ = answer(m, ctx, qst, 5, mode if cfg is not None else "prompt", cfg)
        assert torch.equal(out, gen)


def test_modes_that_do_not_apply_are_errors():
    m = tiny_model("llama")
    ctx, qst = _inputs()
    with pytest.raises(ConfigError, match="question mode must be one of"):
        answer(m, ctx, qst, 2, "before", SnapKV())
    with pytest.raises(UnsupportedOperationError, match="query-aware compression needs a KV"):
        answer(m, ctx, qst, 2, "aware", LazyLLM(ratio=0.5))
    with pytest.raises(ConfigError, match="do not set window"):
        answer(m, ctx, qst, 2, "aware", SnapKV(window=8))
    with pytest.raises(ConfigError, match="do not set window"):
        answer(m, ctx, qst, 2, "aware", AdaKV(scorer_options=("window=8",)))
    answer(m, ctx, qst, 2, "after", LazyLLM(ratio=0.5, layer=1))  # prefill presses: after


def test_needle_retrieval_runs_each_mode_on_needle_windows():
    lm = wrap(tiny_model("llama"), tokenizer=char_tokenizer())
    g = torch.Generator().manual_seed(0)
    hay = torch.randint(97, 123, (2, 110), generator=g)
    hay[:, 0] = 128
    for mode in ("prompt", "after", "aware"):
        res = needle_retrieval(lm, SnapKV(ratio=0.5), hay, mode, horizon=10, new_tokens=6)
        assert res["mode"] == mode and len(res["windows"]) == 2
        assert all(10000 <= w["key"] < 100000 for w in res["windows"])
        assert res["accuracy"] == sum(w["hit"] for w in res["windows"]) / 2
    plain = [needle_retrieval(lm, SnapKV(ratio=0.0), hay, mode, horizon=10, new_tokens=6)
             for mode in ("prompt", "after", "aware")]
    assert plain[0]["windows"] == plain[1]["windows"] == plain[2]["windows"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("query_cli")
    save_tiny_checkpoint("llama", root / "model")
    return root


def _generate(tiny_dir, *extra, prompt=None):
    from tiny_models import SAMPLE_TEXT, cli_inproc

    return cli_inproc("generate", "--model", str(tiny_dir / "model"), "--prompt",
                      prompt or SAMPLE_TEXT[:60], "--max-new-tokens", "4", *extra)


def test_generate_with_a_question(tiny_dir):
    """--question without a mode is the prompt followed by the question (the default,
    unchanged); each mode runs; adakv and pyramidkv are presses of generate with their
    scorer options as flags."""
    from tiny_models import SAMPLE_TEXT

    base = _generate(tiny_dir, "--press", "snapkv", "--budget", "remove-cache:0.5",
                     "--press-window", "4", prompt=SAMPLE_TEXT[:60] + " Who?")
    same = _generate(tiny_dir, "--press", "snapkv", "--budget", "remove-cache:0.5",
                     "--press-window", "4", "--question", " Who?")
    assert base.returncode == 0 and same.returncode == 0, same.stderr
    assert base.stdout.splitlines()[0] == same.stdout.splitlines()[0]
    for mode in ("after", "aware"):
        res = _generate(tiny_dir, "--press", "adakv", "--budget", "remove-cache:0.5",
                        "--press-scorer", "knorm", "--question", " Who?", "--question-mode",
                        mode)
        assert res.returncode == 0, res.stderr
        assert "entries" in res.stdout and "question" in res.stdout
    res = _generate(tiny_dir, "--press", "pyramidkv", "--budget", "remove-cache:0.5",
                    "--press-beta", "2", "--press-floor", "2", "--press-scorer-options",
                    "window=4,kernel=3")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("extra,msg", [
    (("--question-mode", "aware"), "--question-mode applies with --question TEXT only"),
    (("--question", "Who?", "--question-mode", "aware"), "--question-mode needs --press"),
    (("--question", "Who?", "--question-mode", "sideways", "--press", "snapkv"),
     "--question-mode must be one of prompt, after, aware"),
    (("--question", "Who?", "--question-mode", "aware", "--press", "snapkv",
      "--press-window", "8"), "the question is SnapKV's observation window"),
    (("--question", "Who?", "--question-mode", "aware", "--press", "lazyllm"),
     "query-aware compression needs a KV-cache press"),
])
def test_generate_question_conflicts_are_one_line_errors(tiny_dir, extra, msg):
    res = _generate(tiny_dir, *extra)
    assert res.returncode == 2 and msg in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
