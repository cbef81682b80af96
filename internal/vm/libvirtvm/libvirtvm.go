// Package libvirtvm is the libvirt implementation of vm.Hypervisor, over
// libvirt's cgo binding: the connection with its keepalive on libvirt's event
// loop, the calls abandoned when their ctx ends, and libvirt's error codes
// mapped to vm.ErrNotFound, vm.ErrNoOwner, vm.ErrAgentNotReady and
// vm.ErrConnectionLost.
//
// Importing it registers Connect as vm.Connect's Connector (the default of
// lifecycle.Open). Only the executables that talk to libvirt import it
// (prepare, cleanup, the admin tool, the test tooling): the config and run
// stages are built without libvirt's C library and the ~60 shared libraries
// it loads, and start in a few milliseconds.
package libvirtvm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/user"
	"strings"
	"sync"
	"time"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

func init() {
	vm.RegisterConnector(func(ctx context.Context, uri string) (vm.Hypervisor, error) {
		c, err := Connect(ctx, uri)
		if err != nil {
			return nil, err // not a typed nil in the interface
		}
		return c, nil
	})
}

// Conn implements vm.Hypervisor over a libvirt connection.
//
// libvirt's calls cannot be interrupted: each runs in a goroutine of its own
// (vm.Guard), and a method returns ctx's error as soon as ctx ends, abandoning
// the call. The connection stays open while any call, abandoned or not, still
// uses it. A dead or hung libvirtd is noticed within seconds: the connection
// sends keepalives (KeepAliveInterval, KeepAliveCount) and fails its calls
// when they go unanswered.
type Conn struct {
	conn *libvirt.Connect
	// remote: the libvirt is another host's (vm.LocalURI): a path that is
	// no volume of its pools is never looked up in this host's files.
	remote bool

	mu      sync.Mutex
	calls   int  // calls using conn, abandoned ones included
	closing bool // Close was called: conn goes when calls drops to 0
}

var _ vm.Hypervisor = (*Conn)(nil)

// Keepalive of a libvirt connection: after KeepAliveInterval seconds without
// a message from libvirtd the client asks whether it is there, and after
// KeepAliveCount questions in a row without an answer it closes the
// connection, failing the calls that wait on it.
const (
	KeepAliveInterval = 2
	KeepAliveCount    = 3
)

// Connect opens a libvirt connection with keepalive, giving up when ctx
// ends.
func Connect(ctx context.Context, uri string) (*Conn, error) {
	if err := startEventLoop(); err != nil {
		return nil, err
	}
	conn, err := vm.Guard(ctx, func() (*libvirt.Connect, error) { return libvirt.NewConnect(uri) },
		func(c *libvirt.Connect) { _, _ = c.Close() })
	if err != nil {
		return nil, fmt.Errorf("connect to libvirt at %s: %w%s", uri, err, accessHint(err))
	}
	if err := keepAlive(conn); err != nil {
		_, _ = conn.Close()
		return nil, fmt.Errorf("libvirt at %s: %w", uri, err)
	}
	return &Conn{conn: conn, remote: !vm.LocalURI(uri)}, nil
}

// eventLoop is libvirt's default event loop, registered once per process
// before the first connection. The connections' keepalive timers run in it.
var eventLoop struct {
	once sync.Once
	err  error
}

// startEventLoop registers libvirt's default event loop implementation and
// runs it, for the rest of the process, in a goroutine of its own.
func startEventLoop() error {
	eventLoop.once.Do(func() {
		if err := libvirt.EventRegisterDefaultImpl(); err != nil {
			eventLoop.err = fmt.Errorf("register libvirt's event loop: %w", err)
			return
		}
		go runEventLoop()
	})
	return eventLoop.err
}

// runEventLoop dispatches libvirt's events (keepalive timers, socket
// watches) forever.
func runEventLoop() {
	for {
		if err := libvirt.EventRunDefaultImpl(); err != nil {
			time.Sleep(100 * time.Millisecond) // do not spin on a lasting error
		}
	}
}

// keepAlive turns on the connection's keepalive. A driver without it (the
// in-process test driver, a libvirtd too old to answer keepalives) needs
// none or cannot have it: the connection is used without.
func keepAlive(conn *libvirt.Connect) error {
	err := conn.SetKeepAlive(KeepAliveInterval, KeepAliveCount)
	switch code(err) {
	case libvirt.ERR_OK, libvirt.ERR_NO_SUPPORT:
		// ERR_OK with an error: libvirtd does not support keepalive.
		return nil
	}
	return fmt.Errorf("turn on keepalive: %w", err)
}

// call runs fn, which uses l.conn, under vm.Guard, keeping the connection
// open until fn returns. An error on a connection that is no longer alive
// (the keepalive gave up, libvirtd went away) is marked vm.ErrConnectionLost.
func call[T any](ctx context.Context, l *Conn, fn func() (T, error)) (T, error) {
	return vm.Guard(ctx, func() (T, error) {
		var zero T
		if err := l.enter(); err != nil {
			return zero, err
		}
		defer l.leave()
		v, err := fn()
		return v, l.markLost(err)
	}, nil)
}

// call0 is call for fn without a result.
func call0(ctx context.Context, l *Conn, fn func() error) error {
	_, err := call(ctx, l, func() (struct{}, error) { return struct{}{}, fn() })
	return err
}

// enter registers a call on the connection; it fails after Close.
func (l *Conn) enter() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closing {
		return vm.ErrClosed
	}
	l.calls++
	return nil
}

