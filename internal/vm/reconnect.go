package vm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"libvirt.org/go/libvirtxml"
)

// ErrConnectionLost marks an error caused by a broken hypervisor connection
// (libvirtd restarted or died, or the connection's keepalive gave up on it).
// A Hypervisor implementation wraps such errors with it (the libvirt one,
// internal/vm/libvirtvm, classifies libvirt's error codes); Reconnecting
// reconnects on them.
var ErrConnectionLost = errors.New("libvirt connection lost")

// Reconnecting wraps a Hypervisor connection: it dials the first one on the
// first call (or Dial), and when a call fails because the connection broke
// (a libvirtd restart, or its keepalive gave up on a hung libvirtd) it
// reconnects, redialling until the daemon answers again for at most Wait,
// and repeats the call once. A second failure is returned as is.
//
// Every call, dial and wait ends when its ctx does: calls run under Guard, so
// a connection whose own call cannot be interrupted is abandoned too.
type Reconnecting struct {
	dial func(context.Context) (Hypervisor, error)
	// OnReconnect, if set, is told about each reconnection.
	OnReconnect func(cause error)
	// Wait bounds how long a reconnection keeps redialling (default 30s);
	// Interval is the pause between dials (default 250ms).
	Wait, Interval time.Duration

	// sem, holding one token, guards the fields below. Unlike a mutex,
	// waiting for it ends with the waiter's ctx (a redial may hold it).
	sem        chan struct{}
	hv         Hypervisor // nil before the first dial and after a failed reconnection
	closed     bool
	reconnects int
}

var _ Hypervisor = (*Reconnecting)(nil)

// NewReconnecting returns the wrapper; it dials through dial when a
// connection is first needed.
func NewReconnecting(dial func(context.Context) (Hypervisor, error)) *Reconnecting {
	return &Reconnecting{dial: dial, sem: make(chan struct{}, 1)}
}

// lock takes r's token, or gives up when ctx ends.
func (r *Reconnecting) lock(ctx context.Context) error {
	select {
	case r.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return abandoned(ctx)
	}
}

func (r *Reconnecting) unlock() { <-r.sem }

// Reconnects counts the reconnections made.
func (r *Reconnecting) Reconnects() int {
	_ = r.lock(context.Background())
	defer r.unlock()
	return r.reconnects
}

// Dial connects now, if no call has yet: a caller that will surely need the
// hypervisor learns at once that it cannot have it.
func (r *Reconnecting) Dial(ctx context.Context) error {
	_, err := r.connection(ctx)
	return err
}

// connection returns the current connection, dialling one if there is none.
func (r *Reconnecting) connection(ctx context.Context) (Hypervisor, error) {
	if err := r.lock(ctx); err != nil {
		return nil, err
	}
	defer r.unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if r.hv == nil {
		// A connect to a hung libvirtd blocks before any keepalive
		// exists: bound it by Wait, not only by the caller's ctx.
		dctx, cancel := context.WithTimeout(ctx, r.wait())
		hv, err := r.dial(dctx)
		cancel()
		if err != nil {
			return nil, err
		}
		r.hv = hv
	}
	return r.hv, nil
}

// retry makes call on the current connection and, if the connection was
// lost, once more on a new one.
func retry[T any](ctx context.Context, r *Reconnecting, call func(Hypervisor) (T, error)) (T, error) {
	hv, err := r.connection(ctx)
	if err != nil {
		var zero T
		return zero, err
	}
	v, err := Guard(ctx, func() (T, error) { return call(hv) }, nil)
	if err == nil || !errors.Is(err, ErrConnectionLost) || ctx.Err() != nil {
		return v, err
	}
	if hv, err = r.replace(ctx, hv, err); err != nil {
		return v, err
	}
	return Guard(ctx, func() (T, error) { return call(hv) }, nil)
}

