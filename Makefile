# The one entry point for building, testing and running the driver.
# `make help` lists the targets.

CARGO ?= cargo
GO ?= go
TOOLS := $(CURDIR)/.tools
# helm, built from its Go module (no release download needed); kept in .tools/.
HELM_VERSION ?= v3.22.0
HELM := $(TOOLS)/bin/helm

.PHONY: help build release unit test lint fmt fuzz bench bench-check generate chart-package chart-check cdi-check e2e e2e-build e2e-bins e2e-tools e2e-runtime e2e-node-tools e2e-image e2e-kubectl e2e-specs e2e-1.34 e2e-1.34-tools e2e-1.35 e2e-1.35-tools e2e-1.36 e2e-1.36-tools demo demo-helm bench-e2e bench-topology bench-mps advise-demo toolkit image-rootfs image-rootfs-arm64 image image-push image-digest image-tool image-arm64-run image-cross-deps kubectl-plugin selftest-bundle selftest-check

help: ## list targets
	@grep -E '^[a-z0-9.-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | sort

build: ## debug build of every crate
	$(CARGO) build --workspace --all-targets

release: ## release build of the binaries and the simulator
	$(CARGO) build --release --workspace

# kubectl runs `kubectl gpu-dra ...` as the executable `kubectl-gpu_dra` on its PATH (a dash in
# a plugin's command is an underscore in its file name): the gpu-dra binary under that name.
KUBECTL_PLUGIN_DIR ?= $(HOME)/.local/bin
kubectl-plugin: ## install gpu-dra as the kubectl plugin `kubectl gpu-dra` into KUBECTL_PLUGIN_DIR (~/.local/bin)
	$(CARGO) build --release --locked -p gpu-dra-cli --bin gpu-dra
	install -D -m 0755 target/release/gpu-dra $(KUBECTL_PLUGIN_DIR)/kubectl-gpu_dra

lint: ## rustfmt check and clippy with warnings as errors
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

unit: lint ## the quick loop: lint, then every Rust test
	$(CARGO) test --workspace --locked

test: unit bench-check chart-check cdi-check selftest-check image-arm64-run e2e ## everything CI checks: lint, Rust tests, benchmarks once, the Helm chart and its package, our CDI specs against the toolkit, the node self-test on every simulated profile, the image for amd64 and arm64 (arm64 run under qemu-user), the e2e suite on that image

# --- e2e: a real control plane in one Go process (e2e/), simulated GPU nodes ---
E2E_TIMEOUT ?= 70m
# Tests that call t.Parallel (the examples' units) at once per package: they wait on kubelets,
# containerd and the API far more than they compute, and go test's default is GOMAXPROCS (2 here).
E2E_PARALLEL ?= 4
# The root filesystem every e2e container runs on (no registry is reachable to pull images).
TEST_IMAGE := $(TOOLS)/test-image
E2E_ENV = E2E_REPO_ROOT=$(CURDIR) E2E_BIN_DIR=$(CURDIR)/target/debug E2E_TEST_IMAGE=$(TEST_IMAGE)/rootfs E2E_IMAGE_LAYOUT=$(IMAGE_LAYOUT)

e2e-tools: $(HELM) ## helm from the Go module proxy into .tools/bin (e2e and demo install the chart with it)

e2e-kubectl: ## kubectl of the pinned Kubernetes release into .tools/bin (e2e runs the README's kubectl commands with it)
	cd e2e && v=$$($(GO) list -m -f '{{.Version}}' k8s.io/kubernetes) && $(K8S_VERSION_FLAGS) && \
		GOBIN=$(TOOLS)/bin $(GO) install -ldflags "$$flags" k8s.io/kubernetes/cmd/kubectl

e2e-build: ## compile the e2e harness, demo, benchmark and tests without running them
	cd e2e && $(GO) build ./... && $(GO) test -count=1 -run '^$$' ./... >/dev/null

e2e-bins: ## the binaries e2e runs: node plugin, webhook, simulator
	$(CARGO) build --workspace --locked

