# libvirt-executor — run `make help` for the targets.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
# Version, commit and build date (deploy/package/version.sh): stamped into every
# executable (--version) and the package's name.
BUILD_ID := $(shell deploy/package/version.sh 2>/dev/null)
VERSION ?= $(or $(word 1,$(BUILD_ID)),dev)
COMMIT ?= $(word 2,$(BUILD_ID))
BUILD_DATE ?= $(word 3,$(BUILD_ID))
BI := gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo
LDFLAGS := -X $(BI).Version=$(VERSION) -X $(BI).Commit=$(COMMIT) -X $(BI).Date=$(BUILD_DATE)
# The seven executables a host installs are position-independent (-buildmode=pie), as
# Debian builds its own; the package ships them stripped (make package).
# urfave/cli without its man/markdown generators (and their markdown library):
# nothing here uses them, and every stage start paid for their initialisation.
BUILD_TAGS := urfave_cli_no_docs
BIN := bin
PREFIX ?= /usr/local
STAGES := config prepare run cleanup
RIG_DIR ?= /var/lib/libvirt-executor-rig
RIG_NS ?= lve-rig
BENCH_IMAGES ?= tiny
BENCH_RUNS ?= 5
BENCH_CONCURRENCY ?= 2
BENCH_WARM ?= true
BENCH_CACHE_MIB ?= 100
BENCH_CACHE_RUNS ?= 3
BENCH_STEPS_RUNS ?= 3
BENCH_SERVICES_RUNS ?= 3
BENCH_SNAPSHOT_RUNS ?= 3
comma := ,
GO_WANT := $(shell sed -n 's/^go //p' go.mod)

.PHONY: help deps build build-prereqs package release test test-unit test-e2e test-e2e-confined soak lint install demo bench rig-up rig-down images clean

# `build` needs only Go (and the C toolchain and libvirt-dev of the cgo binding), not
# root. The targets below install what they need first (root): when one of them is
# asked for, `build` and its checks come after `deps` (also with make -j).
DEPS_GOALS := deps test test-e2e test-e2e-confined soak demo bench install
ifneq ($(filter $(DEPS_GOALS),$(MAKECMDGOALS)),)
build-prereqs: deps
endif

help: ## show this help
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

deps: ## install what build, lint and the tests need: Debian packages, shellcheck, a verified Go toolchain, golangci-lint (Debian 12, root)
	@deploy/install-deps.sh

