"""A module's own forward pre-hooks read its parameters unsharded in compiled mode, as in FSDP2
(which unshards in a pre-hook registered first): the hook-based ``nn.utils.spectral_norm`` and
``nn.utils.weight_norm`` compute the weight there. Before, compiled mode gathered inside forward,
after the hooks, and such a module in a group of its own failed ("aten.mv.default got mixed
torch.Tensor and DTensor"), run eagerly and under ``torch.compile`` alike."""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import shardkit
import shardkit.compiled
from tests.conftest import fake_world


class Normed(nn.Module):
    """A spectral-normed and a weight-normed layer (the hook-based forms), each sharded as a group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.spectral_norm(nn.Linear(8, 8))
        self.b = nn.utils.weight_norm(nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def sharded(fully_shard, mesh) -> tuple[nn.Module, list]:
    """``Normed`` sharded, plus a pre-hook registered after ``fully_shard`` with ``prepend=True``
    (it still runs after the gather) that records what type and shape ``b.weight_v`` has."""
    torch.manual_seed(0)
    net = Normed()
    fully_shard(net.a, mesh=mesh)
    fully_shard(net.b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    seen = []
    net.b.register_forward_pre_hook(lambda m, args: seen.append((type(m.weight_v), tuple(m.weight_v.shape))), prepend=True)
    return net, seen


def trained(net: nn.Module, run: nn.Module) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(3):
        run(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in net.named_parameters()}


def test_hook_based_spectral_and_weight_norm_train_as_eager_mode():
    """Compiled mode run eagerly (compiled by torch.compile, on 2 gloo ranks against FSDP2:
    tests/gloo/test_compiled_mode.py)."""
    with fake_world(1) as mesh:
        model, _ = sharded(shardkit.fully_shard, mesh)
        eager = trained(model, model)
        net, seen = sharded(shardkit.compiled.fully_shard, mesh)
        compiled = trained(net, net)
    assert compiled.keys() == eager.keys() and all(torch.equal(compiled[n], eager[n]) for n in eager)
    torch.manual_seed(0)
    untrained = dict(Normed().named_parameters())
    torch.manual_seed(0)
    reference = trained(plain := Normed(), plain)  # the unsharded model's training
    for n, p in reference.items():
        assert not torch.equal(p, untrained[n]) and torch.allclose(compiled[n], p, rtol=1e-5, atol=1e-6), n
    assert seen and all(s == (torch.Tensor, (4, 8)) for s in seen), seen


def test_pre_hooks_see_the_gathered_parameters_in_one_graph_at_world_2():
    with fake_world(2) as mesh:
        torch._dynamo.reset()
        net, seen = sharded(shardkit.compiled.fully_shard, mesh)
        torch.compile(net, backend="aot_eager", fullgraph=True)(torch.randn(4, 8)).sum().backward()
        assert seen == [(torch.Tensor, (4, 8))]  # (the whole weight; outside forward it is the (2, 8) shard)
        assert isinstance(net.b.weight_v, DTensor) and net.b.weight_v.to_local().shape == (2, 8)
        assert all(p.grad is not None for p in net.parameters())
