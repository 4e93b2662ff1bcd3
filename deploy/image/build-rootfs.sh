#!/usr/bin/env bash
# Assembles the content of the driver's image: the one recipe behind `make image-rootfs`, the
# Dockerfile and the e2e suite (which runs the node plugin in a container on this rootfs).
#
#   build-rootfs.sh OUT_DIR BIN_DIR NVIDIA_CDI_HOOK [ARCH]
#
# OUT_DIR gets: gpu-kubelet-plugin, gpu-dra-webhook and gpu-dra from BIN_DIR and NVIDIA's
# nvidia-cdi-hook in /usr/local/bin; the glibc loader and the libraries these binaries need
# (found with ldd for the build host's architecture; for another, read from the ELF files and
# taken from the cross toolchain's glibc, Debian's libc6-<arch>-cross); the CA certificates of
# the build host; an /etc/passwd and /etc/group with root and the unprivileged user 65532 (the
# webhook's); empty mount points. No shell, no package manager. The result is built in
# OUT_DIR.tmp and renamed into place. ARCH: amd64 (default) or arm64, the binaries' architecture.
set -euo pipefail
# shellcheck source=elf-libs.sh
. "$(dirname "$0")/elf-libs.sh"

out=${1:?usage: build-rootfs.sh OUT_DIR BIN_DIR NVIDIA_CDI_HOOK}
bin=${2:?usage: build-rootfs.sh OUT_DIR BIN_DIR NVIDIA_CDI_HOOK}
hook=${3:?usage: build-rootfs.sh OUT_DIR BIN_DIR NVIDIA_CDI_HOOK [ARCH]}
arch=${4:-amd64}
case "$arch" in
  amd64) triple=x86_64-linux-gnu ;;
  arm64) triple=aarch64-linux-gnu ;;
  *) echo "build-rootfs.sh: ARCH $arch: want amd64 or arm64" >&2; exit 2 ;;
esac

tmp="$out.tmp"
rm -rf "$tmp"
mkdir -p "$tmp"/{usr/local/bin,etc/ssl/certs,lib/$triple,usr/lib/$triple,proc,sys,dev,run,var/run,tmp}
[ "$arch" != amd64 ] || mkdir -p "$tmp/lib64"
chmod 1777 "$tmp/tmp"

elfs=()
for name in gpu-kubelet-plugin gpu-dra-webhook gpu-dra; do
  [ -f "$bin/$name" ] || { echo "build-rootfs.sh: $bin/$name not found (build the Rust workspace first)" >&2; exit 1; }
  cp "$bin/$name" "$tmp/usr/local/bin/$name"
  elfs+=("$bin/$name")
done
[ -f "$hook" ] || { echo "build-rootfs.sh: $hook not found (make toolkit)" >&2; exit 1; }
cp "$hook" "$tmp/usr/local/bin/nvidia-cdi-hook"
elfs+=("$hook")

# Libraries at the paths the loader resolved them to on the build host (Debian multiarch), or
# for arm64 those of the cross toolchain's glibc (the same Debian release as the host's).
if [ "$arch" = amd64 ]; then
  copy_elf_libs "$tmp" "${elfs[@]}"
else
  sysroot=/usr/$triple/lib
  [ -d "$sysroot" ] || { echo "build-rootfs.sh: $sysroot not found (Debian package libc6-dev-$arch-cross)" >&2; exit 1; }
  copy_elf_libs_from_sysroot "$tmp" "$triple" "$sysroot" "${elfs[@]}"
fi

certs=/etc/ssl/certs/ca-certificates.crt
[ -f "$certs" ] || { echo "build-rootfs.sh: $certs not found (Debian package ca-certificates)" >&2; exit 1; }
cp "$certs" "$tmp/etc/ssl/certs/ca-certificates.crt"

printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$tmp/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$tmp/etc/group"

rm -rf "$out"
mv "$tmp" "$out"
echo "image rootfs in $out ($(du -sh "$out" | cut -f1))"
