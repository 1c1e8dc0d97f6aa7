"""HSDP x tensor parallel on 3-D and 4-D meshes (fake process group, worlds 8 and 16), the way
torchtitan builds them: ``parallelize_module(block, mesh["tp"], plan)``, then
``fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"])``. Each configuration runs FSDP2 and
shardkit side by side: the same placements, local shapes and gradient placements, and the same
collectives (kind, ranks, mesh dim, dtype and, for the all-gathers, elements; a reduction carries
shardkit's grad-presence column, one element per parameter per rank, on top). Numerics:
tests/gloo/test_hsdp_tp_eight_ranks.py."""

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import shardkit
from shardkit.models.llama import Llama, LlamaConfig, sequence_parallel_plans, tp_plan
from tests.conftest import fake_world
from tests.dtype_audit import Audit

NAMES_3D = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Config:
    name: str
    shape: tuple[int, ...]  # the mesh: (dp_replicate, dp_shard, tp), or (pp, dp_replicate, dp_shard, tp)
    names: tuple[str, ...] = NAMES_3D
    sequence_parallel: bool = False
    policy: str = "none"  # none, bf16 (param bf16, reduce fp32), offload
    reshard: bool = True
    knob: str = ""  # an FSDPModule setter applied to every module before the step
    llama: LlamaConfig = field(default_factory=LlamaConfig)
    rank: int = 5

    @property
    def world(self) -> int:
        return int(torch.tensor(self.shape).prod())


UNEVEN = LlamaConfig(vocab_size=10, dim=12, n_layers=2, n_heads=2, hidden=20)  # 5 head rows over 4 ranks: 2, 2, 1, 0
CONFIGS = [
    Config("hsdp2x2_tp2", (2, 2, 2)),
    Config("hsdp2x2_tp2_sequence_parallel", (2, 2, 2), sequence_parallel=True),
    Config("hsdp2x2_tp2_bf16", (2, 2, 2), policy="bf16"),
    Config("hsdp2x2_tp2_sequence_parallel_bf16", (2, 2, 2), sequence_parallel=True, policy="bf16"),
    Config("hsdp2x2_tp2_offload", (2, 2, 2), policy="offload"),
    Config("hsdp2x2_tp2_no_reshard", (2, 2, 2), reshard=False),
    Config("hsdp2x2_tp2_no_gradient_sync", (2, 2, 2), knob="no_sync"),
    Config("hsdp2x2_tp2_no_all_reduce", (2, 2, 2), knob="no_all_reduce"),
    Config("hsdp2x2_tp2_divide_factor", (2, 2, 2), knob="divide"),
    Config("hsdp2x2_tp2_no_reshard_after_backward", (2, 2, 2), knob="no_reshard_after_backward"),
    Config("dims_tp_in_the_middle", (2, 2, 2), names=("dp_replicate", "tp", "dp_shard")),
    Config("hsdp2x4_tp2_uneven_and_empty_shards", (2, 4, 2), sequence_parallel=True, llama=UNEVEN, rank=15),
    Config("pp2_hsdp2x2_tp2", (2, 2, 2, 2), names=("pp", *NAMES_3D), rank=13),
    Config("pp2_hsdp2x2_tp2_bf16_offload", (2, 2, 2, 2), names=("pp", *NAMES_3D), policy="bf16+offload", sequence_parallel=True, rank=6),
]


