"""The fuzzer's rule for bf16 compute (tests/fuzz/sequences.py, ``Run._compare``): a value off
the fp32 reference by more than the tolerance passes only when mixed precision is on and
shardkit and FSDP2 both computed it, alike; otherwise shardkit fails (and FSDP2 is dropped)."""

from types import SimpleNamespace

import pytest
import torch

from tests.fuzz.sequences import FSDP2_TOLERANCE, Failure, Run, Side

TOL = dict(rtol=1e-1, atol=2e-2, of_largest=True)
WANT = torch.tensor([0.411, -0.2, 0.05])
OFF = WANT + torch.tensor([0.0, 0.0, 0.0648])  # seed 4338: 0.158 of the largest element off


def compare(mp: bool, got: torch.Tensor, alike: dict | None, impl: str = "shardkit") -> tuple[list[str], Side]:
    run = SimpleNamespace(spec=SimpleNamespace(mp=mp), log=[])
    run._fail_or_drop = lambda side, why: Run._fail_or_drop(run, side, why)
    side = Side(impl, torch.nn.Linear(1, 1))
    Run._compare(run, side, "gradient b", got, WANT, TOL, alike)
    return run.log, side


def test_bf16_off_the_reference_but_alike_on_both_passes_and_is_logged():
    log, _ = compare(True, OFF, {"shardkit": OFF, "torch": OFF.clone()})
    assert len(log) == 1 and "alike (bf16 math)" in log[0], log
    # within the bound the fuzzer compares shardkit with FSDP2 by under bf16: 100x FSDP2_TOLERANCE of the largest
    nudged = OFF + torch.tensor([0.0, 0.0, 50 * FSDP2_TOLERANCE])
    assert compare(True, nudged, {"shardkit": nudged, "torch": OFF})[0]


@pytest.mark.parametrize("mp, alike", [
    (False, "both"),  # fp32: the tolerance alone judges
    (True, None),  # no other side to agree with
    (True, "fsdp2_dropped"),  # FSDP2 is not live
    (True, "different"),  # FSDP2 computed something else
])
def test_off_the_reference_fails_unless_bf16_and_computed_alike(mp, alike):
    values = {"both": {"shardkit": OFF, "torch": OFF}, "fsdp2_dropped": {"shardkit": OFF},
              "different": {"shardkit": OFF, "torch": OFF + torch.tensor([0.0, 0.0, 200 * FSDP2_TOLERANCE])}, None: None}[alike]
    with pytest.raises(Failure, match="from the unsharded reference"):
        compare(mp, OFF, values)


def test_fsdp2_off_the_reference_is_dropped_not_failed():
    _, side = compare(False, OFF, None, impl="torch")
    assert not side.alive and "disagrees with the reference" in side.why_out


def test_within_the_tolerance_passes_silently():
    log, side = compare(True, WANT + 0.01, None)
    assert log == [] and side.alive
