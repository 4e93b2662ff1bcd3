# Sourced by the image recipe (build-rootfs.sh) and the e2e test image (e2e/testimage/build.sh):
# the one way both put the shared libraries of ELF files into a root filesystem.
#
# copy_elf_libs ROOT ELF...: copies every library ldd resolves for the ELF files (static ones
# have none) to ROOT at the path the loader found it on this host (the Debian multiarch layout
# the images use; other folders map to /lib/x86_64-linux-gnu), with the soname link when the
# file is versioned; fails when no dynamic loader ended up in ROOT/lib64.
copy_elf_libs() {
  local root=$1 elf lib real dir
  shift
  for elf in "$@"; do
    { ldd "$elf" 2>/dev/null || true; } | awk '/=> \// {print $3} /^\t\/[^ ]+ \(/ {print $1}' |
      while read -r lib; do
        real=$(readlink -f "$lib")
        dir=$(dirname "$lib")
        case "$dir" in /lib64|/lib/x86_64-linux-gnu|/usr/lib/x86_64-linux-gnu) ;; *) dir=/lib/x86_64-linux-gnu ;; esac
        cp "$real" "$root$dir/$(basename "$real")"
        [ "$(basename "$real")" = "$(basename "$lib")" ] || ln -sf "$(basename "$real")" "$root$dir/$(basename "$lib")"
      done
  done
  # /lib64/ld-linux-x86-64.so.2 is how every x86-64 binary names its loader.
  if [ ! -e "$root/lib64/ld-linux-x86-64.so.2" ]; then
    echo "$(basename "$0"): no dynamic loader found through ldd" >&2
    return 1
  fi
}
