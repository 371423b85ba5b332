"""Training signals: Muon helpers and BMuon (:mod:`prunelab.train.bmuon`)."""

from prunelab.train.bmuon import (
    BMuon,
    ChannelGroup,
    allocate,
    channel_surrogate,
    mlp_channel_groups,
    orthogonalise,
)

__all__ = ["BMuon", "ChannelGroup", "allocate", "channel_surrogate", "mlp_channel_groups",
           "orthogonalise"]
