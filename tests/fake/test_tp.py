"""FSDP + tensor parallel on a 2x4 (dp, tp) mesh: placements of a Llama-style block, pinned,
and equal to torch FSDP2's on the same model; the all-gathers run over dp only."""

import torch
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import shardkit
from shardkit.models.llama import Llama, LlamaConfig, tp_plan
from tests.conftest import fake_world


def llama_2d(fully_shard, rank: int = 5):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def placements(model) -> str:
    return "\n".join(
        f"{name} {tuple(p.shape)} {p.placements} local {tuple(p.to_local().shape)}"
        for name, p in model.layers[0].named_parameters()
    )


def test_llama_block_placements_at_2x4_are_pinned_and_equal_fsdp2s():
    with fake_world(8, 5):
        ours = placements(llama_2d(shardkit.fully_shard))
    with fake_world(8, 5):
        theirs = placements(llama_2d(torch_fully_shard))
    assert ours == theirs
    assert_expected_inline(ours, """\
attention_norm.weight (32,) (Shard(dim=0),) local (16,)
attention.wq.weight (32, 32) (_StridedShard(dim=0, sf=4), Shard(dim=0)) local (4, 32)
attention.wk.weight (32, 32) (_StridedShard(dim=0, sf=4), Shard(dim=0)) local (4, 32)
attention.wv.weight (32, 32) (_StridedShard(dim=0, sf=4), Shard(dim=0)) local (4, 32)
attention.wo.weight (32, 32) (Shard(dim=0), Shard(dim=1)) local (16, 8)
ffn_norm.weight (32,) (Shard(dim=0),) local (16,)
feed_forward.w1.weight (64, 32) (_StridedShard(dim=0, sf=4), Shard(dim=0)) local (8, 32)
feed_forward.w3.weight (64, 32) (_StridedShard(dim=0, sf=4), Shard(dim=0)) local (8, 32)
feed_forward.w2.weight (32, 64) (Shard(dim=0), Shard(dim=1)) local (16, 16)""")


def test_all_gathers_run_over_dp_and_tp_sees_its_local_dtensor():
    with fake_world(8, 5):
        model = llama_2d(shardkit.fully_shard)
        seen = {}
        model.layers[0].attention.wq.register_forward_pre_hook(
            lambda m, args: seen.update(placements=m.weight.placements, mesh=m.weight.device_mesh.mesh_dim_names, local=tuple(m.weight.to_local().shape)))
        with shardkit.trace() as t:
            model(torch.randint(0, 64, (2, 8))).sum().backward()
        assert seen == {"placements": model.layers[0].attention.wq.weight.placements[1:], "mesh": ("tp",), "local": (8, 32)}
        assert {e.world for e in t.collectives()} == {2}
        counts = t.summary()
        assert (counts["all_gather"].calls, counts["reduce_scatter"].calls) == (5, 3)
        g = model.layers[0].feed_forward.w2.weight.grad
        assert g.placements == model.layers[0].feed_forward.w2.weight.placements and g.to_local().shape == (16, 16)
