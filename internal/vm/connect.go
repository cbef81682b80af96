package vm

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync"
)

// Connector opens one connection to the hypervisor at uri, giving up when
// ctx ends.
type Connector func(ctx context.Context, uri string) (Hypervisor, error)

// ErrNoConnector is Connect's error in an executable that registered no
// Connector.
var ErrNoConnector = errors.New("this executable was built without libvirt: it cannot connect to a hypervisor " +
	"(only libvirt-executor-prepare, libvirt-executor-cleanup and the libvirt-executor admin tool can; " +
	"a main package that needs libvirt imports internal/vm/libvirtvm)")

// registered is the Connector that Connect uses.
var registered struct {
	mu sync.RWMutex
	c  Connector
}

// RegisterConnector makes c the Connector that Connect uses. The libvirt
// implementation (internal/vm/libvirtvm) registers itself when imported, so
// that only the executables that import it link libvirt's C library: the
// config and run stages do not, and start in a few milliseconds.
func RegisterConnector(c Connector) {
	registered.mu.Lock()
	defer registered.mu.Unlock()
	registered.c = c
}

// Connect opens a connection to the hypervisor at uri through the
// registered Connector (ErrNoConnector if there is none).
func Connect(ctx context.Context, uri string) (Hypervisor, error) {
	registered.mu.RLock()
	c := registered.c
	registered.mu.RUnlock()
	if c == nil {
		return nil, ErrNoConnector
	}
	return c(ctx, uri)
}

// LocalURI reports whether the libvirt URI names a libvirt on this host
// (no host part: qemu:///system, qemu+unix:///system?socket=...) rather
// than another host's (qemu+ssh://HOST/system, qemu+tls://HOST/system).
// On another host the files of this one are out of reach: disks must be
// volumes of that host's storage pools, and nothing of a machine may be a
// path on this host (console log, base image read by hand).
func LocalURI(uri string) bool {
	u, err := url.Parse(uri)
	return err != nil || u.Host == "" || u.Hostname() == "localhost"
}

// HostKey is what tells the libvirt of uri from every other: the driver
// (qemu, without the transport), the host (lower case, with its port) and
// the path, plus the socket a local URI names. Two URIs of one host and
// driver reached over different transports (qemu+ssh://h/system and
// qemu+tls://h/system) have the same key; so have a URI with and without
// its keyfile or pkipath.
func HostKey(uri string) string {
	u, err := url.Parse(uri)
	if err != nil {
		return uri
	}
	driver, _, _ := strings.Cut(strings.ToLower(u.Scheme), "+")
	host := strings.ToLower(u.Host)
	if host == "localhost" {
		host = ""
	}
	key := driver + "://" + host + u.Path
	if s := u.Query().Get("socket"); s != "" {
		key += "?socket=" + s
	}
	return key
}
