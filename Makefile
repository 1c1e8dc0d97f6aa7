# shardkit: `make demo` trains a small GPT on 2 CPU ranks, `make test` runs the tests.
# GPU users pick a CUDA build of torch: make demo TORCH_SPEC="torch==2.13.0+cu128" (plus their pip index).

PYTHON ?= python3
VENV ?= .venv
# Pinned on purpose: a bare `torch` would pull a multi-GB CUDA build; 2.13.0 resolves to the CPU wheel on disk.
TORCH_SPEC ?= torch==2.13.0
# Test-only: what users combine with FSDP (float8 / NF4 weights); never imported by shardkit.
TEST_DEPS ?= torchao==0.18.0
# Test-only, with its dependencies (attrs, sortedcontainers): the differential fuzzer (tests/fuzz).
FUZZ_DEPS ?= hypothesis==6.170.17
# Test-only, with their dependencies (none is torch): the safetensors package, the reference that
# shardkit.checkpoint's own reader and writer are checked against, and transformers, which writes and
# reads the Hugging Face checkpoints that tests/gloo/test_pretrained.py loads and saves.
HF_DEPS ?= safetensors==0.8.0 transformers==5.23.0
# Bench-only: the plot of benchmarks/scaling.py (make bench ARGS=--scaling); the tests never need it.
# The same pin as pyproject.toml's `bench` extra.
BENCH_DEPS ?= matplotlib==3.10.9
# Test-only: torchft, which drives HSDP's replicate dim through replica groups that die and heal
# (tests/gloo/test_torchft.py, shardkit.ft). Without its torch pin (--no-deps); its other needs pinned.
FT_DEPS ?= opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
FT_SPEC ?= torchft==0.2.0
# Extra flags for demo/train.py, e.g. make demo ARGS="--steps 100".
ARGS ?=

STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: venv demo bench test test-fast test-all test-sim fuzz gpu-check accept clean distclean

venv: $(STAMP)

# Torch first and pinned, then the test tools, then shardkit itself with --no-deps so that
# nothing it declares can swap the torch we chose. numpy: the CPU torch wheel does not pull it
# in, but torch.distributed's *_object collectives (all_gather_object, ...) need it.
$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install "$(TORCH_SPEC)"
	$(VENV)/bin/pip install numpy rich pytest expecttest "$(FUZZ_DEPS)" $(HF_DEPS)
	$(VENV)/bin/pip install --no-deps $(TEST_DEPS)
	$(VENV)/bin/pip install $(FT_DEPS)
	$(VENV)/bin/pip install --no-deps "$(FT_SPEC)"
	$(VENV)/bin/pip install --no-deps -e .
	touch $@

# One thread per rank: the two ranks share the 2 cores.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 demo/train.py $(ARGS)

# shardkit next to FSDP2, DDP and a local model on 2 CPU ranks; make bench ARGS=--quick for a short run.
# make bench ARGS=--scaling: how the cost grows with the world and the model (benchmarks/scaling.py).
# make bench ARGS=--muon: shardkit.optim.Muon next to torch.optim.Muon alone (benchmarks/muon_bench.py).
bench: $(STAMP) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python benchmarks/bench.py $(ARGS)

# Its own stamp, so that `make test` and the test venv never pull in the plotting library.
$(BENCH_STAMP): $(STAMP)
	$(VENV)/bin/pip install "$(BENCH_DEPS)"
	touch $@

# One thread per rank and per test process: the ranks share the 2 cores. Inductor compiles in the
# test process (TORCHINDUCTOR_COMPILE_THREADS=1), as in the gloo ranks: no pool of worker processes
# that each import torch and that the test then waits for.
PYTEST = OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# The quick tier, under a minute on 2 cores: every test that starts no process and is not
# slow (unit, fake process group, planner, the fuzzer's fake-PG part). The marks are set in
# tests/conftest.py; --forbid-subprocess fails a test that starts a process without its mark.
# Its fuzzer budget is 100 fake-process-group examples (make test: 150).
test-fast: $(STAMP)
	FUZZ_FAKE_EXAMPLES=100 $(PYTEST) -m "not subprocess and not slow" --forbid-subprocess tests

