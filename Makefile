# The two set-up commands of README.md: `make train` and `make test`.
# Each installs what it needs (torch pinned to the CPU wheel for the test/CI set-up).
PY ?= python3
STAMP := .install.stamp
TRAIN_STAMP := .install-train.stamp
export OMP_NUM_THREADS ?= 1

# `make train` needs torch, the package, the Shakespeare corpus, matplotlib and tqdm: not the test dependencies
# (transformers, lightning, triton, torchft, ...) nor scikit-learn (the digits images of --model resnet/vit),
# which take most of a fresh install.
$(TRAIN_STAMP): pyproject.toml
	$(PY) -m pip install -q torch==2.13.0 -e '.[text]'
	touch $(TRAIN_STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e .
	touch $(STAMP)

.PHONY: install train test bench gpu-check
install: $(STAMP)

train: $(TRAIN_STAMP)
	$(PY) -m lioncub.cli train

test: $(STAMP)
	$(PY) -m pytest -q tests

# One-shot check of the CUDA path on a GPU machine (< 5 min, the process tree killed at 280 s +
# 10 s grace): JSON report into OUT. Installs nothing (no $(STAMP)): it runs the machine's own
# python3, torch and triton. Exit 0 = all passed, 1 = a check failed or did not run, 3 = no CUDA,
# 124/137 = killed at the time limit. ARGS: extra gpu_check.py options (e.g. ARGS=--dry-run).
gpu-check:
	PY=$(PY) tests/gpu/gpu_check.sh $(or $(OUT),bench/results/gpu_check) $(ARGS)
