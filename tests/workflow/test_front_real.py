"""The served front of SmolLM2-135M at a small grid (slow): the dense f16 file's perplexity in
llama.cpp is prunelab's own on the same windows, a depth-pruned and healed file is smaller
and generates faster than the dense file of its type, the importance matrix lowers the
dense q4_k_m's perplexity, and the target picks from what was measured."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_smollm2_front_at_a_small_grid(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is built by scripts/test.sh")
    import prunelab
    from prunelab.eval.llamacpp import prunelab_logprobs
    from prunelab.workflow.front import answer, build_front, make_settings

    settings = make_settings("smollm2-135m", grid="depth:4+heal", types="f16,q4_k_m",
                             grid_types="q4_k_m", heal={"steps": 2}, samples=8, seqlen=128,
                             windows=2, test_seqlen=128, rounds=2, prompt=128, gen=32)
    front = build_front(settings, tmp_path / "front")
    rows = {r["file"].split("/")[-1]: r for r in front["rows"]}
    assert sorted(rows) == ["dense.f16.gguf", "dense.q4_k_m.gguf", "depth4-heal.q4_k_m.gguf"]
    # llama.cpp's f16 perplexity is prunelab's float32 one on the same token ids
    lm = prunelab.load("smollm2-135m")
    windows = prunelab.api.tokens_for(lm, "wiki-vital:test", seqlen=128, samples=2,
                                      mode="test").input_ids
    lp = prunelab_logprobs(lm, windows)
    ids = windows.numpy()
    ours = math.exp(-np.take_along_axis(lp[:, :-1], ids[:, 1:, None], -1).mean())
    assert rows["dense.f16.gguf"]["ppl"] == pytest.approx(ours, rel=0.01)
    pruned, dense = rows["depth4-heal.q4_k_m.gguf"], rows["dense.q4_k_m.gguf"]
    assert pruned["mib"] < dense["mib"] - 4 * 2  # four blocks of about 2.4 MiB each
    assert pruned["gen_x"] > 1.0  # 26 of 30 blocks: fewer bytes per token
    assert front["models"]["depth4-heal"]["blocks"] == 26
    assert front["files"]["dense.q4_k_m"]["imatrix"] is True
    assert answer(front, f"size:{dense['mib'] - 1}")["file"].endswith("depth4-heal.q4_k_m.gguf")
