"""Optimizers on sharded parameters.

- ``local_step.py``: torch's elementwise optimizers (AdamW, SGD, ...) step on each rank's
  local shards (installed by ``fully_shard``; nothing to call).
- ``Muon`` (``muon.py``): ``torch.optim.Muon``, each matrix orthogonalized once in the mesh
  by an owner rank (``owners.py``: the owner assignment and transport any matrix optimizer
  reuses; ``PolarExpress`` is a second one built on it).
"""

from shardkit.optim.local_step import groups, install_once
from shardkit.optim.muon import Muon
from shardkit.optim.owners import Matrix, OwnerCompute
from shardkit.optim.polar_express import PolarExpress

__all__ = ["Muon", "PolarExpress", "OwnerCompute", "Matrix"]
