"""Where an elastic ranking lives: the one fitted on a model in this process, an
``elastic.json`` beside a checkpoint's weights, or the checkpoint manifest's history entry;
checked on read (:func:`check_ranking`), found for a model's current shapes
(:func:`find_ranking`), and written by ``prunelab.save`` (:func:`write_ranking`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from prunelab.checkpoint.save import register_save_extra
from prunelab.errors import ConfigError, CorruptCheckpointError
from prunelab.io.files import write_json
from prunelab.io.manifest import read_json_file, read_manifest
from prunelab.pruning.width.elastic.fit import FORMAT


def _matches(ranking: dict, ad, kind: str | None) -> bool:
    n = ad.num_blocks
    if len(ranking.get("blocks", [])) != n:
        return False
    ffn_ok = ranking["ffn_per_block"] == [ad.ffn_width(i) for i in range(n)]
    heads = ranking["heads_per_block"]
    heads_ok = not any(heads) or heads == [ad.head_geometry(i).num_kv_heads for i in range(n)]
    return {"ffn": ffn_ok, "heads": heads_ok}.get(kind, ffn_ok and heads_ok)


def _from_disk(lm) -> dict | None:
    for base in (getattr(lm, "source", None), getattr(lm, "spec", None)):
        if not base or not Path(str(base)).is_dir():
            continue
        path = Path(str(base)) / "elastic.json"
        if path.is_file():
            return check_ranking(read_json_file(path), str(path))
        man = read_manifest(Path(str(base)))
        if man is not None:
            for op in reversed(man.get("operations", [])):
                if isinstance(op.get("ranking"), dict):
                    return check_ranking(op["ranking"], f"{base}/manifest.json")
    return None


def check_ranking(ranking, where: str) -> dict:
    """``ranking`` if it has the shape :func:`fit_ranking` writes (format, per-block KV
    group and FFN channel counts, one finite score per unit); else a one-line
    :class:`CorruptCheckpointError` naming ``where`` (a truncated or edited file)."""
    def bad(why: str):
        return CorruptCheckpointError(f"{where}: not a usable elastic ranking ({why})")

    if not isinstance(ranking, dict):
        raise bad(f"a JSON {type(ranking).__name__}, not an object")
    if ranking.get("format") != FORMAT:
        raise bad(f"format {ranking.get('format')!r}, expected {FORMAT!r}")
    counts = {}
    for key in ("heads_per_block", "ffn_per_block", "blocks"):
        if not isinstance(ranking.get(key), list):
            raise bad(f"'{key}' must be a list")
    for key in ("heads_per_block", "ffn_per_block"):
        v = ranking[key]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v):
            raise bad(f"'{key}' must hold counts")
        counts[key] = v
    blocks = ranking["blocks"]
    if not (len(blocks) == len(counts["heads_per_block"]) == len(counts["ffn_per_block"])):
        raise bad(f"{len(blocks)} blocks of scores for {len(counts['ffn_per_block'])} "
                  "blocks of counts")
    for i, blk in enumerate(blocks):
        if not isinstance(blk, dict):
            raise bad(f"block {i} is not an object")
        for kind, n in (("heads", counts["heads_per_block"][i]),
                        ("ffn", counts["ffn_per_block"][i])):
            scores = blk.get(kind)
            if not isinstance(scores, list) or len(scores) != n:
                raise bad(f"block {i} needs {n} {kind} scores")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                       and math.isfinite(x) for x in scores):
                raise bad(f"block {i}: the {kind} scores must be finite numbers")
    return ranking


def find_ranking(lm, kind: str | None = None, path: str | None = None) -> dict | None:
    """The ranking that applies to ``lm``'s current shapes: ``path`` (an ``elastic.json``),
    else the one fitted on ``lm`` in this process, else ``elastic.json`` / the manifest of
    the checkpoint it was loaded from; ``None`` when there is none. A ranking whose shapes
    do not match (for ``kind``: ``heads``, ``ffn`` or both) is a :class:`ConfigError`."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"elastic ranking {path} does not exist")
        ranking = check_ranking(read_json_file(p), str(p))
    else:
        ranking = getattr(lm, "elastic_ranking", None) or _from_disk(lm)
    if ranking is None:
        return None
    if not _matches(ranking, lm.adapter, kind):
        raise ConfigError("the elastic ranking was fitted on other shapes (the model was "
                          "pruned since?): cut from the elastic checkpoint itself")
    return ranking


def ranking_to_save(lm) -> dict | None:
    """The ranking ``prunelab.save`` writes as ``elastic.json``: the model's own, and only
    while it still fits the model's shapes (a model pruned since is no elastic
    checkpoint)."""
    ranking = getattr(lm, "elastic_ranking", None)
    if ranking is None or not _matches(ranking, lm.adapter, None):
        return None
    return ranking


@register_save_extra
def write_ranking(lm, folder: Path) -> None:
    """Checkpoint hook: an elastic model's ranking as ``elastic.json`` beside its weights."""
    if (ranking := ranking_to_save(lm)) is not None:
        write_json(folder / "elastic.json", ranking)


def block_tensors(ranking: dict, kind: str) -> list[torch.Tensor]:
    return [torch.tensor(b[kind], dtype=torch.float64) for b in ranking["blocks"]]
