package imagebuild

// The checks of a root filesystem before it becomes an image: what would
// otherwise show only when a node runs the image (a binary of the wrong
// architecture, a loader or library the image lacks, an entrypoint or user
// that does not exist), found at build time and named. They read the ELF
// files (debug/elf), so they hold for an architecture the build machine
// cannot run.

import (
	"bufio"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// machines is the ELF machine of each architecture an image can have.
var machines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// libDirs are the folders the glibc loader of each architecture searches
// (Debian's multiarch folders first), as seen inside the image.
var libDirs = map[string][]string{
	"amd64": {"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"},
	"arm64": {"/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"},
}

// CheckRootfs checks root filesystem rootfs for architecture arch (amd64,
// arm64) and the image config that will run it: every ELF file in binDir
// (inside the image, e.g. /usr/local/bin) is for arch, its loader exists
// in the image, and so does every library it needs, transitively, for arch
// too; the files named in static have no loader and need no library (they
// run on the host, under whatever libc it has); entrypoint[0] is an
// executable file; user (uid[:gid], numeric) is in /etc/passwd. All
// problems are returned together.
func CheckRootfs(rootfs, arch, binDir string, static []string, entrypoint []string, user string) error {
	machine, ok := machines[arch]
	if !ok {
		return fmt.Errorf("architecture %q: want amd64 or arm64", arch)
	}
	var errs []error
	bins, err := os.ReadDir(filepath.Join(rootfs, binDir))
	if err != nil {
		return fmt.Errorf("binaries of the image: %w", err)
	}
	checked := map[string]bool{}
	var queue []string
	for _, b := range bins {
		if b.Type().IsRegular() {
			queue = append(queue, path.Join(binDir, b.Name()))
		}
	}
	isStatic := map[string]bool{}
	for _, s := range static {
		isStatic[s] = true
	}
	for len(queue) > 0 {
		name := queue[0]
		queue = queue[1:]
		if checked[name] {
			continue
		}
		checked[name] = true
		f, err := elf.Open(filepath.Join(rootfs, name))
		if err != nil {
			var fe *elf.FormatError
			if errors.As(err, &fe) && strings.HasPrefix(name, binDir+"/") {
				continue // not an ELF file: a script or data
			}
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			continue
		}
		needed, interp, err := elfDeps(f)
		f.Close()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			continue
		}
		if f.Machine != machine {
			errs = append(errs, fmt.Errorf("%s: ELF machine %s, want %s for %s", name, f.Machine, machine, arch))
			continue
		}
		if isStatic[name] {
			if interp != "" || len(needed) > 0 {
				errs = append(errs, fmt.Errorf("%s: must be linked statically (it runs on the host), has loader %q and needs %v", name, interp, needed))
			}
			continue
		}
		if interp != "" {
			if _, err := resolveIn(rootfs, interp); err != nil {
				errs = append(errs, fmt.Errorf("%s: loader %s: %w", name, interp, err))
			} else {
				queue = append(queue, interp)
			}
		}
		for _, lib := range needed {
			found := ""
			for _, dir := range libDirs[arch] {
				if p, err := resolveIn(rootfs, path.Join(dir, lib)); err == nil {
					found = p
					break
				}
			}
			if found == "" {
				errs = append(errs, fmt.Errorf("%s: needs %s, which is in none of %v", name, lib, libDirs[arch]))
				continue
			}
			queue = append(queue, found)
		}
	}
	if len(entrypoint) > 0 {
		p, err := resolveIn(rootfs, entrypoint[0])
		if err != nil {
			errs = append(errs, fmt.Errorf("entrypoint %s: %w", entrypoint[0], err))
		} else if st, err := os.Stat(filepath.Join(rootfs, p)); err != nil || st.Mode()&0o111 == 0 {
			errs = append(errs, fmt.Errorf("entrypoint %s: not an executable file", entrypoint[0]))
		}
	}
	if user != "" {
		if err := checkUser(rootfs, user); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("root filesystem %s (%s): %w", rootfs, arch, errors.Join(errs...))
	}
	return nil
}

// elfDeps is an ELF file's DT_NEEDED libraries and its PT_INTERP loader.
func elfDeps(f *elf.File) (needed []string, interp string, err error) {
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			buf := make([]byte, p.Filesz)
			if _, err := p.ReadAt(buf, 0); err != nil {
				return nil, "", fmt.Errorf("read PT_INTERP: %w", err)
			}
			interp = strings.TrimRight(string(buf), "\x00")
		}
	}
	needed, err = f.ImportedLibraries()
	if err != nil {
		return nil, "", fmt.Errorf("read DT_NEEDED: %w", err)
	}
	return needed, interp, nil
}

// resolveIn follows p's symlinks inside rootfs (absolute targets are
// relative to rootfs, as in the running image) and returns the path of
// the regular file it names, inside the image.
func resolveIn(rootfs, p string) (string, error) {
	p = path.Clean("/" + p)
	for i := 0; i < 40; i++ {
		// Resolve the folders first, one component at a time.
		dir, base := path.Split(p)
		if dir != "/" {
			d, err := resolveDirIn(rootfs, path.Clean(dir), 0)
			if err != nil {
				return "", err
			}
			p = path.Join(d, base)
		}
		st, err := os.Lstat(filepath.Join(rootfs, p))
		if err != nil {
			return "", fmt.Errorf("not in the image")
		}
		if st.Mode()&os.ModeSymlink == 0 {
			if !st.Mode().IsRegular() {
				return "", fmt.Errorf("not a regular file")
			}
			return p, nil
		}
		target, err := os.Readlink(filepath.Join(rootfs, p))
		if err != nil {
			return "", err
		}
		if !path.IsAbs(target) {
			target = path.Join(path.Dir(p), target)
		}
		p = path.Clean(target)
	}
	return "", fmt.Errorf("too many levels of symbolic links")
}

// resolveDirIn is resolveIn for a folder.
func resolveDirIn(rootfs, dir string, depth int) (string, error) {
	if dir == "/" {
		return dir, nil
	}
	if depth > 40 {
		return "", fmt.Errorf("too many levels of symbolic links")
	}
	parent, err := resolveDirIn(rootfs, path.Dir(dir), depth+1)
	if err != nil {
		return "", err
	}
	p := path.Join(parent, path.Base(dir))
	st, err := os.Lstat(filepath.Join(rootfs, p))
	if err != nil {
		return "", fmt.Errorf("not in the image")
	}
	if st.Mode()&os.ModeSymlink == 0 {
		return p, nil
	}
	target, err := os.Readlink(filepath.Join(rootfs, p))
	if err != nil {
		return "", err
	}
	if !path.IsAbs(target) {
		target = path.Join(parent, target)
	}
	return resolveDirIn(rootfs, path.Clean(target), depth+1)
}

// checkUser checks that the uid of user (uid[:gid]) has an /etc/passwd
// entry in rootfs.
func checkUser(rootfs, user string) error {
	uid, _, _ := strings.Cut(user, ":")
	f, err := os.Open(filepath.Join(rootfs, "etc", "passwd"))
	if err != nil {
		return fmt.Errorf("user %s: %w", user, err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Split(s.Text(), ":")
		if len(fields) > 2 && (fields[2] == uid || fields[0] == uid) {
			return nil
		}
	}
	return fmt.Errorf("user %s: no such user in /etc/passwd", user)
}
