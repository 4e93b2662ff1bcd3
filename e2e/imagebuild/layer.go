// Package imagebuild makes and pushes the driver's OCI image without a
// container engine: `make image` and `make image-push` (cmd/gpu-dra-image)
// and the e2e harness, which pushes the same image to its cluster's registry
// and whose real nodes pull it from there.
//
// The manifests, configs, index, OCI layout and registry protocol are
// go-containerregistry's (github.com/google/go-containerregistry: the
// library behind crane, ko and kaniko); what is ours is the one thing it
// leaves to its callers, a layer from a directory (WriteLayer), and the
// checks of a root filesystem before it becomes an image (CheckRootfs).
//
// Invariant: the same root filesystems and Options give the same digests.
// A layer is a tar with its entries sorted, times at the Unix epoch, owners
// root and no user or group names; the config's created time and the
// history's are Options.Created (the source's commit time, as
// SOURCE_DATE_EPOCH); gzip, as go-containerregistry writes it, has no time
// in its header.
package imagebuild

import (
	"archive/tar"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"
)

// WriteLayer writes rootfs as a layer tar to w: directories, regular
// files (hard links as links), symlinks and device nodes with their modes;
// owners root, times the Unix epoch, entries in lexical order.
func WriteLayer(w io.Writer, rootfs string) error {
	var paths []string
	err := filepath.WalkDir(rootfs, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != rootfs {
			paths = append(paths, p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	sort.Strings(paths)
	tw := tar.NewWriter(w)
	seen := map[uint64]string{} // inode -> first name, for hard links
	for _, p := range paths {
		st, err := os.Lstat(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(rootfs, p)
		if err != nil {
			return err
		}
		link := ""
		if st.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(st, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if st.IsDir() {
			hdr.Name += "/"
		}
		hdr.ModTime, hdr.AccessTime, hdr.ChangeTime = time.Unix(0, 0), time.Time{}, time.Time{}
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		hdr.Format = tar.FormatPAX
		if sys, ok := st.Sys().(*syscall.Stat_t); ok && st.Mode().IsRegular() && sys.Nlink > 1 {
			if first, ok := seen[sys.Ino]; ok {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				seen[sys.Ino] = hdr.Name
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeReg {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return err
			}
		}
	}
	return tw.Close()
}