build: build-prereqs ## build the four stage executables, the admin tool, the garm provider, the GitHub Actions hook, the guest agent (static), the test harness and the benchmark into bin/ (needs Go: make deps)
	@mkdir -p $(BIN); t0=$$(date +%s); \
	for s in $(STAGES); do $(GO) build -trimpath -buildmode=pie -tags '$(BUILD_TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/libvirt-executor-$$s ./cmd/$$s || exit 1; done; \
	$(GO) build -trimpath -buildmode=pie -tags '$(BUILD_TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/libvirt-executor ./cmd/admin || exit 1; \
	$(GO) build -trimpath -buildmode=pie -tags '$(BUILD_TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/libvirt-executor-garm ./cmd/garm || exit 1; \
	$(GO) build -trimpath -buildmode=pie -tags '$(BUILD_TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/libvirt-executor-hooks ./cmd/hooks || exit 1; \
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS) -s -w' -o $(BIN)/lve-agent ./cmd/lve-agent || exit 1; \
	$(GO) build -trimpath -o $(BIN)/lve-harness ./cmd/lve-harness || exit 1; \
	$(GO) build -trimpath -o $(BIN)/lve-bench ./cmd/lve-bench || exit 1; \
	$(GO) build -trimpath -o $(BIN)/lve-panels ./cmd/lve-panels || exit 1; \
	echo "build: libvirt-executor $(VERSION) and the test tools into $(BIN)/ in $$(( $$(date +%s) - t0 )) s"

# Go of the version go.mod names (on PATH or in /usr/local/go), gcc and libvirt-dev.
build-prereqs:
	@v=$$($(GO) env GOVERSION 2>/dev/null) || v=; v=$${v#go}; \
	if [ -z "$$v" ] || [ "$$(printf '%s\n%s\n' '$(GO_WANT)' "$$v" | sort -V | head -n1)" != '$(GO_WANT)' ]; then \
	  echo "make build needs Go $(GO_WANT) or newer on PATH or in /usr/local/go (found: $${v:-none usable}): run 'make deps' as root" >&2; exit 1; \
	fi; \
	if ! command -v gcc >/dev/null || ! pkg-config --exists libvirt 2>/dev/null; then \
	  echo "make build needs gcc, pkg-config and libvirt-dev (the cgo libvirt binding): run 'make deps' as root" >&2; exit 1; \
	fi

test: deps build ## all tests: unit tests, then end-to-end tests on real VMs (root; installs what it needs, starts and stops a private libvirt)
	@$(MAKE) --no-print-directory test-unit REQUIRE_PROMETHEUS=1 REQUIRE_PACKAGE_TOOLS=1
	@$(MAKE) --no-print-directory test-e2e

# 1 under make test (after make deps installed it): the promtool and Prometheus
# checks of deploy/prometheus and the dashboard fail instead of skipping.
REQUIRE_PROMETHEUS ?=
# 1 under make test: the package tests (internal/packaging: dpkg-deb, rpm's query
# tools, shellcheck of the .rpm's scriptlets) fail instead of skipping.
REQUIRE_PACKAGE_TOOLS ?=

# The gitlab-runner of the real-runner tests (empty: those tests skip; see deploy/rig/test-runner.sh).
TEST_RUNNER = $$(deploy/rig/test-runner.sh $(BIN))
# The step-runner of the GitLab Steps tests, on the guests' tools disk (empty: none).
TEST_STEP_RUNNER = $$(deploy/rig/test-tool.sh step-runner $(BIN))

test-unit: ## unit tests (race detector, no VMs; the fake job API's tests with a real gitlab-runner when there is one)
	@mkdir -p $(BIN)
	runner=$(TEST_RUNNER) && steprunner=$(TEST_STEP_RUNNER) && LVE_E2E_GITLAB_RUNNER=$$runner LVE_E2E_STEP_RUNNER=$$steprunner LVE_REQUIRE_PROMETHEUS=$(REQUIRE_PROMETHEUS) LVE_REQUIRE_PACKAGE_TOOLS=$(REQUIRE_PACKAGE_TOOLS) $(GO) test -race -count=1 ./...

test-e2e: deps build ## end-to-end tests on real VMs in the private rig (root; installs what it needs; tiny, Debian systemd, cloud-init and podman guests)
	@runner=$(TEST_RUNNER) && steprunner=$(TEST_STEP_RUNNER) && LVE_RIG_GITLAB_RUNNER=$$runner LVE_RIG_STEP_RUNNER=$$steprunner LVE_RIG_IMAGES=tiny,debian,cloud,podman deploy/rig/start.sh
	@set -o pipefail; rc=0; runner=$(TEST_RUNNER) || exit 1; steprunner=$(TEST_STEP_RUNNER) || exit 1; \
	  ip netns exec $(RIG_NS) env LVE_E2E_CONFIG=$(RIG_DIR)/config.toml LVE_E2E_BIN=$(CURDIR)/$(BIN) LVE_E2E_REQUIRED=1 LVE_E2E_IMAGES=debian,cloud LVE_E2E_ALLOW_LIBVIRTD_RESTART=1 LVE_E2E_GITLAB_RUNNER=$$runner LVE_E2E_STEP_RUNNER=$$steprunner \
	    $(GO) test -tags e2e -count=1 -timeout 55m -v ./test/e2e/ 2>&1 | tee $(BIN)/e2e.log || rc=$$?; \
	  deploy/rig/stop.sh; exit $$rc

E2E_RUNNER_USER ?= lve-e2e-runner

test-e2e-confined: ## test-e2e with every driver executable run as a polkit-confined runner user (LVE_E2E_RUNNER_USER, made and kept; docs/security.md)
	@LVE_E2E_RUNNER_USER=$(E2E_RUNNER_USER) $(MAKE) --no-print-directory test-e2e

SOAK_ROUNDS ?= 1
SOAK_JOBS ?= 1000
SOAK_AT_ONCE ?= 3
soak: deps build ## a thousand faulted jobs on real VMs, unattended (root; installs what it needs; not in CI; SOAK_ROUNDS=1 rounds of the fault suite, whose TestFaultRandomJobs runs SOAK_JOBS=1000 jobs, SOAK_AT_ONCE=3 at a time, each faulted once at random: 1 h 34 min to 1 h 53 min on 2 cores (TCG), from a bare machine; cumulative figures every 25 jobs and after every round, and in $(BIN)/soak-figures.json)
	@deploy/rig/start.sh
	@set -o pipefail; rc=0; rm -f $(BIN)/soak-figures.json; \
	  ip netns exec $(RIG_NS) env LVE_E2E_CONFIG=$(RIG_DIR)/config.toml LVE_E2E_BIN=$(CURDIR)/$(BIN) LVE_E2E_REQUIRED=1 LVE_E2E_ALLOW_LIBVIRTD_RESTART=1 \
	    LVE_E2E_FIGURES=$(CURDIR)/$(BIN)/soak-figures.json LVE_E2E_RANDOM_JOBS=$(SOAK_JOBS) LVE_E2E_RANDOM_AT_ONCE=$(SOAK_AT_ONCE) \
	    $(GO) test -tags e2e -v -count=$(SOAK_ROUNDS) -timeout 0 -run 'TestFault' ./test/e2e/ 2>&1 | tee $(BIN)/soak.log | grep -E '^(--- FAIL|FAIL|ok)|fault suite figures|faulted jobs|leaks found|exit class correct|dead-guest detection|  rounds: |figures file|random faulted jobs in|seed [0-9]' || rc=$$?; \
	  deploy/rig/stop.sh; exit $$rc

demo: deps build ## run a sample job end to end on a real VM, cold, then again warm from a standby pool (root; installs what it needs)
	@runner=$(TEST_RUNNER) && LVE_RIG_GITLAB_RUNNER=$$runner deploy/rig/start.sh
	@rc=0; ip netns exec $(RIG_NS) $(BIN)/lve-harness demo --warm --config $(RIG_DIR)/config.toml --bin $(CURDIR)/$(BIN) --git-port 20080 || rc=$$?; \
	  deploy/rig/stop.sh; exit $$rc

bench: deps build ## benchmark jobs on real VMs against the guest's own boot, cold and warm (root; installs what it needs; BENCH_IMAGES="tiny debian", BENCH_RUNS, BENCH_CONCURRENCY, BENCH_WARM=false skips the warm round, BENCH_DIRECT=N jobs with a connection per stage beside the connection holder's and BENCH_WRAPPER=N jobs through the holder without the guest agent (each default BENCH_RUNS, 0 skips); then a cache of BENCH_CACHE_MIB (100; 0 skips) MiB kept by the runner's distributed cache and by the host cache, BENCH_CACHE_RUNS rounds; then BENCH_STEPS_RUNS (3; 0 skips) no-op run: jobs (GitLab Steps, shim mode) beside no-op script: jobs; then BENCH_SERVICES_RUNS (3; 0 skips) jobs on the podman image with and without one service and as container jobs, cold and warm; then BENCH_SNAPSHOT_RUNS (3; 0 skips) tiny and Debian jobs from the image's memory snapshot against its cold boot and a warm claim, four at once, where a restore's time goes and what a snapshot holds against an idle standby; leaves the rig up: make rig-down)
	@runner=$(TEST_RUNNER) && steprunner=$(TEST_STEP_RUNNER) && LVE_RIG_GITLAB_RUNNER=$$runner LVE_RIG_STEP_RUNNER=$$steprunner LVE_RIG_IMAGES="$(BENCH_IMAGES)$(if $(filter-out 0,$(BENCH_SERVICES_RUNS)), podman)$(if $(filter-out 0,$(BENCH_SNAPSHOT_RUNS)), tiny debian)" deploy/rig/start.sh
	ip netns exec $(RIG_NS) $(BIN)/lve-bench --config $(RIG_DIR)/config.toml --bin $(CURDIR)/$(BIN) \
	  $(foreach img,$(subst $(comma), ,$(BENCH_IMAGES)),--image $(img)) \
	  --runs $(BENCH_RUNS) $(if $(BENCH_DIRECT),--direct-runs $(BENCH_DIRECT)) $(if $(BENCH_WRAPPER),--wrapper-runs $(BENCH_WRAPPER)) --concurrency $(BENCH_CONCURRENCY) --warm=$(BENCH_WARM) --json $(BIN)/bench.json
	@runner=$(TEST_RUNNER); if [ "$(BENCH_CACHE_MIB)" != 0 ] && [ -n "$$runner" ]; then \
	  ip netns exec $(RIG_NS) $(BIN)/lve-bench cache --config $(RIG_DIR)/config.toml --bin $(CURDIR)/$(BIN) --runner "$$runner" \
	    --listen "$$(. deploy/rig/env.sh && echo $$LVE_RIG_GATEWAY):20999" --mib $(BENCH_CACHE_MIB) --runs $(BENCH_CACHE_RUNS) --json $(BIN)/bench-cache.json; \
	else echo "[bench] cache round skipped (BENCH_CACHE_MIB=0, or no gitlab-runner for the tests)"; fi
	@runner=$(TEST_RUNNER); steprunner=$(TEST_STEP_RUNNER); if [ "$(BENCH_STEPS_RUNS)" != 0 ] && [ -n "$$runner" ] && [ -n "$$steprunner" ]; then \
	  ip netns exec $(RIG_NS) $(BIN)/lve-bench steps --config $(RIG_DIR)/config.toml --bin $(CURDIR)/$(BIN) --runner "$$runner" \
	    --runs $(BENCH_STEPS_RUNS) --json $(BIN)/bench-steps.json; \
	else echo "[bench] steps round skipped (BENCH_STEPS_RUNS=0, or no gitlab-runner or step-runner for the tests)"; fi
	@runner=$(TEST_RUNNER); if [ "$(BENCH_SERVICES_RUNS)" != 0 ] && [ -n "$$runner" ]; then \
	  ip netns exec $(RIG_NS) env LVE_E2E_CONFIG=$(RIG_DIR)/config.toml LVE_E2E_BIN=$(CURDIR)/$(BIN) LVE_E2E_REQUIRED=1 LVE_E2E_GITLAB_RUNNER=$$runner \
	    LVE_BENCH_SERVICES_RUNS=$(BENCH_SERVICES_RUNS) LVE_BENCH_SERVICES_OUT=$(CURDIR)/$(BIN)/bench-services.txt LVE_BENCH_SERVICES_JSON=$(CURDIR)/$(BIN)/bench-services.json \
	    $(GO) test -tags 'e2e bench' -count=1 -timeout 40m -run '^TestBenchServices$$' ./test/e2e/ >$(BIN)/bench-services.log 2>&1 \
	    && cat $(BIN)/bench-services.txt || { tail -50 $(BIN)/bench-services.log; exit 1; }; \
	else echo "[bench] services round skipped (BENCH_SERVICES_RUNS=0, or no gitlab-runner for the tests)"; fi
	@runner=$(TEST_RUNNER); if [ "$(BENCH_SNAPSHOT_RUNS)" != 0 ] && [ -n "$$runner" ]; then \
	  ip netns exec $(RIG_NS) env LVE_E2E_CONFIG=$(RIG_DIR)/config.toml LVE_E2E_BIN=$(CURDIR)/$(BIN) LVE_E2E_REQUIRED=1 LVE_E2E_GITLAB_RUNNER=$$runner \
	    LVE_BENCH_SNAPSHOT_RUNS=$(BENCH_SNAPSHOT_RUNS) LVE_BENCH_SNAPSHOT_OUT=$(CURDIR)/$(BIN)/bench-snapshot.txt LVE_BENCH_SNAPSHOT_JSON=$(CURDIR)/$(BIN)/bench-snapshot.json \
	    $(GO) test -tags 'e2e bench' -count=1 -timeout 40m -run '^TestBenchSnapshot$$' ./test/e2e/ >$(BIN)/bench-snapshot.log 2>&1 \
	    && cat $(BIN)/bench-snapshot.txt || { tail -50 $(BIN)/bench-snapshot.log; exit 1; }; \
	else echo "[bench] snapshot round skipped (BENCH_SNAPSHOT_RUNS=0, or no gitlab-runner for the tests)"; fi

rig-up: ## start the private libvirt rig (network namespace, libvirtd, network, pool, images)
	@deploy/rig/start.sh

rig-down: ## stop the private libvirt rig
	@deploy/rig/stop.sh

images: ## build (or reuse cached) test guest images
	@deploy/images/build.sh tiny

lint: ## gofmt, go vet, golangci-lint (.golangci.yml) and shellcheck over the shell scripts in deploy/ and .ci/ (needs make deps)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@# no binary or build output in git: a tracked file over 1 MiB fails, test fixtures (testdata/) aside
	@big=$$(git ls-files -z | grep -zv '/testdata/' | xargs -0 -r stat -c '%s %n' 2>/dev/null | awk '$$1 > 1048576 {print $$2 " (" $$1 " bytes)"}'); \
	  if [ -n "$$big" ]; then echo "tracked files over 1 MiB (build outputs belong in bin/, ignored):"; echo "$$big"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags e2e ./test/e2e/
	$(GO) vet -tags "e2e bench" ./test/e2e/
	@command -v golangci-lint >/dev/null || { echo "make lint needs golangci-lint: run 'make deps' as root" >&2; exit 1; }
	golangci-lint run ./...
	@command -v shellcheck >/dev/null || { echo "make lint needs shellcheck: run 'make deps' as root" >&2; exit 1; }
	@# *.sh files and files starting with a sh/bash/dash shebang
	@files=$$(find deploy .ci -type f | LC_ALL=C sort | while read -r f; do \
	  case $$f in *.sh) echo "$$f" ;; *) if head -n1 "$$f" | grep -qE '^#! */(usr/)?bin/(env +)?(ba|da)?sh( |$$)'; then echo "$$f"; fi ;; esac; \
	done); \
	echo "shellcheck -x" $$files; \
	printf '%s\n' "$$files" | xargs -d '\n' shellcheck -x -P SCRIPTDIR

