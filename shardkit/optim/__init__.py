"""Optimizers on sharded parameters.

- ``local_step.py``: torch's elementwise optimizers (AdamW, SGD, ...) step on each rank's
  local shards (installed at the first ``fully_shard``, through core/steps.py; nothing to call).
- ``Muon`` (``muon.py``): ``torch.optim.Muon``, each matrix orthogonalized once in the mesh
  by an owner rank (``owners.py``: the owner assignment and transport any matrix optimizer
  reuses; ``PolarExpress`` is a second one built on it).
"""

from shardkit.core import steps
from shardkit.optim import local_step
from shardkit.optim.muon import Muon
from shardkit.optim.owners import Matrix, OwnerCompute
from shardkit.optim.polar_express import PolarExpress

__all__ = ["Muon", "PolarExpress", "OwnerCompute", "Matrix"]

steps.install_before(local_step.install_once)  # at the first fully_shard, either mode
