# Image of the driver: the node plugin and the admission webhook in one small image.
#   docker build -t gpu-dra-driver .
# Build stage: the pinned toolchain (rust-toolchain.toml) and the locked dependencies.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p gpu-dra-kubelet-plugin -p gpu-dra-webhook -p gpu-dra-cli \
 && mkdir -p /out \
 && cp target/release/gpu-kubelet-plugin target/release/gpu-dra-webhook target/release/gpu-dra /out/

# Runtime: glibc and CA certificates only, no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
# The webhook runs as the image's nonroot user; the chart runs the node plugin privileged.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpu-dra-webhook"]
