"""Bad input gets a clear error that names the module/parameter and what to do."""

import pytest
import torch

import shardkit
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit import FSDPModule, MixedPrecisionPolicy, fully_shard
from tests.conftest import fake_world


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def test_fully_shard_twice_on_one_module_raises(mesh8):
    m = Pair()
    fully_shard(m, mesh=mesh8)
    with pytest.raises(ValueError, match="already applied to this Pair"):
        fully_shard(m, mesh=mesh8)


def test_fully_shard_on_child_of_sharded_module_raises_bottom_up_hint(mesh8):
    m = Pair()
    fully_shard(m, mesh=mesh8)
    with pytest.raises(ValueError, match=r"'weight' of Linear is already sharded.*bottom-up"):
        fully_shard(m.a, mesh=mesh8)


def test_mesh_of_wrong_type_raises(mesh8):
    with pytest.raises(TypeError, match="DeviceMesh, got str"):
        fully_shard(Pair(), mesh="cpu")


def test_mesh_of_wrong_ndim_raises():
    with fake_world(8) as mesh:
        mesh_2d = mesh.mesh.view(2, 4)
        from torch.distributed.device_mesh import DeviceMesh

        with pytest.raises(ValueError, match="1-D DeviceMesh"):
            fully_shard(Pair(), mesh=DeviceMesh("cpu", mesh.mesh.view(2, 2, 2)))


@pytest.mark.parametrize("value, error", [("yes", "should be None, a bool, or an int"), (3, "factor of 8"), (0, "factor of 8")])
def test_reshard_after_forward_of_wrong_type_or_value_raises(mesh8, value, error):
    with pytest.raises(ValueError, match=error):
        fully_shard(Pair(), mesh=mesh8, reshard_after_forward=value)


def test_ignored_params_not_in_module_raises(mesh8):
    stray = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"not parameters of the module.*\(3, 2\)"):
        fully_shard(Pair(), mesh=mesh8, ignored_params={stray})


def test_ignored_params_are_left_alone(mesh8):
    m = Pair()
    kept = m.a.weight
    fully_shard(m, mesh=mesh8, ignored_params={kept})
    assert m.a.weight is kept and not isinstance(m.a.weight, DTensor)
    assert isinstance(m.b.weight, DTensor)
    m(torch.randn(2, 4)).sum().backward()
    assert kept.grad is not None and not isinstance(kept.grad, DTensor)


def test_params_still_on_meta_at_first_forward_raise_with_names(mesh8):
    with torch.device("meta"):
        m = Pair()
    fully_shard(m.a, mesh=mesh8)
    fully_shard(m, mesh=mesh8)
    with pytest.raises(RuntimeError, match=r"\['a.weight', 'a.bias', 'b.weight', 'b.bias'\] are still on the meta device.*to_empty"):
        m(torch.randn(2, 4))


def test_child_forward_before_root_raises(mesh8):
    m = Pair()
    fully_shard(m.a, mesh=mesh8)
    fully_shard(m, mesh=mesh8)
    with pytest.raises(RuntimeError, match="Linear .*inside Pair.* ran forward before its root"):
        m.a(torch.randn(2, 4))


def test_prefetch_with_non_fsdp_module_raises(mesh8):
    m = Pair()
    fully_shard(m.a, mesh=mesh8)
    fully_shard(m, mesh=mesh8)
    with pytest.raises(ValueError, match=r"modules\[1\] is a Linear; call fully_shard on it first"):
        m.set_modules_to_forward_prefetch([m.a, m.b])
    with pytest.raises(ValueError, match="set_modules_to_backward_prefetch"):
        m.set_modules_to_backward_prefetch([m.b])


def test_unshard_after_process_group_is_gone_raises():
    with fake_world(4) as mesh:
        m = Pair()
        fully_shard(m, mesh=mesh)
    with pytest.raises(RuntimeError, match="not initialized"):
        m.unshard()


