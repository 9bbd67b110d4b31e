"""Lion Cub: communication-efficient distributed Lion (arXiv 2411.16462).

Public API (docs/api.md)::

    lioncub.LionCub         every step: Lion with its update agreed across ranks in 1-8 bits per element
    lioncub.LocalCub        local steps: H inner steps, then one agreed outer step
    lioncub.OneBitMean, SignVote, Mean, LaneMean, ScatterMean
                            how the update travels (``aggregation=``; lioncub.aggregations)
    lioncub.Outer, Streaming, Options
                            LocalCub's outer rule and streamed rounds; the advanced settings of both
    lioncub.node_groups     the in-node and cross-node groups of ``LionCub(process_group=node_groups())``
    lioncub.Lion            single-process Lion (torch.optim.Optimizer)
    lioncub.majority_vote   the vote collective; lioncub.reference_vote its exact reference
    lioncub.quantize        the quantizers (sign, l1, lp, l0, linf, log)
"""
from .aggregations import LaneMean, Mean, OneBitMean, ScatterMean, SignVote
from .comm import CommStats
from .options import Options, Outer, Streaming
from .optim.lioncub import GRAD_DTYPES, OPTIMIZER_VOTES, LionCub
from .optim.nodecub import NodeCub, NodeLayout, node_groups
from .lion import Lion
from .optim.localcub import LocalCub
from .optim.replicas import FTLionCub as _FTLionCub  # registers what LionCub/LocalCub(manager=...) build
from .quantize import QUANTIZERS, Quantized, quantize
from .votes.api import VOTE_METHODS, majority_vote, reference_vote

__version__ = "0.1.0"

__all__ = [
    "CommStats",
    "LaneMean",
    "Mean",
    "OneBitMean",
    "Options",
    "Outer",
    "ScatterMean",
    "SignVote",
    "Streaming",
    "GRAD_DTYPES",
    "Lion",
    "LionCub",
    "LocalCub",
    "NodeCub",
    "NodeLayout",
    "OPTIMIZER_VOTES",
    "QUANTIZERS",
    "Quantized",
    "VOTE_METHODS",
    "majority_vote",
    "node_groups",
    "quantize",
    "reference_vote",
]

del _FTLionCub
