"""A matched budget sets a factorization method's target_params and clears its ratio:
`compare --methods slicegpt --budget keep-params:0.8` (and shared-dict, basis-sharing)
said "ratio must be a number, got None" (issue 39, class 7)."""

from __future__ import annotations

import pytest

import prunelab
from prunelab.data.batches import TokenBatches
from prunelab.models.loading import wrap
from prunelab.pruning import METHODS
from prunelab.workflow.budget import achieved, apply_budget, parse_budget, sizes

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

CALIB = TokenBatches(input_ids=tiny_tokens(4, 16, seed=1), spec="tiny", seqlen=16, samples=4,
                     seed=0, mode="calib", total_windows=4, sha256="0")


@pytest.mark.parametrize("name", ["slicegpt", "shared-dict", "basis-sharing", "svd-llm"])
def test_keep_params_budget_on_a_factor_method(name):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    dense = sizes(lm)
    budget = parse_budget("keep-params:0.8")
    cfg = apply_budget(METHODS.make(name), budget, dense)
    assert cfg.target_params == 0.8 and cfg.ratio is None
    prunelab.prune(lm, cfg, CALIB, batch_size=2)
    kept = achieved(sizes(lm), dense, budget)["params_kept"]
    assert kept <= 0.8 + 1e-9  # meets the budget (never above it)