// leave ends a call, and closes the connection if Close is waiting for it.
func (l *Conn) leave() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls--
	if l.closing && l.calls == 0 {
		_, _ = l.conn.Close()
	}
}

// markLost marks err with vm.ErrConnectionLost when it means the connection
// is gone: by libvirt's error code (connectionLost), or because the
// connection is no longer alive, whatever the code says. vm.Reconnecting
// reconnects on that mark alone.
func (l *Conn) markLost(err error) error {
	if err == nil || errors.Is(err, vm.ErrConnectionLost) {
		return err
	}
	if connectionLost(err) {
		return fmt.Errorf("%w: %w", vm.ErrConnectionLost, err)
	}
	if alive, aerr := l.conn.IsAlive(); aerr == nil && !alive {
		return fmt.Errorf("%w: %w", vm.ErrConnectionLost, err)
	}
	var lerr libvirt.Error
	if errors.As(err, &lerr) {
		return &vm.HypervisorError{Err: err}
	}
	return err
}

// connectionLost reports whether libvirt's error code says that the
// connection itself is gone (libvirtd restarted or died, the RPC failed).
func connectionLost(err error) bool {
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

// accessHint explains a refused connection: on a system libvirtd, an
// unprivileged user gets in through the libvirt group (socket permissions or
// the polkit rule that grants org.libvirt.unix.manage to that group).
func accessHint(err error) string {
	switch c := code(err); {
	case c == libvirt.ERR_AUTH_FAILED, c == libvirt.ERR_AUTH_UNAVAILABLE, c == libvirt.ERR_AUTH_CANCELLED,
		strings.Contains(err.Error(), "Permission denied"):
		who := "this user"
		if u, uerr := user.Current(); uerr == nil {
			who = "user " + u.Username
		}
		return fmt.Sprintf(" (%s may not manage libvirt: add it to the libvirt group and check the polkit rule for org.libvirt.unix.manage; `libvirt-executor doctor` checks both)", who)
	}
	return ""
}

// Close implements vm.Hypervisor. The connection is closed now if no call uses
// it, else when the last one returns: closing a libvirt connection under a
// running call is not safe. Calls made after Close fail.
func (l *Conn) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closing {
		return nil
	}
	l.closing = true
	if l.calls > 0 {
		return nil
	}
	_, err := l.conn.Close()
	return err
}

func code(err error) libvirt.ErrorNumber {
	var lerr libvirt.Error
	if errors.As(err, &lerr) {
		return lerr.Code
	}
	return libvirt.ERR_OK
}

func notFound(err error, codes ...libvirt.ErrorNumber) error {
	c := code(err)
	for _, want := range codes {
		if c == want {
			return fmt.Errorf("%w: %v", vm.ErrNotFound, err)
		}
	}
	return err
}

// KVMAvailable implements vm.Hypervisor.
func (l *Conn) KVMAvailable(ctx context.Context) (bool, error) {
	return call(ctx, l, func() (bool, error) {
		s, err := l.conn.GetCapabilities()
		if err != nil {
			return false, err
		}
		var caps libvirtxml.Caps
		if err := caps.Unmarshal(s); err != nil {
			return false, err
		}
		for _, g := range caps.Guests {
			if g.Arch.Name != "x86_64" {
				continue
			}
			for _, d := range g.Arch.Domains {
				if d.Type == "kvm" {
					return true, nil
				}
			}
		}
		return false, nil
	})
}

func (l *Conn) pool(name string) (*libvirt.StoragePool, error) {
	p, err := l.conn.LookupStoragePoolByName(name)
	if err != nil {
		return nil, fmt.Errorf("storage pool %q: %w", name, err)
	}
	return p, nil
}

// CreateVolume implements vm.Hypervisor.
func (l *Conn) CreateVolume(ctx context.Context, pool string, vol *libvirtxml.StorageVolume) (string, error) {
	return call(ctx, l, func() (string, error) {
		p, err := l.pool(pool)
		if err != nil {
			return "", err
		}
		defer p.Free()
		x, err := vol.Marshal()
		if err != nil {
			return "", err
		}
		v, err := p.StorageVolCreateXML(x, 0)
		if err != nil {
			return "", err
		}
		defer v.Free()
		return v.GetPath()
	})
}

// volume looks a volume up by pool and name (ErrNotFound if absent).
func (l *Conn) volume(pool, name string) (*libvirt.StorageVol, error) {
	p, err := l.pool(pool)
	if err != nil {
		return nil, err
	}
	defer p.Free()
	v, err := p.LookupStorageVolByName(name)
	if err != nil {
		return nil, notFound(err, libvirt.ERR_NO_STORAGE_VOL)
	}
	return v, nil
}

// UploadVolume implements vm.Hypervisor.
func (l *Conn) UploadVolume(ctx context.Context, pool, name string, data []byte) error {
	return l.StreamToVolume(ctx, pool, name, bytes.NewReader(data), int64(len(data)))
}

