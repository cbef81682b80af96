package services

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"oras.land/oras-go/v2/registry"
)

// Bounds of names read from the payload.
const (
	// MaxImageName bounds an image reference (the docker grammar allows
	// 255 for the repository, 128 for a tag, a digest and a host).
	MaxImageName = 512
	// MaxAlias bounds one alias (a DNS name).
	MaxAlias = 253
	// MaxAliases bounds a service's aliases, derived and the job's.
	MaxAliases = 16
)

// DockerHub is the registry of a reference that names none, as Docker and
// GitLab Runner read it; its official images live under library/.
const DockerHub = "docker.io"

// Ref is an image reference split as a registry client needs it.
type Ref struct {
	// Registry is the host (and port) the image comes from: DockerHub
	// when the name gives none.
	Registry string
	// Repository is the path in the registry (library/postgres).
	Repository string
	// Tag and Digest: at least one is set (Tag "latest" when the name
	// gives neither).
	Tag, Digest string
}

// String is the fully qualified reference podman is given, so that no
// short-name resolution (registries.conf's unqualified-search-registries,
// or a prompt) ever decides where an image comes from.
func (r Ref) String() string {
	s := r.Registry + "/" + r.Repository
	if r.Tag != "" {
		s += ":" + r.Tag
	}
	if r.Digest != "" {
		s += "@" + r.Digest
	}
	return s
}

// ParseRef reads an image reference as Docker does: a first component with
// a dot or a colon, or "localhost", is the registry (else Docker Hub, with
// library/ before a one-component name); a tag after the last colon of the
// last component; a digest after @. The result is checked with
// oras-go's reference grammar (the distribution spec's).
func ParseRef(name string) (Ref, error) {
	if name == "" {
		return Ref{}, fmt.Errorf("an empty image name")
	}
	if len(name) > MaxImageName {
		return Ref{}, fmt.Errorf("an image name of %d bytes (at most %d)", len(name), MaxImageName)
	}
	var r Ref
	rest := name
	if i := strings.IndexByte(rest, '@'); i >= 0 {
		r.Digest, rest = rest[i+1:], rest[:i]
	}
	if i := strings.LastIndexByte(rest, ':'); i >= 0 && !strings.Contains(rest[i+1:], "/") {
		r.Tag, rest = rest[i+1:], rest[:i]
		if r.Tag == "" {
			return Ref{}, fmt.Errorf("not an image reference: an empty tag after ':'")
		}
	}
	if i := strings.IndexByte(name, '@'); i >= 0 && r.Digest == "" {
		return Ref{}, fmt.Errorf("not an image reference: an empty digest after '@'")
	}
	first, path, found := strings.Cut(rest, "/")
	if found && (strings.ContainsAny(first, ".:") || first == "localhost") {
		r.Registry, r.Repository = first, path
	} else {
		r.Registry, r.Repository = DockerHub, rest
		if !found {
			r.Repository = "library/" + rest
		}
	}
	if r.Tag == "" && r.Digest == "" {
		r.Tag = "latest"
	}
	check := registry.Reference{Registry: r.Registry, Repository: r.Repository}
	if err := check.ValidateRegistry(); err != nil {
		return Ref{}, fmt.Errorf("not an image reference: %w", err)
	}
	if err := check.ValidateRepository(); err != nil {
		return Ref{}, fmt.Errorf("not an image reference: %w", err)
	}
	if r.Tag != "" {
		check.Reference = r.Tag
		if err := check.ValidateReferenceAsTag(); err != nil {
			return Ref{}, fmt.Errorf("not an image reference: %w", err)
		}
	}
	if r.Digest != "" {
		check.Reference = r.Digest
		if err := check.ValidateReferenceAsDigest(); err != nil {
			return Ref{}, fmt.Errorf("not an image reference: %w", err)
		}
	}
	return r, nil
}

// DerivedAliases are the host names GitLab Runner's Docker executor gives a
// service from its image name: the name without tag or digest and without
// the registry's port (the host stays), with each "/" made "__", and, when
// that differs, with each "/" made "-" (a name RFC 1123 allows):
// postgres:15 -> postgres; group/img -> group__img, group-img;
// registry.example:5000/team/db:1 -> registry.example__team__db,
// registry.example-team-db.
func DerivedAliases(name string) []string {
	base := name
	if i := strings.IndexByte(base, '@'); i >= 0 {
		base = base[:i]
	}
	if i := strings.LastIndexByte(base, ':'); i >= 0 && !strings.Contains(base[i+1:], "/") {
		base = base[:i]
	}
	if first, path, found := strings.Cut(base, "/"); found {
		if host, port, ok := strings.Cut(first, ":"); ok && allDigits(port) {
			base = host + "/" + path
		}
	}
	a := strings.ReplaceAll(base, "/", "__")
	b := strings.ReplaceAll(base, "/", "-")
	if a == b {
		return []string{a}
	}
	return []string{a, b}
}

func allDigits(s string) bool {
	if s == "" {
		return false
	}
	_, err := strconv.ParseUint(s, 10, 16)
	return err == nil
}

// UserAliases are the job's `alias:` entries: a list separated by commas
// and/or white space, as GitLab Runner reads it.
func UserAliases(alias string) []string {
	return strings.Fields(strings.ReplaceAll(alias, ",", " "))
}

var aliasRe = regexp.MustCompile(`^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$`)

// ValidAlias reports whether a is usable as a host name on the job's
// network and in /etc/hosts: letters, digits, ".", "_" and "-", starting
// and ending with a letter or digit, at most MaxAlias bytes.
func ValidAlias(a string) bool {
	return len(a) <= MaxAlias && aliasRe.MatchString(a)
}

// NetworkName is the podman network of a job's services: deterministic
// and prefixed, so that a sweep of a kept VM finds it.
func NetworkName(jobID int64) string {
	if jobID <= 0 {
		return "lve-services"
	}
	return "lve-job-" + strconv.FormatInt(jobID, 10)
}

// containerName is the i-th service's container (0-based).
func containerName(i int) string { return "lve-service-" + strconv.Itoa(i) }