def build(fully_shard, config: Config, mp_cls, offload_cls):
    mesh = init_device_mesh("cpu", config.shape, mesh_dim_names=config.names)
    torch.manual_seed(0)
    model = Llama(config.llama)
    root_plan, block_plan = sequence_parallel_plans() if config.sequence_parallel else ({}, tp_plan())
    parallelize_module(model, mesh["tp"], root_plan)
    kwargs = {}
    if "bf16" in config.policy:
        kwargs["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "offload" in config.policy:
        kwargs["offload_policy"] = offload_cls(pin_memory=False)
    dp = mesh["dp_replicate", "dp_shard"]
    for block in model.layers:
        parallelize_module(block, mesh["tp"], block_plan)
        fully_shard(block, mesh=dp, reshard_after_forward=config.reshard, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    return model, mesh


def apply_knob(model: nn.Module, knob: str) -> None:
    for m in model.modules():
        if not hasattr(m, "set_requires_gradient_sync"):
            continue
        if knob == "no_sync":
            m.set_requires_gradient_sync(False)
        elif knob == "no_all_reduce":
            m.set_requires_all_reduce(False)
        elif knob == "divide":
            m.set_gradient_divide_factor(2.0)
        elif knob == "no_reshard_after_backward":
            m.set_reshard_after_backward(False)


def run(fully_shard, config: Config, mp_cls, offload_cls) -> tuple[str, Counter]:
    with fake_world(config.world, config.rank):
        model, mesh = build(fully_shard, config, mp_cls, offload_cls)
        apply_knob(model, config.knob)
        text = describe(model, grads=False)
        with Audit(mesh) as audit:
            model(torch.randint(0, config.llama.vocab_size, (2, 8))).sum().backward()
        text += "\n" + describe(model, grads=True)
        seen = Counter((s.kind, s.world, s.mesh_dim, str(s.dtype), s.numel if s.kind == "all_gather" else None)
                       for s in audit.seen if s.node == "" or s.sums)
        return text, seen


def describe(model: nn.Module, grads: bool) -> str:
    lines = []
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            lines.append(f"{name} grad None")
        else:
            lines.append(f"{name}{' grad' if grads else ''} {tuple(t.shape)} {t.dtype} {t.device_mesh.mesh_dim_names} {t.placements} local {tuple(t.to_local().shape)} {t.to_local().device}")
    return "\n".join(lines)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_hsdp_tp_places_shards_and_communicates_as_fsdp2(config):
    theirs = run(torch_fully_shard, config, TorchMP, TorchOffload)
    ours = run(shardkit.fully_shard, config, shardkit.MixedPrecisionPolicy, shardkit.CPUOffloadPolicy)
    assert ours[0] == theirs[0]
    expected = theirs[1].copy()
    if config.sequence_parallel and "bf16" in config.policy:  # the norms' Partial gradients summed over tp in
        # reduce_dtype, where FSDP2 sums them in bf16 (pytorch#190626; tests/fake/test_reduce_dtypes.py)
        moved = expected.pop(("all_reduce", 2, "tp", "torch.bfloat16", None))
        assert moved == 5 and ("all_reduce", 2, "tp", "torch.float32", None) not in expected  # 2 norms a block, the root's
        expected[("all_reduce", 2, "tp", "torch.float32", None)] = moved
    assert ours[1] == expected, (ours[1], theirs[1])
    assert ours[1], "no collective seen"


def test_the_3d_placements_are_pinned():
    text, seen = run(shardkit.fully_shard, CONFIGS[1], shardkit.MixedPrecisionPolicy, shardkit.CPUOffloadPolicy)
    assert_expected_inline("\n".join(line.rsplit(" ", 1)[0] for line in text.splitlines()[:10]), """\
tok_embeddings.weight (64, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (16, 32)
layers.0.attention_norm.weight (32,) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Replicate()) local (16,)
layers.0.attention.wq.weight (32, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (8, 32)
layers.0.attention.wk.weight (32, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (8, 32)
layers.0.attention.wv.weight (32, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (8, 32)
layers.0.attention.wo.weight (32, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Shard(dim=1)) local (16, 16)
layers.0.ffn_norm.weight (32,) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Replicate()) local (16,)
layers.0.feed_forward.w1.weight (64, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (16, 32)
layers.0.feed_forward.w3.weight (64, 32) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (16, 32)
layers.0.feed_forward.w2.weight (32, 64) torch.float32 ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Shard(dim=1)) local (16, 32)""")


def test_reshard_after_forward_int_goes_beyond_fsdp2():
    """FSDP2 raises "Resharding to smaller mesh is not supported for DTensor parameters yet";
    shardkit keeps 1/2 of each block after forward and gathers it back over 2 ranks."""
    config = Config("int", (2, 4, 2), rank=9)
    with fake_world(16, 9):
        mesh = init_device_mesh("cpu", config.shape, mesh_dim_names=config.names)
        model = Llama(LlamaConfig())
        with pytest.raises(Exception, match="Resharding to smaller mesh"):
            for block in model.layers:
                parallelize_module(block, mesh["tp"], tp_plan())
                torch_fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=2)
            torch_fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
            model(torch.randint(0, 64, (2, 8))).sum().backward()
    with fake_world(16, 9):
        mesh = init_device_mesh("cpu", config.shape, mesh_dim_names=config.names)
        model = Llama(LlamaConfig())
        for block in model.layers:
            parallelize_module(block, mesh["tp"], tp_plan())
            shardkit.fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=2)
        shardkit.fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
        with shardkit.trace() as t:
            model(torch.randint(0, 64, (2, 8))).sum().backward()
        gathers = [(e.world, e.mesh_dim) for e in t.collectives("all_gather") if e.group == "layers.0"]
        assert gathers == [(4, "dp_shard"), (2, "dp_shard/2")], gathers
        assert model.layers[0].attention.wq.weight.grad.placements == model.layers[0].attention.wq.weight.placements


