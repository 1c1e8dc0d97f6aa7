"""shardkit's public surface against the installed torch's FSDP2: every public name, the
parameters of ``fully_shard`` and of every public method, and the policies' fields. A new
torch release that adds or changes one fails here, naming it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import _fully_shard as torch_fsdp2

import shardkit

FSDP2_NAMES = sorted(torch_fsdp2.__all__)


def _params(fn) -> list[tuple]:
    """Name, kind and default of each parameter; annotations differ in spelling only. A default
    that is a policy object (ours or torch's class) is its class name and field values."""
    return [(p.name, p.kind, _default(p.default)) for p in inspect.signature(fn).parameters.values()]


def _default(value):
    if dataclasses.is_dataclass(value):
        return type(value).__name__, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return repr(value)


def _same_params(ours: list[tuple], theirs: list[tuple]) -> bool:
    """The same parameters; a policy default may have the fields of a newer release too."""
    if [(n, k) for n, k, _ in ours] != [(n, k) for n, k, _ in theirs]:
        return False
    for (_, _, a), (_, _, b) in zip(ours, theirs):
        if isinstance(b, tuple):
            if not (isinstance(a, tuple) and a[0] == b[0] and b[1].items() <= a[1].items()):
                return False
        elif a != b:
            return False
    return True


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if not n.startswith("_") and callable(v))


@pytest.mark.parametrize("name", FSDP2_NAMES)
def test_every_fsdp2_name_is_exported(name):
    assert name in torch_fsdp.__all__
    assert name in shardkit.__all__ and hasattr(shardkit, name), f"shardkit lacks FSDP2's {name}"


def test_fully_shard_takes_fsdp2s_parameters():
    assert _same_params(_params(shardkit.fully_shard), _params(torch_fsdp.fully_shard)), (_params(shardkit.fully_shard), _params(torch_fsdp.fully_shard))


@pytest.mark.parametrize("method", _public_methods(torch_fsdp.FSDPModule))
def test_fsdp_module_method_takes_fsdp2s_parameters(method):
    ours = getattr(shardkit.FSDPModule, method)
    assert ours is not getattr(torch_fsdp.FSDPModule, method), f"FSDPModule.{method} is torch's, not overridden"
    assert _same_params(_params(ours), _params(getattr(torch_fsdp.FSDPModule, method)))


@pytest.mark.parametrize("fn", ["register_fsdp_forward_method", "share_comm_ctx"])
def test_functions_take_fsdp2s_parameters(fn):
    assert _same_params(_params(getattr(shardkit, fn)), _params(getattr(torch_fsdp, fn)))


@pytest.mark.parametrize("cls", ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"])
def test_dataclasses_have_fsdp2s_fields(cls):
    """Every field of the installed torch's, in its order, with its default (shardkit may have
    the fields of a newer release too: it supports several)."""
    fields = lambda c: [(f.name, f.default, f.kw_only) for f in dataclasses.fields(c)]  # noqa: E731
    ours, theirs = fields(getattr(shardkit, cls)), fields(getattr(torch_fsdp, cls))
    assert [f for f in ours if f in theirs] == theirs, (ours, theirs)


def test_unshard_handle_has_fsdp2s_methods():
    assert _public_methods(torch_fsdp.UnshardHandle) == _public_methods(shardkit.UnshardHandle)


def test_data_parallel_mesh_dims_names():
    dims = shardkit.DataParallelMeshDims(shard=("dp_shard", "cp"), replicate="dp_replicate")
    assert (dims.shard_names, dims.replicate_names) == (("dp_shard", "cp"), ("dp_replicate",))
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        shardkit.DataParallelMeshDims()


def test_fsdp_modules_are_torchs_fsdp_modules():
    """torch code that checks for FSDP2 (pipelining, torch's register_fsdp_forward_method)
    finds shardkit's modules."""
    assert issubclass(shardkit.FSDPModule, torch_fsdp.FSDPModule)
