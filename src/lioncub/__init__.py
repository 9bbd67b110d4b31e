"""Lion Cub: communication-efficient distributed Lion (arXiv 2411.16462).

Public API::

    lioncub.Lion            single-process Lion (torch.optim.Optimizer)
    lioncub.LionCub         distributed Lion by majority vote, 1-8 bits per element
    lioncub.LocalCub        local steps under the vote: H inner steps, then one agreed outer step
    lioncub.NodeCub         many ranks per node: average inside the node, vote across nodes
    lioncub.node_groups     the in-node and cross-node groups NodeCub runs on
    lioncub.majority_vote   the vote collective; lioncub.reference_vote its exact reference
    lioncub.quantize        the quantizers (sign, l1, lp, l0, linf, log)
"""
from .comm import CommStats
from .optim.lioncub import GRAD_DTYPES, OPTIMIZER_VOTES, LionCub
from .optim.nodecub import NodeCub, NodeLayout, node_groups
from .lion import Lion
from .optim.localcub import LocalCub
from .quantize import QUANTIZERS, Quantized, quantize
from .votes.api import VOTE_METHODS, majority_vote, reference_vote

__version__ = "0.1.0"

__all__ = [
    "CommStats",
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
