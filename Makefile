# hugepool: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# The Rust of rust-toolchain.toml, available before any cargo command runs.
RUST_TOOLCHAIN_CHECK := $(shell bash hack/rust-toolchain.sh >&2; echo $$?)
ifneq ($(RUST_TOOLCHAIN_CHECK),0)
$(error hack/rust-toolchain.sh could not make rust-toolchain.toml's Rust available (above))
endif
CONTROLPLANE_DIR := e2e/controlplane
# CI builds once from a fresh clone: incremental state (3 GB there) would never be reused.
ifeq ($(CI),true)
export CARGO_INCREMENTAL := 0
endif
# The oldest Kubernetes minor the chart admits (Chart.yaml kubeVersion, k8s-openapi's feature).
OLDEST_K8S := 1.33
# The oldest Kubernetes minor DRA pools need (consumable capacity: resource.k8s.io/v1
# with shared devices), and the control-plane tests that use DRA there (cargo test's
# name filters: `_dra_`, not `dra`, which every drain test's name holds).
DRA_K8S := 1.36
DRA_TESTS := _dra_ claim consumption own_nodes_status workload_examples
# Every test that needs only a control plane (no node): the API, the chart on the
# apiserver, the operator, the agent's cluster side, the dashboards on a real scrape.
CONTROLPLANE_TESTS := -p hugepool-e2e --test api --test manifests --test prometheus \
	-p hugepool-operator --test faults --test fleet --test kubectl_hugepool \
	-p hugepool-agent --test cluster

.PHONY: all build test test-hosted test-oldest-k8s test-dra-k8s lint fmt crds manifests controlplane images previous krew release bench bench-fragment bench-usable bench-fleet demo diagrams clean

all: build

build:
	$(CARGO) build --workspace --all-targets

## Everything CI checks: lint, then every test (unit, real kernel, real control plane).
test: lint controlplane images previous
	cd hooks && CGO_ENABLED=0 go test ./...
	bash e2e/with-controlplane.sh $(CARGO) test --workspace --all-targets --no-fail-fast

## The control-plane tests again on the oldest Kubernetes the chart admits (v$(OLDEST_K8S), built
## from $(CONTROLPLANE_DIR)/k8s-$(OLDEST_K8S)); .ci/run runs it after `make test`.
## What a hosted CI runner can run before a release: lint, the unit tests, and the
## control-plane tests (their real-kernel parts skip there: no writable hugetlb sysctls).
## The real-kernel and node tests (e2e/tests/node.rs: a kubelet and containerd on a
## root machine with the hugetlb controller) and the upgrade test run in `make test`
## on the project's own CI (.ci/run).
test-hosted: lint controlplane
	cd hooks && CGO_ENABLED=0 go test ./...
	$(CARGO) test --workspace --lib --bins
	bash e2e/with-controlplane.sh $(CARGO) test $(CONTROLPLANE_TESTS)

test-oldest-k8s:
	bash $(CONTROLPLANE_DIR)/build.sh k8s-$(OLDEST_K8S)
	HUGEPOOL_CONTROLPLANE_BIN=$(CURDIR)/$(CONTROLPLANE_DIR)/bin-$(OLDEST_K8S) \
	  bash e2e/with-controlplane.sh $(CARGO) test $(CONTROLPLANE_TESTS)

## The control-plane tests that use DRA again on the oldest Kubernetes DRA pools need
## (v$(DRA_K8S), built from $(CONTROLPLANE_DIR)/k8s-$(DRA_K8S)); .ci/run runs it after `make test`.
test-dra-k8s:
	bash $(CONTROLPLANE_DIR)/build.sh k8s-$(DRA_K8S)
	HUGEPOOL_CONTROLPLANE_BIN=$(CURDIR)/$(CONTROLPLANE_DIR)/bin-$(DRA_K8S) \
	  bash e2e/with-controlplane.sh $(CARGO) test $(CONTROLPLANE_TESTS) -- $(DRA_TESTS)

# go vet with CGO_ENABLED=0, as build.sh builds: it reuses the build's compiled packages
# (with cgo on it compiled all of Kubernetes again, about 10 min on a cold cache).
lint: controlplane
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@unformatted="$$(gofmt -l $(CONTROLPLANE_DIR)/*.go hooks/*.go)"; \
	  if [[ -n "$$unformatted" ]]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	cd $(CONTROLPLANE_DIR) && CGO_ENABLED=0 go vet ./...
	cd hooks && CGO_ENABLED=0 go vet ./...
	"$$(bash hack/tool.sh actionlint)" .github/workflows/*.yml

fmt:
	$(CARGO) fmt --all
	gofmt -w $(CONTROLPLANE_DIR)/*.go hooks/*.go

## Regenerate the CRD manifests (crds/ and charts/hugepool/crds/) from the Rust types.
crds:
	$(CARGO) run -q -p hugepool-crds --features crdgen --bin crdgen
	bash hack/manifests.sh

## Render deploy/ from the Helm chart (a test fails with this hint when they drift).
manifests:
	bash hack/manifests.sh

## Build the real kube-apiserver + etcd + controller-manager and kubectl (cached).
controlplane:
	bash $(CONTROLPLANE_DIR)/build.sh

## Build the operator, agent and test images as OCI archives in target/images/ (nothing pulled).
images:
	bash hack/images.sh

## The chart and images of an earlier version (hack/previous.sh), for the upgrade test; after
## `images`, whose compiled dependencies it copies.
previous: images
	@bash hack/previous.sh >/dev/null || echo "make previous: no earlier version to upgrade from (above); every other test runs, the upgrade test says what it needs"

## kubectl-hugepool as krew installs it: target/krew/ (archive + manifest from .krew.yaml).
krew:
	bash hack/krew.sh

## A release: multi-arch images and the chart pushed to REGISTRY, signed, SBOMs attested, krew
## archives in target/release/VERSION/ (hack/release.sh says what it needs: VERSION, COSIGN_KEY, ...).
release:
	VERSION=$(VERSION) bash hack/release.sh

## Side-by-side benchmark of the resize engine against one write and fixed steps (real kernel, root); raw JSON and an SVG of write latency in node-agent/bench-results/.
bench:
	HUGEPOOL_BENCH_REPS=$${HUGEPOOL_BENCH_REPS:-7} $(CARGO) bench -p hugepool-agent --bench resize

## What a grow can get, predicted and measured over 12 states of fragmented memory, the engine with and without the free lists (real kernel, root; HUGEPOOL_FRAGMENT_PAGES).
bench-fragment:
	$(CARGO) bench -p hugepool-agent --bench fragment

## A grown pool to a pod using it, DRA against the kubelet restart, side by side on the real node
## (HUGEPOOL_BENCH_REPS, 5 by default): medians printed, runs in target/bench-usable/runs.json.
bench-usable: controlplane images
	HUGEPOOL_BENCH_REPS=$${HUGEPOOL_BENCH_REPS:-5} bash e2e/with-controlplane.sh $(CARGO) test -p hugepool-e2e --test node -- --ignored --exact --nocapture bench_apply_to_usable_dra_against_the_kubelet_restart

## The operator at fleet size: N Nodes on a real control plane, simulated agents (HUGEPOOL_FLEET_NODES); an SVG of each rollout in target/bench-fleet/.
bench-fleet: controlplane
	HUGEPOOL_FLEET_NODES=$${HUGEPOOL_FLEET_NODES:-2000,10000} $(CARGO) bench -p hugepool-operator --bench fleet

## A local control plane, the operator and an agent on this machine's kernel (root).
demo:
	bash e2e/demo.sh

## Render the docs' Graphviz diagrams (docs/images/*.dot -> .svg; Debian's graphviz, installed when missing).
diagrams:
	dot="$$(bash hack/graphviz.sh)"; for source in docs/images/*.dot; do "$$dot" -Tsvg "$$source" -o "$${source%.dot}.svg"; done

clean:
	$(CARGO) clean
	rm -rf $(CONTROLPLANE_DIR)/bin $(CONTROLPLANE_DIR)/bin-*
