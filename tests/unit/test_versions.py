import pytest
import torch
import torch.distributed.fsdp as fsdp

from shardkit import versions


@pytest.mark.parametrize("text, parsed", [
    ("2.13.0+cpu", (2, 13, 0)),
    ("2.14.1+cu130", (2, 14, 1)),
    ("2.15.0", (2, 15, 0)),
    ("2.15.0a0+git1234abc", (2, 15, 0)),
    ("2.16.0.dev20260101+cpu", (2, 16, 0)),
    ("2.15", (2, 15, 0)),
])
def test_parse_reads_major_minor_patch(text, parsed):
    assert versions.parse(text) == parsed


def test_parse_refuses_what_is_no_version():
    with pytest.raises(ValueError, match="not a torch version"):
        versions.parse("nightly")


def test_flags_agree_with_the_torch_installed():
    assert versions.TORCH_VERSION == versions.parse(torch.__version__)
    new = versions.TORCH_VERSION >= (2, 15)
    # what torch itself shows of the 2.15 differences
    assert versions.HAS_GRAD_DTYPE_OVERRIDE == new
    assert versions.MANUAL_BACKWARD_FINALIZATION == hasattr(fsdp.FSDPModule, "finalize_backward") == new
    assert versions.REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE == versions.RELEASE_ALL_GATHER_OUTPUTS_HOOK == new
