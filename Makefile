# sandman: one entry point per task. `make test` is the README's test command and what CI runs.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-stamp
PYTEST_ARGS ?=

.PHONY: help deps sysdeps gotoolchain kubeconform helm helm-docs jaeger lock kind-up kind-down lint check test test-windows-full demo-grading testbed-build testbed-up testbed-down \
        testbed-status e2e bench-execd bench-swerex bench-minisweagent bench-reuse bench-netguard bench-webhook bench-controller clean \
        frameworks-venv swerex-tests demo bench-loadtest bench-realnode bench-trees bench-replay bench-group bench-fork bench-warmburst

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# Go for the test bed's builds: a `go` >= 1.26 on PATH, else the toolchain `make deps` fetched
# from the Go module proxy into the cache (tools/gotoolchain.py).
export PATH := $(or $(SANDMAN_TESTBED_CACHE),$(HOME)/.cache/sandman-testbed)/go-toolchain/bin:$(PATH)

PIP := $(VPY) -m pip --disable-pip-version-check
# Every PyPI package at its locked version, hash-checked (tools/lock.py); then the two
# distributions of this tree, editable, adding nothing (--no-deps) and building without
# isolation (the isolated build's setuptools would be unlocked).
$(STAMP): pyproject.toml client/pyproject.toml requirements-dev.lock
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install --quiet --require-hashes --no-deps -r requirements-dev.lock
	$(PIP) install --quiet --no-deps --no-build-isolation -e ./client -e .
	$(PIP) check
	@touch $@

deps: $(STAMP) frameworks-venv swerex-tests sysdeps gotoolchain kubeconform helm helm-docs jaeger  ## install the venv (locked PyPI deps), the frameworks' 3.12 venv, SWE-ReX's own tests, Debian packages the tests need, Go when missing, kubeconform, helm, helm-docs, Jaeger

# Harbor needs Python >= 3.12, newer than the dev venv's: its tests drive it from .venv-frameworks
# (requirements-frameworks.lock, hash-checked, and ./client editable; the machine's 3.12).
frameworks-venv: $(STAMP)  ## the Python 3.12 venv of the framework tests (Harbor): tools/frameworks_venv.py
	$(VPY) tools/frameworks_venv.py

# SWE-ReX's runtime tests ship in its sdist only: fetched hash-checked by pip download (the lock's
# hashes) into the bed's cache, where tests/controller/test_swerex_upstream.py finds them.
swerex-tests: $(STAMP)  ## SWE-ReX's own runtime tests from its locked sdist into ~/.cache/sandman-testbed: tools/swerex_tests.py
	$(VPY) tools/swerex_tests.py

gotoolchain:  ## Go >= 1.26 for the test-bed builds: the one on PATH, else fetched from the Go module proxy
	@$(PY) tools/gotoolchain.py

kubeconform: $(STAMP) gotoolchain  ## kubeconform and the test bed's Kubernetes JSON schemas into ~/.cache/sandman-testbed (chart checks)
	$(VPY) tools/kubeconform.py

helm: $(STAMP) gotoolchain  ## the test bed's helm into ~/.cache/sandman-testbed (the chart checks of make check)
	$(VPY) -m testbed build --only helm

helm-docs: $(STAMP) gotoolchain  ## helm-docs (pinned in tools/helm_docs.py) from the Go module proxy into ~/.cache/sandman-testbed (the chart README)
	$(VPY) tools/helm_docs.py

jaeger: $(STAMP) gotoolchain  ## Jaeger v2 (pinned in tools/jaeger.py), built from the Go module proxy into ~/.cache/sandman-testbed: the OTLP receiver of the trace tests
	$(VPY) tools/jaeger.py

lock: $(STAMP)  ## regenerate requirements*.lock from the pyprojects (needs PyPI); commit them
	$(VPY) tools/lock.py

# REAL_NODE=1: the test bed adds a node that runs real containers (docs/testbed.md "Real node").
# REAL_NODE=auto (what `make test` uses): install and build what it needs where it can run (root).
REAL_NODE ?=
export REAL_NODE

sysdeps:  ## install Debian packages the tests need (iptables, iproute2, bash; REAL_NODE=1: containerd, runc, CNI plugins, ipset, conntrack)
	@$(PY) tools/sysdeps.py

lint: $(STAMP)  ## ruff on the tree; vermin: execd stays python3.8-compatible, the client distribution 3.9; mypy --strict on the client distribution, mypy on the server's packages
	$(VENV)/bin/ruff check .
	@if [ -d execd ]; then $(VENV)/bin/vermin -q --no-tips --violations -t=3.8- execd; fi
	$(VENV)/bin/vermin -q --no-tips --violations -t=3.9- sandman/client sandman/api.py sandman/execd_api.py sandman/contract.py sandman/egress.py sandman/quantity.py sandman/tracing.py sandman/_version.py
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --python-version 3.10 sandman/client/swerex.py sandman/client/minisweagent.py
	$(VENV)/bin/mypy --python-version 3.12 sandman/client/harbor.py sandman/client/nemo_gym.py
	$(VENV)/bin/mypy --config-file tools/mypy_server.ini

