PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[test]"
	$(PY) -m pip install --no-deps "torchstore==0.1.2" pygtrie
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

demo: $(STAMP)
	$(PY) -m apps.sft.main --config configs/sft_cpu_demo.yaml
	$(PY) -m apps.grpo.main --config configs/grpo_cpu_demo.yaml

bench: $(STAMP)
	$(PY) -m bench.train_step
	$(PY) -m bench.pipeline
	$(PY) -m bench.push_weights
	$(PY) -m bench.convert

clean:
	rm -rf $(VENV)
