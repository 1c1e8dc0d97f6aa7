"""Mixed precision, mixed dtypes, offload and reshard_after_forward=int on a fake process group:
dtypes, devices, collective bytes and schedules (numerics are in tests/gloo/test_mixed_precision_numerics.py)."""

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.tensor import DTensor

import shardkit
from shardkit import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from shardkit.eager.param_group import Holding
from tests.conftest import TanhStack, fake_world

BF16 = torch.bfloat16


def Net(n_blocks: int = 2) -> TanhStack:
    return TanhStack(n_blocks, dim=16)


def sharded(mesh, n_blocks: int = 2, **kwargs) -> TanhStack:
    torch.manual_seed(0)
    net = Net(n_blocks)
    for block in net.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    fully_shard(net, mesh=mesh, **root_kwargs)
    return net


def step(net, x=None) -> shardkit.Trace:
    with shardkit.trace() as t:
        net(torch.randn(4, 16) if x is None else x).sum().backward()
    return t


def collectives(t: shardkit.Trace) -> str:
    return t.format(kinds=("all_gather", "reduce_scatter"))


def test_bf16_params_fp32_reduce_gather_in_bf16_and_keep_fp32_shards_and_grads():
    with fake_world(8, 3) as mesh:
        net = sharded(mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))
        seen = {}
        net.blocks[0][0].register_forward_hook(lambda m, i, o: seen.update(inp=i[0].dtype, weight=m.weight.dtype, out=o.dtype))
        t = step(net)
        assert seen == {"inp": BF16, "weight": BF16, "out": BF16}
        for name, p in net.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.to_local().dtype == torch.float32, name
            assert p.grad.dtype == torch.float32 and p.grad.to_local().dtype == torch.float32, name
    assert_expected_inline(collectives(t), """\
all_gather <root> bfloat16 numel=408 world=8 mesh=dim0
all_gather blocks.0 bfloat16 numel=272 world=8 mesh=dim0
all_gather blocks.1 bfloat16 numel=272 world=8 mesh=dim0
all_gather blocks.1 bfloat16 numel=272 world=8 mesh=dim0
all_gather blocks.0 bfloat16 numel=272 world=8 mesh=dim0
reduce_scatter blocks.1 float32 numel=288 world=8 mesh=dim0
reduce_scatter blocks.0 float32 numel=288 world=8 mesh=dim0
reduce_scatter <root> float32 numel=440 world=8 mesh=dim0""")
    # bf16 halves the all-gather bytes of the same schedule in fp32
    with fake_world(8, 3) as mesh:
        fp32 = step(sharded(mesh)).summary()["all_gather"].nbytes
    assert t.summary()["all_gather"].nbytes * 2 == fp32


def test_reduce_dtype_defaults_as_the_installed_fsdp2_and_outputs_take_output_dtype():
    """Without a reduce_dtype: param_dtype before torch 2.15, the parameter's own dtype from
    2.15 (checked against FSDP2 itself in the last test below)."""
    from shardkit import versions

    with fake_world(4, 0) as mesh:
        torch.manual_seed(0)
        net = Net()
        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
        fully_shard(net, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float32))
        out = net(torch.randn(4, 16))
        assert out.dtype == torch.float32
        with shardkit.trace() as t:
            out.sum().backward()
        expected = "torch.float32" if versions.REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else "torch.bfloat16"
        assert {str(e.dtype) for e in t.collectives("reduce_scatter")} == {expected}
        assert all(p.grad.dtype == torch.float32 for p in net.parameters())


def test_cast_forward_inputs_false_leaves_inputs_alone():
    with fake_world(4, 0) as mesh:
        torch.manual_seed(0)
        lin = nn.Linear(16, 16)
        fully_shard(lin, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False))
        with pytest.raises(RuntimeError, match="dtype"):  # fp32 input, bf16 weight: the user's job now
            lin(torch.randn(2, 16))
        assert lin(torch.randn(2, 16, dtype=BF16)).dtype == BF16


