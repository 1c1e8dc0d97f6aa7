"""One-line mutants of the runtime, and which test tier kills each.

    python -m tests.fuzz.mutants [--only NAME ...] [--full]

Each mutant is one edited line of shardkit/, applied to a copy of the working tree (the
checkout is never touched). For each, in order, until one kills it (fails):

1. ``fake fuzz``: tests/fuzz/test_fake_fuzz.py (fake process group, against FSDP2);
2. ``gloo fuzz``: tests/fuzz/test_gloo_fuzz.py (2 gloo ranks, numerics);
3. ``test-fast``: the rest of the in-process tier (unit, fake, planner, regressions);
4. with ``--full``: every other test, then the simulated-streams tier (make test's rerun).

``--tests PATH ...`` runs only those tests on each mutant instead (to check which test kills a
mutant the tiers above leave to the full one).

It prints a markdown table: the mutant, the tier that killed it, and that tier's first
failure line. A mutant no tier kills is a hole in the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import inductor_cache_dir

ROOT = Path(__file__).resolve().parents[2]

# name: (file, the line as it is, the line as the mutant has it, what it breaks)
MUTANTS = {
    "stale-mark-dropped": ("shardkit/core/steps.py", "            group.shards_changed()", "            pass",
                           "an optimizer step no longer marks gathered data stale"),
    "avg-for-a-divide-factor": ("shardkit/core/reduction.py", "if averages and not user_factor and divide_by == shard[0] * over[0]:", "if averages:",
                                "the backend averages even when the user's divide factor is not the world"),
    "compiled-mixed-gathers-per-dtype": ("shardkit/compiled/group.py", "self.gathers_apart = self.extension_mesh is not None or len(",
                                         "self.gathers_apart = self.extension_mesh is not None and len(",
                                         "a compiled group of several dtypes all-gathers once per dtype, not once as bytes as eager mode"),
    "compiled-apart-reduces-in-reverse": ("shardkit/compiled/gather.py", "order = range(len(buckets)) if not group.gathers_apart else reversed(range(len(buckets)))",
                                          "order = range(len(buckets))",
                                          "a compiled group of several reduce dtypes reduce-scatters them in the reverse of eager mode's order"),
    "compiled-frozen-rows-reduced": ("shardkit/compiled/gather.py", "trains = None if all(trains) or not any(trains) else trains", "trains = None",
                                     "compiled mode reduce-scatters frozen parameters' zero rows (and computes their gradients), eager mode does not"),
    "compiled-cut-misplaces-rows": ("shardkit/compiled/gather.py", "keep = [k for k, t in enumerate(self.trains) if t]\n",
                                    "keep = [k for k, t in enumerate(self.trains) if t][::-1]\n",
                                    "compiled mode's reduction without frozen parameters sends the trainable ones' rows in another order than it takes them back"),
    "compiled-mode-sums-always": ("shardkit/compiled/gather.py", 'shard_op, replicate_op = "avg" if ops.shard_averages else "sum", "avg" if ops.replicate_averages else "sum"', 'shard_op, replicate_op = "sum", "sum"',
                                  "compiled mode's collectives sum where eager mode's average (and nothing divides after)"),
    "compiled-kept-sums-averaged": ("shardkit/compiled/gather.py", "kept = reduced * shard.world if ops.shard_averages else reduced", "kept = reduced",
                                    "compiled HSDP keeps averaged rows without the all-reduce and a later summing backward adds them as sums"),
    "force-sum-ignored": ("shardkit/core/reduction.py", "return not overflow_risk(dtype) and not force_sum", "return not overflow_risk(dtype)",
                          "bug 3: set_force_sum_reduction_for_comms(True) changes nothing"),
    "all-gather-not-waited": ("shardkit/comm/collectives.py", "    pending.handle.wait()\n    pending.bucket.copy_out", "    pending.bucket.copy_out",
                              "copy-out without waiting for the all-gather"),
    "no-reshard-after-forward": ("shardkit/eager/schedule.py", "            elif reshard:\n                group.reshard()", "            elif reshard:\n                pass",
                                 "reshard_after_forward=True keeps the parameters unsharded"),
    "padding-off-by-one": ("shardkit/dtensor/placements.py", "return math.ceil(rows / world) if rows else 0", "return math.ceil(rows / world) + 1 if rows else 0",
                           "every shard padded by one row too many"),
    "prefetch-wrong-group": ("shardkit/eager/schedule.py", "targets = order[i : i + 1]", "targets = order[i + 1 : i + 2]",
                             "forward prefetch issues the group after the next one"),
    "root-reduce-dropped": ("shardkit/eager/schedule.py", "            else:\n                self.collectives.reduce(state, reshard=True)", "            elif state is not self.states[0]:\n                self.collectives.reduce(state, reshard=True)",
                            "the root group's gradients are never reduced"),
    "all-gather-reused-across-steps": ("shardkit/eager/param_group.py", "return self.gathered_version == self._shard_version()", "return True",
                                       "kept unsharded data is reused after an optimizer step"),
    "unshard-before-forward": ("shardkit/dtensor/sharded_param.py", "if registered is self.sharded_param or registered is self.unsharded_param:", "if registered is self.sharded_param:",
                               "bug 1: an explicit unshard() before the first forward replaces the parameters"),
    "no-division-after-sum": ("shardkit/comm/collectives.py", "            reduced.div_(self.divide_by)  # not at all when the collective averaged", "            pass",
                              "summed gradients are not divided (gloo, divide factors)"),
    "unused-grads-zero": ("shardkit/comm/buckets.py", "counts[i] > 0:", "counts[i] >= 0:",
                          "a parameter no rank used gets a zero .grad instead of None"),
    "pipeline-final-callback-dropped": ("shardkit/eager/fsdp2_view.py", "            self._state.schedule.end_backward()", "            pass",
                                        "pipelining's final callback does nothing: the last reductions never finish"),
    "module-data-not-refilled": ("shardkit/dtensor/sharded_param.py", "self._data_replaced = self.buffer.data_replaced()", "self._data_replaced = False",
                                 "data a forward gave its parameter is never refilled: later steps compute with stale weights"),
    "compiled-grad-divisor": ("shardkit/compiled/gather.py", "        reduced = reduced / ops.after\n", "        reduced = reduced / (ops.after * 2)\n",
                              "compiled mode divides its reduced gradients by twice the ranks"),
    "compiled-hsdp-no-all-reduce": ("shardkit/compiled/gather.py", "if group.all_reduces:", "if False:",
                                    "compiled mode's HSDP never all-reduces its gradients over the replicas"),
    "compiled-unused-grads-zero": ("shardkit/compiled/unused.py", "if values is None or values[k] != 0:", "if values is None or values[k] >= 0:",
                                   "compiled mode gives a parameter no rank used a zero .grad instead of None"),
    "post-accumulate-grad-hooks-dropped": ("shardkit/dtensor/sharded_param.py", "            hook(self.sharded_param)\n", "            pass\n",
                                           "a sharded parameter's post-accumulate-grad hooks never run (an optimizer stepping in them does nothing)"),
    "compiled-tied-borrower-settings": ("shardkit/compiled/gather.py", "own = (self if b.owner is None else Settings.of(b.owner)._replace(reshard=self.reshard, post_forward=self.post_forward, keep=self.keep) for b in group.buckets)",
                                        "own = (self for b in group.buckets)",
                                        "compiled mode reduces a weight tied to another call's with the borrower's settings, not its owner's"),
    "compiled-post-forward-rank-order": ("shardkit/compiled/gather.py", "return gathered.view(within.world, across.world, -1).transpose(0, 1).reshape(-1)  # (world * per_rank,), rank-major",
                                         "return gathered",
                                         "compiled mode's two-step all-gather (reshard_after_forward=R) leaves the rows in the order the steps gathered them"),
    "compiled-kept-not-stale-after-step": ("shardkit/compiled/group.py", "return any(id(param) in ids for param in self.registered())",
                                           "return False",
                                           "compiled mode's next forward uses what a backward kept (set_reshard_after_backward(False)) after an optimizer step"),
    "overlap-no-prefetch": ("shardkit/compiled/overlap.py", "place[g] = min(place[g], place[wait_of[previous]] + 0.25)", "place[g] = place[g]",
                            "the overlap pass never issues an all-gather ahead of its group"),
    "overlap-waits-at-issue": ("shardkit/compiled/overlap.py", "place[wait_of[g]] = min(users[wait_of[g]], default=n) - 0.5", "place[wait_of[g]] = g + 0.01",
                               "the overlap pass waits for each all-gather right where it is issued"),
    "stale-hook-before-swap": ("shardkit/core/steps.py", "        for installer in _installers:\n            installer()\n        register_optimizer_step_post_hook(_stale)",
                               "        register_optimizer_step_post_hook(_stale)\n        for installer in _installers:\n            installer()",
                               "the staleness hook runs before the swap back to DTensors: compiled mode's kept rows stay stale after a step"),
    "region-schema-key-ignores-graph": ("shardkit/compiled/region.py", "key = (identifier, graphs, tuple(metadata))", "key = (identifier, tuple(metadata))",
                                        "a region's kept schema outlives a change to its graph (an input written in place goes unseen)"),
    "region-reductions-unrecorded": ("shardkit/compiled/region.py", "return (*shards[:i], _Reductions.apply(group, settings, _reduced_numels(group, shards), shards[i]), *shards[i + 1 :]), kept",
                                     "return shards, kept",
                                     "the trace misses a region's reduce-scatters and all-reduces"),
    "region-key-without-settings": ("shardkit/compiled/region.py", "(tuple(settings), held, inputs, torch.is_grad_enabled())", "((), held, inputs, torch.is_grad_enabled())",
                                    "blocks of one structure share a region whatever their settings (divide factor, reshard, sync)"),
    "region-key-without-keyword-arguments": ("shardkit/compiled/region.py", "inputs = (_described(tuple(args)), _described(dict(kwargs)))",
                                             "inputs = (_described(tuple(args)), ())",
                                             "blocks called with other keyword arguments (a constant, None against a tensor) share a region"),
    "region-takes-any-object": ("shardkit/compiled/region.py", "return _described(tuple(args)) is not None and _described(dict(kwargs)) is not None", "return True",
                                "a block called with an object it writes to (a cache) runs as a region, traced once"),
    "region-inplace-buffers-on": ("shardkit/compiled/region.py", "config.inplace_buffers = False", "config.inplace_buffers = True",
                                  "inductor writes in place into a buffer a region still reads: blocks taking a second tensor get wrong gradients"),
    "region-structure-without-attrs": ("shardkit/compiled/region.py", "parts.append((name, f\"{cls.__module__}.{cls.__qualname__}\", m.training, attrs))",
                                       "parts.append((name, f\"{cls.__module__}.{cls.__qualname__}\", m.training))",
                                       "blocks that differ only in a plain attribute (n_head) share a region"),
    "compiled-read-symbolic-index": ("shardkit/compiled/unused.py", "by_uid(uid).watch.reads.add(int(i))", "by_uid(uid).watch.reads.add(i)",
                                     "compiled mode's blocks that break the graph crash: the resumed frame's symbolic index is unhashable"),
    "compiled-inputs-through-modules": ("shardkit/compiled/group.py", "leaf if p.sharded_param.requires_grad else leaf.detach() for leaf, p in zip(leaves, self.params)",
                                        "leaf if param.requires_grad else leaf.detach() for leaf, param in zip(leaves, self.registered())",
                                        "compiled mode reads each parameter through its module: dynamo guards that two paths reach one object"),
    "compiled-shared-root-code": ("shardkit/compiled/forwarding.py", "gathering_forward.__code__ = gathering_forward.__code__.replace()", "pass",
                                  "every compiled-mode model's root shares one code object: the ninth compiled in a process fails"),
    "compiled-no-room-for-graphs": ("shardkit/compiled/__init__.py", "    _room_for_graphs()\n", "",
                                    "dynamo's recompile limit stays 8: past the eighth block that breaks the graph, blocks run eagerly"),
    "compiled-regions-may-break": ("shardkit/compiled/forwarding.py", " and region.allowed_here()):", "):",
                                   "blocks run as regions under fullgraph=False: a block that breaks the graph fails the compile"),
    "compiled-no-side-effects-under-checkpoint": ("shardkit/compiled/__init__.py", "    _side_effects_under_checkpoint()\n", "",
                                                  "a block under the user's torch.utils.checkpoint fails fullgraph=True: the gather's state is a side effect"),
    "compiled-no-keep-all-gather": ("shardkit/compiled/gather.py", "(settings.reshard or torch.compiler.is_compiling())", "settings.reshard",
                                    "a block that keeps its parameters all-gathers them again in backward under the user's checkpoint"),
    "unshard-inside-inference-mode": ("shardkit/eager/param_group.py", "        if not torch.is_inference_mode_enabled():\n", "        if True:\n",
                                      "a first forward under torch.inference_mode makes the unsharded buffers inference tensors: the training forward after it fails"),
    "compiled-gather-per-module": ("shardkit/compiled/forward_state.py", "self._move(Event.END_IN_SCOPE if self.scoped else Event.END)", "self._move(Event.END)",
                                   "a group of several modules (fully_shard([a, b])) all-gathers at each module's forward, not once per forward (test-fast: the pair run eagerly; make fuzz: Spec.paired)"),
    "create-graph-backward-reshards": ("shardkit/eager/schedule.py", "group.reshard(free=not self.schedule.creates_graph)",
                                       "group.reshard(free=True)",
                                       "a backward with create_graph=True (a gradient penalty) frees the unsharded parameters the backward through it reads"),
    "compiled-no-grad-read-is-a-use": ("shardkit/compiled/unused.py", "    if not torch.is_grad_enabled():  # (a norm taken under no_grad): no gradient can come of it, so no use\n",
                                       "    if False:\n",
                                       "compiled mode gives a parameter read only under no_grad in forward a zero gradient instead of None"),
    "compiled-no-grad-forward-watches": ("shardkit/compiled/unused.py", "    if not torch.is_grad_enabled():\n        return True\n    under",
                                         "    under",
                                         "an evaluation under no_grad makes compiled mode watch (read back the counts of) every parameter for good"),
    "compiled-pre-hooks-before-gather": ("shardkit/compiled/__init__.py", "        if m in group.modules and m._forward_pre_hooks:\n",
                                         "        if False:\n",
                                         "compiled mode gathers after a module's own forward pre-hooks (hook-based spectral_norm fails)"),
    "compiled-pre-hooks-registered-later-unseen": ("shardkit/compiled/__init__.py",
                                                   '            namespace["register_forward_pre_hook"] = registering_pre_hooks(group, type(m))\n', "",
                                                   "a forward pre-hook registered after compiled fully_shard reads the sharded parameters"),
    "compiled-regions-under-dynamic-shapes": ("shardkit/compiled/region.py", "    return not dynamic and bool(", "    return bool(",
                                              "blocks run as regions in a graph with a symbolic length: a second sequence length fails the compile"),
    "param-mesh-divisor": ("shardkit/eager/param_group.py", "ranks = plan.comm.world * (plan.replicate.size()", "ranks = self.parts[0].plan.comm.world * (plan.replicate.size()",
                           "a parameter on a mesh of its own is divided by the first mesh's size"),
    "muon-owner-sends-its-own-rows": ("shardkit/optim/owners.py", "parts.extend(take(result, bucket.pieces[j][r]).reshape(-1) for j, result in results)",
                                      "parts.extend(take(result, bucket.pieces[j][bucket.rank]).reshape(-1) for j, result in results)",
                                      "Muon's owner sends every rank its own rows of each update"),
    "muon-nesterov-dropped": ("shardkit/optim/muon.py", 'update = g.lerp(buf, momentum) if opt_group["nesterov"] else buf', "update = buf",
                              "Muon orthogonalizes the momentum without the Nesterov blend"),
    "clip-coefficient-unclamped": ("shardkit/clip.py", "coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)",
                                   "coefficient = float(max_norm) / (total + 1e-6)",
                                   "clip_grad_norm_ scales gradients up when their norm is below max_norm"),
    "tp-partial-grad-not-cast": ("shardkit/dtensor/sharded_param.py", "grad = grad.to(self.reduce_dtype).redistribute(spec.mesh, target)",
                                 "grad = grad.redistribute(spec.mesh, target)",
                                 "a Partial tensor-parallel gradient is summed over tp in param_dtype, not reduce_dtype"),
    "reduce-scatter-in-param-dtype": ("shardkit/comm/buckets.py", "by_dtype.setdefault(p.reduce_dtype, []).append(p)",
                                      "by_dtype.setdefault(p.param_dtype, []).append(p)",
                                      "gradients are reduce-scattered in param_dtype, not reduce_dtype"),
    "hsdp-tp-strided-split-ignored": ("shardkit/dtensor/placements.py", "    dp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)",
                                      "    dp = Shard(dim)",
                                      "a column-wise weight's dp placement is Shard(0), not _StridedShard: full_tensor() interleaves the rows wrongly"),
    "hsdp-tp-replicate-dim-dropped": ("shardkit/dtensor/placements.py", "(*(Replicate(),) * (dp_mesh.ndim - 1), dp, *tp_spec.placements)",
                                      "(*(Shard(dim),) * (dp_mesh.ndim - 1), dp, *tp_spec.placements)",
                                      "HSDP x TP parameters claim a shard over dp_replicate too (their full_tensor and state_dict are wrong)"),
    "replicate-only-shards-the-replicas": ("shardkit/core/meshes.py", "dp = flat(replicate)._unflatten(0, (flat(replicate).size(), 1), (name, f\"{name}_unsharded\"))",
                                           "dp = flat(replicate)._unflatten(0, (1, flat(replicate).size()), (name, f\"{name}_unsharded\"))",
                                           "DataParallelMeshDims(replicate=...) shards over the replicas while the placements say Replicate()"),
    "all-reduce-hook-sees-the-sum": ("shardkit/comm/collectives.py", "divide_first = settings.hook is None or divides_in_collectives(bucket.dtype, settings.force_sum)",
                                     "divide_first = settings.hook is None",
                                     "the all-reduce hook receives the summed gradient in fp32 on gloo, not FSDP2's divided one"),
    "muon-every-rank-takes-rank-0s-rows": ("shardkit/optim/owners.py", "out[bucket.index[j]] = take(result, bucket.pieces[j][bucket.rank]).contiguous()",
                                           "out[bucket.index[j]] = take(result, bucket.pieces[j][0]).contiguous()",
                                           "Muon's small buckets on every rank: each rank applies rank 0's rows of the update"),
    "owner-gather-on-every-rank": ("shardkit/optim/owners.py", "below = self._every_rank_below(pg) if every_rank else 0.0", "below = self._every_rank_below(pg)",
                                   "OwnerCompute.gather (one run per matrix: save_pretrained writes each tensor there) runs a small bucket on every rank once a threshold is set"),
    "one-rank-in-place-not-copied": ("shardkit/comm/collectives.py", "output = bucket.columns[0].view(-1).copy_(send) if bucket.in_place else send",
                                     "output = bucket.columns[0].view(-1) if bucket.in_place else send",
                                     "over a one-rank shard dim a group gathered in place computes with its unsharded buffer's stale bytes"),
    "one-rank-reduction-not-the-copy-in": ("shardkit/comm/collectives.py", "        return None, send.view(-1), send\n", "        return None, send.view(-1) * 0 + send.view(-1)[0], send\n",
                                     "over a one-rank shard dim the reduced row is not the copy-in"),
    "compiled-leaves-unpadded": ("shardkit/compiled/group.py", "leaf = (p.padded_shard if plain else param._local_tensor).detach()", "leaf = param._local_tensor.detach()",
                                 "compiled mode's graph takes the real rows and pads in the graph: a rank with padding rows compiles other graphs"),
    "compiled-padding-rows-to-grad": ("shardkit/compiled/group.py", "        grad = p._valid(grad)", "        pass",
                                      "compiled mode hands a padded leaf's whole gradient, padding rows included, to .grad"),
    "resizable-group-size-frozen": ("shardkit/comm/collectives.py", "return self.process_group.size() if self.resizable else self.world", "return self.world",
                                    "a replicate group whose size changes (torchft) is divided by its size at lazy init"),
    "state-dict-off-thread-reshards": ("shardkit/eager/hooks.py", "if schedule is not None and schedule.off_step_thread():\n        return", "if False:\n        return",
                                       "state_dict() from another thread reshards the groups the step is using"),
    "state-dict-keeps-unsharded": ("shardkit/eager/hooks.py", "if value is not None and value is not p.sharded_param:", "if False:",
                                   "state_dict() during a step returns the unsharded tensors the modules hold"),
    "lockstep-tokens-over-every-rank": ("shardkit/eager/lockstep.py", "    return mesh._flatten().get_group(), mesh.size()",
                                        "    return dist.group.WORLD, mesh.size()",
                                        "set_lockstep on HSDP x TP agrees over every rank, tp ranks included, and reads the wrong number of tokens"),
}

# Not tests/unit/test_mutants_apply.py: in a mutated tree it fails by construction (the line it
# looks for is the one the mutant edited), which would count every mutant as killed.
PY = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--deselect", "tests/unit/test_mutants_apply.py"]
TIERS = [
    ("fake fuzz", PY + ["tests/fuzz/test_fake_fuzz.py"]),
    ("gloo fuzz", PY + ["tests/fuzz/test_gloo_fuzz.py"]),
    ("test-fast", PY + ["-m", "not subprocess and not slow", "--ignore=tests/fuzz", "tests"]),
]
FULL = [
    ("make test (rest)", PY + ["-m", "subprocess or slow", "--ignore=tests/fuzz", "tests"]),
    ("test-sim", PY + ["tests/unit", "tests/fake", "--ignore=tests/fake/test_compiled_graphs.py", "--ignore=tests/fake/test_compiled_overlap.py", "--ignore=tests/fake/test_compiled_methods.py", "tests/gloo/test_training_parity.py", "tests/gloo/test_composition.py"], {"SHARDKIT_STREAMS": "sim"}),
]


def copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", "*.egg-info", "runs", "fuzz-repro*.json")
    shutil.copytree(ROOT, dst, ignore=ignore)


def mutate(tree: Path, file: str, old: str, new: str) -> None:
    path = tree / file
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutant does not apply: {file} holds {text.count(old)} copies of {old!r}")
    path.write_text(text.replace(old, new))


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("E ", "FAILED", "AssertionError")) or "Failure:" in line:
            return line.strip()[:160]
    return output.strip().splitlines()[-1][:160] if output.strip() else "(no output)"


def run_mutant(name: str, full: bool, tests: list[str] | None = None) -> tuple[str, str, float]:
    file, old, new, _ = MUTANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        mutate(tree, file, old, new)
        scratch = Path(tmp) / "tmp"
        scratch.mkdir()
        inductor_cache = inductor_cache_dir()
        start = time.monotonic()
        tiers = [("chosen tests", PY + tests)] if tests else TIERS + (FULL if full else [])
        for tier in tiers:
            label, cmd, extra = (*tier, {})[:3]
            # PYTHONPATH: the processes tests start by path (torchrun, a worker script) would
            # otherwise import the checkout's shardkit through its editable install.
            # TMPDIR: what the tests' processes leave behind when a mutant fails them (a failing
            # test's tmp_path, the folder of a pytest killed by a check) goes with this folder;
            # inductor's kernel cache stays the shared one.
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree), "TMPDIR": str(scratch),
                   "TORCHINDUCTOR_CACHE_DIR": inductor_cache, **extra}
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:  # the whole output kept: a crash's cause is rarely in its first line
                log = Path(tempfile.gettempdir()) / f"mutant-{name}.log"
                log.write_text(proc.stdout + proc.stderr)
                return label, f"{first_failure(proc.stdout + proc.stderr)} ({log})", time.monotonic() - start
        return "survived", "", time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.mutants")
    parser.add_argument("--only", nargs="*", default=list(MUTANTS))
    parser.add_argument("--full", action="store_true", help="run make test's other tiers on mutants the fast ones miss")
    parser.add_argument("--tests", nargs="*", default=None, metavar="PATH",
                        help="run only these pytest paths (or node ids) on each mutant, in place of the tiers")
    args = parser.parse_args()
    print("| mutant | what it breaks | killed by | first failure | s |")
    print("|---|---|---|---|---|")
    survivors = 0
    for name in args.only:
        tier, why, seconds = run_mutant(name, args.full, args.tests)
        survivors += tier == "survived"
        print(f"| {name} | {MUTANTS[name][3]} | {tier} | {why.replace('|', '/')} | {seconds:.0f} |", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