// StreamToVolume implements vm.Hypervisor.
func (l *Conn) StreamToVolume(ctx context.Context, pool, name string, r io.Reader, size int64) error {
	if size < 0 {
		return fmt.Errorf("volume %s: negative size %d", name, size)
	}
	return call0(ctx, l, func() error {
		v, err := l.volume(pool, name)
		if err != nil {
			return err
		}
		defer v.Free()
		st, err := l.conn.NewStream(0)
		if err != nil {
			return err
		}
		defer st.Free()
		if err := v.Upload(st, 0, uint64(size), 0); err != nil { //nolint:gosec // G115: size >= 0, checked above
			return err
		}
		// In pieces: libvirt refuses a stream message of more than 32 MiB
		// (and the connection with it).
		buf := make([]byte, 1<<20)
		for left := size; left > 0; {
			n, rerr := io.ReadFull(r, buf[:min(int64(len(buf)), left)])
			for off := 0; off < n; {
				m, err := st.Send(buf[off:n])
				if err != nil {
					_ = st.Abort()
					return err
				}
				off += m
			}
			left -= int64(n)
			if rerr != nil {
				_ = st.Abort()
				return fmt.Errorf("volume %s: reading what goes into it: %w", name, rerr)
			}
		}
		return st.Finish()
	})
}

// StreamFromVolume implements vm.Hypervisor.
func (l *Conn) StreamFromVolume(ctx context.Context, pool, name string, w io.Writer) error {
	return call0(ctx, l, func() error {
		v, err := l.volume(pool, name)
		if err != nil {
			return err
		}
		defer v.Free()
		st, err := l.conn.NewStream(0)
		if err != nil {
			return err
		}
		defer st.Free()
		if err := v.Download(st, 0, 0, 0); err != nil {
			return err
		}
		buf := make([]byte, 1<<20)
		for {
			n, err := st.Recv(buf)
			if err != nil {
				_ = st.Abort()
				return err
			}
			if n == 0 {
				return st.Finish()
			}
			if _, err := w.Write(buf[:n]); err != nil {
				_ = st.Abort()
				return err
			}
		}
	})
}

// DeleteVolume implements vm.Hypervisor.
func (l *Conn) DeleteVolume(ctx context.Context, pool, name string) error {
	return call0(ctx, l, func() error {
		v, err := l.volume(pool, name)
		if err != nil {
			return err
		}
		defer v.Free()
		return notFound(v.Delete(0), libvirt.ERR_NO_STORAGE_VOL)
	})
}

// VolumePath implements vm.Hypervisor.
func (l *Conn) VolumePath(ctx context.Context, pool, name string) (string, error) {
	return call(ctx, l, func() (string, error) {
		v, err := l.volume(pool, name)
		if err != nil {
			return "", err
		}
		defer v.Free()
		return v.GetPath()
	})
}

// VolumeBacking implements vm.Hypervisor.
func (l *Conn) VolumeBacking(ctx context.Context, pool, name string) (string, error) {
	return call(ctx, l, func() (string, error) {
		v, err := l.volume(pool, name)
		if err != nil {
			return "", err
		}
		defer v.Free()
		x, err := v.GetXMLDesc(0)
		if err != nil {
			return "", notFound(err, libvirt.ERR_NO_STORAGE_VOL)
		}
		var desc libvirtxml.StorageVolume
		if err := desc.Unmarshal(x); err != nil {
			return "", err
		}
		if desc.BackingStore == nil {
			return "", nil
		}
		return desc.BackingStore.Path, nil
	})
}

// VolumeNames implements vm.Hypervisor.
func (l *Conn) VolumeNames(ctx context.Context, pool string) ([]string, error) {
	return call(ctx, l, func() ([]string, error) {
		p, err := l.pool(pool)
		if err != nil {
			return nil, err
		}
		defer p.Free()
		// Pick up volumes created or deleted behind libvirt's back.
		_ = p.Refresh(0)
		return p.ListStorageVolumes()
	})
}

// VolumeCapacity implements vm.Hypervisor. It asks libvirt first and, on
// this host's libvirt, falls back to reading the image header (qcow2) or
// size (raw) for a base that lives outside any pool. Another host's
// libvirt must know the path as a volume of one of its pools: this host's
// file of that name, if any, is not that host's.
func (l *Conn) VolumeCapacity(ctx context.Context, path string) (uint64, error) {
	return call(ctx, l, func() (uint64, error) {
		v, err := l.conn.LookupStorageVolByPath(path)
		if err == nil {
			defer v.Free()
			info, err := v.GetInfo()
			if err == nil {
				return info.Capacity, nil
			}
			if l.remote {
				return 0, fmt.Errorf("volume %s: %w", path, err)
			}
		} else if l.remote {
			return 0, fmt.Errorf("%s is not a volume of a storage pool of that host's libvirt (%v): on another host the image must be in one of its pools (copy it into the pool's directory there, then virsh pool-refresh POOL)", path, err)
		}
		return imageVirtualSize(path)
	})
}

// imageVirtualSize reads the virtual size of a qcow2 image from its header, or
// the size of any other file.
func imageVirtualSize(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	hdr := make([]byte, 32)
	if _, err := io.ReadFull(f, hdr); err == nil && string(hdr[:4]) == "QFI\xfb" {
		return binary.BigEndian.Uint64(hdr[24:32]), nil
	}
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return uint64(max(st.Size(), 0)), nil //nolint:gosec // G115: a file size is never negative
}

func (l *Conn) domain(name string) (*libvirt.Domain, error) {
	d, err := l.conn.LookupDomainByName(name)
	if err != nil {
		return nil, notFound(err, libvirt.ERR_NO_DOMAIN)
	}
	return d, nil
}

// Define implements vm.Hypervisor.
func (l *Conn) Define(ctx context.Context, xml string) error {
	return call0(ctx, l, func() error {
		d, err := l.conn.DomainDefineXMLFlags(xml, libvirt.DOMAIN_DEFINE_VALIDATE)
		if err != nil {
			return err
		}
		return d.Free()
	})
}

