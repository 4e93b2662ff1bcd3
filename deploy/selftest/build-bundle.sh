#!/usr/bin/env bash
# Builds the self-test bundle: one folder to bring to a GPU host that has an NVIDIA driver and
# nothing else (no Kubernetes, no container runtime, no registry), where `selftest.sh` proves the
# node path in a few minutes (see docs/STATUS.md, "The node self-test").
#
#   build-bundle.sh OUT_DIR PLUGIN PROBE RUNC NVIDIA_CDI_HOOK [EXTRA_ELF...]
#
# OUT_DIR gets:
#   bin/gpu-kubelet-plugin   the node plugin (its `selftest` subcommand runs the production path)
#   bin/runc                 a statically linked runc: it runs on any host's libc
#   bin/nvidia-cdi-hook      NVIDIA's hook, statically linked: the specs' createContainer hooks
#   rootfs/                  the test containers' root: gpu-cuda-probe (a CUDA program that needs
#                            no CUDA toolkit: it loads libcuda.so.1 and runs a PTX kernel) with
#                            the C library it loads libcuda with, glibc's ldconfig and an ld.so.conf
#                            naming the multiarch and lib64 folders (the hook's update-ldcache
#                            runs it), the rest of glibc's libraries the driver's own nvidia-smi
#                            needs when the spec mounts it in, mount points
#   selftest.sh              runs the self-test with --leave-settings and writes the report; the
#                            plugin runs under rootfs/'s loader and glibc (any host glibc will do)
# EXTRA_ELF: more programs whose libraries the root needs (a simulated host's tools).
# The build is written to OUT_DIR.tmp and renamed into place.
set -euo pipefail
# shellcheck source=../image/elf-libs.sh
. "$(dirname "$0")/../image/elf-libs.sh"

usage="usage: build-bundle.sh OUT_DIR PLUGIN PROBE RUNC NVIDIA_CDI_HOOK [EXTRA_ELF...]"
out=${1:?$usage}
plugin=${2:?$usage}
probe=${3:?$usage}
runc=${4:?$usage}
hook=${5:?$usage}
shift 5
for f in "$plugin" "$probe" "$runc" "$hook" "$@"; do
  [ -f "$f" ] || { echo "build-bundle.sh: $f not found" >&2; exit 1; }
done
# Static: no loader to ask for (ldd says so; a static-pie binary is one too).
is_static() {
  { ldd "$1" 2>&1 || true; } | grep -qE 'not a dynamic executable|statically linked'
}
for f in "$runc" "$hook"; do
  if ! is_static "$f"; then
    echo "build-bundle.sh: $f is dynamically linked; the bundle needs static builds (make selftest-bundle builds them)" >&2
    exit 1
  fi
done
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)

tmp="$out.tmp"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp"/rootfs/{bin,sbin,etc,proc,sys,dev,tmp,run,root,usr/bin,usr/local/bin,lib64,lib/x86_64-linux-gnu,usr/lib/x86_64-linux-gnu,usr/lib64}
chmod 1777 "$tmp/rootfs/tmp"

cp "$plugin" "$tmp/bin/gpu-kubelet-plugin"
cp "$runc" "$tmp/bin/runc"
cp "$hook" "$tmp/bin/nvidia-cdi-hook"
strip "$tmp/bin/gpu-kubelet-plugin" 2>/dev/null || true

root="$tmp/rootfs"
cp "$probe" "$root/usr/local/bin/gpu-cuda-probe"
strip "$root/usr/local/bin/gpu-cuda-probe" 2>/dev/null || true
copy_elf_libs "$root" "$probe" "$@"
# The rest of glibc's run-time libraries: the driver's nvidia-smi links libm, libdl, libpthread
# and librt besides libc.
for lib in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libgcc_s.so.1; do
  for dir in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu; do
    if [ -e "$dir/$lib" ] && [ ! -e "$root/lib/x86_64-linux-gnu/$lib" ]; then
      cp "$(readlink -f "$dir/$lib")" "$root/lib/x86_64-linux-gnu/$lib"
      break
    fi
  done
done
cp "$ldconfig" "$root/sbin/ldconfig"
if ! is_static "$root/sbin/ldconfig"; then
  echo "build-bundle.sh: $ldconfig is dynamically linked; the hook runs it in the container" >&2
  exit 1
fi
printf 'root:x:0:0:root:/root:/bin/false\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
# Driver libraries sit in the multiarch folder on Debian-family hosts and in lib64 on
# RHEL-family ones; specs mount them at the host's path, and update-ldcache adds theirs.
printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n/usr/lib64\n/lib64\n' >"$root/etc/ld.so.conf"
"$ldconfig" -r "$root"

cat >"$tmp/selftest.sh" <<'EOF'
#!/usr/bin/env bash
# Runs the node self-test on this host with --leave-settings (no GPU setting is changed) and
# writes the report as text and JSON to REPORT_DIR (default: this folder). Exit status: the
# self-test's (0 all passed, 1 a check failed or it could not run). Needs root (containers).
# Extra flags are passed on, e.g. --nvidia-driver-root /run/nvidia/driver.
set -u
set -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${REPORT_DIR:-$here}
mkdir -p "$out"
# The plugin runs under the bundle's own loader and C library, so that a host with an older glibc
# than the build machine's (RHEL 8, Ubuntu 20.04) runs it too; the tools it starts (the driver's
# nvidia-smi and MPS control daemon) run under the host's, as on a node.
"$here/rootfs/lib64/ld-linux-x86-64.so.2" --library-path "$here/rootfs/lib/x86_64-linux-gnu" \
  "$here/bin/gpu-kubelet-plugin" selftest --leave-settings \
  --rootfs "$here/rootfs" --runtime "$here/bin/runc" \
  --nvidia-cdi-hook-path "$here/bin/nvidia-cdi-hook" \
  --json-report "$out/selftest-report.json" "$@" 2>"$out/selftest.log" | tee "$out/selftest-report.txt"
rc=$?
exit $rc
EOF
chmod +x "$tmp/selftest.sh"

rm -rf "$out"
mv "$tmp" "$out"
echo "self-test bundle: $out ($(du -sh "$out" | cut -f1))"
