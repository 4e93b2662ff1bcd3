// Command gpu-dra-image makes the driver's OCI image from the root
// filesystems of `make image-rootfs` and pushes it, with no container
// engine (package imagebuild: go-containerregistry).
//
//	gpu-dra-image build --out DIR --rootfs amd64=DIR [--rootfs arm64=DIR] --version V --revision R --created EPOCH [--source URL]
//	gpu-dra-image push [--insecure] DIR REGISTRY/REPOSITORY:TAG
//	gpu-dra-image digest DIR
//
// build prints the index's digest; push prints the pushed reference by
// digest (what the chart's image.digest takes); digest prints the digest of
// a layout already built.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"

	"github.com/gpu-dra/e2e/imagebuild"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "gpu-dra-image:", err)
		os.Exit(1)
	}
}

type rootfsFlag []imagebuild.Platform

func (r *rootfsFlag) String() string { return fmt.Sprint(*r) }
func (r *rootfsFlag) Set(v string) error {
	arch, dir, ok := strings.Cut(v, "=")
	if !ok || arch == "" || dir == "" {
		return fmt.Errorf("%q: want ARCH=DIR", v)
	}
	*r = append(*r, imagebuild.Platform{Arch: arch, Rootfs: dir})
	return nil
}

func run(args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("want a command: build, push or digest")
	}
	switch args[0] {
	case "build":
		fs := flag.NewFlagSet("build", flag.ContinueOnError)
		var roots rootfsFlag
		fs.Var(&roots, "rootfs", "ARCH=DIR: the root filesystem of one architecture (amd64, arm64); repeat for each")
		out := fs.String("out", "", "the OCI layout to write (replaced)")
		version := fs.String("version", "", "the image's version (label, and the layout's ref name)")
		revision := fs.String("revision", "", "the source revision (label)")
		created := fs.String("created", "", "creation time, seconds since the epoch (SOURCE_DATE_EPOCH)")
		source := fs.String("source", "", "the source repository's address (label; optional)")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if *out == "" || len(roots) == 0 || *version == "" || *revision == "" || *created == "" {
			return fmt.Errorf("build: --out, --rootfs, --version, --revision and --created are required")
		}
		t, err := imagebuild.ParseEpoch(*created)
		if err != nil {
			return err
		}
		tmp, err := os.MkdirTemp("", "gpu-dra-image-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		idx, err := imagebuild.Build(imagebuild.DriverImage(roots, t, *version, *revision, *source), tmp)
		if err != nil {
			return err
		}
		digest, err := imagebuild.WriteLayout(*out, *version, idx)
		if err != nil {
			return err
		}
		fmt.Printf("image %s (revision %s) in %s: %s\n", *version, *revision, *out, digest)
		return nil
	case "push":
		fs := flag.NewFlagSet("push", flag.ContinueOnError)
		insecure := fs.Bool("insecure", false, "plain HTTP to the registry (localhost, loopback and private addresses use it anyway)")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if fs.NArg() != 2 {
			return fmt.Errorf("push: want the OCI layout and REGISTRY/REPOSITORY:TAG")
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
		defer stop()
		ref, err := imagebuild.Push(ctx, fs.Arg(0), fs.Arg(1), *insecure)
		if err != nil {
			return err
		}
		fmt.Println(ref.String())
		return nil
	case "digest":
		if len(args) != 2 {
			return fmt.Errorf("digest: want the OCI layout")
		}
		idx, err := imagebuild.LayoutIndex(args[1])
		if err != nil {
			return err
		}
		d, err := idx.Digest()
		if err != nil {
			return err
		}
		fmt.Println(d)
		return nil
	}
	return fmt.Errorf("unknown command %q: want build, push or digest", args[0])
}
