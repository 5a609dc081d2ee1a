# Two commands set everything up on a fresh Debian/Ubuntu machine:
#   make serve   installs what is missing and serves on 127.0.0.1:8080
#   make test    installs what is missing and runs the test suite
VENV    := .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.shoal-installed
SYSTEM  := $(VENV)/.shoal-system
TEST_SYSTEM := $(VENV)/.shoal-test-system

.PHONY: serve test test-slow test-cluster bench bench-http system runtime check clean lock

serve: runtime
	$(BIN)/shoal serve

# Everything runs on the default launcher (the zygote); the escape and containment
# suites run a second time on bubblewrap, the fallback. (The Python, bash and editor
# suites, a minute there, run on bubblewrap with make test-slow: make test is kept
# under 20 minutes.)
BWRAP_SUITES := tests/sandbox/test_isolation.py tests/sandbox/test_limits.py \
                tests/sandbox/test_hardening.py tests/security/test_escape.py
BWRAP_FUNCTIONAL := tests/sandbox/test_python.py tests/sandbox/test_bash.py \
                    tests/sandbox/test_editor.py

# The escape suites once more with egress on (the relay, AF_INET, a broker), on both.
EGRESS_SUITES := tests/sandbox/test_isolation.py tests/sandbox/test_hardening.py \
                 tests/security/test_escape.py

# The main pass names its 15 slowest tests: make test is kept under 20 minutes.
test: runtime $(TEST_SYSTEM)
	SHOAL_LAUNCHER=bwrap bash scripts/run-tests.sh -q -m "not slow" $(BWRAP_SUITES)
	SHOAL_TEST_EGRESS=1 bash scripts/run-tests.sh -q -m "not slow" $(EGRESS_SUITES)
	SHOAL_TEST_EGRESS=1 SHOAL_LAUNCHER=bwrap bash scripts/run-tests.sh -q -m "not slow" $(EGRESS_SUITES)
	bash scripts/run-tests.sh --durations=15 -m "not slow and not cluster"

test-slow: runtime
	bash scripts/run-tests.sh --allow-empty -m slow
	SHOAL_LAUNCHER=bwrap bash scripts/run-tests.sh -q -m "not slow" $(BWRAP_FUNCTIONAL)

# Cluster mode's suites, on real services (PostgreSQL, SeaweedFS's S3 gateway, a Ray cluster).
test-cluster: runtime
	bash scripts/ensure-system.sh runtime/cluster-packages.txt
	bash scripts/run-tests.sh -m cluster tests/cluster

bench: runtime
	$(BIN)/python bench/sandbox_bench.py

bench-http: runtime
	$(BIN)/python bench/http_bench.py

check: runtime
	$(BIN)/shoal check

# The document tools (wkhtmltopdf, a headless Java runtime: ~700 MiB) are part of
# the runtime by default; make RUNTIME_DOCUMENTS=0 leaves them out (docs/runtime.md).
RUNTIME_DOCUMENTS ?= 1
system: $(SYSTEM)
$(SYSTEM): runtime/debian-packages.txt runtime/debian-packages-documents.txt scripts/ensure-system.sh
	bash scripts/ensure-system.sh
	if [ "$(RUNTIME_DOCUMENTS)" = 1 ]; then bash scripts/ensure-system.sh runtime/debian-packages-documents.txt; fi
	@mkdir -p $(VENV) && touch $@

# What only the tests need (strace, kernel headers): installed for make test only.
$(TEST_SYSTEM): runtime/test-packages.txt scripts/ensure-system.sh $(SYSTEM)
	bash scripts/ensure-system.sh runtime/test-packages.txt
	@mkdir -p $(VENV) && touch $@

$(STAMP): pyproject.toml constraints.txt $(SYSTEM)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

# Re-resolve every dependency to its newest allowed version, in a scratch venv,
# and write the result to constraints.txt (then run make test and commit it).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	{ sed -n '1,3p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .venv-lock

runtime: $(STAMP)
	$(BIN)/shoal runtime build

clean:
	rm -rf $(VENV) .pytest_cache
