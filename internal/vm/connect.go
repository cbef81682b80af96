package vm

import (
	"context"
	"errors"
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
