"""benchmarks/peers: the token-id hash check, the page writer and the continuation scoring,
on hand-made values (no venv is created, no peer is installed)."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import common  # noqa: E402
import continuation  # noqa: E402
import table  # noqa: E402


def test_ids_hash_is_shape_and_int64_bytes():
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    want = hashlib.sha256(b"2x3:" + np.arange(1, 7, dtype="<i8").tobytes()).hexdigest()
    assert common.ids_sha256(ids) == want
    assert common.ids_sha256(torch.arange(1, 7).reshape(2, 3)) == want  # torch, int64
    assert common.ids_sha256(ids.reshape(3, 2)) != want  # same numbers, other shape
    with pytest.raises(ValueError):
        common.ids_sha256(np.arange(6))


def test_ids_round_trip_and_mismatch(tmp_path):
    ids = torch.tensor([[5, 9, 2, 7]])
    sha = common.save_ids(tmp_path / "a.npy", ids)
    back = common.load_ids(tmp_path / "a.npy", sha)
    assert back.dtype == np.int64 and back.tolist() == [[5, 9, 2, 7]]
    common.save_ids(tmp_path / "b.npy", torch.tensor([[5, 9, 2, 8]]))
    with pytest.raises(common.IdsMismatch):
        common.load_ids(tmp_path / "b.npy", sha)
    common.check_result_ids({"ids_sha256": sha}, sha, "peer")
    with pytest.raises(common.IdsMismatch):
        common.check_result_ids({"ids_sha256": "0" * 64}, sha, "peer")
    with pytest.raises(common.IdsMismatch):
        common.check_result_ids({}, sha, "peer")


def test_ratio_gap_fmt():
    assert table.ratio(1.0, 4.0) == "0.25"
    assert table.ratio(1.0, 0) == "-" and table.ratio(None, 2.0) == "-"
    assert table.fmt(float("nan"), ".2f") == "-" and table.fmt(1.23456, ".3f") == "1.235"
    assert table.gap(10.2, 10.0, 0.001) == "**gap +2.0%**"
    assert table.gap(10.0, 10.0, 0.001) == "" and table.gap(9.0, 10.0, 0.001) == ""
    assert table.gap(1.019, 1.0, 0.02) == ""


def test_markdown_table_shape():
    t = table.markdown_table(["a", "b"], [[1, "x"], [2.5, "-"]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | - |"]
    with pytest.raises(ValueError):
        table.markdown_table(["a", "b"], [[1]])


def test_update_page_rewrites_only_its_section():
    page = table.update_page("", "torch-pruning", "## TP\nold")
    assert page.startswith(table.PAGE_HEAD)
    page = table.update_page(page, "kvpress", "## kv\nfirst")
    page = table.update_page(page, "mergekit", "## mk")
    assert table.sections(page) == ["kvpress", "torch-pruning", "mergekit"]  # ORDER kept
    new = table.update_page(page, "torch-pruning", "## TP\nnew")
    assert "new" in new and "old" not in new
    assert new.replace("## TP\nnew", "## TP\nold") == page  # nothing else changed
    assert table.sections(new) == ["kvpress", "torch-pruning", "mergekit"]
    with pytest.raises(ValueError):
        table.update_page(page, "nope", "x")


def test_window_sums_hand_case():
    # C = 2 positions over V = 2 tokens; the reference is uniform; the pressed model gives
    # token 1 probability 3/4 at position 0, token 0 probability 3/4 at position 1; the
    # continuation tokens are [0, 1].
    ref = torch.zeros(2, 2)
    out = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    ids = torch.tensor([[7, 0, 1]])
    s = continuation.window_sums(ref, out, ids, continuation=2)
    assert s["tokens"] == 1 and s["positions"] == 2
    assert s["nll"] == pytest.approx(-math.log(0.75))  # position 0 predicts token 1
    assert s["nll_dense"] == pytest.approx(math.log(2.0))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert s["kl"] == pytest.approx(2 * kl, rel=1e-5)
    assert s["agree"] == 1.0  # the reference's tie gives token 0: only position 1 agrees
    done = continuation.finish([s, s])
    assert done["continuation_perplexity"] == pytest.approx(1 / 0.75)
    assert done["continuation_kl"] == pytest.approx(kl, rel=1e-5)
    assert done["windows"] == 2 and done["tokens"] == 2


def test_kvpress_keeps_earlier_rows_on_the_same_ids(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    import peer_kvpress

    monkeypatch.setattr(common, "BENCH", tmp_path)
    old = {"ids_sha256": "abc", "started": "S", "commit": "C0",
           "prunelab": {"rows": [{"press": "tova", "ratio": 0.5, "v": 1},
                                 {"press": "tova", "ratio": 0.25, "v": 9}]},
           "kvpress": {"rows": [{"press": "tova", "ratio": 0.5, "v": 2}]}}
    (tmp_path / "kvpress.json").write_text(json.dumps(old))
    ctx = SimpleNamespace(quick=False, ratios=(0.25,))
    ours = {"rows": [{"press": "tova", "ratio": 0.25, "v": 3}]}
    theirs = {"rows": [{"press": "tova", "ratio": 0.25, "v": 4}]}
    earlier = peer_kvpress.merge_earlier(ctx, "abc", ours, theirs)
    # the rerun setting (0.25) is the new one; 0.5 comes from the earlier run
    assert [(r["ratio"], r["v"]) for r in ours["rows"]] == [(0.25, 3), (0.5, 1)]
    assert [(r["ratio"], r["v"]) for r in theirs["rows"]] == [(0.25, 4), (0.5, 2)]
    assert len(earlier) == 1 and "0.5" in earlier[0] and "C0" in earlier[0]
    other = {"rows": [{"press": "tova", "ratio": 0.25, "v": 3}]}
    assert peer_kvpress.merge_earlier(ctx, "other-ids", other, {"rows": []}) == []
    assert len(other["rows"]) == 1


def test_ragged_ids_round_trip_and_mismatch(tmp_path):
    rows = [torch.tensor([3, 1, 4]), np.array([1, 5]), torch.tensor([9])]
    sha, lengths = common.save_ragged(tmp_path / "r.npy", rows)
    assert lengths == [3, 2, 1]
    assert sha == common.ids_sha256(np.array([[3, 1, 4, 1, 5, 9]]))
    back = common.load_ragged(tmp_path / "r.npy", sha, lengths)
    assert [b.tolist() for b in back] == [[[3, 1, 4]], [[1, 5]], [[9]]]
    with pytest.raises(common.IdsMismatch):
        common.load_ragged(tmp_path / "r.npy", sha, [3, 2])
    with pytest.raises(common.IdsMismatch):
        common.load_ragged(tmp_path / "r.npy", "0" * 64, lengths)


def _tiny_llama():
    from tiny_models import tiny_model

    return tiny_model("llama").eval()


def test_stepwise_continuation_equals_one_forward():
    """One token per forward gives the one-shot continuation's logits (no press, with and
    without explicit positions)."""
    model = _tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 14), generator=torch.Generator()
                        .manual_seed(1))
    for explicit in (False, True):
        one, kept, _ = continuation.pressed_window(model, ids, 5, None, explicit)
        step, kept2, _ = continuation.pressed_window(model, ids, 5, None, explicit,
                                                     stepwise=True)
        assert kept == kept2 == [9] * model.config.num_hidden_layers
        assert one.shape == step.shape == (5, model.config.vocab_size)
        torch.testing.assert_close(step, one, atol=1e-5, rtol=1e-5)


def test_needle_answer_is_greedy_decoding():
    """The dense answer is the greedy continuation: each token the argmax of the full
    forward over the prompt plus the answer so far."""
    model = _tiny_llama()
    prompt = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator()
                           .manual_seed(2))
    for explicit in (False, True):
        got = continuation.needle_answer(model, prompt, None, explicit, new_tokens=4)
        seq = prompt
        want = []
        with torch.no_grad():
            for _ in range(4):
                tok = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
                want.append(tok)
                seq = torch.cat([seq, torch.tensor([[tok]])], 1)
        assert got == want


def test_a_failing_press_is_a_row_not_the_end():
    model = _tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator()
                        .manual_seed(3))

    class Boom:
        def __enter__(self):
            raise RuntimeError("mask of 204 against 208\nsecond line")

        def __exit__(self, *exc):
            return False

    class NoPeak:
        peak = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    rows = continuation.run_presses(model, ids, 4, [("boom", 0.5, Boom), ("none", 0.5, None)],
                                    False, NoPeak, lambda: 0, needles=[ids[:, :8]],
                                    new_tokens=2, needle_ratios=(0.5,))
    assert [r["press"] for r in rows] == ["dense", "boom", "none"]
    assert rows[1]["error"] == "RuntimeError: mask of 204 against 208"
    assert rows[2]["continuation_kl"] == pytest.approx(0.0, abs=1e-6)  # no press: dense
    assert rows[2]["needle_tokens"] == rows[0]["needle_tokens"]


def test_every_peer_module_has_a_section_slot():
    import run

    assert set(run.MODULES) == set(table.ORDER)


def test_snapkv_settings_section_marks_the_lowest_kl_per_ratio():
    import types

    import peer_snapkv_settings as ps

    proto = {"windows": 2, "prompt": 8, "continuation": 2, "ratios": (0.5,),
             "needle_lengths": (16,), "needle_depths": (0.5,), "needle_ratios": (0.5,)}
    kls = {(32, "max"): 0.006, (32, "mean"): 0.007, (64, "max"): 0.004, (64, "mean"): 0.005}
    rows = [{"press": "dense", "ratio": 0.0, "needle_hits": [True],
             "dense_continuation_perplexity": 10.0}]
    rows += [{"press": ps.label(w, p), "ratio": 0.5, "continuation_perplexity": 11.0,
              "continuation_kl": kl, "continuation_top1": 0.9, "needle_hits": [kl < 0.0055]}
             for (w, p), kl in kls.items()]
    ctx = types.SimpleNamespace(commit="abc", machine="m", command="c", model="tiny")
    text = ps.section(ctx, proto, "now", {"rows": rows}, "f" * 64, (64, "max"))
    lines = {ln.split(" | ")[0] + " " + ln.split(" | ")[1]: ln for ln in text.splitlines()
             if ln.startswith("| 32") or ln.startswith("| 64")}
    assert "(lowest)" in lines["| 64 max"] and "0.0040" in lines["| 64 max"]
    assert sum("(lowest)" in ln for ln in lines.values()) == 1
    assert lines["| 32 max"].endswith("0 / 1 |") and lines["| 64 mean"].endswith("1 / 1 |")
    assert "window 64 max 0.0040; window 64 mean 0.0050; window 32 max 0.0060" in text
    assert "dense pass-key hits 1 / 1." in text


def test_group_l2_by_hand_keeps_the_largest_coupled_channels():
    """The Torch-Pruning replica: per block, the channels of largest mean squared norm over
    the gate row, up row and down column survive, in order, and the config follows."""
    import worker_width

    from prunelab.models.loading import wrap

    from tiny_models import tiny_model

    lm = wrap(tiny_model("llama"))
    ad = lm.adapter
    width = ad.ffn_width(0)
    want = []
    for i in range(ad.num_blocks):
        p = ad.mlp_projections(i)
        imp = (p["gate"].weight.pow(2).sum(1) + p["up"].weight.pow(2).sum(1)
               + p["down"].weight.pow(2).sum(0)) / 3
        keep = sorted(imp.argsort(descending=True)[:width // 2].tolist())
        want.append((p["up"].weight[keep].clone(), p["down"].weight[:, keep].clone()))
    worker_width.group_l2_by_hand(lm, width // 2)
    for i, (up, down) in enumerate(want):
        p = ad.mlp_projections(i)
        assert torch.equal(p["up"].weight, up) and torch.equal(p["down"].weight, down)
    assert lm.model.config.intermediate_size == width // 2
