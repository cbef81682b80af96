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

// LocalURI reports whether the libvirt URI names a libvirt on this host:
// no host part (qemu:///system, qemu+unix:///system?socket=...), or
// localhost without a port (a port on localhost is usually a tunnel to
// another machine). Anything else, and a URI that does not parse, is
// another host's (qemu+ssh://HOST/system, qemu+tls://HOST/system). On
// another host the files of this one are out of reach: disks must be
// volumes of that host's storage pools, and nothing of a machine may be a
// path on this host (console log, base image read by hand).
func LocalURI(uri string) bool {
	u, err := url.Parse(uri)
	if err != nil {
		return false
	}
	return u.Host == "" || (u.Port() == "" && isLocalhost(u.Hostname()))
}

func isLocalhost(h string) bool {
	h = strings.ToLower(h)
	return h == "localhost" || h == "127.0.0.1" || h == "::1"
}

// HostKey is what tells the libvirt of uri from every other: the driver
// (qemu, without the transport), the host (lower case) and the path, plus
// the socket a local URI names. The transport and its parameters do not
// count (qemu+ssh://h/system and qemu+tls://h/system are one libvirt; so
// are a URI with and without its keyfile or pkipath), nor does a port of
// the transport's own (an SSH port, libvirtd's default 16514 for TLS and
// 16509 for TCP); another port of libvirtd's does.
func HostKey(uri string) string {
	u, err := url.Parse(uri)
	if err != nil {
		return uri
	}
	driver, transport, _ := strings.Cut(strings.ToLower(u.Scheme), "+")
	host := strings.ToLower(u.Hostname())
	if LocalURI(uri) {
		host = ""
	}
	switch port := u.Port(); {
	case port == "", transport == "ssh", transport == "libssh", transport == "libssh2", transport == "ext":
	case port == "16514" && (transport == "tls" || transport == ""), port == "16509" && transport == "tcp":
	default:
		host += ":" + port
	}
	key := driver + "://" + host + u.Path
	if s := u.Query().Get("socket"); s != "" && host == "" {
		key += "?socket=" + s
	}
	return key
}
