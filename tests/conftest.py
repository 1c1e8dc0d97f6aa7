import contextlib
import multiprocessing.util
import getpass
import os
import shutil
import subprocess
import tempfile

import pytest
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """An in-process fake process group: collectives return at once and move no data."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions, which hold the meshes they were made on.

    Two meshes of the same shape in successive fake worlds compare equal, so a decision cached in
    the first world hands its DTensors the first world's mesh, whose process groups are gone
    ("Could not resolve the process group registered under the name 2"); a process that opens
    one world after another forgets them when each world ends."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


@pytest.fixture
def mesh8() -> DeviceMesh:
    with fake_world(8, rank=0) as mesh:
        yield mesh


class TanhStack(nn.Module):
    """inp, then ``n_blocks`` of Linear + Tanh in ``blocks`` (one group each when sharded), then out."""

    def __init__(self, n_blocks: int, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_blocks))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


# Test tiers ----------------------------------------------------------------------------------
# ``subprocess``: the test starts other processes (gloo ranks, torchrun, a script). ``slow``: it
# takes long in this process. ``make test-fast`` runs neither (pytest -m "not subprocess and
# not slow" --forbid-subprocess); ``make test`` runs everything. Both marks are set here, so
# that a new test lands in the right tier by what it uses: a test that asks for a fixture that
# spawns, sits under a path below, or is a fuzzer test not named test_fake_*, is ``subprocess``;
# a test may also mark itself. --forbid-subprocess fails a test that starts a process without
# the mark, so that a test missing here cannot slip into the quick tier.
SPAWNING_FIXTURES = {"gloo_outcomes", "gloo_runs"}  # tests/gloo/conftest.py: the checks run in spawned ranks
SPAWNING_PATHS = (  # node id prefixes: tests that spawn in their body or their own fixtures
    "tests/examples/",  # torchrun of the examples and the demo
    "tests/checkpoint/test_resume.py",  # resume_worker.py in fresh processes
    "tests/gloo/test_trace_env.py",  # torchrun, then python -m shardkit timeline
    "tests/gloo/test_pipeline.py",  # torchrun of pp_worker.py (4 ranks, pipelining)
    "tests/gloo/test_torchft.py",  # ft_worker.py: 2 torchft replica groups x 2 ranks, a group killed and restarted
    "tests/fake/test_docs.py::test_the_two_block_script_prints_what_the_design_doc_shows",  # python -c
    "tests/planner/test_plan.py::test_cli_json_and_table",  # python -m shardkit plan
)
SLOW_PATHS = (
    "tests/fake/test_grad_hooks.py::test_post_accumulate_grad_hooks_run_as_fsdp2_runs_them[compiled]",  # torch.compile: ~10 s in all
    "tests/fake/test_grad_hooks.py::test_compiled_mode_",
    "tests/fake/test_grad_hooks.py::test_a_weight_tied_across_two_calls_runs_its_hooks_once_per_backward[compiled]",
    "tests/fake/test_grad_hooks.py::test_a_weight_also_used_outside_its_groups_forward_runs_its_hooks_as_fsdp2[compiled]",
    "tests/planner/test_plan.py::test_llama_70b_at_world_64_plans_within_30_seconds",  # ~4 s
    "tests/fake/test_compiled_graphs.py::test_collectives",  # torch.compile: ~4 s a model
    "tests/fake/test_compiled_graphs.py::test_mixed_precision",
    "tests/fake/test_compiled_graphs.py::test_every_rank_compiles_the_same_graphs",  # torch.compile, twice
    "tests/fake/test_compiled_graphs.py::test_the_trace",
    "tests/fake/test_compiled_graphs.py::test_peak_memory",
    "tests/fake/test_compiled_graphs.py::test_a_second_model",
    "tests/fake/test_compiled_graphs.py::test_a_frozen_integer",  # torch.compile, 3 models: ~6 s
    "tests/fake/test_compiled_graphs.py::test_a_group_of_several",  # torch.compile, 4 models
    "tests/fake/test_compiled_graphs.py::test_blocks_under_the_users_checkpoint_train",  # torch.compile, twice: ~3 s
    "tests/fake/test_compiled_graphs.py::test_blocks_under_the_users_checkpoint_compile",  # torch.compile, 4 times
    "tests/fake/test_compiled_graphs.py::test_more_models_and_breaking_blocks",  # torch.compile past dynamo's recompile limit
    "tests/fake/test_compiled_graphs.py::test_blocks_that_break_the_graph",  # torch.compile with graph breaks: ~3 s
    "tests/fake/test_compiled_graphs.py::test_a_weight_tied_across_calls",  # torch.compile, twice: ~3 s
    "tests/fake/test_compiled_overlap.py",  # inductor compiles the GPT: ~15 s
    "tests/fake/test_compiled_fuzz_models.py",  # torch.compile of the fuzzer's models: ~10 s
    "tests/fake/test_compiled_methods.py::test_a_new_setting",  # torch.compile, 4 times
    "tests/fake/test_compiled_methods.py::test_hsdp",
    "tests/fake/test_compiled_methods.py::test_the_compiled_graphs_collectives",  # torch.compile, twice
    "tests/fake/test_compiled_regions.py::test_repeated",  # torch.compile of a 4-block GPT, 4 steps, traced
    "tests/fake/test_compiled_regions.py::test_blocks_that_differ",
    "tests/fake/test_compiled_regions.py::test_peak_memory",
    "tests/fake/test_compiled_regions.py::test_with_inductor",  # inductor: ~8 s
    "tests/fake/test_compiled_regions.py::test_aot_traces",  # torch.compile at two block counts: ~5 s
    "tests/fake/test_compiled_regions.py::test_blocks_called_with_keyword",  # torch.compile, twice
    "tests/fake/test_compiled_regions.py::test_a_batch_of_another_length",  # torch.compile, twice: ~6 s
    "tests/fake/test_compiled_methods.py::test_not_resharding",  # torch.compile, twice
    "tests/fake/test_compiled_extensions.py::test_float8",  # torch.compile of a float8 model
    "tests/fake/test_compiled_post_forward.py::test_forward",  # torch.compile of the GPT, twice
    "tests/fake/test_compiled_post_forward.py::test_hsdp",
    "tests/fake/test_compiled_post_forward.py::test_peak_memory",
    "tests/fake/test_compiled_post_forward.py::test_set_reshard",
    # HSDP x TP beside FSDP2: the knobs and policies (the plain, sequence-parallel, bf16, uneven and 4-D cases stay quick)
    "tests/fake/test_hsdp_tp.py::test_hsdp_tp_places_shards_and_communicates_as_fsdp2[hsdp2x2_tp2_no",
    "tests/fake/test_hsdp_tp.py::test_hsdp_tp_places_shards_and_communicates_as_fsdp2[hsdp2x2_tp2_divide",
    "tests/fake/test_hsdp_tp.py::test_hsdp_tp_places_shards_and_communicates_as_fsdp2[hsdp2x2_tp2_offload",
    "tests/fake/test_hsdp_tp.py::test_hsdp_tp_places_shards_and_communicates_as_fsdp2[dims_tp",
)


def _spawns(item) -> bool:
    path = item.nodeid.split("::")[0]
    # the fuzzer: its fake-process-group part (test_fake_*.py) runs in this process, the rest on gloo ranks
    fuzz_on_ranks = path.startswith("tests/fuzz/") and not path.rsplit("/", 1)[-1].startswith("test_fake_")
    return bool(SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ()))) or item.nodeid.startswith(SPAWNING_PATHS) or fuzz_on_ranks


def pytest_addoption(parser):
    parser.addoption("--forbid-subprocess", action="store_true",
                     help="fail a test that starts a process (make test-fast): mark it subprocess in tests/conftest.py")


def pytest_configure(config):
    """The processes the tests start keep their temporary files in one folder of this session's,
    removed when it ends: torchrun's agents leave a ``torchelastic_*`` log folder behind in the
    temporary folder they find. Inductor's kernel cache stays where it was, shared by the lanes
    of make test and by the next run."""
    folder = tempfile.mkdtemp(prefix="shardkit-tests-")
    config.stash[_TMPDIR] = folder
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    os.environ["TMPDIR"] = folder


def inductor_cache_dir() -> str:
    """Inductor's kernel cache, shared by every test process and run (and by the mutant tool's,
    whose TMPDIR is a folder of its own): the user's folder in the system's temporary folder."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


