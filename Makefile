# The two entry points of the README: `make demo` (train a small model on neuron) and `make test`.
# Both install everything from scratch into .venv first (torch==2.13.0, then the package with its
# C++ runtime built against that torch, without build isolation, and the extras `serve` (vLLM, whose
# CUDA builds of torchvision/torchaudio/torchcodec are removed again, as they break transformers), `ao` (torchao),
# `diffusion` (diffusers) and `titan` (torchtitan's dependencies; torchtitan itself without its datasets pin).
VENV ?= .venv
PY := $(VENV)/bin/python
# the C++ sources of the one library torchneuron/runtime/_C.so (setup.py's CSRC_DIRS)
CSRC_DIRS := torchneuron/runtime/csrc torchneuron/ops/csrc torchneuron/eager/csrc torchneuron/serving/llm/csrc
CSRC := $(wildcard $(addsuffix /*.cpp,$(CSRC_DIRS)) $(addsuffix /*.h,$(CSRC_DIRS)))
PYTEST_ARGS ?=
# test modules spread over this many processes (pytest-xdist); slow ones start first (tests/conftest.py)
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope

.PHONY: install demo test test-fast bench clean

install: $(VENV)/.installed torchneuron/runtime/_C.so

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e ".[test,serve,ao,diffusion,titan]"
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

torchneuron/runtime/_C.so: $(CSRC) $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace

demo: install
	$(VENV)/bin/torchneuron demo

# The serving tests start vLLM engines and servers: they run in a pytest process of their own, after
# the rest (in a process that ran other test modules first, vLLM's engine start failed inside llvmlite).
SERVING_TESTS := tests/serving

test: install
	$(PYTEST) --ignore=$(SERVING_TESTS) $(PYTEST_ARGS)
	$(PY) -m pytest -q -p no:cacheprovider -n 1 $(SERVING_TESTS) $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) -m "not slow and not multiprocess" --ignore=$(SERVING_TESTS) $(PYTEST_ARGS)
	$(PY) -m pytest -q -p no:cacheprovider -n 1 -m "not slow and not multiprocess" $(SERVING_TESTS) $(PYTEST_ARGS)

# bench/nkilib_parity.py needs a checkout of AWS's nki-library (outside this repository) as its argument
BENCHES := $(filter-out bench/nkilib_parity.py,$(wildcard bench/*.py))

bench: install
	for b in $(BENCHES); do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build torchneuron/runtime/_C.so *.egg-info
