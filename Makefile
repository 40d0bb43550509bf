# Two commands on a fresh machine: `make demo` (the workshop) and `make test`.
# Both create .venv/ in the repo and install what they need; torch is pinned to the
# CPU wheel 2.13.0 only when it is absent (the package itself asks for torch>=2.4).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.subquad-installed

.PHONY: demo test test-quick bench bench-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,hf,serve,eval,rwkv,grammar,gguf]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/subquad workshop

# SUBQUAD_REQUIRE_REFERENCES=1: the references the extras install (transformers, the openai client, fastapi,
# uvicorn, rwkv, gguf) must import; a test that would skip without one fails (tests/conftest.py).
# Two test processes (pytest-xdist; one torch thread each), cases handed out as workers free up (worksteal);
# TEST_WORKERS=0 runs them in this process. test-quick: the cases of tests/quick.txt, a few from every file.
TEST_WORKERS ?= 2
PYTEST := SUBQUAD_REQUIRE_REFERENCES=1 $(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
test: $(STAMP)
	$(PYTEST)

test-quick: $(STAMP)
	$(PYTEST) -m quick -q

# Peers for benchmarks/ only. fast-transformers compiles a C++ extension (~5 min);
# with nvcc on PATH it would try CUDA, so PATH is cut to a copy without nvcc.
bench-deps: $(STAMP)
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -e ".[bench]" -c $(VENV)/torch-constraint.txt
	mkdir -p $(VENV)/nonvcc && for f in $$(dirname $$(command -v $(PYTHON)))/* /usr/local/bin/*; do \
	  case $$(basename $$f) in nvcc) ;; *) ln -sf $$f $(VENV)/nonvcc/ 2>/dev/null;; esac; done
	env PATH=$(CURDIR)/$(VENV)/bin:$(CURDIR)/$(VENV)/nonvcc:/usr/bin:/bin CUDA_HOME= \
	  $(PY) -m pip install -q --no-build-isolation pytorch-fast-transformers || \
	  echo "fast-transformers did not build; benchmarks will skip it"

bench: bench-deps
	$(PY) benchmarks/bench_linear_attention.py
	$(PY) benchmarks/bench_gla.py
	$(PY) benchmarks/bench_delta_rule.py
	$(PY) benchmarks/bench_mamba.py
	$(PY) benchmarks/bench_models.py
	$(PY) benchmarks/bench_distributed.py
	$(PY) benchmarks/bench_context_parallel.py
	$(PY) benchmarks/bench_pieces.py
	$(PY) benchmarks/bench_decode_step.py
	$(PY) benchmarks/bench_precision.py
	$(PY) benchmarks/bench_routes.py
	$(PY) benchmarks/bench_varlen.py
	$(PY) benchmarks/bench_pretrained.py

clean:
	rm -rf $(VENV) runs .cache
