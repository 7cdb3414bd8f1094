# Thin entry points; the work lives in scripts/ and the pdflow CLI.
VENV := .venv
PYTEST_FLAGS ?= -q

.PHONY: setup test lint typecheck pytest demo check bench setup-sglang test-sglang
# Steps run in the order listed, even under make -j: setup must finish before the checks.
.NOTPARALLEL:

setup:
	bash scripts/setup.sh

test: setup lint typecheck pytest test-sglang

lint:
	$(VENV)/bin/ruff check .

typecheck:
	$(VENV)/bin/mypy --strict src/pdflow/core
	$(VENV)/bin/mypy src/pdflow

# pytest exits 5 when it collected nothing; that must fail the build, so say why.
pytest:
	@rc=0; $(VENV)/bin/pytest -p no:cacheprovider $(PYTEST_FLAGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$rc

# pdflow as SGLang's transfer backend, tested against SGLang 0.5.23 itself (CPU, its own env
# .venv-sglang: about 90 s to build on a clean machine, seconds when built). docs/sglang.md
setup-sglang: setup
	bash scripts/setup_sglang.sh

test-sglang: setup-sglang
	@rc=0; .venv-sglang/bin/pytest -p no:cacheprovider $(PYTEST_FLAGS) -W ignore::UserWarning \
		tests_sglang || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no SGLang tests: failing" >&2; fi; exit $$rc

demo: setup
	$(VENV)/bin/pdflow demo

check: setup
	$(VENV)/bin/pdflow check

bench: setup
	$(VENV)/bin/python benchmarks/transport_raw.py --json out/bench/transport_raw.json
