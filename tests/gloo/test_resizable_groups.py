"""A replicate dimension whose size changes between steps, on 2 gloo ranks, shardkit beside
torch's FSDP2 and an unsharded reference.

``Resizing`` is a process group written in Python, as torchft's ``ManagedProcessGroup`` is: its
``size()`` is the replicas taking part this step, and a replica that does not take part (one
that is healing) adds zeros to the all-reduce, as torchft's manager has it. The mesh is HSDP
(replicate 2, shard 1) with ``Resizing`` as the replicate dimension, made with
``DeviceMesh.from_group``. Each step the reduced gradient must be the mean over the replicas
taking part, at every participant count; and a resizable group anywhere else is refused at
``fully_shard`` with an error that names the dimension.
"""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import shardkit
import shardkit.compiled
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD

checks = Checks()
_NAMES = itertools.count()


class Resizing(dist.ProcessGroup):
    """A group over the ranks of ``inner`` whose size is the ranks in ``participants``; the
    others add zeros (torchft: a healing replica). AVG: SUM, then a division by the size."""

    def __init__(self, inner: dist.ProcessGroup) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner, self.participants = inner, set(range(inner.size()))
        self._name = f"resizing:{next(_NAMES)}"
        torch._C._distributed_c10d._register_process_group(self._name, self)  # DeviceMesh.get_group finds it by name

    @property
    def group_name(self) -> str:  # (as torchft's groups: c10d's registry does not know it)
        return self._name

    def size(self) -> int:
        return len(self.participants)

    def getBackendName(self) -> str:
        return "resizing"

    def allreduce(self, tensors, opts):
        op = opts if isinstance(opts, dist.ReduceOp) else opts.reduceOp
        (tensor,) = tensors
        if self.inner.rank() not in self.participants:
            tensor.zero_()
        work = self.inner.allreduce([tensor], dist.AllreduceOptions())  # SUM
        work.wait()
        if op == dist.ReduceOp.AVG:
            tensor.div_(self.size())
        return work


def resizing_mesh() -> tuple[DeviceMesh, Resizing]:
    plain = DeviceMesh("cpu", torch.arange(2).view(2, 1), mesh_dim_names=("replicate", "shard"))
    group = Resizing(plain.get_group(0))
    mesh = DeviceMesh.from_group([group, plain.get_group(1)], "cpu", mesh=torch.arange(2).view(2, 1), mesh_dim_names=("replicate", "shard"))
    return mesh, group


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


PARTICIPANTS = [{0, 1}, {0}, {0, 1}, {1}, {0, 1}]  # the replicas taking part, step by step


def train(impl: str, reduce_dtype=None) -> list[dict[str, torch.Tensor]]:
    """Each step's gradients (full tensors) with the participants of PARTICIPANTS."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh, group = resizing_mesh()
    torch.manual_seed(0)
    model = Net()
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.blocks:
        FULLY_SHARD[impl](block, mesh=mesh, mp_policy=policy)
    FULLY_SHARD[impl](model, mesh=mesh, mp_policy=policy)
    grads = []
    for step, participants in enumerate(PARTICIPANTS):
        group.participants = participants
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(4, 8, generator=g)).sum().backward()
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        model.zero_grad()
    return grads


def reference() -> list[dict[str, torch.Tensor]]:
    """The mean over the participants' gradients of an unsharded copy, step by step."""
    torch.manual_seed(0)
    model = Net()
    out = []
    for step, participants in enumerate(PARTICIPANTS):
        grads = []
        for rank in sorted(participants):
            g = torch.Generator().manual_seed(100 * step + rank)
            copy_ = copy.deepcopy(model)
            copy_(torch.randn(4, 8, generator=g)).sum().backward()
            grads.append({n: p.grad for n, p in copy_.named_parameters()})
        out.append({n: sum(g[n] for g in grads) / len(grads) for n in grads[0]})
    return out


@checks("shardkit")
def the_replicate_reduction_averages_over_the_replicas_taking_part_at_every_size_as_fsdp2(mesh, impl):
    want = reference()
    ours, theirs = train("shardkit"), train("torch")
    for step, (a, b, w) in enumerate(zip(ours, theirs, want)):
        for name in w:
            torch.testing.assert_close(a[name], w[name], msg=lambda m: f"step {step} {PARTICIPANTS[step]}: {name}: {m}")
            torch.testing.assert_close(a[name], b[name], msg=lambda m: f"step {step}: {name} against FSDP2: {m}")


@checks("shardkit")
def a_resizable_group_in_fp16_and_under_the_trace_keeps_its_size_per_step(mesh, impl):
    want = reference()
    with shardkit.trace() as t:
        ours = train("shardkit", reduce_dtype=torch.float16)
    for step, (a, w) in enumerate(zip(ours, want)):
        for name in w:
            torch.testing.assert_close(a[name], w[name], atol=2e-3, rtol=2e-3, msg=lambda m: f"step {step}: {name}: {m}")
    worlds = [e.world for e in t.collectives("all_reduce")]
    assert worlds == [len(p) for p in PARTICIPANTS for _ in range(2)], worlds  # the 2 blocks' (the root holds none)


@checks("shardkit")
def a_resizable_group_as_a_shard_dimension_or_in_compiled_mode_is_refused_with_its_name(mesh, impl):
    plain = DeviceMesh("cpu", torch.arange(2).view(1, 2), mesh_dim_names=("replicate", "shard"))
    names = ("replicate", "shard")
    sharded_over = DeviceMesh.from_group([plain.get_group(0), Resizing(plain.get_group(1))], "cpu", mesh=torch.arange(2).view(1, 2), mesh_dim_names=names)
    with pytest.raises(NotImplementedError, match="'shard' dimension is a Resizing.*as a shard dimension"):
        shardkit.fully_shard(Net(), mesh=sharded_over)
    hsdp, _ = resizing_mesh()
    with pytest.raises(NotImplementedError, match="'replicate' dimension is a Resizing.*in compiled mode"):
        shardkit.compiled.fully_shard(Net(), mesh=hsdp)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_resizable_groups_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