// Start implements vm.Hypervisor.
func (l *Conn) Start(ctx context.Context, name string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		err = d.Create()
		if err != nil && code(err) == libvirt.ERR_OPERATION_INVALID {
			// Repeated after a reconnect: the first call may have started it.
			if active, aerr := d.IsActive(); aerr == nil && active {
				return nil
			}
		}
		return err
	})
}

// Destroy implements vm.Hypervisor.
func (l *Conn) Destroy(ctx context.Context, name string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		if err := d.Destroy(); err != nil && code(err) != libvirt.ERR_OPERATION_INVALID {
			return notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		return nil
	})
}

// Suspend implements vm.Hypervisor.
func (l *Conn) Suspend(ctx context.Context, name string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		st, _, err := d.GetState()
		if err != nil {
			return notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		if st != libvirt.DOMAIN_RUNNING && st != libvirt.DOMAIN_BLOCKED {
			return nil // paused already, or not running
		}
		if err := d.Suspend(); err != nil && code(err) != libvirt.ERR_OPERATION_INVALID {
			return notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		return nil
	})
}

// Undefine implements vm.Hypervisor.
func (l *Conn) Undefine(ctx context.Context, name string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		flags := libvirt.DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.DOMAIN_UNDEFINE_SNAPSHOTS_METADATA |
			libvirt.DOMAIN_UNDEFINE_NVRAM | libvirt.DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
		err = d.UndefineFlags(flags)
		if c := code(err); c == libvirt.ERR_NO_SUPPORT || c == libvirt.ERR_INVALID_ARG {
			// A driver that knows none of these extras (the test driver) has
			// none of them to remove.
			err = d.Undefine()
		}
		return notFound(err, libvirt.ERR_NO_DOMAIN)
	})
}

// DetachDisk implements vm.Hypervisor. Each definition, persistent and
// live, is read and changed on its own: after a hot unplug the guest has
// not completed yet, the live one still has the disk that the persistent
// one lost.
func (l *Conn) DetachDisk(ctx context.Context, name, source string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		active, err := d.IsActive()
		if err != nil {
			return notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		persistent, err := d.IsPersistent()
		if err != nil {
			return notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		type def struct {
			read   libvirt.DomainXMLFlags
			detach libvirt.DomainDeviceModifyFlags
		}
		var defs []def
		if persistent {
			defs = append(defs, def{libvirt.DOMAIN_XML_INACTIVE, libvirt.DOMAIN_DEVICE_MODIFY_CONFIG})
		}
		if active {
			defs = append(defs, def{0, libvirt.DOMAIN_DEVICE_MODIFY_LIVE})
		}
		for _, df := range defs {
			dx, err := domainXML(d, df.read)
			if err != nil {
				return err
			}
			if dx.Devices == nil {
				continue
			}
			for _, disk := range dx.Devices.Disks {
				if disk.Source == nil || disk.Source.File == nil || disk.Source.File.File != source {
					continue
				}
				dxml, err := disk.Marshal()
				if err != nil {
					return err
				}
				if err := d.DetachDeviceFlags(dxml, df.detach); err != nil {
					return notFound(err, libvirt.ERR_NO_DOMAIN)
				}
			}
		}
		return nil
	})
}

// VolumeFile implements vm.Hypervisor.
func (l *Conn) VolumeFile(ctx context.Context, pool, name string) (*os.File, error) {
	if l.remote {
		return nil, nil
	}
	path, err := l.VolumePath(ctx, pool, name)
	if err != nil {
		return nil, err
	}
	return vm.OpenVolumeFile(path), nil
}

// domainXML is the domain's XML (live, or as flags say), parsed.
func domainXML(d *libvirt.Domain, flags libvirt.DomainXMLFlags) (*libvirtxml.Domain, error) {
	x, err := d.GetXMLDesc(flags)
	if err != nil {
		return nil, notFound(err, libvirt.ERR_NO_DOMAIN)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(x); err != nil {
		return nil, err
	}
	return &dx, nil
}

// DACImageLabel implements vm.Hypervisor: "" for another host's libvirt
// (its users and groups are not this host's: a scratch volume there stays
// 0600, read through libvirt's stream).
func (l *Conn) DACImageLabel(ctx context.Context, name string) (string, error) {
	if l.remote {
		return "", nil
	}
	return call(ctx, l, func() (string, error) {
		d, err := l.domain(name)
		if err != nil {
			return "", err
		}
		defer d.Free()
		dx, err := domainXML(d, 0)
		if err != nil {
			return "", err
		}
		return vm.DACImageLabelOf(dx), nil
	})
}

// AttachDisk implements vm.Hypervisor.
func (l *Conn) AttachDisk(ctx context.Context, name string, disk *libvirtxml.DomainDisk) error {
	return l.attachLive(ctx, name, disk)
}

// AttachFilesystem implements vm.Hypervisor.
func (l *Conn) AttachFilesystem(ctx context.Context, name string, fs *libvirtxml.DomainFilesystem) error {
	return l.attachLive(ctx, name, fs)
}

// device is a libvirt device definition (libvirtxml's DomainDisk,
// DomainInterface, DomainFilesystem, ...).
type device interface{ Marshal() (string, error) }

// attachLive hot-plugs dev into the running domain name.
func (l *Conn) attachLive(ctx context.Context, name string, dev device) error {
	x, err := dev.Marshal()
	if err != nil {
		return err
	}
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		return notFound(d.AttachDeviceFlags(x, libvirt.DOMAIN_DEVICE_MODIFY_LIVE), libvirt.ERR_NO_DOMAIN)
	})
}

