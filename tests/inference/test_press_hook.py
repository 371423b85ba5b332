"""Every registered press, built-in or a plugin's, through the same checks: the press
machinery asks a press only through its hooks (``score`` / ``protected`` for a KV press,
``select`` for a prefill press), so what a plugin registers the documented way acts.

For each press: ratio 0 is the plain model exactly (greedy tokens and logits); at ratio
0.5 every evictable block keeps the budget (a budget wrapper: the same total), the cached
entries are the dense cache's entries at the indices the press reports, and every KV head
keeps its fixed tokens and otherwise its highest scores (the scores its own hook gave).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from prunelab import plugins
from prunelab.errors import UnsupportedOperationError
from prunelab.inference import CACHE_BUDGET, PRESSES, Press, kv, press, press_for
from prunelab.inference.budgets import kept_entries
from prunelab.models.loading import wrap

from tiny_models import SAMPLE_TEXT, cli, save_tiny_checkpoint, tiny_model, tiny_tokens

PLUGIN = Path(__file__).with_name("plugin_presses.py")
PLUGIN_NAMES = ("keep-oldest", "prefill-oldest")
ALL = [*PRESSES.names(), *PLUGIN_NAMES]
#: small windows for a 32-token prompt (the defaults are sized for 1K-token prompts)
OPTIONS = {"snapkv": {"window": 4}, "decay": {"window": 4},
           "expected-attention": {"sinks": 2, "horizon": 16},
           "adakv": {"scorer_options": ("window=4",)},
           "pyramidkv": {"floor": 4, "scorer_options": ("window=2",)},
           "entroprefill": {"window": 4, "mass_bound": 1.0, "keep_scale": 0.1}}
PROMPT = 32


@pytest.fixture(scope="module", autouse=True)
def plugin_presses():
    """The plugin loaded as ``--plugin`` loads it; unregistered afterwards."""
    plugins.import_plugin(str(PLUGIN))
    yield
    for name in PLUGIN_NAMES:
        PRESSES.unregister(name)
    plugins.imported.discard(str(PLUGIN))


def _config(name: str, ratio: float) -> Press:
    return press_for(name, ratio, **OPTIONS.get(name, {}))


def test_every_press_is_listed():
    assert set(PLUGIN_NAMES) <= set(PRESSES.names())
    assert len(ALL) == len(PRESSES.names()) == len(set(ALL))


@pytest.mark.parametrize("name", ALL)
def test_ratio_zero_is_the_plain_model(name):
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(2, 20)

    def generate():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        return out.sequences, torch.stack(out.logits)

    seq, logits = generate()
    with press(lm, _config(name, 0.0)):
        seq_p, logits_p = generate()
    assert torch.equal(seq, seq_p) and torch.equal(logits, logits_p)


def _recorder(cls, monkeypatch) -> dict:
    """Record the last scores ``cls.score`` gave per block."""
    seen: dict[int, torch.Tensor] = {}
    real = cls.score

    def score(self, inputs):
        out = real(self, inputs)
        seen[inputs.layer] = out.detach().clone()
        return out

    monkeypatch.setattr(cls, "score", score)
    return seen


@pytest.mark.parametrize("name", ALL)
def test_kept_tokens_are_the_reported_ones_and_the_top_of_its_own_score(name, monkeypatch):
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(2, PROMPT, seed=3)
    cfg = _config(name, 0.5)
    dense = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids, cache=dense, use_cache=True)
    scores = _recorder(type(cfg.scoring), monkeypatch) if cfg.kind == "kv" else {}
    with torch.no_grad(), press(lm, cfg) as s:
        cache = lm.model(ids, use_cache=True).cache
    rep = s.report
    if cfg.kind == "prefill":
        keep = rep["keep"]  # [B, K]
        assert keep.shape == (2, rep["kept"]) and rep["kept"] == PROMPT - PROMPT // 2
        assert bool((keep[:, -1] == PROMPT - 1).all())
        for i in range(len(cache.layers)):
            keys = cache.layers[i].keys
            assert keys.shape[2] == rep["kept"]
            if i <= rep["layer"]:  # before the cut: the dense entries of the kept tokens
                idx = keep[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
                assert torch.equal(keys, dense.layers[i].keys.gather(2, idx))
        if name == "prefill-oldest":
            assert keep[0].tolist() == [*range(rep["kept"] - 1), PROMPT - 1]
        return
    budget = PROMPT - PROMPT // 2
    layers = kv.evictable_layers(cache)
    assert rep["kept"] == budget and set(rep["keep"]) == set(layers) == {0, 1, 2, 3}
    assert kept_entries(cache) == rep["entries"] == len(layers) * 2 * 2 * budget
    holes = getattr(cache, "prunelab_heads", None) or {}
    scorer = cfg.scoring
    for i in layers:
        idx, hole = rep["keep"][i], holes.get(i)
        width = idx.shape[-1] if hole is None else budget
        fixed = kv.fixed_positions(scorer, PROMPT, width, "cpu")
        for b in range(2):
            for g in range(2):
                n = idx.shape[-1] if hole is None else int((~hole[b, g]).sum())
                kept = idx[b, g, :n]
                assert torch.equal(cache.layers[i].keys[b, g, :n],
                                   dense.layers[i].keys[b, g, kept])
                mask = torch.zeros(PROMPT, dtype=torch.bool)
                mask[kept] = True
                assert bool(mask[fixed].all()), f"block {i}: a fixed token was evicted"
                sc = scores[i][b, g]
                free_kept, evicted = sc[mask & ~fixed], sc[~mask]
                if len(free_kept) and len(evicted):
                    assert float(evicted.max()) <= float(free_kept.min())
        if name == "keep-oldest":
            assert idx.tolist() == [[list(range(budget))] * 2] * 2


@dataclass(frozen=True)
class NoScore(Press):
    """A KV press without a score"""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)


@dataclass(frozen=True)
class BadShape(Press):
    """A KV press whose score has the wrong shape"""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)

    def score(self, inputs):
        return inputs.key.norm(dim=-1)[0]


def test_a_press_that_cannot_score_is_refused_at_start():
    lm = wrap(tiny_model("llama"))
    calls = []
    lm.model.register_forward_pre_hook(lambda *a: calls.append(1))
    PRESSES.register("no-score")(NoScore)
    try:
        with pytest.raises(UnsupportedOperationError, match=r"press 'no-score' \(.*NoScore\) "
                           r"cannot score: a KV press defines score"):
            with press(lm, "no-score"):
                pass
    finally:
        PRESSES.unregister("no-score")
    assert not calls
    PRESSES.register("bad-shape")(BadShape)
    try:
        with pytest.raises(UnsupportedOperationError, match=r"press 'bad-shape': score\(\) "
                           r"returned \(2, 32\), expected a tensor \[B, G, L\] = \[1, 2, 32\]"):
            with press(lm, BadShape()):
                lm.model(tiny_tokens(1, PROMPT), use_cache=True)
    finally:
        PRESSES.unregister("bad-shape")


def test_eval_refuses_a_plugin_press_that_cannot_score(tmp_path):
    plugin = tmp_path / "noscore.py"
    plugin.write_text(
        "from dataclasses import dataclass, field\n"
        "from prunelab.inference import CACHE_BUDGET, PRESSES, Press\n"
        "@PRESSES.register('no-score')\n@dataclass(frozen=True)\n"
        "class NoScore(Press):\n"
        "    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)\n")
    save_tiny_checkpoint("llama", tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text(SAMPLE_TEXT)
    res = cli("--plugin", str(plugin), "eval", "--model", str(tmp_path / "tiny"), "--data",
              f"text:{text}", "--press", "no-score", "--budget", "remove-cache:0.5",
              "--samples", "1", "--seqlen", "16")
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: press 'no-score'") and "cannot score" in lines[-1]
    assert "Traceback" not in res.stderr
