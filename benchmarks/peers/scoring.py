"""The one evaluator every peer's checkpoint goes through (prunelab's environment only).

:func:`score_dirs` loads each checkpoint directory with ``prunelab.load`` (float32, CPU)
and scores it with ``prunelab.evaluate`` on one and the same test ``TokenBatches`` against
the dense model: perplexity (``exp`` of the mean NLL of tokens ``1..T-1`` of every
window), KL(dense || pruned) and top-1 agreement averaged over all positions, and the
parameter count (``prunelab.eval`` protocol, :mod:`prunelab.eval.perplexity`). The dense
model's outputs are computed once and kept (``reference_cache``).
"""

from __future__ import annotations


def score_dirs(model: str, test, dirs: dict[str, str], batch_size: int = 4) -> dict:
    """``{label: {perplexity, kl, top1, params}}`` for ``dirs`` ``{label: path}``, plus
    ``"dense"`` (the model itself, KL 0 by construction)."""
    import gc

    import prunelab

    dense = prunelab.load(model, dtype="float32", device="cpu")
    cache: dict = {}
    out = {}
    r = prunelab.evaluate(dense, test, batch_size=batch_size, reference=dense,
                          reference_cache=cache)
    out["dense"] = _row(r)
    for label, path in dirs.items():
        if path is None:
            continue
        lm = prunelab.load(path, dtype="float32", device="cpu")
        r = prunelab.evaluate(lm, test, batch_size=batch_size, reference=dense,
                              reference_cache=cache)
        out[label] = _row(r)
        del lm
        gc.collect()
    return out


def _row(r: dict) -> dict:
    return {"perplexity": float(r["perplexity"]), "kl": float(r.get("kl_to_reference", 0.0)),
            "top1": float(r.get("top1_agreement", 1.0)), "params": r.get("params")}