// replace returns the connection to use instead of lost, whose call failed
// with cause: one that another call made meanwhile, or a new one.
func (r *Reconnecting) replace(ctx context.Context, lost Hypervisor, cause error) (Hypervisor, error) {
	if err := r.lock(ctx); err != nil {
		return nil, fmt.Errorf("%w: %v; %w", ErrConnectionLost, cause, err)
	}
	defer r.unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if r.hv != nil && r.hv != lost {
		return r.hv, nil
	}
	if r.hv == lost {
		_ = lost.Close()
		r.hv = nil
	}
	hv, err := r.redial(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %v; reconnecting failed: %w", ErrConnectionLost, cause, err)
	}
	r.hv = hv
	r.reconnects++
	if r.OnReconnect != nil {
		r.OnReconnect(cause)
	}
	return hv, nil
}

// redial dials until it succeeds, Wait has passed or ctx ends (a restarting
// libvirtd takes a few seconds to listen again).
func (r *Reconnecting) redial(ctx context.Context) (Hypervisor, error) {
	wait, interval := r.wait(), r.Interval
	if interval <= 0 {
		interval = 250 * time.Millisecond
	}
	deadline := time.Now().Add(wait)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		dctx, cancel := context.WithDeadline(ctx, deadline)
		hv, err := r.dial(dctx)
		cancel()
		switch {
		case err == nil:
			return hv, nil
		case ctx.Err() != nil:
			return nil, redialStopped(ctx, err)
		case time.Now().After(deadline):
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, redialStopped(ctx, err)
		case <-t.C:
		}
	}
}

// wait is how long a connect, or redialling, may take (Wait, default 30 s).
func (r *Reconnecting) wait() time.Duration {
	if r.Wait <= 0 {
		return 30 * time.Second
	}
	return r.Wait
}

// redialStopped is redial's error when ctx ended; last is the last dial's.
func redialStopped(ctx context.Context, last error) error {
	if errors.Is(last, ctx.Err()) {
		return last
	}
	return fmt.Errorf("%w (last attempt: %v)", abandoned(ctx), last)
}

func retry0(ctx context.Context, r *Reconnecting, call func(Hypervisor) error) error {
	_, err := retry(ctx, r, func(h Hypervisor) (struct{}, error) { return struct{}{}, call(h) })
	return err
}

// KVMAvailable implements Hypervisor.
func (r *Reconnecting) KVMAvailable(ctx context.Context) (bool, error) {
	return retry(ctx, r, func(h Hypervisor) (bool, error) { return h.KVMAvailable(ctx) })
}

// Version implements Hypervisor.
func (r *Reconnecting) Version(ctx context.Context) (libvirtVersion, hypervisor uint32, err error) {
	v, err := retry(ctx, r, func(h Hypervisor) ([2]uint32, error) {
		lv, hv, err := h.Version(ctx)
		return [2]uint32{lv, hv}, err
	})
	return v[0], v[1], err
}

// CreateVolume implements Hypervisor.
func (r *Reconnecting) CreateVolume(ctx context.Context, pool string, vol *libvirtxml.StorageVolume) (string, error) {
	return retry(ctx, r, func(h Hypervisor) (string, error) { return h.CreateVolume(ctx, pool, vol) })
}

// UploadVolume implements Hypervisor.
func (r *Reconnecting) UploadVolume(ctx context.Context, pool, name string, data []byte) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.UploadVolume(ctx, pool, name, data) })
}

// StreamToVolume implements Hypervisor: r is read once, so a call cut by a
// lost connection is not repeated.
func (r *Reconnecting) StreamToVolume(ctx context.Context, pool, name string, rd io.Reader, size int64) error {
	hv, err := r.connection(ctx)
	if err != nil {
		return err
	}
	_, err = Guard(ctx, func() (struct{}, error) { return struct{}{}, hv.StreamToVolume(ctx, pool, name, rd, size) }, nil)
	return err // the next call reconnects if the connection is lost
}

// StreamFromVolume implements Hypervisor: w has what came before a lost
// connection, so the call is not repeated.
func (r *Reconnecting) StreamFromVolume(ctx context.Context, pool, name string, w io.Writer) error {
	hv, err := r.connection(ctx)
	if err != nil {
		return err
	}
	_, err = Guard(ctx, func() (struct{}, error) { return struct{}{}, hv.StreamFromVolume(ctx, pool, name, w) }, nil)
	return err // the next call reconnects if the connection is lost
}