// Owner implements vm.Hypervisor.
func (l *Conn) Owner(ctx context.Context, name string) (string, error) {
	return call(ctx, l, func() (string, error) {
		d, err := l.domain(name)
		if err != nil {
			return "", err
		}
		defer d.Free()
		s, err := d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, vm.OwnerNamespace, libvirt.DOMAIN_AFFECT_CONFIG)
		if code(err) == libvirt.ERR_OPERATION_INVALID {
			// A transient domain (undefined while running) has no
			// persistent config; its live definition carries the record.
			s, err = d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, vm.OwnerNamespace, libvirt.DOMAIN_AFFECT_LIVE)
		}
		if err != nil {
			switch code(err) {
			case libvirt.ERR_NO_DOMAIN_METADATA:
				return "", vm.ErrNoOwner
			case libvirt.ERR_NO_DOMAIN:
				return "", notFound(err, libvirt.ERR_NO_DOMAIN)
			}
			return "", err
		}
		return s, nil
	})
}

// SetOwner implements vm.Hypervisor.
func (l *Conn) SetOwner(ctx context.Context, name, ownerXML string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		flags := libvirt.DOMAIN_AFFECT_CONFIG
		if active, err := d.IsActive(); err == nil && active {
			flags |= libvirt.DOMAIN_AFFECT_LIVE
		}
		return d.SetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, ownerXML, "lve", vm.OwnerNamespace, flags)
	})
}

// DomainNames implements vm.Hypervisor.
func (l *Conn) DomainNames(ctx context.Context) ([]string, error) {
	return call(ctx, l, func() ([]string, error) {
		doms, err := l.conn.ListAllDomains(0)
		if err != nil {
			return nil, err
		}
		var names []string
		for _, d := range doms {
			if n, err := d.GetName(); err == nil {
				names = append(names, n)
			}
			_ = d.Free()
		}
		return names, nil
	})
}

// IsActive implements vm.Hypervisor.
func (l *Conn) IsActive(ctx context.Context, name string) (bool, error) {
	return call(ctx, l, func() (bool, error) {
		d, err := l.domain(name)
		if err != nil {
			return false, err
		}
		defer d.Free()
		return d.IsActive()
	})
}

