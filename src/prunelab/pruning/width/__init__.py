"""Structured width pruning: KV groups / heads / query heads and FFN channels removed
physically, scored by wanda-sp, magnitude profile, FLAP, ablation KL, Putri or jointly by
CoCurve, with least-squares compensation of the consumer projections."""

from prunelab.pruning.width.config import Width, from_dict, to_dict

__all__ = ["Width", "from_dict", "to_dict"]