def test_fully_shard_without_process_group_or_mesh_raises(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(Pair())


def test_module_without_parameters_is_fine(mesh8):
    relu = fully_shard(nn.ReLU(), mesh=mesh8)
    assert isinstance(relu, FSDPModule)
    x = torch.randn(3, requires_grad=True)
    relu(x).sum().backward()
    assert x.grad is not None


def test_scalar_parameter_raises_with_name(mesh8):
    m = Pair()
    m.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar parameter 'scale' of Pair"):
        fully_shard(m, mesh=mesh8)


def test_not_a_module_and_containers_without_forward_raise(mesh8):
    with pytest.raises(TypeError, match="nn.Module or a non-empty list"):
        fully_shard(torch.zeros(3), mesh=mesh8)
    with pytest.raises(TypeError, match="nn.Module or a non-empty list"):
        fully_shard([], mesh=mesh8)
    with pytest.raises(ValueError, match="containers that do not implement forward: ModuleList"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh8)


def test_bad_policies_raise_with_what_to_pass(mesh8):
    with pytest.raises(ValueError, match="param_dtype should be a floating-point torch.dtype"):
        fully_shard(Pair(), mesh=mesh8, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(TypeError, match="mp_policy should be a MixedPrecisionPolicy"):
        fully_shard(Pair(), mesh=mesh8, mp_policy="bf16")
    with pytest.raises(TypeError, match="offload_policy should be an OffloadPolicy or CPUOffloadPolicy"):
        fully_shard(Pair(), mesh=mesh8, offload_policy=True)


def test_torch_fsdp2_policy_objects_are_accepted(mesh8):
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload, MixedPrecisionPolicy as TorchMP

    m = fully_shard(Pair(), mesh=mesh8, mp_policy=TorchMP(param_dtype=torch.bfloat16), offload_policy=TorchOffload(pin_memory=False))
    m(torch.randn(2, 4)).sum().backward()
    assert m.a.weight.dtype == torch.float32 and m.a.weight.grad.dtype == torch.float32
    assert m._shardkit().group.params[0].param_dtype == torch.bfloat16


def test_deepcopy_of_sharded_module_raises(mesh8):
    import copy

    m = fully_shard(Pair(), mesh=mesh8)
    with pytest.raises(AssertionError, match="state dict"):
        copy.deepcopy(m)


def test_weight_tied_across_two_groups_stays_one_parameter(mesh8):
    m = Pair()
    m.b.weight = m.a.weight  # tied
    fully_shard(m.b, mesh=mesh8)
    fully_shard(m, mesh=mesh8)  # the root uses b's weight through a: it borrows b's group
    assert m.a.weight is m.b.weight and isinstance(m.a.weight, DTensor)
    assert len(list(m.parameters())) == 3  # one weight, two biases
    with shardkit.trace() as t:
        m(torch.randn(2, 4)).sum().backward()
    assert m.a.weight is m.b.weight and m.a.weight.grad is not None
    # one reduce-scatter for the tied weight's group, after both groups' backward
    assert [e.group for e in t.collectives("reduce_scatter")] == ["", "b"]


def test_weight_tied_inside_one_group_is_one_sharded_param(mesh8):
    m = Pair()
    m.b.weight = m.a.weight
    fully_shard(m, mesh=mesh8)
    assert m.a.weight is m.b.weight and isinstance(m.a.weight, DTensor)
    m(torch.randn(2, 4)).sum().backward()
    assert m.a.weight.grad is not None


def test_fully_shard_twice_raises_what_fsdp2_code_catches(mesh8):
    m = fully_shard(Pair(), mesh=mesh8)
    with pytest.raises(AssertionError):  # FSDP2's exception type, for code written against it
        fully_shard(m, mesh=mesh8)


@pytest.mark.parametrize("factor", [0, -2.0])
def test_gradient_divide_factor_must_be_positive(mesh8, factor):
    m = fully_shard(Pair(), mesh=mesh8)
    with pytest.raises(ValueError, match="positive factor"):
        m.set_gradient_divide_factor(factor)


def test_a_failed_wait_names_this_ranks_last_collectives(mesh8):
    from shardkit.comm import check

    m = fully_shard(Pair(), mesh=mesh8)
    m(torch.randn(2, 4)).sum().backward()
    message = str(check.failed(RuntimeError("Timed out waiting 1800000ms")))
    assert "Timed out waiting 1800000ms" in message
    assert "all_gather of group '<root>', float32" in message and "reduce_scatter of group '<root>'" in message
    assert "SHARDKIT_CHECK=1" in message


# The same exception types as FSDP2 -----------------------------------------------------------
class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


def _three_d_mesh(fs, mesh):
    from torch.distributed.device_mesh import DeviceMesh

    fs(nn.Linear(4, 4), mesh=DeviceMesh("cpu", torch.arange(8).view(2, 2, 2), mesh_dim_names=("a", "b", "c")))


def _scalar(fs, mesh):
    fs(WithScalar(), mesh=mesh)


def _shard_dim_too_high(fs, mesh):
    from torch.distributed.tensor import Shard

    fs(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(2))


def _forward_on_meta(fs, mesh):
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    fs(m, mesh=mesh)
    m(torch.randn(2, 4))


@pytest.mark.parametrize("case", [_three_d_mesh, _scalar, _shard_dim_too_high, _forward_on_meta], ids=lambda f: f.__name__[1:])
def test_invalid_input_raises_what_fsdp2_raises(case):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    raised = {}
    for name, fs in [("shardkit", fully_shard), ("torch", torch_fully_shard)]:
        with fake_world(8) as mesh, pytest.raises(Exception) as info:
            case(fs, mesh)
        raised[name] = info.value
    assert isinstance(raised["shardkit"], type(raised["torch"])), {k: type(v).__mro__ for k, v in raised.items()}


def test_a_meta_mesh_raises_naming_it():
    from torch.distributed.device_mesh import DeviceMesh

    with fake_world(2):
        mesh = DeviceMesh("meta", torch.arange(2))
        with pytest.raises(ValueError, match=r"cannot shard over DeviceMesh\(.*'meta'.*runs no collectives"):
            fully_shard(nn.Linear(4, 4), mesh=mesh)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_a_cuda_mesh_without_cuda_raises_naming_it():
    from torch.distributed.device_mesh import DeviceMesh

    with fake_world(2):
        mesh = DeviceMesh("cuda", torch.arange(2))
        with pytest.raises(RuntimeError, match=r"CUDA mesh DeviceMesh\(.*'cuda'.*not available.*init_device_mesh\('cpu'"):
            fully_shard(nn.Linear(4, 4), mesh=mesh)


@pytest.mark.parametrize("placement", ["Replicate", "Shard"])
def test_params_that_are_already_dtensors_on_the_fsdp_ranks_raise_saying_what_works(placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake_world(2) as mesh:
        m = nn.Linear(4, 4)
        how = Replicate() if placement == "Replicate" else Shard(0)
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [how]))
        with pytest.raises(ValueError, match=r"'weight' of Linear is already a DTensor.*TP on mesh\[\"tp\"\].*plain tensors"):
            fully_shard(m, mesh=mesh)


def test_an_optimizer_built_before_fully_shard_warns_once_at_its_first_step():
    import warnings

    with fake_world(2) as mesh:
        m = nn.Linear(4, 4)
        stale = torch.optim.AdamW(m.parameters())
        fully_shard(m, mesh=mesh)
        good = torch.optim.AdamW(m.parameters())
        m(torch.randn(2, 4)).sum().backward()
        with pytest.warns(UserWarning, match=r"AdamW holds 2 parameters that fully_shard has replaced.*Build the optimizer after"):
            stale.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stale.step()  # once
            good.step()  # and never for one built after


def test_a_full_parameter_assigned_before_the_first_forward_is_sharded_then():
    with fake_world(2) as mesh:
        m = nn.Linear(4, 4)
        fully_shard(m, mesh=mesh)
        new = torch.arange(16.0).view(4, 4)
        m.weight = nn.Parameter(new.clone())
        early = torch.optim.SGD(m.parameters(), lr=0.1)  # holds the full weight
        m(torch.randn(2, 4)).sum().backward()
        assert isinstance(m.weight, DTensor) and torch.equal(m.weight.to_local(), new[:2])
        assert m.weight.grad is not None
        with pytest.warns(UserWarning, match="holds 1 parameters that fully_shard has replaced"):
            early.step()


class _SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_sparse_gradient_raises_naming_the_parameter_and_ignored_params_keep_it_local(mesh8):
    """``nn.Embedding(sparse=True)``: its weight's gradient is sparse, which no reduce-scatter
    takes (FSDP2 fails with "Could not run 'fsdp::chunk_cat' ... 'SparseCPU'", shardkit failed
    with "reshape is not implemented for sparse tensors"). Eager mode raises when it arrives,
    naming the parameter; compiled mode at fully_shard. Left out with ``ignored_params`` the
    weight trains as a plain local tensor with its sparse gradient."""
    import shardkit.compiled

    model = _SparseLookup()
    fully_shard(model.emb, mesh=mesh8)
    fully_shard(model, mesh=mesh8)
    with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' got a gradient of layout torch.sparse_coo.*sparse=False.*ignored_params"):
        model(torch.randint(0, 10, (2, 3))).sum().backward()
    with pytest.raises(NotImplementedError, match=r"'weight' of Embedding has sparse gradients.*sparse=False"):
        shardkit.compiled.fully_shard(_SparseLookup(), mesh=mesh8)
    model = _SparseLookup()
    fully_shard(model, mesh=mesh8, ignored_params={model.emb.weight})
    model(torch.randint(0, 10, (2, 3))).sum().backward()
    assert model.emb.weight.grad.layout == torch.sparse_coo and isinstance(model.head.weight.grad, DTensor)
