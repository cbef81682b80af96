package vm

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"
)

// ErrConnectionLost marks an error caused by a broken hypervisor connection
// (libvirtd restarted or died).
var ErrConnectionLost = errors.New("libvirt connection lost")

// connectionLost reports whether err means the connection itself is gone.
func connectionLost(err error) bool {
	if errors.Is(err, ErrConnectionLost) {
		return true
	}
	var lerr libvirt.Error
	if errors.As(err, &lerr) {
		switch lerr.Code {
		case libvirt.ERR_NO_CONNECT, libvirt.ERR_INVALID_CONN, libvirt.ERR_RPC, libvirt.ERR_SYSTEM_ERROR:
			return lerr.Domain == libvirt.FROM_RPC || lerr.Domain == libvirt.FROM_REMOTE ||
				lerr.Code == libvirt.ERR_NO_CONNECT || lerr.Code == libvirt.ERR_INVALID_CONN
		}
	}
	return false
}

// Reconnecting wraps a Hypervisor: when a call fails because the connection
// broke (a libvirtd restart), it reconnects — redialling until the daemon
// answers again, for at most Wait — and repeats the call once. A second
// failure is returned as is.
type Reconnecting struct {
	dial func() (Hypervisor, error)
	// OnReconnect, if set, is told about each reconnection.
	OnReconnect func(cause error)
	// Wait bounds how long a reconnection keeps redialling (default 30s);
	// Interval is the pause between dials (default 250ms).
	Wait, Interval time.Duration

	mu        sync.Mutex
	hv        Hypervisor
	reconnect int
}

var _ Hypervisor = (*Reconnecting)(nil)

// NewReconnecting connects through dial and returns the wrapper.
func NewReconnecting(dial func() (Hypervisor, error)) (*Reconnecting, error) {
	hv, err := dial()
	if err != nil {
		return nil, err
	}
	return &Reconnecting{dial: dial, hv: hv}, nil
}

// Reconnects counts the reconnections made.
func (r *Reconnecting) Reconnects() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reconnect
}

func (r *Reconnecting) current() Hypervisor {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hv
}

func do[T any](r *Reconnecting, call func(Hypervisor) (T, error)) (T, error) {
	hv := r.current()
	v, err := call(hv)
	if err == nil || !connectionLost(err) {
		return v, err
	}
	r.mu.Lock()
	if r.hv == hv { // nobody reconnected meanwhile
		_ = hv.Close()
		nhv, derr := r.redial()
		if derr != nil {
			r.mu.Unlock()
			return v, fmt.Errorf("%w: %v; reconnecting failed: %v", ErrConnectionLost, err, derr)
		}
		r.hv = nhv
		r.reconnect++
		if r.OnReconnect != nil {
			r.OnReconnect(err)
		}
	}
	hv = r.hv
	r.mu.Unlock()
	return call(hv)
}

// redial dials until it succeeds or Wait has passed (a restarting libvirtd
// takes a few seconds to listen again).
func (r *Reconnecting) redial() (Hypervisor, error) {
	wait, interval := r.Wait, r.Interval
	if wait <= 0 {
		wait = 30 * time.Second
	}
	if interval <= 0 {
		interval = 250 * time.Millisecond
	}
	deadline := time.Now().Add(wait)
	for {
		hv, err := r.dial()
		if err == nil || time.Now().After(deadline) {
			return hv, err
		}
		time.Sleep(interval)
	}
}

func do0(r *Reconnecting, call func(Hypervisor) error) error {
	_, err := do(r, func(h Hypervisor) (struct{}, error) { return struct{}{}, call(h) })
	return err
}

// KVMAvailable implements Hypervisor.
func (r *Reconnecting) KVMAvailable() (bool, error) {
	return do(r, func(h Hypervisor) (bool, error) { return h.KVMAvailable() })
}

// CreateVolume implements Hypervisor.
func (r *Reconnecting) CreateVolume(pool string, vol *libvirtxml.StorageVolume) (string, error) {
	return do(r, func(h Hypervisor) (string, error) { return h.CreateVolume(pool, vol) })
}

// UploadVolume implements Hypervisor.
func (r *Reconnecting) UploadVolume(pool, name string, data []byte) error {
	return do0(r, func(h Hypervisor) error { return h.UploadVolume(pool, name, data) })
}

// DeleteVolume implements Hypervisor.
func (r *Reconnecting) DeleteVolume(pool, name string) error {
	return do0(r, func(h Hypervisor) error { return h.DeleteVolume(pool, name) })
}

// VolumeNames implements Hypervisor.
func (r *Reconnecting) VolumeNames(pool string) ([]string, error) {
	return do(r, func(h Hypervisor) ([]string, error) { return h.VolumeNames(pool) })
}

// VolumeCapacity implements Hypervisor.
func (r *Reconnecting) VolumeCapacity(path string) (uint64, error) {
	return do(r, func(h Hypervisor) (uint64, error) { return h.VolumeCapacity(path) })
}

// Define implements Hypervisor.
func (r *Reconnecting) Define(xml string) error {
	return do0(r, func(h Hypervisor) error { return h.Define(xml) })
}

// Start implements Hypervisor.
func (r *Reconnecting) Start(name string) error {
	return do0(r, func(h Hypervisor) error { return h.Start(name) })
}

// Destroy implements Hypervisor.
func (r *Reconnecting) Destroy(name string) error {
	return do0(r, func(h Hypervisor) error { return h.Destroy(name) })
}

// Undefine implements Hypervisor.
func (r *Reconnecting) Undefine(name string) error {
	return do0(r, func(h Hypervisor) error { return h.Undefine(name) })
}

// Owner implements Hypervisor.
func (r *Reconnecting) Owner(name string) (string, error) {
	return do(r, func(h Hypervisor) (string, error) { return h.Owner(name) })
}

// SetOwner implements Hypervisor.
func (r *Reconnecting) SetOwner(name, ownerXML string) error {
	return do0(r, func(h Hypervisor) error { return h.SetOwner(name, ownerXML) })
}

// DomainNames implements Hypervisor.
func (r *Reconnecting) DomainNames() ([]string, error) {
	return do(r, func(h Hypervisor) ([]string, error) { return h.DomainNames() })
}

// IsActive implements Hypervisor.
func (r *Reconnecting) IsActive(name string) (bool, error) {
	return do(r, func(h Hypervisor) (bool, error) { return h.IsActive(name) })
}

// State implements Hypervisor.
func (r *Reconnecting) State(name string) (DomainState, error) {
	return do(r, func(h Hypervisor) (DomainState, error) { return h.State(name) })
}

// Addresses implements Hypervisor.
func (r *Reconnecting) Addresses(name string, source AddressSource) ([]Lease, error) {
	return do(r, func(h Hypervisor) ([]Lease, error) { return h.Addresses(name, source) })
}

// NetworkLeaseMACs implements Hypervisor.
func (r *Reconnecting) NetworkLeaseMACs(network string) ([]string, error) {
	return do(r, func(h Hypervisor) ([]string, error) { return h.NetworkLeaseMACs(network) })
}

// Close implements Hypervisor.
func (r *Reconnecting) Close() error { return r.current().Close() }