def test_replicate_only_mode_places_as_fsdp2_and_all_reduces_only():
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    from tests.fake.test_spmd_and_moe import Collectives, describe as spmd_describe
    from tests.gloo.moe_spmd_models import D, SpmdStack

    def build_spmd(fully_shard, dims_cls, names, shape, dims):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = SpmdStack(mesh, n_dp=len(names) - 1)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, dp_mesh_dims=dims_cls(**dims))
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims_cls(**dims))
        return model

    cases = [(("dp", "tp"), (4, 2), dict(replicate="dp")),
             (NAMES_3D, (2, 2, 2), dict(replicate=("dp_replicate", "dp_shard")))]
    for names, shape, dims in cases:
        results = []
        for fully_shard, cls in ((torch_fully_shard, TorchDims), (shardkit.fully_shard, shardkit.DataParallelMeshDims)):
            with fake_world(8, 5):
                model = build_spmd(fully_shard, cls, names, shape, dims)
                with Collectives() as c:
                    model(torch.randn(4, D)).sum().backward()
                grads = "\n".join(f"{n} {p.grad.placements} {tuple(p.grad.to_local().shape)}" for n, p in model.named_parameters())
                results.append((spmd_describe(model), grads, c.seen))  # (over the one-rank shard dim, neither issues any)
        assert results[0] == results[1], (names, results)
        assert results[1][2] == Counter({("all_reduce", 4): 2})


def test_errors_name_the_parameter_and_the_meshes():
    with fake_world(8, 0):
        a = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=NAMES_3D)
        other = DeviceMesh("cpu", torch.tensor([[0, 3], [1, 2], [4, 7], [5, 6]]), mesh_dim_names=("x", "y"))  # not a's
        block = Llama(LlamaConfig()).layers[0]
        parallelize_module(block, other["y"], tp_plan())
        with pytest.raises(ValueError, match="parameter 'weight' of Linear is a DTensor on .* not dims of one mesh"):
            shardkit.fully_shard(block.attention.wq, mesh=a["dp_replicate", "dp_shard"])
        block = Llama(LlamaConfig()).layers[0]
        parallelize_module(block, a["dp_shard", "tp"]._flatten("dp_shard_tp"), tp_plan())
        with pytest.raises(ValueError, match="over ranks that fully_shard's mesh .* also shards over"):
            shardkit.fully_shard(block.attention.wq, mesh=a["dp_replicate", "dp_shard"])


class Experts(nn.Module):
    """Expert weights (E, M, N) on an (ep, tp) mesh: experts split over ep, columns over tp."""

    def __init__(self, mesh) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        torch.manual_seed(0)
        self.w = nn.Parameter(distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(0), Shard(2)], src_data_rank=None))

    def forward(self, x):
        return (x @ self.w.to_local()).sum()


@pytest.mark.parametrize("dp_dims", [("dp_shard",), ("dp_replicate", "dp_shard")], ids=["fsdp_ep_tp", "hsdp_ep_tp"])
def test_expert_and_tensor_parallel_over_two_dims_as_fsdp2(dp_dims):
    """FSDP2's 3-D (FSDP x EP x TP) and 4-D (HSDP x EP x TP) spec meshes."""
    results = []
    for fully_shard in (torch_fully_shard, shardkit.fully_shard):
        with fake_world(16, 11):
            mesh = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "ep", "tp"))
            model = Experts(mesh["ep", "tp"])
            fully_shard(model, mesh=mesh[dp_dims] if len(dp_dims) > 1 else mesh[dp_dims[0]])
            model(torch.randn(2, 6)).backward()
            w = model.w
            results.append((w.device_mesh.mesh_dim_names, w.placements, tuple(w.to_local().shape), w.grad.placements, tuple(w.grad.to_local().shape)))
    assert results[0] == results[1], results
    assert results[1][1][-2:] == (torch.distributed.tensor.Shard(0), torch.distributed.tensor.Shard(2))


def test_lockstep_on_hsdp_tp_agrees_over_the_data_parallel_ranks():
    """set_lockstep's tokens go over the (dp_replicate, dp_shard) ranks of each tp rank: the
    group's collectives are the same as without it, plus one token all-gather per step over 4 ranks."""
    seen = []
    for lockstep in (False, True):
        with fake_world(8, 5):
            model, mesh = build(shardkit.fully_shard, CONFIGS[0], shardkit.MixedPrecisionPolicy, shardkit.CPUOffloadPolicy)
            model.set_lockstep(lockstep)
            with shardkit.trace() as t, Audit(mesh) as audit:
                model(torch.randint(0, 64, (2, 8))).sum().backward()
            seen.append(([(e.kind, e.group, e.world, e.mesh_dim) for e in t.collectives() if e.kind in ("all_gather", "reduce_scatter", "all_reduce") and e.group],
                         Counter((s.kind, s.world) for s in audit.seen if s.node == "" and s.dtype == torch.int64)))
    assert sorted(seen[0][0]) == sorted(seen[1][0])
    assert not seen[0][1] and set(seen[1][1]) == {("all_gather", 4)}, seen[1][1]
