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

# copy_elf_libs_from_sysroot ROOT TRIPLE SYSROOT_LIB ELF...: the same for ELF files of another
# architecture, which ldd cannot load: the libraries their DT_NEEDED entries name (and theirs,
# transitively, read with readelf) are taken from SYSROOT_LIB (a cross toolchain's, e.g. Debian's
# /usr/aarch64-linux-gnu/lib) into ROOT/lib/TRIPLE, the Debian multiarch folder the loader
# searches, with the soname link when the file is versioned; the loader each ELF names
# (PT_INTERP) is copied to that path in ROOT. Fails on a library SYSROOT_LIB lacks.
copy_elf_libs_from_sysroot() {
  local root=$1 triple=$2 sysroot=$3 elf lib real interp
  shift 3
  mkdir -p "$root/lib/$triple"
  local queue=("$@") seen=" "
  while [ ${#queue[@]} -gt 0 ]; do
    elf=${queue[0]}
    queue=("${queue[@]:1}")
    interp=$(readelf -l "$elf" | sed -n 's/.*\[Requesting program interpreter: \(.*\)\]/\1/p')
    if [ -n "$interp" ] && [ ! -e "$root$interp" ]; then
      [ -f "$sysroot/$(basename "$interp")" ] || { echo "$(basename "$0"): loader $interp of $elf not in $sysroot" >&2; return 1; }
      mkdir -p "$root$(dirname "$interp")"
      cp "$(readlink -f "$sysroot/$(basename "$interp")")" "$root$interp"
    fi
    for lib in $(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
      case "$seen" in *" $lib "*) continue ;; esac
      seen="$seen$lib "
      [ -e "$sysroot/$lib" ] || { echo "$(basename "$0"): $lib (needed by $elf) not in $sysroot" >&2; return 1; }
      real=$(readlink -f "$sysroot/$lib")
      cp "$real" "$root/lib/$triple/$(basename "$real")"
      [ "$(basename "$real")" = "$lib" ] || ln -sf "$(basename "$real")" "$root/lib/$triple/$lib"
      queue+=("$real")
    done
  done
}