def pytest_unconfigure(config):
    folder = config.stash.get(_TMPDIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


_TMPDIR = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _spawns(item):
            item.add_marker(pytest.mark.subprocess)
        if item.nodeid.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("forbid_subprocess") or item.get_closest_marker("subprocess"):
        return (yield)
    with _no_new_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    started = item.stash.get(_STARTED, None)
    if started and report.passed:  # the test swallowed the error: fail it all the same
        report.outcome, report.longrepr = "failed", _forbidden(item, started[0])
    if started:
        started.clear()
    return report


_STARTED = pytest.StashKey[list]()


def _forbidden(item, what: str) -> str:
    return (f"{item.nodeid} started a process ({what}) under --forbid-subprocess (make test-fast): "
            "mark it subprocess, e.g. in SPAWNING_PATHS of tests/conftest.py, or give it a spawning fixture")


@contextlib.contextmanager
def _no_new_processes(item):
    """Every way of starting a process raises, and is remembered for the report."""
    item.stash[_STARTED] = []
    patched = [(subprocess.Popen, "__init__"), (os, "fork"), (os, "forkpty"), (os, "posix_spawn"),
               (os, "posix_spawnp"), (os, "system"), (multiprocessing.util, "spawnv_passfds")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched if hasattr(owner, name)]

    def refuse(name):
        def raising(*args, **kwargs):
            item.stash[_STARTED].append(name)
            raise RuntimeError(_forbidden(item, name))
        return raising

    for owner, name, _ in saved:
        setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