// VolumeFile implements Hypervisor.
func (r *Reconnecting) VolumeFile(ctx context.Context, pool, name string) (*os.File, error) {
	return retry(ctx, r, func(h Hypervisor) (*os.File, error) { return h.VolumeFile(ctx, pool, name) })
}

// DACImageLabel implements Hypervisor.
func (r *Reconnecting) DACImageLabel(ctx context.Context, name string) (string, error) {
	return retry(ctx, r, func(h Hypervisor) (string, error) { return h.DACImageLabel(ctx, name) })
}

// AttachDisk implements Hypervisor.
func (r *Reconnecting) AttachDisk(ctx context.Context, name string, disk *libvirtxml.DomainDisk) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.AttachDisk(ctx, name, disk) })
}

// DeleteVolume implements Hypervisor.
func (r *Reconnecting) DeleteVolume(ctx context.Context, pool, name string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.DeleteVolume(ctx, pool, name) })
}

// VolumePath implements Hypervisor.
func (r *Reconnecting) VolumePath(ctx context.Context, pool, name string) (string, error) {
	return retry(ctx, r, func(h Hypervisor) (string, error) { return h.VolumePath(ctx, pool, name) })
}

// VolumeBacking implements Hypervisor.
func (r *Reconnecting) VolumeBacking(ctx context.Context, pool, name string) (string, error) {
	return retry(ctx, r, func(h Hypervisor) (string, error) { return h.VolumeBacking(ctx, pool, name) })
}

// VolumeNames implements Hypervisor.
func (r *Reconnecting) VolumeNames(ctx context.Context, pool string) ([]string, error) {
	return retry(ctx, r, func(h Hypervisor) ([]string, error) { return h.VolumeNames(ctx, pool) })
}

// VolumeCapacity implements Hypervisor.
func (r *Reconnecting) VolumeCapacity(ctx context.Context, path string) (uint64, error) {
	return retry(ctx, r, func(h Hypervisor) (uint64, error) { return h.VolumeCapacity(ctx, path) })
}

// Define implements Hypervisor.
func (r *Reconnecting) Define(ctx context.Context, xml string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.Define(ctx, xml) })
}

// Start implements Hypervisor.
func (r *Reconnecting) Start(ctx context.Context, name string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.Start(ctx, name) })
}

// Suspend implements Hypervisor.
func (r *Reconnecting) Suspend(ctx context.Context, name string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.Suspend(ctx, name) })
}

// AttachInterface implements Hypervisor.
func (r *Reconnecting) AttachInterface(ctx context.Context, name string, iface *libvirtxml.DomainInterface) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.AttachInterface(ctx, name, iface) })
}

// AttachFilesystem implements Hypervisor.
func (r *Reconnecting) AttachFilesystem(ctx context.Context, name string, fs *libvirtxml.DomainFilesystem) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.AttachFilesystem(ctx, name, fs) })
}

// Save implements Hypervisor: not repeated on a new connection (the
// domain may have stopped, its file half written).
func (r *Reconnecting) Save(ctx context.Context, name, path string) error {
	hv, err := r.connection(ctx)
	if err != nil {
		return err
	}
	_, err = Guard(ctx, func() (struct{}, error) { return struct{}{}, hv.Save(ctx, name, path) }, nil)
	return err // the next call reconnects if the connection is lost
}

// RestoreStream implements Hypervisor: not repeated on a new connection
// (the stream is read once).
func (r *Reconnecting) RestoreStream(ctx context.Context, rd io.Reader, pipeDir string) error {
	hv, err := r.connection(ctx)
	if err != nil {
		return err
	}
	_, err = Guard(ctx, func() (struct{}, error) { return struct{}{}, hv.RestoreStream(ctx, rd, pipeDir) }, nil)
	return err
}

// Destroy implements Hypervisor.
func (r *Reconnecting) Destroy(ctx context.Context, name string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.Destroy(ctx, name) })
}

// Undefine implements Hypervisor.
func (r *Reconnecting) Undefine(ctx context.Context, name string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.Undefine(ctx, name) })
}

