# Image of the driver: the node plugin, the admission webhook and the CLI in one small image.
#   docker build -t gpu-dra-driver .
# Without Docker, for amd64 and arm64 at once: `make image` and `make image-push` (README,
# "Install on your cluster"); their image config (e2e/imagebuild DriverImage) has this file's
# entrypoint and user, which a test checks.
# The build stage runs the same recipe as `make image-rootfs` (deploy/image/build-rootfs.sh),
# which the e2e suite runs the node plugin on: what e2e runs is what users run.
FROM golang:1.26-bookworm AS go

# Build stage: the pinned Rust toolchain (rust-toolchain.toml), the locked dependencies, and Go
# for NVIDIA's nvidia-cdi-hook (built from its Go module by `make toolkit`).
FROM rust:1.95-bookworm AS build
COPY --from=go /usr/local/go /usr/local/go
ENV PATH=/usr/local/go/bin:$PATH
WORKDIR /src
COPY . .
RUN make image-rootfs IMAGE_PROFILE=release

# Runtime: the assembled rootfs (binaries, glibc, CA certificates, nvidia-cdi-hook) on an empty
# base: no shell, no package manager.
FROM scratch
COPY --from=build /src/target/image-rootfs/ /
# Unprivileged by default. The chart states each workload's user explicitly: the webhook runs
# as 65532 (runAsNonRoot), the node plugin as root (runAsUser 0, privileged): it creates its
# sockets in the kubelet's root-owned folders and manages device state.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpu-dra-webhook"]