# The fast tier (docs/testbed.md "Test tiers"): every test that needs no test bed (neither its
# control plane nor its binaries) and no root, and is not `slow` (seconds each: `make test` runs
# those beside the beds), in CHECK_WORKERS pytest-xdist workers (more than the 2 cores: about
# half of the tier's time is tests waiting, which other workers fill).
CHECK_MARKERS := not testbed and not realnode and not netns and not e2e and not slow
CHECK_WORKERS := 4
check: lint frameworks-venv  ## lint + every test that needs no test bed and no root (a few minutes on 2 cores)
	$(VPY) tools/run_pytest.py -m "$(CHECK_MARKERS)" -n $(CHECK_WORKERS) $(PYTEST_ARGS)

testbed-build: $(STAMP) gotoolchain  ## build the test-bed binaries into ~/.cache/sandman-testbed (once per version)
	$(VPY) -m testbed build

test: REAL_NODE := $(if $(REAL_NODE),$(REAL_NODE),auto)
# SANDMAN_NO_SKIPS=1: a skipped test fails the run unless tests/conftest.py's ALLOWED_SKIPS lists it.
# The suite in three phases (tools/run_pytest.py): check on CHECK_WORKERS workers; the kwok bed's and the
# real node's sessions side by side, and the slow tests that need no bed beside them; the timing tests alone.
test: deps testbed-build lint  ## lint + the whole pytest suite, test-bed tests included; a skip fails it
	SANDMAN_NO_SKIPS=1 $(VPY) tools/run_pytest.py --phased $(PYTEST_ARGS)

e2e: REAL_NODE := 1
e2e: deps testbed-build  ## the real-node suite: bed + real node + helm install, tests/e2e, uninstall, teardown
	SANDMAN_NO_SKIPS=1 $(VPY) tools/run_pytest.py tests/e2e $(PYTEST_ARGS)

demo-grading: REAL_NODE := 1
demo-grading: deps testbed-build  ## the grading demo on the real node (docs/grading.md): bed + helm install + tests/e2e/test_grading_demo.py + teardown
	$(VPY) tools/run_pytest.py tests/e2e/test_grading_demo.py $(PYTEST_ARGS)

test-windows-full: deps testbed-build  ## the controller's 25 ownership windows, 20 repeats each
	SANDMAN_WINDOW_REPEATS=20 $(VPY) tools/run_pytest.py tests/controller/test_windows.py $(PYTEST_ARGS)

# The chart's admission on another Kubernetes minor (docs/install.md "Kubernetes versions"): a kwok
# bed on K8S (a minor pinned in testbed/versions.py, its control plane built once into its own
# cache folder), the chart installed, every admission golden and hostile case through the policy
# with the webhook down and through the webhook with it up. Not in `make test`: CI keeps one
# version. Under the machine's bed lock: one bed at a time.
.PHONY: test-compat
test-compat: $(STAMP) gotoolchain  ## the chart's admission on Kubernetes K8S=1.xx (testbed/versions.py): policy alone, then webhook
	@test -n "$(K8S)" || { echo "make test-compat: set K8S=1.xx (testbed/versions.py KUBERNETES_MINORS)" >&2; exit 2; }
	SANDMAN_K8S=$(K8S) $(VPY) -m testbed build
	SANDMAN_COMPAT=1 SANDMAN_K8S=$(K8S) flock /tmp/sandman-bed.lock $(VPY) tools/run_pytest.py tests/compat $(PYTEST_ARGS)

.PHONY: test-chart chart-golden chart-docs
test-chart: deps testbed-build  ## the Helm chart: lint, golden renders, schema, install/upgrade/uninstall on the test bed
	$(VPY) tools/run_pytest.py tests/charts $(PYTEST_ARGS)

chart-golden: $(STAMP) testbed-build  ## regenerate the chart's _contract.tpl and golden renders (review the diff)
	$(VPY) charts/gen_contract.py
	$(VPY) charts/gen_dashboard.py
	SANDMAN_GOLDEN_UPDATE=1 $(VPY) -m pytest -q tests/charts/test_chart.py

chart-docs: $(STAMP) helm-docs  ## regenerate values.schema.json's descriptions and charts/sandman/README.md from values.yaml's `# --` comments
	$(VPY) charts/gen_schema.py
	$(VPY) tools/helm_docs.py readme

.PHONY: images images-list
IMAGES ?=
images: $(STAMP)  ## build the real-node images without Docker into ~/.cache (IMAGES="pause" for one)
	$(VPY) -m testbed.images build $(IMAGES)