// State implements vm.Hypervisor.
func (l *Conn) State(ctx context.Context, name string) (vm.DomainState, error) {
	return call(ctx, l, func() (vm.DomainState, error) {
		d, err := l.domain(name)
		if err != nil {
			return vm.DomainState{}, err
		}
		defer d.Free()
		st, reason, err := d.GetState()
		if err != nil {
			return vm.DomainState{}, notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		return describeState(st, reason), nil
	})
}

func describeState(st libvirt.DomainState, reason int) vm.DomainState {
	why := func(reasons map[int]string) string {
		if r, ok := reasons[reason]; ok {
			return " (" + r + ")"
		}
		return ""
	}
	switch st {
	case libvirt.DOMAIN_RUNNING, libvirt.DOMAIN_BLOCKED:
		return vm.DomainState{Code: vm.StateRunning, Running: true, Summary: "running"}
	case libvirt.DOMAIN_PAUSED:
		return vm.DomainState{
			Code:    vm.StatePaused,
			IOError: reason == int(libvirt.DOMAIN_PAUSED_IOERROR),
			Summary: "paused" + why(map[int]string{
				int(libvirt.DOMAIN_PAUSED_IOERROR):       "I/O error",
				int(libvirt.DOMAIN_PAUSED_USER):          "by a user",
				int(libvirt.DOMAIN_PAUSED_CRASHED):       "guest crashed",
				int(libvirt.DOMAIN_PAUSED_SHUTTING_DOWN): "shutting down",
				int(libvirt.DOMAIN_PAUSED_WATCHDOG):      "watchdog",
			}),
		}
	case libvirt.DOMAIN_SHUTDOWN:
		return vm.DomainState{Code: vm.StateShuttingDown, Summary: "shutting down"}
	case libvirt.DOMAIN_SHUTOFF:
		return vm.DomainState{Code: vm.StateShutOff, Summary: "shut off" + why(map[int]string{
			int(libvirt.DOMAIN_SHUTOFF_SHUTDOWN):  "the guest shut down",
			int(libvirt.DOMAIN_SHUTOFF_DESTROYED): "destroyed",
			int(libvirt.DOMAIN_SHUTOFF_CRASHED):   "crashed",
			int(libvirt.DOMAIN_SHUTOFF_FAILED):    "failed to start",
		})}
	case libvirt.DOMAIN_CRASHED:
		return vm.DomainState{Code: vm.StateCrashed, Summary: "crashed" + why(map[int]string{int(libvirt.DOMAIN_CRASHED_PANICKED): "guest kernel panic"})}
	case libvirt.DOMAIN_PMSUSPENDED:
		return vm.DomainState{Code: vm.StateSuspended, Summary: "suspended by the guest"}
	}
	return vm.DomainState{Code: vm.StateUnknown, Summary: fmt.Sprintf("state %d, reason %d", st, reason)}
}

// Addresses implements vm.Hypervisor. With SourceLease libvirt matches the
// network's active, unexpired leases against this domain's own MACs.
func (l *Conn) Addresses(ctx context.Context, name string, source vm.AddressSource) ([]vm.Lease, error) {
	return call(ctx, l, func() ([]vm.Lease, error) {
		d, err := l.domain(name)
		if err != nil {
			return nil, err
		}
		defer d.Free()
		src := libvirt.DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
		if source == vm.SourceAgent {
			src = libvirt.DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT
		}
		ifaces, err := d.ListAllInterfaceAddresses(src)
		if err != nil {
			if c := code(err); source == vm.SourceAgent && (c == libvirt.ERR_AGENT_UNRESPONSIVE || c == libvirt.ERR_AGENT_UNSYNCED) {
				return nil, fmt.Errorf("%w: %v", vm.ErrAgentNotReady, err)
			}
			return nil, err
		}
		var out []vm.Lease
		for _, i := range ifaces {
			for _, a := range i.Addrs {
				if a.Type != libvirt.IP_ADDR_TYPE_IPV4 {
					continue
				}
				if ip := net.ParseIP(a.Addr); ip != nil {
					out = append(out, vm.Lease{MAC: strings.ToLower(i.Hwaddr), IP: ip})
				}
			}
		}
		return out, nil
	})
}

// NetworkLeaseMACs implements vm.Hypervisor.
func (l *Conn) NetworkLeaseMACs(ctx context.Context, network string) ([]string, error) {
	return call(ctx, l, func() ([]string, error) {
		n, err := l.conn.LookupNetworkByName(network)
		if err != nil {
			return nil, fmt.Errorf("network %q: %w", network, err)
		}
		defer n.Free()
		leases, err := n.GetDHCPLeases()
		if err != nil {
			return nil, err
		}
		macs := make([]string, 0, len(leases))
		for _, le := range leases {
			macs = append(macs, strings.ToLower(le.Mac))
		}
		return macs, nil
	})
}

// Host facts for diagnostics (not part of vm.Hypervisor: only the admin
// command's doctor uses them). Like the Hypervisor methods, they give up
// when ctx ends.

// Version returns the libvirt version (the daemon's, over a remote
// connection) and the hypervisor's (QEMU) version.
func (l *Conn) Version(ctx context.Context) (libvirtVersion, hypervisor uint32, err error) {
	v, err := call(ctx, l, func() ([2]uint32, error) {
		lv, err := l.conn.GetLibVersion()
		if err != nil {
			return [2]uint32{}, err
		}
		hv, err := l.conn.GetVersion()
		return [2]uint32{lv, hv}, err
	})
	return v[0], v[1], err
}

// poolFacts is what PoolActive reports.
type poolFacts struct {
	active bool
	path   string
}

// PoolActive reports whether the storage pool exists and is active, and its
// target path.
func (l *Conn) PoolActive(ctx context.Context, name string) (active bool, path string, err error) {
	f, err := call(ctx, l, func() (poolFacts, error) {
		var f poolFacts
		p, err := l.pool(name)
		if err != nil {
			return f, err
		}
		defer p.Free()
		if f.active, err = p.IsActive(); err != nil {
			return poolFacts{}, err
		}
		x, err := p.GetXMLDesc(0)
		if err != nil {
			return f, err
		}
		var px libvirtxml.StoragePool
		if err := px.Unmarshal(x); err == nil && px.Target != nil {
			f.path = px.Target.Path
		}
		return f, nil
	})
	return f.active, f.path, err
}

// NetworkAddress returns the host's IPv4 address on the network (its
// <ip address=...>): where the guests reach the host.
func (l *Conn) NetworkAddress(ctx context.Context, name string) (string, error) {
	a, err := l.NetworkGateway(ctx, name)
	if err == nil && a == "" {
		err = fmt.Errorf("network %s has no IPv4 address of the host (a bridge of the host's LAN?): pass the address the guests reach this host at", name)
	}
	return a, err
}

// NetworkGateway implements vm.Hypervisor.
func (l *Conn) NetworkGateway(ctx context.Context, name string) (string, error) {
	return call(ctx, l, func() (string, error) {
		n, err := l.conn.LookupNetworkByName(name)
		if err != nil {
			return "", err
		}
		defer n.Free()
		x, err := n.GetXMLDesc(0)
		if err != nil {
			return "", err
		}
		var nx libvirtxml.Network
		if err := nx.Unmarshal(x); err != nil {
			return "", err
		}
		for _, ip := range nx.IPs {
			if a := net.ParseIP(ip.Address); a != nil && a.To4() != nil {
				return a.String(), nil
			}
		}
		return "", nil
	})
}

// networkFacts is what NetworkActive reports.
type networkFacts struct{ active, dhcp bool }

// NetworkActive reports whether the network exists and is active, and
// whether libvirt serves DHCP on it.
func (l *Conn) NetworkActive(ctx context.Context, name string) (active, dhcp bool, err error) {
	f, err := call(ctx, l, func() (networkFacts, error) {
		var f networkFacts
		n, err := l.conn.LookupNetworkByName(name)
		if err != nil {
			return f, err
		}
		defer n.Free()
		if f.active, err = n.IsActive(); err != nil {
			return networkFacts{}, err
		}
		x, err := n.GetXMLDesc(0)
		if err != nil {
			return f, err
		}
		var nx libvirtxml.Network
		if err := nx.Unmarshal(x); err != nil {
			return f, err
		}
		for _, ip := range nx.IPs {
			if ip.DHCP != nil {
				f.dhcp = true
			}
		}
		return f, nil
	})
	return f.active, f.dhcp, err
}

// NWFilterDefined reports whether libvirt has the network filter name
// (virsh nwfilter-list).
func (l *Conn) NWFilterDefined(ctx context.Context, name string) (bool, error) {
	return call(ctx, l, func() (bool, error) {
		f, err := l.conn.LookupNWFilterByName(name)
		if err != nil {
			var le libvirt.Error
			if errors.As(err, &le) && le.Code == libvirt.ERR_NO_NWFILTER {
				return false, nil
			}
			return false, err
		}
		_ = f.Free()
		return true, nil
	})
}

// FilterBindings implements vm.Hypervisor.
func (l *Conn) FilterBindings(ctx context.Context) ([]vm.FilterBinding, error) {
	return call(ctx, l, func() ([]vm.FilterBinding, error) {
		bs, err := l.conn.ListAllNWFilterBindings(0)
		if code(err) == libvirt.ERR_NO_SUPPORT {
			return nil, nil // a driver without network filters has no bindings
		}
		if err != nil {
			return nil, err
		}
		var out []vm.FilterBinding
		var errs []error
		for i := range bs {
			x, err := bs[i].GetXMLDesc(0)
			_ = bs[i].Free()
			if err != nil {
				if code(err) != libvirt.ERR_NO_NWFILTER_BINDING {
					errs = append(errs, err)
				}
				continue // gone meanwhile
			}
			var b libvirtxml.NWFilterBinding
			if err := b.Unmarshal(x); err != nil {
				errs = append(errs, fmt.Errorf("a network filter binding's description: %w", err))
				continue
			}
			fb := vm.FilterBinding{}
			if b.PortDev != nil {
				fb.PortDev = b.PortDev.Name
			}
			if b.FilterRef != nil {
				fb.Filter = b.FilterRef.Filter
			}
			if b.Owner != nil {
				fb.OwnerName, fb.OwnerUUID = b.Owner.Name, b.Owner.UUID
			}
			out = append(out, fb)
		}
		return out, errors.Join(errs...)
	})
}

// DeleteFilterBinding implements vm.Hypervisor.
func (l *Conn) DeleteFilterBinding(ctx context.Context, portDev, owner string) error {
	return call0(ctx, l, func() error {
		b, err := l.conn.LookupNWFilterBindingByPortDev(portDev)
		if err != nil {
			return notFound(err, libvirt.ERR_NO_NWFILTER_BINDING)
		}
		defer func() { _ = b.Free() }()
		x, err := b.GetXMLDesc(0)
		if err != nil {
			return notFound(err, libvirt.ERR_NO_NWFILTER_BINDING)
		}
		var d libvirtxml.NWFilterBinding
		if err := d.Unmarshal(x); err != nil {
			return fmt.Errorf("network filter binding %s: its description: %w", portDev, err)
		}
		if d.Owner == nil || d.Owner.Name != owner {
			return fmt.Errorf("network filter binding %s: no longer %s's: %w", portDev, owner, vm.ErrNotFound)
		}
		return notFound(b.Delete(), libvirt.ERR_NO_NWFILTER_BINDING)
	})
}

// PinFilterAddress implements vm.Hypervisor: the running domain's
// interface is updated live (libvirt re-instantiates its filter with the
// new parameters; a failure leaves the old one).
func (l *Conn) PinFilterAddress(ctx context.Context, name, mac, ip string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		dx, err := domainXML(d, 0)
		if err != nil {
			return err
		}
		iface, changed, err := vm.PinDomainFilterIP(dx, mac, ip)
		if err != nil || !changed {
			return err
		}
		ix, err := iface.Marshal()
		if err != nil {
			return err
		}
		return notFound(d.UpdateDeviceFlags(ix, libvirt.DOMAIN_DEVICE_MODIFY_LIVE), libvirt.ERR_NO_DOMAIN)
	})
}