class Mixed(nn.Module):
    """A bf16 base layer with an fp32 adapter in ONE group (FSDP2 refuses this group)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16).to(BF16)
        self.adapter = nn.Linear(16, 16)

    def forward(self, x):
        return self.base(x.to(BF16)).float() + self.adapter(x)


def test_a_group_of_bf16_and_fp32_params_gathers_once_as_bytes_and_reduces_once_per_dtype():
    # One all-gather: 272 bf16 (2 bytes) + 272 fp32 (4 bytes) = 1632 bytes.
    with fake_world(8, 0) as mesh:
        torch.manual_seed(0)
        m = fully_shard(Mixed(), mesh=mesh)
        t = step(m)
        assert {n: p.grad.dtype for n, p in m.named_parameters()} == {
            "base.weight": BF16, "base.bias": BF16, "adapter.weight": torch.float32, "adapter.bias": torch.float32}
    assert_expected_inline(collectives(t), """\
all_gather <root> uint8 numel=1632 world=8 mesh=dim0
reduce_scatter <root> bfloat16 numel=288 world=8 mesh=dim0
reduce_scatter <root> float32 numel=288 world=8 mesh=dim0""")


def test_mixed_group_with_param_dtype_gathers_once_and_frozen_params_are_not_reduced():
    with fake_world(8, 0) as mesh:
        torch.manual_seed(0)
        m = Mixed()
        m.base.requires_grad_(False)  # a frozen base, a trainable adapter: LoRA
        fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))
        t = step(m)
        assert m.base.weight.grad is None and m.adapter.weight.grad.dtype == torch.float32
    assert_expected_inline(collectives(t), """\
all_gather <root> bfloat16 numel=544 world=8 mesh=dim0
reduce_scatter <root> float32 numel=288 world=8 mesh=dim0""")


def test_cpu_offload_keeps_shards_and_grads_on_cpu():
    with fake_world(4, 1) as mesh:
        net = sharded(mesh, offload_policy=CPUOffloadPolicy())  # pin_memory needs an accelerator: ignored here
        step(net)
        group = net.blocks[0]._shardkit().group
        assert all(p.offload and not p.pin_memory for p in group.params)
        assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in net.parameters())


def test_reshard_after_forward_2_at_world_8_gathers_backward_among_2_ranks():
    with fake_world(8, 5) as mesh:
        net = sharded(mesh, n_blocks=3, reshard_after_forward=2)
        block = net.blocks[0]
        t_hooks = []
        block.register_forward_hook(lambda *_: t_hooks.append([p.post_forward_shard is None for p in block._shardkit().group.params]))
        t = step(net)
        p = block._shardkit().group.params[0]  # weight (16, 16): 2 rows per rank over 8, 8 rows per rank over 2
        assert (p.layout.post_forward_rows, p.layout.post_forward_index) == (8, 1)  # rank 5 is the second of ranks 4-5
        assert all(q.post_forward_shard is None for q in block._shardkit().group.params)  # freed after backward
        steps = [e for e in t.events if e.kind in ("all_gather", "reduce_scatter", "reshard") and e.group.startswith("blocks")]
    assert_expected_inline("\n".join(str(e) for e in steps), """\