e2e-runtime: ## runc, a static busybox, the CNI plugins and iptables (Debian packages), installed when missing: e2e runs containers
	@if ! command -v runc >/dev/null || ! busybox --list >/dev/null 2>&1 || ldd "$$(command -v busybox)" >/dev/null 2>&1; then \
		apt-get update && apt-get install -y --no-install-recommends runc busybox-static; \
	fi
	@if ! { test -x /usr/lib/cni/bridge && test -x /usr/lib/cni/host-local && test -x /usr/lib/cni/loopback; } && \
		! { test -x /opt/cni/bin/bridge && test -x /opt/cni/bin/host-local && test -x /opt/cni/bin/loopback; }; then \
		apt-get update && apt-get install -y --no-install-recommends containernetworking-plugins; \
	fi
	@# Real nodes forward the kubernetes Service to the API server (e2e/harness/podnet.go).
	@if ! command -v iptables >/dev/null; then \
		apt-get update && apt-get install -y --no-install-recommends iptables; \
	fi
	@# Every real node's kubelet and containerd watch files with inotify: the kernel's default of
	@# 128 instances per user is too few for the suites' nodes running side by side (kind asks 512).
	@if [ "$$(cat /proc/sys/fs/inotify/max_user_instances 2>/dev/null || echo 512)" -lt 512 ]; then \
		echo 512 > /proc/sys/fs/inotify/max_user_instances || echo "fs.inotify.max_user_instances is below 512: real nodes may fail to start" >&2; \
	fi

# Real nodes (e2e/harness/realnode.go) run the kubelet of the control plane's Kubernetes release,
# built from e2e/nodetools (its own module: the kubelet's dependencies as Kubernetes pins them),
# and containerd v2 from its Go module. containerd lists 2.3 and 2.4 as the releases supporting
# Kubernetes 1.37 (its RELEASES.md); CDI is always on since 2.0.
CONTAINERD_VERSION ?= v2.4.2
NODE_TOOLS := $(TOOLS)/bin/kubelet $(TOOLS)/bin/containerd

e2e-node-tools: $(NODE_TOOLS) ## the real nodes' kubelet (the control plane's release) and containerd, shim, ctr into .tools/bin

