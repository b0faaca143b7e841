# sandman: one entry point per task. `make test` is the README's test command and what CI runs.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-stamp
PYTEST_ARGS ?=

.PHONY: help deps sysdeps lint test test-windows-full testbed-build testbed-up testbed-down \
        testbed-status e2e bench-execd bench-netguard bench-webhook bench-controller clean \
        demo bench-loadtest bench-realnode

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $@

deps: $(STAMP) sysdeps  ## install the venv, pinned PyPI deps and Debian packages the tests need

# REAL_NODE=1: the test bed adds a node that runs real containers (docs/testbed.md "Real node").
# REAL_NODE=auto (what `make test` uses): install and build what it needs where it can run (root).
REAL_NODE ?=
export REAL_NODE

sysdeps:  ## install Debian packages the tests need (iptables, iproute2, bash; REAL_NODE=1: containerd, runc, CNI plugins, ipset, conntrack)
	@$(PY) tools/sysdeps.py

lint: $(STAMP)  ## ruff on the tree; vermin checks execd stays python3.8-compatible
	$(VENV)/bin/ruff check .
	@if [ -f execd/execd.py ]; then $(VENV)/bin/vermin -q --no-tips --violations -t=3.8- execd/execd.py; fi

testbed-build: $(STAMP)  ## build the test-bed binaries into ~/.cache/sandman-testbed (once per version)
	$(VPY) -m testbed build

test: REAL_NODE := $(if $(REAL_NODE),$(REAL_NODE),auto)
test: deps testbed-build lint  ## lint + the whole pytest suite, test-bed tests included
	$(VPY) tools/run_pytest.py $(PYTEST_ARGS)

e2e: REAL_NODE := 1
e2e: deps testbed-build  ## the real-node suite: bed + real node + helm install, tests/e2e, uninstall, teardown
	$(VPY) tools/run_pytest.py tests/e2e $(PYTEST_ARGS)

test-windows-full: deps testbed-build  ## the controller's 25 ownership windows, 20 repeats each
	SANDMAN_WINDOW_REPEATS=20 $(VPY) tools/run_pytest.py tests/controller/test_windows.py $(PYTEST_ARGS)

.PHONY: test-chart chart-golden
test-chart: deps testbed-build  ## the Helm chart: lint, golden renders, schema, install/upgrade/uninstall on the test bed
	$(VPY) tools/run_pytest.py tests/charts $(PYTEST_ARGS)

chart-golden: $(STAMP) testbed-build  ## regenerate the chart's _contract.tpl and golden renders (review the diff)
	$(VPY) charts/gen_contract.py
	$(VPY) charts/gen_dashboard.py
	SANDMAN_GOLDEN_UPDATE=1 $(VPY) -m pytest -q tests/charts/test_chart.py

.PHONY: images images-list
IMAGES ?=
images: $(STAMP)  ## build the real-node images without Docker into ~/.cache (IMAGES="pause" for one)
	$(VPY) -m testbed.images build $(IMAGES)

images-list: $(STAMP)  ## ref, cache state and archive path of each real-node image
	$(VPY) -m testbed.images list

# INSTALL=1 (with REAL_NODE=1): also `helm install --wait` of charts/sandman on the real node
# (testbed/install.py, values testbed/values-realnode.yaml), and how to reach the controller.
INSTALL ?=

testbed-up: deps testbed-build  ## start the test bed in the background; prints the KUBECONFIG export (REAL_NODE=1: plus a real node; INSTALL=1: plus sandman installed on it)
	$(VPY) -m testbed up
	@if [ -n "$(INSTALL)" ] && [ "$(INSTALL)" != 0 ]; then $(VPY) -m testbed.install up; fi

testbed-down: $(STAMP)  ## stop the test bed started by testbed-up; nothing is left running
	@if [ -f .testbed/manual/install/install-nodes.json ]; then $(VPY) -m testbed.install down || true; fi
	$(VPY) -m testbed down

testbed-status: $(STAMP)  ## is the test bed up, and are its components healthy
	$(VPY) -m testbed status

bench-execd: deps  ## execd vs SWE-ReX vs the bare limit (writes figures to stdout)
	$(VPY) -m execd.bench --write-docs

bench-netguard: deps  ## netguard apply + self-verify time in a real network namespace
	$(VPY) -m netguard.bench

bench-webhook: deps testbed-build  ## creates/s through the API server with vs without the webhooks
	$(VPY) -m webhook.bench --update-docs

bench-controller: deps testbed-build  ## ramp to 12,000 sandboxes at 25/s, warm hits, overhead vs bare, acquire p50 with vs without auth
	$(VPY) -m controller.bench --plot docs/bench-controller-ramp.png --out .testbed/bench-controller.md

bench-realnode: REAL_NODE := 1
bench-realnode: deps testbed-build  ## real node: create-to-Ready, acquire-to-first-command, execd echo vs a bare pod (docs/benchmarks.md)
	$(VPY) -m testbed.bench_realnode --update-docs

SHAPE ?= burst64
RAMP_MAX ?= 1000
demo: deps testbed-build  ## one-machine sandman + locust: SHAPE (burst64|two-runs|steady|ramp), then a ramp to RAMP_MAX
	$(VPY) -m loadtest.demo --shape $(SHAPE) --ramp-max $(RAMP_MAX)

bench-loadtest: deps testbed-build  ## the locust ramp to 12,000 at 50 creates/s: the highest step this machine holds
	$(VPY) -m loadtest.demo --shape ramp --ramp-max 12000 --rate 50 --burst 100

clean:  ## remove the venv (the test-bed binary cache stays in ~/.cache)
	rm -rf $(VENV) .pytest_cache .ruff_cache
