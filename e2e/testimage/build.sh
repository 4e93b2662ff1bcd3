#!/usr/bin/env bash
# Builds the e2e test image: a root filesystem that every workload container runs on
# (no registry is reachable, so pod images are not pulled).
#
#   build.sh OUT_DIR CUDA_APP ELF...
#
# OUT_DIR/rootfs gets: a static busybox with its applet links; the host's glibc dynamic
# loader and the libraries each ELF file given needs (found with ldd), so the simulator's
# dynamically linked `nvidia-smi` stand-in runs when CDI mounts it in; glibc's static
# `ldconfig`, an /etc/ld.so.conf naming the multiarch library folders and an ld.so.cache
# built for the image, as a distribution image has; mount points for /proc, /sys, /dev;
# the simulator's `cuda-app` (the stand-in for a CUDA program: the GPUs it sees and the MPS
# server it joins through CUDA_MPS_PIPE_DIRECTORY) in /usr/local/bin, as a workload image
# carries its own CUDA program.
# The build is written to OUT_DIR/rootfs.tmp and renamed into place.
set -euo pipefail
# shellcheck source=../../deploy/image/elf-libs.sh
. "$(dirname "$0")/../../deploy/image/elf-libs.sh"

out=${1:?usage: build.sh OUT_DIR CUDA_APP ELF...}
cuda_app=${2:?usage: build.sh OUT_DIR CUDA_APP ELF...}
shift 2
busybox=$(command -v busybox || true)
if [ -z "$busybox" ] || ! "$busybox" --list >/dev/null 2>&1; then
  echo "build.sh: busybox not found (Debian package busybox-static)" >&2
  exit 1
fi
if ldd "$busybox" >/dev/null 2>&1; then
  echo "build.sh: $busybox is dynamically linked; install the busybox-static package" >&2
  exit 1
fi
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)

tmp="$out/rootfs.tmp"
rm -rf "$tmp"
mkdir -p "$tmp"/{bin,sbin,etc,proc,sys,dev,tmp,run,root,usr/bin,usr/sbin,usr/local/bin,lib64,lib/x86_64-linux-gnu,usr/lib/x86_64-linux-gnu}
chmod 1777 "$tmp/tmp"

cp "$busybox" "$tmp/bin/busybox"
for applet in $("$busybox" --list); do
  [ -e "$tmp/bin/$applet" ] || ln -s busybox "$tmp/bin/$applet"
done
# glibc's ldconfig, not busybox's (which has none): ldconfig -p reads the image's cache.
rm -f "$tmp/sbin/ldconfig"
cp "$ldconfig" "$tmp/sbin/ldconfig"

# Libraries the given ELF files load, at the paths the loader resolved them to on this host
# (the same Debian multiarch layout the image uses).
for elf in "$@"; do
  [ -f "$elf" ] || { echo "build.sh: $elf not found (build the Rust workspace first)" >&2; exit 1; }
done
[ -f "$cuda_app" ] || { echo "build.sh: $cuda_app not found (build the Rust workspace first)" >&2; exit 1; }
cp "$cuda_app" "$tmp/usr/local/bin/cuda-app"
copy_elf_libs "$tmp" "$@" "$cuda_app"

printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$tmp/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$tmp/etc/group"
printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n' >"$tmp/etc/ld.so.conf"
"$ldconfig" -r "$tmp"

rm -rf "$out/rootfs"
mv "$tmp" "$out/rootfs"
echo "test image: $out/rootfs ($(du -sh "$out/rootfs" | cut -f1))"
