"""Fingerprinted resume (probes' partials, depth sweeps) and the no-overwrite folder rule."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

import prunelab.probes.session as session
from prunelab.errors import OutputExistsError, ResumeMismatchError
from prunelab.io.fingerprint import (
    config_digest,
    differences,
    make_fingerprint,
    mismatch_message,
    weights_digest,
)
from prunelab.models.loading import wrap
from prunelab.probes import run_probes
from prunelab.workflow.sweep import sweep_depth

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)
INFO = {"spec": "text:a.txt", "mode": "calib", "samples": 4, "seqlen": 12, "seed": 0}
SWEEP = sys.modules["prunelab.workflow.sweep"]


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- fingerprint
def test_weights_digest_sees_every_value_and_dtype():
    model = tiny_model("llama")
    d0 = weights_digest(model)
    assert d0 == weights_digest(tiny_model("llama")) and len(d0) == 32
    assert d0 != weights_digest(tiny_model("llama", seed=1))  # same shapes, other values
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[3].mlp.down_proj.weight[0, 0] += 1e-6  # one value, in memory
    assert weights_digest(other) != d0
    assert weights_digest(copy.deepcopy(model).to(torch.bfloat16)) != d0
    # volatile config keys do not count, real ones do
    cfg = copy.deepcopy(model.config)
    cfg._name_or_path, cfg.transformers_version = "/elsewhere", "9.9"
    assert config_digest(cfg) == config_digest(model.config)
    cfg.rms_norm_eps = 1e-3
    assert config_digest(cfg) != config_digest(model.config)


def test_differences_name_each_part():
    lm = wrap(tiny_model("llama"), spec="a")
    fp = make_fingerprint(lm, IDS, INFO, options={"window": 1})
    assert differences(fp, make_fingerprint(wrap(tiny_model("llama"), spec="b"), IDS, INFO,
                                            options={"window": 1})) == []  # same weights
    bf = make_fingerprint(wrap(copy.deepcopy(lm.model).to(torch.bfloat16), spec="a"), IDS,
                          INFO, options={"window": 1})
    assert differences(fp, bf) == [("dtype", "dtype float32 vs bfloat16")]
    w = make_fingerprint(wrap(tiny_model("llama", seed=1), spec="c"), IDS, INFO,
                         options={"window": 1})
    assert differences(fp, w) == [("model", "model weights differ: 'a' vs 'c'")]
    other = make_fingerprint(lm, IDS[:3], dict(INFO, samples=3), options={"window": 2})
    assert differences(fp, other) == [("data", "data: samples 4 vs 3"),
                                      ("options", "options: window 1 vs 2")]
    msg = mismatch_message("out/x.partial.json", differences(fp, other))
    assert msg == ("out/x.partial.json was made with another data / options (data: samples "
                   "4 vs 3; options: window 1 vs 2); pass --overwrite (overwrite=True) to "
                   "start afresh")
    assert differences(None, fp)[0][0] == "fingerprint"


# ---------------------------------------------------------------- probes
def interrupted(monkeypatch, lm, out, ids=IDS, after: int = 1, **kw):
    """Run interchange and 'kill' it right after the partial holds ``after`` scores."""
    real = session.write_json

    def write_then_die(path, obj, overwrite=False):
        real(path, obj, overwrite=overwrite)
        if str(path).endswith(".partial.json") and len(obj["scores"]) >= after:
            raise KeyboardInterrupt

    monkeypatch.setattr(session, "write_json", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_probes(lm, ["interchange"], ids, batch_size=2, out_dir=out, data_info=INFO,
                   window=1, **kw)
    monkeypatch.setattr(session, "write_json", real)
    partial = json.loads((out / "interchange.partial.json").read_text())
    assert len(partial["scores"]) == after and not (out / "interchange.json").exists()
    return partial


def test_probe_resume_requires_the_same_fingerprint(tmp_path, monkeypatch):
    lm = wrap(tiny_model("llama"), spec="tiny")
    full = run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=tmp_path / "full",
                      data_info=INFO, window=1)["interchange"]
    out = tmp_path / "out"
    interrupted(monkeypatch, lm, out)
    before = (out / "interchange.partial.json").read_text()
    refusals = {
        "model weights of 'tiny' differ": (wrap(tiny_model("llama", seed=1), spec="tiny"), IDS, {}),
        "dtype float32 vs bfloat16": (wrap(copy.deepcopy(lm.model).to(torch.bfloat16),
                                           spec="tiny"), IDS, {}),
        "another data (data: other tokens)": (lm, tiny_tokens(4, 12, seed=5), {}),
        "options (options: window 1 vs 2)": (lm, IDS, {"window": 2}),
    }
    for what, (model, ids, opts) in refusals.items():
        with pytest.raises(ResumeMismatchError) as exc:
            run_probes(model, ["interchange"], ids, batch_size=2, out_dir=out,
                       data_info=INFO, **{"window": 1, **opts})
        msg = one_line(exc)
        assert what in msg and "interchange.partial.json" in msg and "--overwrite" in msg
        assert (out / "interchange.partial.json").read_text() == before  # untouched
    # same fingerprint: resumes (two pairs left: 3 cache + 2 swap block evaluations,
    # against 9 uninterrupted) and equals the uninterrupted run
    again = run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=out, data_info=INFO,
                       window=1)["interchange"]
    assert again.scores == full.scores
    assert again.meta["block_evaluations"] == 3 + 2 < full.meta["block_evaluations"]
    assert not (out / "interchange.partial.json").exists()
    assert json.loads((out / "interchange.json").read_text())["fingerprint"] == \
        full.meta["fingerprint"]


def test_probe_overwrite_starts_afresh(tmp_path, monkeypatch):
    lm = wrap(tiny_model("llama"), spec="tiny")
    out = tmp_path / "out"
    interrupted(monkeypatch, lm, out, after=2)
    with torch.no_grad():  # the same model object, modified in memory
        lm.model.model.layers[1].self_attn.o_proj.weight.mul_(1.5)
    with pytest.raises(ResumeMismatchError, match="model"):
        run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=out, window=1)
    fresh = run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=out, window=1,
                       overwrite=True)["interchange"]
    ref = run_probes(lm, ["interchange"], IDS, batch_size=2, window=1)["interchange"]
    assert fresh.scores == ref.scores
    assert fresh.meta["block_evaluations"] == ref.meta["block_evaluations"] == 9
    assert not (out / "interchange.partial.json").exists()


def test_partial_without_fingerprint_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "interchange.partial.json").write_text(json.dumps(
        {"config": {}, "data_sha256": "", "scores": [{"layers": [0, 1], "value": 9.0}]}))
    lm = wrap(tiny_model("llama"))
    with pytest.raises(ResumeMismatchError, match="fingerprint"):
        run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=out, window=1)


def test_probe_never_replaces_files_it_did_not_write(tmp_path):
    lm = wrap(tiny_model("llama"), spec="tiny")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.md").write_text("my notes\n")
    with pytest.raises(OutputExistsError) as exc:
        run_probes(lm, ["block-influence"], IDS, batch_size=2, out_dir=out)
    assert "summary.md" in one_line(exc) and "--overwrite" in str(exc.value)
    (out / "interchange.csv").write_text("mine\n")  # a csv without interchange.json
    (out / "summary.md").unlink()
    with pytest.raises(OutputExistsError, match="interchange.csv"):
        run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=out, window=1)
    assert (out / "interchange.csv").read_text() == "mine\n"
    assert sorted(p.name for p in out.iterdir()) == ["interchange.csv"]  # nothing written
    run_probes(lm, ["interchange"], IDS, batch_size=2, out_dir=out, window=1, overwrite=True)
    assert (out / "interchange.csv").read_text().startswith("layers,")


def test_probe_folder_of_prunelab_is_updated_and_summary_keeps_to_one_model(tmp_path):
    lm = wrap(tiny_model("llama"), spec="tiny")
    out = tmp_path / "out"
    run_probes(lm, ["block-influence"], IDS, batch_size=2, out_dir=out)
    # prunelab's folder: another probe adds to it and summary.md compares both
    run_probes(lm, ["leave-one-out"], IDS, batch_size=2, out_dir=out)
    assert "`block-influence`" in (out / "summary.md").read_text()
    # a probe of another model in the same folder: the summary leaves the others out
    other = wrap(tiny_model("llama", seed=1), spec="other")
    run_probes(other, ["contraction"], IDS, batch_size=2, out_dir=out)
    text = (out / "summary.md").read_text()
    assert "`contraction`" in text and "`block-influence`" not in text


# ---------------------------------------------------------------- sweep
def counting(monkeypatch) -> list:
    calls: list = []
    real = SWEEP._run_point

    def run_point(*a, **k):
        calls.append(a[2:5])  # (probe, recovery, n)
        return real(*a, **k)

    monkeypatch.setattr(SWEEP, "_run_point", run_point)
    return calls


def test_sweep_rerun_needs_the_same_fingerprint(tmp_path, monkeypatch):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    test_ids = tiny_tokens(2, 12, seed=9)
    out = tmp_path / "sweep"
    calls = counting(monkeypatch)
    args = (["last-n"], [1], ["none"])
    points = sweep_depth(lm, *args, IDS, test_ids, out, batch_size=2, data_info=INFO)
    assert len(calls) == 1 and (out / "sweep.json").is_file()
    files = {f: (out / f).read_bytes() for f in ("points.json", "dense.json", "sweep.json")}
    refusals = {
        "test data (test data: samples 2 vs 3)": dict(test_ids=tiny_tokens(3, 12, seed=9)),
        "model (model weights of 'tiny' differ)": dict(
            lm=wrap(tiny_model("llama", seed=1), char_tokenizer(), spec="tiny")),
        "data (data: samples 4 vs 2)": dict(calib=IDS[:2]),
        "options (options: window 1 vs 2)": dict(window=2),
    }
    for what, change in refusals.items():
        with pytest.raises(ResumeMismatchError) as exc:
            sweep_depth(change.get("lm", lm), *args, change.get("calib", IDS),
                        change.get("test_ids", test_ids), out, batch_size=2, data_info=INFO,
                        window=change.get("window", 1))
        assert what in one_line(exc) and "sweep.json" in str(exc.value)
        assert {f: (out / f).read_bytes() for f in files} == files  # nothing replaced
    # the same fingerprint: reuses every point (batch size is not part of it) and may
    # add points to the grid
    again = sweep_depth(lm, *args, IDS, test_ids, out, batch_size=4, data_info=INFO)
    assert again == points and len(calls) == 1
    more = sweep_depth(lm, ["last-n"], [1, 2], ["none"], IDS, test_ids, out, batch_size=2)
    assert calls == [("last-n", "none", 1), ("last-n", "none", 2)] and more[0] == points[0]
    # overwrite: starts afresh with the new test windows
    new_test = tiny_tokens(3, 12, seed=9)
    fresh = sweep_depth(lm, *args, IDS, new_test, out, batch_size=2, overwrite=True)
    assert len(calls) == 3 and len(fresh) == 1
    assert json.loads((out / "dense.json").read_text())["samples"] == 3
    stored = json.loads((out / "sweep.json").read_text())["fingerprint"]
    assert stored["test_data"]["samples"] == 3


def test_sweep_never_replaces_a_curve_it_did_not_write(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    test_ids = tiny_tokens(2, 12, seed=9)
    for name in ("curve.md", "dense.json", "points.json"):
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        (out / name).write_text("[]\n")  # someone's file, or an unfingerprinted sweep
        with pytest.raises(OutputExistsError) as exc:
            sweep_depth(lm, ["last-n"], [1], ["none"], IDS, test_ids, out, batch_size=2)
        assert name in one_line(exc) and "--overwrite" in str(exc.value)
        assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == "[]\n"
    sweep_depth(lm, ["last-n"], [1], ["none"], IDS, test_ids, tmp_path / "curve",
                batch_size=2, overwrite=True)
    assert (tmp_path / "curve" / "curve.md").read_text().startswith("# Depth pruning curve")