// EnsureNWFilters implements vm.Hypervisor.
func (l *Conn) EnsureNWFilters(ctx context.Context, requires []string, defs []vm.NWFilter) error {
	return call0(ctx, l, func() error {
		has := func(name string) (bool, error) {
			f, err := l.conn.LookupNWFilterByName(name)
			if err != nil {
				if code(err) == libvirt.ERR_NO_NWFILTER {
					return false, nil
				}
				return false, err
			}
			_ = f.Free()
			return true, nil
		}
		for _, n := range requires {
			ok, err := has(n)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("libvirt has no network filter %s: install libvirt-daemon-config-nwfilter and ebtables and restart libvirtd (or set l2_filter = false)", n)
			}
		}
		for _, d := range defs {
			// One of ours by name is ours only when its rules are
			// (vm.CheckFilter): one defined by someone else is refused.
			f, err := l.conn.LookupNWFilterByName(d.Name)
			if err == nil {
				x, xerr := f.GetXMLDesc(0)
				_ = f.Free()
				if xerr != nil {
					return fmt.Errorf("network filter %s: %w", d.Name, xerr)
				}
				if err := vm.CheckFilter(d, x); err != nil {
					return err
				}
				continue
			}
			if code(err) != libvirt.ERR_NO_NWFILTER {
				return err
			}
			f, err = l.conn.NWFilterDefineXML(d.XML)
			if err != nil {
				return fmt.Errorf("define network filter %s: %w", d.Name, err)
			}
			_ = f.Free()
		}
		return nil
	})
}

