"""``state_dict()`` from another thread while a step runs on the training thread, as torchft's
quorum thread calls its ``state_dict`` callback, on 2 gloo ranks.

The other thread must get the sharded state (each parameter its ``Shard(0)`` DTensor, of the
shard's shape), whatever the step is doing, and the step must not notice: the training run is
bitwise the one without the thread. ``load_state_dict`` from another thread during a step
raises an error that says so; on the training thread between steps it loads.
"""

import threading
import time

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from gloo_harness import Checks, run_worker
from gloo_parity import Parity, Stack, shard_blocks_then_root, stack_batches

checks = Checks()
STEPS = 12


def sharded_shapes(model) -> dict[str, torch.Size]:
    return {n: p.to_local().shape for n, p in model.named_parameters()}


def check_sharded(sd: dict, shapes: dict[str, torch.Size], problems: list[str]) -> None:
    for name, shape in shapes.items():
        value = sd.get(name)
        if not isinstance(value, DTensor) or value.to_local().shape != shape or value.placements[-1] != Shard(0):
            problems.append(f"{name}: {type(value).__name__} {getattr(value, 'shape', None)} local "
                            f"{value.to_local().shape if isinstance(value, DTensor) else None}, want the shard {shape}")


def run(mesh, impl, reader: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int, list[str]]:
    """STEPS steps of a 2-block stack; with ``reader``, a thread that reads ``state_dict()``
    every 0.1 ms while they run. Losses, final parameters, the reads and the problems seen."""
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl, optimizer=torch.optim.SGD, lr=0.1)
    shapes, problems, reads, stop = sharded_shapes(p.model), [], [0], threading.Event()

    def read():
        while not stop.is_set():
            try:
                check_sharded(p.model.state_dict(), shapes, problems)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                problems.append(f"{type(e).__name__}: {e}")
            reads[0] += 1
            time.sleep(1e-4)

    thread = threading.Thread(target=read, name="quorum") if reader else None
    if thread is not None:
        thread.start()
    try:
        losses = [p.step(batch).loss for batch in stack_batches(STEPS)]
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    return losses, {n: t.full_tensor() for n, t in p.model.named_parameters()}, reads[0], problems


@checks("shardkit")
def state_dict_from_another_thread_during_steps_returns_the_shards_and_changes_nothing(mesh, impl):
    base_losses, base_params, _, _ = run(mesh, impl, reader=False)
    for attempt in range(3):
        losses, params, reads, problems = run(mesh, impl, reader=True)
        assert not problems, problems[:5]
        assert reads > STEPS, reads  # it did read while the steps ran
        assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), (attempt, losses, base_losses)
        for name, value in params.items():
            assert torch.equal(value, base_params[name]), (attempt, name)


@checks("shardkit")
def state_dict_from_another_thread_inside_forward_gets_the_shards_where_the_module_holds_unsharded(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl, optimizer=torch.optim.SGD, lr=0.1)
    shapes, problems, seen = sharded_shapes(p.model), [], []

    def read_now(module, args):
        held = module.weight if hasattr(module, "weight") else None
        seen.append(isinstance(held, DTensor))  # False: the module holds its unsharded weight now

        def read():
            check_sharded(p.model.state_dict(), shapes, problems)
            try:
                p.model.load_state_dict(p.model.state_dict())
            except RuntimeError as e:
                problems.append(f"load: {e}")

        thread = threading.Thread(target=read, name="quorum")
        thread.start()
        thread.join()

    handle = p.model.blocks[1].register_forward_pre_hook(read_now)
    batch = stack_batches(1)[0]
    p.step(batch)
    handle.remove()
    assert seen and not any(seen), seen
    loads = [m for m in problems if m.startswith("load: ")]
    assert len(problems) == len(loads) == 1, problems  # the shards were read; the load was refused
    assert "from thread 'quorum' while a step runs on another thread" in loads[0], loads[0]
    assert "blocks.1" in loads[0] or "<root>" in loads[0], loads[0]
    p.model.load_state_dict(p.model.state_dict())  # the training thread, between steps: loads
    p.step(stack_batches(2)[1])
    p.assert_params_match()


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_threaded_state_dict_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
