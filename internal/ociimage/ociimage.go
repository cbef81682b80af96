// Package ociimage keeps VM images in an OCI registry: one artifact per
// image (the qcow2 disk, and the kernel and initrd of an image that boots
// a kernel), pushed by `libvirt-executor image push` and pulled by digest
// into a content-addressed store on each host, so that every host of a
// fleet runs the same bytes.
//
// The artifact is an OCI image manifest (image-spec 1.1) with our own
// artifact type, a small JSON config (ImageConfig: each file's name, size
// and sha256 once uncompressed) and one zstd-compressed layer per file.
// A pull trusts nothing it receives before checking it: the manifest and
// the config are bounded and their digests checked, the layers' digests
// are checked as they stream in, each file's size and sha256 once
// uncompressed must match the config (a decompression bomb stops at the
// declared size, which is bounded too), and the image becomes visible
// only by the rename of its complete, checked directory. The store never
// follows a name it received: file names are fixed (DiskFile, KernelFile,
// InitrdFile) and directories are named by digest.
package ociimage

import (
	"errors"
	"fmt"
	"strings"

	"github.com/opencontainers/go-digest"
	"oras.land/oras-go/v2/registry"
)

// Media types of the artifact.
const (
	ArtifactType    = "application/vnd.libvirt-executor.image.v1"
	MediaTypeConfig = "application/vnd.libvirt-executor.image.config.v1+json"
	MediaTypeDisk   = "application/vnd.libvirt-executor.disk.qcow2.v1+zstd"
	MediaTypeKernel = "application/vnd.libvirt-executor.kernel.v1+zstd"
	MediaTypeInitrd = "application/vnd.libvirt-executor.initrd.v1+zstd"
)

// The files of a stored image.
const (
	DiskFile   = "disk.qcow2"
	KernelFile = "vmlinuz"
	InitrdFile = "initrd.img"
)

// fileMediaTypes maps each file an image may carry to its layer's media
// type: nothing else is accepted.
var fileMediaTypes = map[string]string{DiskFile: MediaTypeDisk, KernelFile: MediaTypeKernel, InitrdFile: MediaTypeInitrd}

// MediaTypeOf is the layer media type of an image file named name; false
// for a name an image may not carry.
func MediaTypeOf(name string) (string, bool) {
	mt, ok := fileMediaTypes[name]
	return mt, ok
}

// FileNames lists the files an image may carry, the disk first.
var FileNames = []string{DiskFile, KernelFile, InitrdFile}

// Bounds on what a registry sends before it is checked.
const (
	MaxManifestBytes = 64 << 10
	MaxConfigBytes   = 64 << 10
	// ConfigFormat is the version of ImageConfig written; a pull refuses
	// a newer one.
	ConfigFormat = 1
)

// ImageConfig is the artifact's config blob.
type ImageConfig struct {
	Format int        `json:"format"`
	Files  []FileInfo `json:"files"`
}

// FileInfo is one file of an image, as it is once uncompressed.
type FileInfo struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"` // hex
}

// Scheme prefixes an image source in the configuration.
const Scheme = "oci://"

// Source is where an image comes from: a registry, a repository and a tag
// or a digest.
type Source struct {
	Ref registry.Reference
}

// ParseSource parses "oci://HOST[:PORT]/REPO:TAG" or
// "oci://HOST[:PORT]/REPO@sha256:HEX".
func ParseSource(s string) (Source, error) {
	rest, ok := strings.CutPrefix(s, Scheme)
	if !ok {
		return Source{}, fmt.Errorf("image source %q: must start with %s (oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:...)", s, Scheme)
	}
	ref, err := registry.ParseReference(rest)
	if err != nil {
		return Source{}, fmt.Errorf("image source %q: %w (oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:...)", s, err)
	}
	if ref.Reference == "" {
		return Source{}, fmt.Errorf("image source %q: names no tag or digest (oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:...)", s)
	}
	if strings.Contains(rest, "@") {
		d, err := ref.Digest()
		if err != nil {
			return Source{}, fmt.Errorf("image source %q: %w", s, err)
		}
		if d.Algorithm() != digest.SHA256 {
			return Source{}, fmt.Errorf("image source %q: digest algorithm %s: only sha256 is accepted", s, d.Algorithm())
		}
	}
	return Source{Ref: ref}, nil
}

// String is the source as the configuration writes it.
func (s Source) String() string { return Scheme + s.Ref.String() }

// Pinned reports whether the source names a digest (it never moves).
func (s Source) Pinned() bool {
	_, err := s.Ref.Digest()
	return err == nil
}

// Errors a caller can tell apart.
var (
	// ErrNotPulled: the store has no image for the source yet.
	ErrNotPulled = errors.New("not pulled yet")
	// ErrRefused: what the registry sent is not an image of ours, or does
	// not match what it claims.
	ErrRefused = errors.New("refused")
)