// NetworkDHCP implements vm.Hypervisor: the first IPv4 <ip> of the
// network's XML (its address, netmask or prefix, ranges and hosts) and
// the addresses of its leases.
func (l *Conn) NetworkDHCP(ctx context.Context, network string) (vm.DHCPInfo, error) {
	return call(ctx, l, func() (vm.DHCPInfo, error) {
		var d vm.DHCPInfo
		n, err := l.conn.LookupNetworkByName(network)
		if err != nil {
			return d, fmt.Errorf("network %q: %w", network, err)
		}
		defer n.Free()
		x, err := n.GetXMLDesc(0)
		if err != nil {
			return d, err
		}
		var nx libvirtxml.Network
		if err := nx.Unmarshal(x); err != nil {
			return d, err
		}
		for _, ip := range nx.IPs {
			a := net.ParseIP(ip.Address)
			if a == nil || a.To4() == nil || (ip.Family != "" && ip.Family != "ipv4") {
				continue
			}
			mask := net.CIDRMask(int(ip.Prefix), 32) //nolint:gosec // G115: a prefix of at most 32
			if ip.Netmask != "" {
				if m := net.ParseIP(ip.Netmask); m != nil && m.To4() != nil {
					mask = net.IPMask(m.To4())
				}
			} else if ip.Prefix == 0 {
				mask = net.CIDRMask(24, 32) // libvirt's default for an IPv4 address without one
			}
			d.Gateway = a.To4()
			d.Subnet = &net.IPNet{IP: a.To4().Mask(mask), Mask: mask}
			if ip.DHCP == nil {
				break
			}
			d.Enabled = true
			for _, r := range ip.DHCP.Ranges {
				s, e := net.ParseIP(r.Start), net.ParseIP(r.End)
				if s != nil && e != nil {
					d.Ranges = append(d.Ranges, [2]net.IP{s.To4(), e.To4()})
				}
			}
			for _, h := range ip.DHCP.Hosts {
				d.Hosts = append(d.Hosts, vm.DHCPHost{MAC: strings.ToLower(h.MAC), Name: h.Name, IP: h.IP})
			}
			break
		}
		if !d.Enabled {
			return d, nil
		}
		leases, err := n.GetDHCPLeases()
		if code(err) == libvirt.ERR_NO_SUPPORT {
			err = nil // a driver that keeps no leases (libvirt's test driver): none
		}
		if err != nil {
			return d, err
		}
		for _, le := range leases {
			if a := net.ParseIP(le.IPaddr); a != nil && a.To4() != nil {
				d.Leased = append(d.Leased, a.To4())
			}
		}
		return d, nil
	})
}

// updateDHCPHost applies cmd to the network's DHCP host entries with h:
// on the persistent definition, and on the running network when it runs.
func (l *Conn) updateDHCPHost(network string, cmd libvirt.NetworkUpdateCommand, h libvirtxml.NetworkDHCPHost) error {
	x, err := h.Marshal()
	if err != nil {
		return err
	}
	n, err := l.conn.LookupNetworkByName(network)
	if err != nil {
		return fmt.Errorf("network %q: %w", network, err)
	}
	defer n.Free()
	// The persistent definition where there is one (a transient network
	// has none: libvirt refuses AFFECT_CONFIG there), the running network
	// where it runs.
	var flags libvirt.NetworkUpdateFlags
	if persistent, err := n.IsPersistent(); err == nil && persistent {
		flags |= libvirt.NETWORK_UPDATE_AFFECT_CONFIG
	}
	if active, err := n.IsActive(); err == nil && active {
		flags |= libvirt.NETWORK_UPDATE_AFFECT_LIVE
	}
	return n.Update(cmd, libvirt.NETWORK_SECTION_IP_DHCP_HOST, -1, x, flags)
}

// AddDHCPHost implements vm.Hypervisor.
func (l *Conn) AddDHCPHost(ctx context.Context, network string, h vm.DHCPHost) error {
	mac, err := net.ParseMAC(h.MAC)
	ip := net.ParseIP(h.IP)
	if err != nil || ip == nil || ip.To4() == nil || vm.CheckName(h.Name) != nil {
		return fmt.Errorf("DHCP host entry %q %q %q: want a MAC, a machine name and an IPv4 address", h.MAC, h.Name, h.IP)
	}
	return call0(ctx, l, func() error {
		err := l.updateDHCPHost(network, libvirt.NETWORK_UPDATE_COMMAND_ADD_LAST,
			libvirtxml.NetworkDHCPHost{MAC: mac.String(), Name: h.Name, IP: ip.To4().String()})
		if code(err) == libvirt.ERR_OPERATION_INVALID && strings.Contains(err.Error(), "existing") {
			return fmt.Errorf("%w: %v", vm.ErrAddressTaken, err)
		}
		return err
	})
}

// DeleteDHCPHost implements vm.Hypervisor.
func (l *Conn) DeleteDHCPHost(ctx context.Context, network, name string) error {
	if err := vm.CheckName(name); err != nil {
		return err
	}
	return call0(ctx, l, func() error {
		err := l.updateDHCPHost(network, libvirt.NETWORK_UPDATE_COMMAND_DELETE, libvirtxml.NetworkDHCPHost{Name: name})
		// No such entry ("couldn't locate a matching dhcp host entry"), a
		// network without an <ip> or DHCP (a host bridge: "no <ip> element
		// found"), or no such network: no entry to remove, in each case.
		if c := code(err); c == libvirt.ERR_OPERATION_INVALID || c == libvirt.ERR_NO_NETWORK {
			return fmt.Errorf("%w: %v", vm.ErrNotFound, err)
		}
		return err
	})
}
