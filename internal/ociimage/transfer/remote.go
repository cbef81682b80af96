package transfer

import (
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"

	"fmt"
	"net/http"
	"slices"
	"time"

	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/retry"
)

// Remote is how registries are reached.
type Remote struct {
	// CredentialsFile is a docker-style config.json whose "auths" entries
	// log in to registries (never a credential helper: the file's
	// credsStore and credHelpers are not run). Empty: anonymous.
	CredentialsFile string
	// PlainHTTP lists registries (HOST:PORT) reached over plain HTTP,
	// for a registry on a private network or in a test.
	PlainHTTP []string
	// Timeout bounds each HTTP request's wait for response headers (the
	// transfer itself is bounded by the caller's context). Default 30 s.
	Timeout time.Duration
	// UserAgent names the client to the registry.
	UserAgent string
}

// repository is the client of src's repository.
func (r Remote) repository(src ociimage.Source) (*remote.Repository, error) {
	repo, err := remote.NewRepository(src.Ref.Registry + "/" + src.Ref.Repository)
	if err != nil {
		return nil, err
	}
	repo.PlainHTTP = slices.Contains(r.PlainHTTP, src.Ref.Registry)
	repo.MaxMetadataBytes = ociimage.MaxManifestBytes
	timeout := r.Timeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.ResponseHeaderTimeout = timeout
	client := &auth.Client{
		Client: &http.Client{Transport: retry.NewTransport(transport)},
		Cache:  auth.NewCache(),
	}
	if r.UserAgent != "" {
		client.SetUserAgent(r.UserAgent)
	}
	if r.CredentialsFile != "" {
		store, err := credentials.NewFileStore(r.CredentialsFile)
		if err != nil {
			return nil, fmt.Errorf("registry credentials %s: %w", r.CredentialsFile, err)
		}
		client.Credential = credentials.Credential(store)
	}
	repo.Client = client
	return repo, nil
}

// RemoteOf is how the configuration's [registry] reaches registries.
func RemoteOf(r config.Registry, userAgent string) Remote {
	return Remote{CredentialsFile: r.Credentials, PlainHTTP: r.PlainHTTP, UserAgent: userAgent}
}