all_gather blocks.0 float32 numel=272 world=8 mesh=dim0
reshard blocks.0 (1/2 kept)
all_gather blocks.1 float32 numel=272 world=8 mesh=dim0
reshard blocks.1 (1/2 kept)
all_gather blocks.2 float32 numel=272 world=8 mesh=dim0
reshard blocks.2 (1/2 kept)
all_gather blocks.2 float32 numel=272 world=2 mesh=dim0/2
all_gather blocks.1 float32 numel=272 world=2 mesh=dim0/2
reduce_scatter blocks.2 float32 numel=288 world=8 mesh=dim0
reshard blocks.2
all_gather blocks.0 float32 numel=272 world=2 mesh=dim0/2
reduce_scatter blocks.1 float32 numel=288 world=8 mesh=dim0
reshard blocks.1
reduce_scatter blocks.0 float32 numel=288 world=8 mesh=dim0
reshard blocks.0""")


def test_reshard_after_forward_int_without_grad_frees_everything():
    with fake_world(8, 0) as mesh:
        net = sharded(mesh, reshard_after_forward=4)
        with torch.no_grad():
            net(torch.randn(2, 16))
        group = net.blocks[0]._shardkit().group
        assert not any(part.holds_post_forward for part in group.parts) and group.holding is Holding.SHARDED


def test_set_reshard_after_forward_bool_replaces_the_int():
    with fake_world(8, 0) as mesh:
        net = sharded(mesh, reshard_after_forward=2)
        net.set_reshard_after_forward(True)
        t = step(net)
        assert {e.world for e in t.collectives("all_gather")} == {8}


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def test_unshard_in_backward_false_skips_the_backward_all_gather():
    with fake_world(4, 0) as mesh:
        torch.manual_seed(0)
        m = Embedded()
        fully_shard(m.emb, mesh=mesh)
        fully_shard(m, mesh=mesh)
        m.emb.set_unshard_in_backward(False)  # an embedding's backward needs no weight values
        t = step(m, torch.tensor([[1, 2, 3]]))
        assert [e.group for e in t.collectives("all_gather")] == ["", "emb"]  # forward only
        assert [e.group for e in t.collectives("reduce_scatter")] == ["emb", ""]
        assert m.emb.weight.grad is not None


def test_reduce_dtype_none_reduces_in_the_dtype_the_installed_fsdp2_does():
    """MixedPrecisionPolicy(param_dtype=bf16) without a reduce_dtype: torch 2.13 and 2.14's FSDP2
    reduce in bf16, 2.15's in each parameter's accumulation dtype (its own, fp32 here);
    shardkit follows the installed release (shardkit/versions.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    class ReduceDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("c10d::_reduce_scatter_base_", "c10d::alltoall_base_"):
                self.seen.append(args[1].dtype)
            return func(*args, **kwargs or {})

    seen = {}
    for name, fsdp, mp in (("torch", torch_fully_shard, TorchMP), ("shardkit", fully_shard, shardkit.MixedPrecisionPolicy)):
        with fake_world(2) as mesh:
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
            fsdp(net, mesh=mesh, mp_policy=mp(param_dtype=torch.bfloat16))
            with ReduceDtypes() as r:
                net(torch.randn(4, 8)).sum().backward()
            seen[name] = set(r.seen)
            assert all(p.grad.dtype == torch.float32 for p in net.parameters())
    assert seen["shardkit"] == seen["torch"], seen
    from shardkit import versions
    assert seen["shardkit"] == ({torch.float32} if versions.REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else {torch.bfloat16})


@pytest.mark.parametrize("impl", ["shardkit", "compiled", "torch"])
def test_to_float32_after_a_bf16_policy_keeps_the_policy_as_fsdp2(impl):
    """torch's FSDP2 test_clamp_reduce_dtype: a model built in bf16, MixedPrecisionPolicy(bf16,
    bf16), then ``model.to(torch.float32)`` before the first step: the shards become fp32, the
    all-gathers and reduce-scatters stay bf16 (the policy's), the compute bf16, the grads fp32.
    (shardkit made param_dtype follow the old dtype to fp32, and the forward failed.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit.compiled import fully_shard as compiled_fully_shard
    from tests.dtype_audit import Audit

    shard, policy = {"shardkit": (fully_shard, MixedPrecisionPolicy), "compiled": (compiled_fully_shard, MixedPrecisionPolicy),
                     "torch": (torch_fully_shard, TorchPolicy)}[impl]
    with fake_world(4) as mesh:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32, dtype=BF16), nn.Linear(32, 32, dtype=BF16))
        mp = policy(param_dtype=BF16, reduce_dtype=BF16)
        for layer in model:
            shard(layer, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        model.to(torch.float32)
        with Audit(mesh) as audit:
            out = model(torch.randn(4, 32))
            out.sum().backward()
        assert out.dtype == BF16
        assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
        kinds = sorted({(s.kind, s.dtype) for s in audit.seen})
        assert kinds == [("all_gather", BF16), ("reduce_scatter", BF16)], kinds
