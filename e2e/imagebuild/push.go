package imagebuild

import (
	"context"
	"fmt"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// Push pushes the image index of the OCI layout at dir (WriteLayout's) to
// image (registry/repository:tag), with the credentials of the usual
// places (authn.DefaultKeychain: $DOCKER_CONFIG/config.json, by default
// ~/.docker/config.json, and the credential helpers it names), and
// returns the pushed reference by digest (registry/repository@sha256:...).
// Plain HTTP is used for localhost, loopback and private (RFC 1918)
// addresses as by every client of go-containerregistry, and for any
// registry with insecure.
func Push(ctx context.Context, dir, image string, insecure bool) (name.Digest, error) {
	var opts []name.Option
	if insecure {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.NewTag(image, append(opts, name.StrictValidation)...)
	if err != nil {
		return name.Digest{}, fmt.Errorf("image %q: want registry/repository:tag: %w", image, err)
	}
	idx, err := LayoutIndex(dir)
	if err != nil {
		return name.Digest{}, err
	}
	digest, err := idx.Digest()
	if err != nil {
		return name.Digest{}, err
	}
	if err := remote.WriteIndex(ref, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return name.Digest{}, fmt.Errorf("push %s: %w", ref, err)
	}
	return ref.Context().Digest(digest.String()), nil
}