# The version flags a release build sets (shell: $$v is the release, sets $$flags): the Node then
# reports the release as its kubelet version, and `kubectl version` its client version.
K8S_VERSION_FLAGS = minor=$${v\#v*.} && flags="-X k8s.io/component-base/version.gitVersion=$$v \
	-X k8s.io/component-base/version.gitMajor=$$(echo $$v | cut -d. -f1 | tr -d v) \
	-X k8s.io/component-base/version.gitMinor=$${minor%%.*} \
	-X k8s.io/component-base/version.gitTreeState=clean"

$(TOOLS)/bin/kubelet: e2e/nodetools/go.mod e2e/nodetools/go.sum
	cd e2e/nodetools && v=$$($(GO) list -m -f '{{.Version}}' k8s.io/kubernetes) && $(K8S_VERSION_FLAGS) && \
		$(GO) build -o $@ -ldflags "$$flags" k8s.io/kubernetes/cmd/kubelet

$(TOOLS)/bin/containerd:
	GOBIN=$(TOOLS)/bin $(GO) install -ldflags "-X github.com/containerd/containerd/v2/version.Version=$(CONTAINERD_VERSION)" \
		$(foreach c,containerd containerd-shim-runc-v2 ctr,github.com/containerd/containerd/v2/cmd/$(c)@$(CONTAINERD_VERSION))

e2e-image: e2e-bins e2e-runtime ## the e2e test image: busybox, glibc for the simulator's tools, an ld cache
	bash e2e/testimage/build.sh $(TEST_IMAGE) target/debug/cuda-app target/debug/nvidia-smi target/debug/libgpu_dra_sim.so

e2e: e2e-bins e2e-tools e2e-kubectl e2e-node-tools e2e-image image ## end-to-end tests against the in-process control plane
	cd e2e && $(E2E_ENV) $(GO) test -count=1 -parallel $(E2E_PARALLEL) -timeout $(E2E_TIMEOUT) ./...

# Other people's specs as written: every YAML file of DIR, one at a time, on real nodes
# (e2e/tests/specs_test.go, e2e/harness/specs.go; e2e/README.md says what is checked).
# SPECS_TESTS: the tests of e2e/tests run with them (a Go -run alternation).
SPECS_TESTS ?= TestSpecFolder
e2e-specs: e2e-bins e2e-tools e2e-node-tools e2e-image image ## run every YAML file of a spec folder (DIR=<folder>) on real nodes and check what holds for any spec
	@test -n "$(DIR)" || { echo "make e2e-specs: name the spec folder: DIR=<folder>" >&2; exit 2; }
	cd e2e && E2E_SPECS_DIR=$(abspath $(DIR)) $(if $(E2E_K8S_RELEASE_DIR),E2E_K8S_RELEASE_DIR=$(abspath $(E2E_K8S_RELEASE_DIR))) \
		$(E2E_ENV) $(GO) test -count=1 -timeout $(E2E_TIMEOUT) -run '^($(SPECS_TESTS))$$' -v ./tests

# Older supported releases: the control plane and kubelet of the newest patch of Kubernetes 1.34,
# 1.35 and 1.36, each built from e2e/release-<minor> (its own module, the release's pins) into
# .tools/k8s-<minor>/bin (e2e/harness/external.go runs them as processes). On each: the examples
# that must work there through e2e-specs, the tests of what that release has or lacks (device
# taints dropped before 1.36: unhealthy GPUs withheld; consumable capacity, partitionable devices
# and device taints on from 1.36), and the chart installed with helm (refusing values that need a
# gate that is off, accepting them where it is on). Not in CI: a cold build of the four binaries
# of one release does not fit its budget (docs/STATUS.md has the figures).
E2E_RELEASE_EXAMPLES_1.34 ?= whole-gpu mig-1g5gb time-slicing-shared mps
E2E_RELEASE_EXAMPLES_1.35 ?= $(E2E_RELEASE_EXAMPLES_1.34)
E2E_RELEASE_EXAMPLES_1.36 ?= $(E2E_RELEASE_EXAMPLES_1.34) dynamic-mig nvlink-pair nvlink-or-numa mig-four-from-one-gpu
E2E_RELEASE_TESTS_1.34 ?= TestSpecFolder|TestUnhealthyGPUWithheldWithoutDeviceTaints
E2E_RELEASE_TESTS_1.35 ?= $(E2E_RELEASE_TESTS_1.34)
E2E_RELEASE_TESTS_1.36 ?= TestSpecFolder|TestDeviceHealth|TestMemoryShares|TestConsumableSharesCount

e2e-1.34-tools: $(TOOLS)/k8s-1.34/bin/kubelet ## kube-apiserver, kube-controller-manager, kube-scheduler and kubelet of the newest 1.34 patch into .tools/k8s-1.34/bin
e2e-1.35-tools: $(TOOLS)/k8s-1.35/bin/kubelet ## the same of the newest 1.35 patch into .tools/k8s-1.35/bin
e2e-1.36-tools: $(TOOLS)/k8s-1.36/bin/kubelet ## the same of the newest 1.36 patch into .tools/k8s-1.36/bin

$(TOOLS)/k8s-%/bin/kubelet: e2e/release-%/go.mod e2e/release-%/go.sum
	cd e2e/release-$* && v=$$($(GO) list -m -f '{{.Version}}' k8s.io/kubernetes) && $(K8S_VERSION_FLAGS) && \
		$(GO) build -o $(TOOLS)/k8s-$*/bin/ -ldflags "$$flags" \
		$(foreach b,kube-apiserver kube-controller-manager kube-scheduler kubelet,k8s.io/kubernetes/cmd/$(b))

# $(call e2e_release,<minor>): that release's examples (a folder of copies in target/e2e-<minor>)
# and tests through e2e-specs, then the chart test of the deployed suite.
define e2e_release
	rm -rf target/e2e-$(1) && mkdir -p target/e2e-$(1)
	for e in $(E2E_RELEASE_EXAMPLES_$(1)); do for f in examples/$$e/*.yaml; do cp $$f target/e2e-$(1)/$$e-$$(basename $$f); done; done
	$(MAKE) e2e-specs DIR=target/e2e-$(1) E2E_K8S_RELEASE_DIR=$(TOOLS)/k8s-$(1)/bin SPECS_TESTS='$(E2E_RELEASE_TESTS_$(1))'
	cd e2e && E2E_K8S_RELEASE_DIR=$(TOOLS)/k8s-$(1)/bin $(E2E_ENV) $(GO) test -count=1 -timeout $(E2E_TIMEOUT) \
		-run '^TestChartOnAnOlderRelease$$' -v ./deployed
endef

e2e-1.34: e2e-1.34-tools ## the examples that must work on Kubernetes 1.34 (whole GPUs, static MIG, time-slicing, MPS), the taints fallback and the chart, on its own control plane and kubelet (not in CI)
	$(call e2e_release,1.34)
e2e-1.35: e2e-1.35-tools ## the same on Kubernetes 1.35 (not in CI)
	$(call e2e_release,1.35)
e2e-1.36: e2e-1.36-tools ## on Kubernetes 1.36, where consumable capacity, partitionable devices and device taints are on: those examples plus dynamic MIG and NVLink, memory and consumable shares, device health, the chart with shares (not in CI)
	$(call e2e_release,1.36)

demo: e2e-bins e2e-tools e2e-node-tools e2e-image toolkit ## local cluster with real A100 (static and dynamic MIG) and T4 nodes, a short tour, then up for kubectl until Ctrl-C
	cd e2e && $(E2E_ENV) $(GO) run ./cmd/demo

# The same nodes as real nodes with no driver, then the user's commands printed and run: helm
# install of the chart (the DaemonSet's plugin pods on the image `make image` built), the tour,
# helm upgrade, kubectl logs/exec, gpu-dra check and usage (e2e/demo/helm.go).
demo-helm: e2e-bins e2e-tools e2e-kubectl e2e-node-tools e2e-image image ## the driver installed as a user does: helm install onto real A100 and T4 nodes, helm upgrade, kubectl logs/exec, gpu-dra check and usage, then up for kubectl until Ctrl-C
	cd e2e && $(E2E_ENV) $(GO) run ./cmd/demo --helm

# BENCH_PROFILE: the cargo profile of the plugins and the simulator the benchmark runs
# (debug or release); the figures depend on it and the output names it.
BENCH_PROFILE ?= debug
bench-e2e: toolkit ## scale benchmark: 100 nodes x 8 GPUs, 800 one-GPU pods, BENCH_PROFILE=debug|release plugins (not in CI)
	@case "$(BENCH_PROFILE)" in debug|release) ;; *) echo "make bench-e2e: BENCH_PROFILE=$(BENCH_PROFILE): want debug or release" >&2; exit 2;; esac
	$(CARGO) build --locked $(if $(filter release,$(BENCH_PROFILE)),--release) -p gpu-dra-kubelet-plugin -p gpu-dra-sim -p gpu-dra-sim-cuda -p gpu-dra-webhook
	cd e2e && $(E2E_ENV) E2E_BIN_DIR=$(CURDIR)/target/$(BENCH_PROFILE) BENCH_PROFILE=$(BENCH_PROFILE) $(GO) run ./cmd/bench-e2e

# NVLink placement on the real scheduler: a fleet of bridged-pair, PCIe-only and cube-mesh hosts,
# rounds of 4-GPU and 2-GPU claims with and without matchAttribute on nvlinkDomain; the table is
# kept in target/bench-topology.txt.
bench-topology: toolkit ## NVLink placement on kube-scheduler: share of claims on NVLink sets, Pending claims and pods/s, with the nvlinkDomain constraint and without (not in CI)
	@case "$(BENCH_PROFILE)" in debug|release) ;; *) echo "make bench-topology: BENCH_PROFILE=$(BENCH_PROFILE): want debug or release" >&2; exit 2;; esac
	$(CARGO) build --locked $(if $(filter release,$(BENCH_PROFILE)),--release) -p gpu-dra-kubelet-plugin -p gpu-dra-sim -p gpu-dra-sim-cuda -p gpu-dra-webhook
	cd e2e && $(E2E_ENV) E2E_BIN_DIR=$(CURDIR)/target/$(BENCH_PROFILE) BENCH_PROFILE=$(BENCH_PROFILE) BENCH_OUT=$(CURDIR)/target/bench-topology.txt $(GO) run ./cmd/bench-topology

bench-mps: e2e-bins e2e-tools e2e-image toolkit ## MPS claim created -> pod Running, p50/p99 over 24 claims, against whole-GPU claims (root: runs containers)
	cd e2e && $(E2E_ENV) $(GO) run ./cmd/bench-mps

# The wasteful cluster of e2e/tests/advise_test.go at full size: 8 nodes x 4 A100-SXM4-80GB,
# 4 training jobs of 4 GPUs, 12 inference services and 8 notebooks of 1 (36 GPUs asked for 32);
# gpu-dra advise over their usage, its templates applied, the workloads re-run; prints the
# before/after table (kept in target/advise-demo.txt).
advise-demo: e2e-bins e2e-node-tools e2e-kubectl e2e-image ## the wasteful-cluster scenario at full size, right-sized by gpu-dra advise; prints the before/after table (not in CI)
	cd e2e && E2E_ADVISE_SCENARIO=full E2E_ADVISE_TABLE=$(CURDIR)/target/advise-demo.txt $(E2E_ENV) \
		$(GO) test -count=1 -timeout 60m -run '^TestWastefulClusterAdvice$$' ./tests
	@cat $(CURDIR)/target/advise-demo.txt

generate: ## regenerate committed generated files (protobuf bindings, JSON schema)
	UPDATE_GENERATED=1 $(CARGO) test --workspace --locked generated_

FUZZ_SECONDS ?= 600
# cargo-fuzz passes -Z sanitizer flags; RUSTC_BOOTSTRAP=1 lets the pinned stable toolchain
# accept them, so no nightly toolchain is needed. Crashes land in api/fuzz/artifacts/.
fuzz: ## run the opaque-config fuzzer for FUZZ_SECONDS (default 600)
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	mkdir -p api/fuzz/corpus/decode_validate
	cd api/fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run decode_validate corpus/decode_validate seeds \
		-- -max_total_time=$(FUZZ_SECONDS) -dict=decode_validate.dict -max_len=4096

# Every benchmark, as package:example. `bench` runs them in release and prints the figures;
# `bench-check` (part of `test`) runs each once in the debug build with a handful of iterations
# (BENCH_QUICK=1), so that a benchmark that no longer runs fails CI instead of rotting.
BENCHES := gpu-dra-api:bench_validate gpu-dra-sim:bench_sim gpu-dra-core:bench_discover \
	gpu-dra-kubelet-plugin:bench_prepare gpu-dra-kubelet-plugin:bench_mps gpu-dra-kubelet-plugin:bench_usage \
	gpu-dra-webhook:bench_admission
# $(1): cargo profile flag, $(2): environment of each run. The simulator's library and tools
# and the webhook binary are what bench_mps and bench_admission start.
define run-benches
	$(CARGO) build --locked $(1) -p gpu-dra-sim -p gpu-dra-sim-cuda --lib --bins
	$(CARGO) build --locked $(1) -p gpu-dra-webhook --bin gpu-dra-webhook
	set -e; for b in $(BENCHES); do \
		echo "== $$b"; $(2) $(CARGO) run --locked $(1) -p $${b%%:*} --example $${b#*:}; \
	done
endef

bench: ## benchmarks: print figures (medians, percentiles, ratios)
	$(call run-benches,--release,)

bench-check: ## every benchmark once with a handful of iterations (debug build): proves they still run
	$(call run-benches,,BENCH_QUICK=1)

$(HELM):
	GOBIN=$(TOOLS)/bin $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

TOOLKIT_VERSION ?= v1.20.1
TOOLKIT := $(TOOLS)/bin/nvidia-ctk $(TOOLS)/bin/nvidia-cdi-hook $(TOOLS)/bin/nvidia-container-runtime

toolkit: $(TOOLKIT) ## NVIDIA's nvidia-ctk, nvidia-cdi-hook and nvidia-container-runtime from the Go module proxy into .tools/bin

$(TOOLS)/bin/nvidia-ctk:
	GOBIN=$(TOOLS)/bin $(GO) install github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk@$(TOOLKIT_VERSION)

# The runtime GPU Operator nodes run every container with (containerd's default runtime there);
# e2e runs the containers of NodeOptions.NvidiaRuntime nodes through it, wrapping runc.
$(TOOLS)/bin/nvidia-container-runtime:
	GOBIN=$(TOOLS)/bin $(GO) install github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime@$(TOOLKIT_VERSION)

# The hook runs on the host (the container runtime executes it there), under the host's loader
# and libc, which may be older than the build machine's: a dynamic build needs GLIBC_2.34 and
# fails on RHEL 8 or Ubuntu 20.04. Linked statically it needs none. glibc warns that dlopen
# and getaddrinfo in a static binary need its shared libraries at run time: the hooks our specs
# name never call them (only apply-cuda-memory-limits loads NVML; netgo and osusergo keep
# name and user lookups in Go). tests/static_hook.rs runs it in a root without any libc.
$(TOOLS)/bin/nvidia-cdi-hook:
	CGO_ENABLED=1 GOBIN=$(TOOLS)/bin $(GO) install -tags netgo,osusergo \
		-ldflags '-linkmode external -extldflags "-static"' \
		github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook@$(TOOLKIT_VERSION)

# The image's content (binaries, glibc, CA certificates, nvidia-cdi-hook), assembled by the
# same script the Dockerfile runs; e2e runs the node plugin in a container on it.
IMAGE_PROFILE ?= debug
IMAGE_ROOTFS := $(CURDIR)/target/image-rootfs

image-rootfs: $(TOOLKIT) ## the image's root filesystem (IMAGE_PROFILE=debug|release) into target/image-rootfs
	$(CARGO) build --workspace --locked $(if $(filter release,$(IMAGE_PROFILE)),--release)
	bash deploy/image/build-rootfs.sh $(IMAGE_ROOTFS) target/$(IMAGE_PROFILE) $(TOOLS)/bin/nvidia-cdi-hook

# --- The driver's image: an OCI image layout, amd64 and arm64, with no container engine ---
# The image is made of image-rootfs's trees (the one recipe e2e runs and the Dockerfile copies)
# by gpu-dra-image (e2e/cmd/gpu-dra-image, package e2e/imagebuild: go-containerregistry), which
# checks each tree first (every binary's ELF machine, loader and libraries, the hook static, the
# entrypoint and user) and is reproducible: same trees, version, revision and time, same digest.
# The arm64 tree holds only the three shipped binaries, cross-compiled with Debian's aarch64 gcc.
IMAGE_ARCHS ?= amd64 arm64
IMAGE_LAYOUT := $(CURDIR)/target/image/oci
IMAGE_ROOTFS_ARM64 := $(CURDIR)/target/image-rootfs-arm64
IMAGE_VERSION ?= $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*$$/\1/p' deploy/helm/gpu-dra-driver/Chart.yaml)
IMAGE_REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD 2>/dev/null || echo -dirty)
# The images' creation time: the last commit's, unless given (reproducible builds' convention).
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
IMAGE_SOURCE ?=
IMAGE_TOOL := $(TOOLS)/bin/gpu-dra-image
ARM64_TARGET := aarch64-unknown-linux-gnu
ARM64_ENV := CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
# The debug arm64 build (CI's) keeps debug assertions but no debug info: nothing here runs it,
# and the binaries link faster and weigh less.
ARM64_DEBUG_FLAGS := --config profile.dev.debug=0
IMAGE_BINS := -p gpu-dra-kubelet-plugin --bin gpu-kubelet-plugin -p gpu-dra-webhook --bin gpu-dra-webhook -p gpu-dra-cli --bin gpu-dra
ARM64_HOOK := $(TOOLS)/bin/linux_arm64/nvidia-cdi-hook

image-tool: ## gpu-dra-image (builds, checks and pushes the image) into .tools/bin
	cd e2e && $(GO) build -o $(IMAGE_TOOL) ./cmd/gpu-dra-image

image-cross-deps: ## the arm64 cross toolchain when missing: Rust's aarch64-unknown-linux-gnu target, Debian's gcc-aarch64-linux-gnu and libc6-dev-arm64-cross
	@rustup target list --installed | grep -qx $(ARM64_TARGET) || rustup target add $(ARM64_TARGET)
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! test -f /usr/aarch64-linux-gnu/lib/libc.so.6; then \
		apt-get update && apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross; \
	fi

# The static hook for arm64: `go install` puts a cross-compiled binary under GOPATH/bin/linux_arm64
# (it refuses GOBIN), so GOPATH is a folder of ours and the module cache stays where it is.
$(ARM64_HOOK):
	GOMODCACHE=$$($(GO) env GOMODCACHE) GOPATH=$(TOOLS)/go-arm64 GOBIN= GOOS=linux GOARCH=arm64 CGO_ENABLED=1 CC=aarch64-linux-gnu-gcc \
		$(GO) install -tags netgo,osusergo -ldflags '-linkmode external -extldflags "-static"' \
		github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook@$(TOOLKIT_VERSION)
	install -D -m 0755 $(TOOLS)/go-arm64/bin/linux_arm64/nvidia-cdi-hook $@

image-rootfs-arm64: image-cross-deps ## the image's arm64 root filesystem (IMAGE_PROFILE=debug|release) into target/image-rootfs-arm64
	$(MAKE) $(ARM64_HOOK)
	$(ARM64_ENV) $(CARGO) build --locked --target $(ARM64_TARGET) $(if $(filter release,$(IMAGE_PROFILE)),--release,$(ARM64_DEBUG_FLAGS)) $(IMAGE_BINS)
	bash deploy/image/build-rootfs.sh $(IMAGE_ROOTFS_ARM64) target/$(ARM64_TARGET)/$(IMAGE_PROFILE) $(ARM64_HOOK) arm64

# The arm64 tree's binaries run under Debian's qemu-user (installed when missing), with the tree
# as their root for the loader and libraries: each starts (--version) and the CLI validates an
# example and refuses an invalid one, as on an arm64 node. CI runs it; `make image` does not.
QEMU_ARM64 = qemu-aarch64 -L $(IMAGE_ROOTFS_ARM64)
image-arm64-run: image-rootfs-arm64 ## run the arm64 image tree's binaries under qemu-user (--version; gpu-dra validate on examples)
	@command -v qemu-aarch64 >/dev/null || { apt-get update && apt-get install -y --no-install-recommends qemu-user; }
	set -e; for b in gpu-kubelet-plugin gpu-dra-webhook gpu-dra nvidia-cdi-hook; do \
		$(QEMU_ARM64) $(IMAGE_ROOTFS_ARM64)/usr/local/bin/$$b --version; done
	$(QEMU_ARM64) $(IMAGE_ROOTFS_ARM64)/usr/local/bin/gpu-dra validate examples/whole-gpu/whole-gpu.yaml
	! $(QEMU_ARM64) $(IMAGE_ROOTFS_ARM64)/usr/local/bin/gpu-dra validate examples/invalid/misspelled-field.yaml

image: $(if $(filter amd64,$(IMAGE_ARCHS)),image-rootfs) $(if $(filter arm64,$(IMAGE_ARCHS)),image-rootfs-arm64) image-tool ## the driver's image, amd64 and arm64 (IMAGE_ARCHS), as an OCI layout in target/image/oci; prints its digest
	$(IMAGE_TOOL) build --out $(IMAGE_LAYOUT) $(foreach a,$(IMAGE_ARCHS),--rootfs $(a)=$(if $(filter arm64,$(a)),$(IMAGE_ROOTFS_ARM64),$(IMAGE_ROOTFS))) \
		--version $(IMAGE_VERSION) --revision $(IMAGE_REVISION) --created $(SOURCE_DATE_EPOCH) $(if $(IMAGE_SOURCE),--source $(IMAGE_SOURCE))

image-digest: image-tool ## print the digest of target/image/oci (make image): what image-push pushes and image.digest takes
	$(IMAGE_TOOL) digest $(IMAGE_LAYOUT)

image-push: image-tool ## push target/image/oci (make image) to IMAGE=<registry>/<repository>:<tag> with ~/.docker/config.json's credentials; prints <repository>@<digest>
	@test -n "$(IMAGE)" || { echo "make image-push: name the image: IMAGE=<registry>/<repository>:<tag>" >&2; exit 2; }
	$(IMAGE_TOOL) push $(IMAGE_LAYOUT) $(IMAGE)

# The node self-test (docs/STATUS.md, "The node self-test"). Its bundle carries a static runc: a
# GPU host may have no container runtime, or one of another libc. runc from its Go module, built
# as its own Makefile's `static` target does, without the seccomp tag (the self-test's
# containers ask for no seccomp profile, so libseccomp is not needed). v1.2.5: the module
# archives of later releases replace go-selinux with a folder they do not carry, so the Go
# module proxy cannot build them.
RUNC_VERSION ?= v1.2.5
RUNC_STATIC := $(TOOLS)/bin/runc-static
SELFTEST_BUNDLE := $(CURDIR)/target/selftest-bundle
SELFTEST_SIM_BUNDLE := $(CURDIR)/target/selftest-bundle-sim

$(RUNC_STATIC):
	mkdir -p $(TOOLS)/runc-build
	cd $(TOOLS)/runc-build && CGO_ENABLED=1 GOBIN=$(TOOLS)/runc-build $(GO) install -trimpath -tags "netgo osusergo" \
		-ldflags "-extldflags -static -s -w -X main.version=$(RUNC_VERSION:v%=%)" github.com/opencontainers/runc@$(RUNC_VERSION)
	mv $(TOOLS)/runc-build/runc $@

selftest-bundle: $(TOOLS)/bin/nvidia-cdi-hook $(RUNC_STATIC) ## the node self-test bundle into target/selftest-bundle (release, under 60 MiB): bring it to a GPU host, run selftest.sh
	$(CARGO) build --locked --release -p gpu-dra-kubelet-plugin --bin gpu-kubelet-plugin -p gpu-dra-cuda-probe --bin gpu-cuda-probe
	bash deploy/selftest/build-bundle.sh $(SELFTEST_BUNDLE) target/release/gpu-kubelet-plugin target/release/gpu-cuda-probe \
		$(RUNC_STATIC) $(TOOLS)/bin/nvidia-cdi-hook
	@size=$$(du -sm $(SELFTEST_BUNDLE) | cut -f1); echo "self-test bundle: $$size MiB (limit 60)"; \
		test "$$size" -lt 60 || { echo "make selftest-bundle: the bundle is $$size MiB, over 60" >&2; exit 1; }

# The same bundle from the debug build, with the libraries the simulator's tools load in a
# container, run against every simulated profile (root: it starts containers).
selftest-check: $(TOOLS)/bin/nvidia-cdi-hook $(RUNC_STATIC) ## the node self-test on every simulated profile, and broken hosts failing it by name (root)
	$(CARGO) build --locked -p gpu-dra-kubelet-plugin -p gpu-dra-cuda-probe -p gpu-dra-sim -p gpu-dra-sim-cuda
	bash deploy/selftest/build-bundle.sh $(SELFTEST_SIM_BUNDLE) target/debug/gpu-kubelet-plugin target/debug/gpu-cuda-probe \
		$(RUNC_STATIC) $(TOOLS)/bin/nvidia-cdi-hook target/debug/nvidia-smi target/debug/libgpu_dra_sim.so target/debug/libgpu_dra_sim_cuda.so
	SELFTEST_BUNDLE=$(SELFTEST_SIM_BUNDLE) $(CARGO) test --locked -p gpu-dra-kubelet-plugin --test selftest

# As root: the toolkit runs in a private mount namespace (see the test's module doc).
cdi-check: $(TOOLKIT) ## our CDI specs against NVIDIA's nvidia-ctk on every simulated profile and a real H100 host's spec; the hook runs without the host's libc
	NVIDIA_CTK=$(TOOLS)/bin/nvidia-ctk $(CARGO) test --locked -p gpu-dra-kubelet-plugin --test toolkit_cdi
	NVIDIA_CDI_HOOK=$(TOOLS)/bin/nvidia-cdi-hook $(CARGO) test --locked -p gpu-dra-kubelet-plugin --test static_hook

# The chart as a release publishes it: `helm package`'s archive, gpu-dra-driver-<version>.tgz.
CHART_PACKAGE_DIR := $(CURDIR)/target/chart
CHART_VERSION = $(shell sed -n 's/^version: *"*\([^"]*\)"*$$/\1/p' deploy/helm/gpu-dra-driver/Chart.yaml)
CHART_PACKAGE = $(CHART_PACKAGE_DIR)/gpu-dra-driver-$(CHART_VERSION).tgz

chart-package: $(HELM) ## helm package the chart into target/chart/gpu-dra-driver-<version>.tgz
	rm -rf $(CHART_PACKAGE_DIR)
	$(HELM) package deploy/helm/gpu-dra-driver --destination $(CHART_PACKAGE_DIR)

chart-check: chart-package ## lint the Helm chart and its package, render the package with several value sets (schema included), check what it renders
	$(HELM) lint --strict --kube-version 1.34.0 deploy/helm/gpu-dra-driver
	$(HELM) lint --strict --kube-version 1.34.0 $(CHART_PACKAGE)
	HELM=$(HELM) CHART_CHECK=1 CHART=$(CHART_PACKAGE) $(CARGO) test --locked -p gpu-dra-repo-tests --test chart
