"""Redundancy probes: one number per block, span or block pair, under several protocols.

Importing this package registers every probe in :data:`PROBES` (name -> typed config);
``prunelab.probe(lm, Interchange(window=1), data)`` and ``prunelab.probe(lm, "interchange",
data, window=1)`` are the same run.
"""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__)

from prunelab.probes.ablation import LeaveOneOut, SublayerAblation
from prunelab.probes.attribution import DLA
from prunelab.probes.base import (
    PROBES,
    ProbeResult,
    ProbeSpec,
    make_config,
    options_for,
    probe_names,
    probe_spec,
    route_options,
)
from prunelab.probes.context import ProbeContext
from prunelab.probes.contraction import Contraction
from prunelab.probes.gradient_flow import GradientFlow
from prunelab.probes.head_weights import StableRank
from prunelab.probes.heads import HeadAblation, Induction
from prunelab.probes.interval import Interval
from prunelab.probes.session import run_probes
from prunelab.probes.similarity import CKA, BlockInfluence, SpanAngular
from prunelab.probes.swap import Interchange, Replacement
from prunelab.probes.weights import WeightRedundancy

__all__ = ["CKA", "DLA", "PROBES", "BlockInfluence", "Contraction", "GradientFlow",
           "HeadAblation", "Induction", "Interchange", "Interval", "StableRank",
           "LeaveOneOut", "ProbeContext", "ProbeResult", "ProbeSpec", "Replacement",
           "SpanAngular", "SublayerAblation", "WeightRedundancy", "make_config",
           "options_for", "probe_names", "probe_spec", "route_options",
           "run_probes"]