install: deps build ## install the stage executables and the admin tool into $(PREFIX)/bin, the guest agent and the GitHub runner's hook script into $(PREFIX)/lib/libvirt-executor, the image recipes into $(PREFIX)/share/libvirt-executor/images and the systemd units into /etc/systemd/system, enabling none (root; installs what it needs)
	@for s in $(STAGES); do install -m 0755 $(BIN)/libvirt-executor-$$s $(PREFIX)/bin/; done
	@install -m 0755 $(BIN)/libvirt-executor $(BIN)/libvirt-executor-garm $(BIN)/libvirt-executor-hooks $(PREFIX)/bin/
	@install -d -m 0755 $(PREFIX)/lib/libvirt-executor && install -m 0755 $(BIN)/lve-agent $(PREFIX)/lib/libvirt-executor/
	@# the GitHub runner's container hook (ACTIONS_RUNNER_CONTAINER_HOOKS), naming this prefix's libvirt-executor-hooks
	@sed 's|/usr/bin/libvirt-executor-hooks|$(PREFIX)/bin/libvirt-executor-hooks|' deploy/github-hooks/container-hook.sh > $(BIN)/github-container-hook.sh && install -m 0755 $(BIN)/github-container-hook.sh $(PREFIX)/lib/libvirt-executor/
	@# the image recipes, where libvirt-executor image build finds them (../share/libvirt-executor/images)
	@rm -rf $(PREFIX)/share/libvirt-executor/images && install -d -m 0755 $(PREFIX)/share/libvirt-executor && cp -r deploy/images $(PREFIX)/share/libvirt-executor/images
	@install -d -m 0755 /etc/libvirt-executor
	@[ -e /etc/libvirt-executor/config.toml ] || install -m 0640 deploy/config.example.toml /etc/libvirt-executor/config.toml
	@# the units name /usr/local/bin: point them at $(PREFIX)/bin
	@install -d -m 0755 /etc/systemd/system
	@for u in libvirt-executor.service libvirt-executor-gc.service libvirt-executor-gc.timer; do \
	  sed 's|/usr/local/bin/|$(PREFIX)/bin/|g' deploy/systemd/$$u > $(BIN)/$$u && install -m 0644 $(BIN)/$$u /etc/systemd/system/$$u || exit 1; \
	done
	@echo "installed into $(PREFIX)/bin and /etc/systemd/system; edit /etc/libvirt-executor/config.toml, then:"
	@echo "  systemctl daemon-reload"
	@echo "  systemctl enable --now libvirt-executor-gc.timer     # sweep leftovers"
	@echo "  systemctl enable --now libvirt-executor.service      # standby pools (images with [images.NAME.pool]; docs/pool.md)"
	@echo "  systemctl try-restart libvirt-executor.service       # after an upgrade, if it runs"

package: build ## build the Debian package bin/libvirt-executor_VERSION_amd64.deb (executables, units, example configuration, guard hook, docs; not root; docs/install.md)
	@deb=$$(deploy/package/build.sh --version '$(VERSION)' $(BIN)) && echo "package: $$deb"

release: ## from a clean tree: the .deb, the .rpm (one description, internal/packaging), SHA256SUMS and the version's CHANGELOG.md entry into bin/release/VERSION/ (not root; docs/install.md)
	@deploy/package/release.sh

clean: ## remove build output
	rm -rf $(BIN)
