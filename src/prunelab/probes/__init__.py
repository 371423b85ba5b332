"""Redundancy probes: one number per block, span or block pair, under several protocols.

Importing this package registers every probe (see :func:`probe_names`).
"""

from prunelab.probes import ablation, contraction, interval, similarity, swap, weights  # noqa: F401
from prunelab.probes.base import ProbeResult, make_config, probe_names, register
from prunelab.probes.context import ProbeContext
from prunelab.probes.session import run_probes

__all__ = ["ProbeContext", "ProbeResult", "make_config", "probe_names", "register",
           "run_probes"]