# Every test, and the fake-process-group tier and the 2-rank gloo parity modules once more with
# SHARDKIT_STREAMS=sim (test-sim): shardkit takes its CUDA path on simulated streams, and every
# tensor access is checked for races (shardkit/comm/sim.py); each gloo module must leave
# accesses checked and no race ("sim streams: N accesses checked, ..."). Three lanes at once
# (gloo ranks wait on each other and on start-up, and one lane alone leaves a core idle; the
# cores are busy with three, a fourth lane made it slower): the tests that are none of the
# others' (unit, fake process group with the compiled mode's, fuzzer, planner); the gloo
# modules, then tests/checkpoint (processes of their own: there they end the two lanes at about
# the same time, where the first lane ended a minute after the second); test-sim. Their output
# after the first's. Then, alone, the torchrun ones
# (tests/examples, the pipelining check: up to 8 ranks on the 2 cores, bound by how soon each
# rank's peer is scheduled): 60 s alone, about 180 s beside the lanes. Not rerun under sim:
# the 4-rank gloo modules (what they add, HSDP 2x2 and 4-rank meshes, the fake-PG tier checks
# under sim; 4 ranks cost twice the CPU), test_pretrained*.py (a transformers model; reading and writing shards puts nothing
# on a stream), the compiled mode's tests (torch.compile does not trace under the checker's
# dispatch mode).
COMPILED_FAKE_TESTS = tests/fake/test_compiled_graphs.py tests/fake/test_compiled_overlap.py \
	tests/fake/test_compiled_methods.py tests/fake/test_compiled_regions.py tests/fake/test_compiled_post_forward.py \
	tests/fake/test_compiled_extensions.py tests/fake/test_grad_hooks.py tests/fake/test_compiled_fuzz_models.py \
	tests/fake/test_compiled_forward_hooks.py tests/fake/test_compiled_buckets.py
SIDE_LANE_TESTS = tests/examples tests/gloo/test_pipeline.py
GLOO_LANE = tests/gloo tests/checkpoint $(SIDE_LANE_TESTS:%=--ignore=%)
MAIN_LANE = tests --ignore=tests/gloo --ignore=tests/checkpoint $(SIDE_LANE_TESTS:%=--ignore=%)
SIM_TESTS = tests/fake tests/gloo/test_training_parity.py tests/gloo/test_composition.py \
	tests/gloo/test_mixed_precision_numerics.py tests/gloo/test_sharded_params.py \
	tests/gloo/test_checkpoint.py tests/gloo/test_extensions.py tests/gloo/test_moe_and_spmd.py tests/gloo/test_muon.py

test: $(STAMP)
	@logs=$$(mktemp -d); \
	$(MAKE) --no-print-directory test-sim > $$logs/sim 2>&1 & sim=$$!; \
	( echo "$(PYTEST) $(GLOO_LANE)"; $(PYTEST) $(GLOO_LANE) ) > $$logs/gloo 2>&1 & gloo=$$!; \
	echo "$(PYTEST) $(MAIN_LANE)  (beside it, their output after: $(GLOO_LANE); make test-sim)"; \
	$(PYTEST) $(MAIN_LANE); rc=$$?; \
	for lane in gloo:$$gloo sim:$$sim; do wait $${lane#*:} || rc=1; cat $$logs/$${lane%%:*}; done; \
	rm -rf $$logs; echo "$(PYTEST) $(SIDE_LANE_TESTS)  (alone)"; $(PYTEST) $(SIDE_LANE_TESTS) || rc=1; exit $$rc

# Every test in one run (make test but for test-sim, and one lane).
test-all: $(STAMP)
	$(PYTEST) tests

# (Not the compiled mode's fake-PG tests: torch.compile does not trace under the checker's dispatch mode; not
# tests/unit: plain tensors and no process group, so no stream to check.)
test-sim: $(STAMP)
	SHARDKIT_STREAMS=sim $(PYTEST) $(SIM_TESTS) $(COMPILED_FAKE_TESTS:%=--ignore=%)

# The differential fuzzer for FUZZ_S seconds (a third on the fake process group, the rest on 2
# gloo ranks); prints its seed (rerun one with FUZZ_SEED=N) and shrinks a failure to a repro
# file: make fuzz REPLAY=fuzz-repro.json replays it call by call. make test runs a fixed budget.
FUZZ_S ?= 600
fuzz: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m tests.fuzz.fuzz $(if $(REPLAY),--replay $(REPLAY),--seconds $(FUZZ_S) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED)))

# On a machine with a GPU: the tests/gpu tier, NCCL world-1 parity, overlap, memory and step time
# next to FSDP2 (benchmarks/gpu_check.py). Run it first whenever a GPU is lent.
gpu-check: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/gpu
	$(VENV)/bin/python benchmarks/gpu_check.py

# Regenerate the expecttest strings pinned in the tests.
accept: $(STAMP)
	EXPECTTEST_ACCEPT=1 OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf .pytest_cache *.egg-info build dist
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