// Owner implements Hypervisor.
func (r *Reconnecting) Owner(ctx context.Context, name string) (string, error) {
	return retry(ctx, r, func(h Hypervisor) (string, error) { return h.Owner(ctx, name) })
}

// DetachDisk implements Hypervisor.
func (r *Reconnecting) DetachDisk(ctx context.Context, name, source string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.DetachDisk(ctx, name, source) })
}

// SetOwner implements Hypervisor.
func (r *Reconnecting) SetOwner(ctx context.Context, name, ownerXML string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.SetOwner(ctx, name, ownerXML) })
}

// DomainNames implements Hypervisor.
func (r *Reconnecting) DomainNames(ctx context.Context) ([]string, error) {
	return retry(ctx, r, func(h Hypervisor) ([]string, error) { return h.DomainNames(ctx) })
}

// IsActive implements Hypervisor.
func (r *Reconnecting) IsActive(ctx context.Context, name string) (bool, error) {
	return retry(ctx, r, func(h Hypervisor) (bool, error) { return h.IsActive(ctx, name) })
}

// State implements Hypervisor.
func (r *Reconnecting) State(ctx context.Context, name string) (DomainState, error) {
	return retry(ctx, r, func(h Hypervisor) (DomainState, error) { return h.State(ctx, name) })
}

// Addresses implements Hypervisor.
func (r *Reconnecting) Addresses(ctx context.Context, name string, source AddressSource) ([]Lease, error) {
	return retry(ctx, r, func(h Hypervisor) ([]Lease, error) { return h.Addresses(ctx, name, source) })
}

// NetworkDHCP implements Hypervisor.
func (r *Reconnecting) NetworkDHCP(ctx context.Context, network string) (DHCPInfo, error) {
	return retry(ctx, r, func(h Hypervisor) (DHCPInfo, error) { return h.NetworkDHCP(ctx, network) })
}

// AddDHCPHost implements Hypervisor.
func (r *Reconnecting) AddDHCPHost(ctx context.Context, network string, host DHCPHost) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.AddDHCPHost(ctx, network, host) })
}

// DeleteDHCPHost implements Hypervisor.
func (r *Reconnecting) DeleteDHCPHost(ctx context.Context, network, name string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.DeleteDHCPHost(ctx, network, name) })
}

// NetworkLeaseMACs implements Hypervisor.
func (r *Reconnecting) NetworkLeaseMACs(ctx context.Context, network string) ([]string, error) {
	return retry(ctx, r, func(h Hypervisor) ([]string, error) { return h.NetworkLeaseMACs(ctx, network) })
}

// NetworkGateway implements Hypervisor.
func (r *Reconnecting) NetworkGateway(ctx context.Context, network string) (string, error) {
	return retry(ctx, r, func(h Hypervisor) (string, error) { return h.NetworkGateway(ctx, network) })
}

// EnsureNWFilters implements Hypervisor.
func (r *Reconnecting) EnsureNWFilters(ctx context.Context, requires []string, defs []NWFilter) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.EnsureNWFilters(ctx, requires, defs) })
}

// FilterBindings implements Hypervisor.
func (r *Reconnecting) FilterBindings(ctx context.Context) ([]FilterBinding, error) {
	return retry(ctx, r, func(h Hypervisor) ([]FilterBinding, error) { return h.FilterBindings(ctx) })
}

// DeleteFilterBinding implements Hypervisor.
func (r *Reconnecting) DeleteFilterBinding(ctx context.Context, portDev, owner string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.DeleteFilterBinding(ctx, portDev, owner) })
}

// PinFilterAddress implements Hypervisor.
func (r *Reconnecting) PinFilterAddress(ctx context.Context, name, mac, ip string) error {
	return retry0(ctx, r, func(h Hypervisor) error { return h.PinFilterAddress(ctx, name, mac, ip) })
}

// Close implements Hypervisor. Calls after Close fail.
func (r *Reconnecting) Close() error {
	_ = r.lock(context.Background())
	defer r.unlock()
	r.closed = true
	if r.hv == nil {
		return nil
	}
	hv := r.hv
	r.hv = nil
	return hv.Close()
}