images-list: $(STAMP)  ## ref, cache state and archive path of each real-node image
	$(VPY) -m testbed.images list

# A release users install by name (docs/install.md "Install a release"; docs/testbed.md
# "Releasing"): the images as `make images` builds them, pushed to REGISTRY, and the chart
# pinned to their digests, pushed to oci://REGISTRY/charts. The version is sandman/_version.py's.
# PLAIN_HTTP=1: a registry without TLS (a local one). ALLOW_DIRTY=1: uncommitted changes of
# the image's sources or the chart ship too (refused otherwise).
.PHONY: release
REGISTRY ?=
PLAIN_HTTP ?=
ALLOW_DIRTY ?=
release: $(STAMP) helm  ## push the sandman image and the chart pinned to its digest to REGISTRY=host/prefix (tools/release.py)
	$(VPY) tools/release.py --registry "$(REGISTRY)" $(if $(filter-out 0,$(PLAIN_HTTP)),--plain-http) $(if $(filter-out 0,$(ALLOW_DIRTY)),--allow-dirty)

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

bench-execd: deps  ## execd vs SWE-ReX vs the bare limit (docs/benchmarks.md)
	$(VPY) -m bench.execd --write-docs

bench-trees: deps  ## whole trees as one tar vs one request per file: 1,000 small files, one 50 MiB file (docs/benchmarks.md)
	$(VPY) -m bench.trees --write-docs

bench-swerex: deps  ## a SWE-ReX echo action: sandman's adapter vs SWE-ReX's LocalRuntime (writes docs/benchmarks.md)
	$(VPY) -m bench.swerex --write-docs

bench-minisweagent: deps  ## a mini-swe-agent step: sandman's environment vs mini-swe-agent's LocalEnvironment (writes docs/benchmarks.md on a quiet machine)
	$(VPY) -m bench.minisweagent --write-docs

bench-reuse: deps testbed-build  ## execd /diff, /restore vs git status (10k-file repo + venv); reused vs fresh grading pod; BEFORE=rev adds that revision's execd, interleaved
	$(VPY) -m bench.reuse --write-docs $(if $(BEFORE),--before $(BEFORE))

bench-netguard: deps  ## netguard apply + self-verify time in a real network namespace (docs/benchmarks.md)
	$(VPY) -m bench.netguard --write-docs

bench-webhook: deps testbed-build  ## creates/s through the API server with vs without the webhooks
	$(VPY) -m bench.webhook --write-docs

bench-controller: deps testbed-build  ## ramp to 12,000 sandboxes at 25/s, warm hits, overhead vs bare, acquire p50 with vs without auth
	$(VPY) -m bench.controller --write-docs --plot docs/bench-controller-ramp.png --out .testbed/bench-controller.md

bench-replay: deps  ## warm-pool policies (none, fixed 2 per key, demand-sized) replayed in virtual time through the real controller code
	$(VPY) -m bench.replay --write-docs

bench-realnode: REAL_NODE := 1
bench-realnode: deps testbed-build  ## real node: create-to-Ready, acquire-to-first-command, execd echo vs a bare pod (docs/benchmarks.md)
	$(VPY) -m bench.realnode --write-docs

bench-fork: deps testbed-build  ## fork to 8 from a warm pool vs a warm acquire + the delta's upload; restore of 64 vs 64 fresh acquires (REAL_NODE=1: the real node too)
	$(VPY) -m bench.fork --write-docs

bench-group: deps testbed-build  ## one group acquire of N vs N parallel acquires: calls, time to the last sandbox, pacing
	$(VPY) -m bench.group --write-docs

bench-warmburst: deps testbed-build  ## warm acquires as agent-sandbox publishes them: 300 at once, 45/s for 60 s (docs/benchmarks.md)
	$(VPY) -m bench.warmburst --write-docs

SHAPE ?= burst64
RAMP_MAX ?= 1000
demo: deps testbed-build  ## one-machine sandman + locust: SHAPE (burst64|two-runs|steady|ramp), then a ramp to RAMP_MAX
	$(VPY) -m testbed.demo --shape $(SHAPE) --ramp-max $(RAMP_MAX)

bench-loadtest: deps testbed-build  ## the locust ramp to 12,000 at 50 creates/s: the highest step this machine holds (docs/benchmarks.md)
	$(VPY) -m bench.loadtest --write-docs

# Users with Docker only: our machines have no Docker engine, and there it stops at once with
# one line (testbed/kind_up.py).
kind-up: $(STAMP)  ## with Docker: kind cluster, docker build + kind load, helm install --wait, helm test
	$(VPY) -m testbed.kind_up

kind-down: $(STAMP)  ## delete the kind cluster of kind-up
	$(VPY) -m testbed.kind_up --down

clean:  ## remove the venvs (the test-bed binary cache stays in ~/.cache)
	rm -rf $(VENV) .venv-frameworks .pytest_cache .ruff_cache .mypy_cache
