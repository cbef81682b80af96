package vm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/user"
	"strings"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"
)

// Libvirt implements Hypervisor over a libvirt connection.
type Libvirt struct {
	conn *libvirt.Connect
}

var _ Hypervisor = (*Libvirt)(nil)

// Connect opens a libvirt connection.
func Connect(uri string) (*Libvirt, error) {
	conn, err := libvirt.NewConnect(uri)
	if err != nil {
		return nil, fmt.Errorf("connect to libvirt at %s: %w%s", uri, err, accessHint(err))
	}
	return &Libvirt{conn: conn}, nil
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

// Close implements Hypervisor.
func (l *Libvirt) Close() error {
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
			return fmt.Errorf("%w: %v", ErrNotFound, err)
		}
	}
	return err
}

// KVMAvailable implements Hypervisor.
func (l *Libvirt) KVMAvailable() (bool, error) {
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
}

func (l *Libvirt) pool(name string) (*libvirt.StoragePool, error) {
	p, err := l.conn.LookupStoragePoolByName(name)
	if err != nil {
		return nil, fmt.Errorf("storage pool %q: %w", name, err)
	}
	return p, nil
}

// CreateVolume implements Hypervisor.
func (l *Libvirt) CreateVolume(pool string, vol *libvirtxml.StorageVolume) (string, error) {
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
}

// volume looks a volume up by pool and name (ErrNotFound if absent).
func (l *Libvirt) volume(pool, name string) (*libvirt.StorageVol, error) {
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

// UploadVolume implements Hypervisor.
func (l *Libvirt) UploadVolume(pool, name string, data []byte) error {
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
	if err := v.Upload(st, 0, uint64(len(data)), 0); err != nil {
		return err
	}
	for off := 0; off < len(data); {
		n, err := st.Send(data[off:])
		if err != nil {
			_ = st.Abort()
			return err
		}
		off += n
	}
	return st.Finish()
}

// DeleteVolume implements Hypervisor.
func (l *Libvirt) DeleteVolume(pool, name string) error {
	v, err := l.volume(pool, name)
	if err != nil {
		return err
	}
	defer v.Free()
	return notFound(v.Delete(0), libvirt.ERR_NO_STORAGE_VOL)
}

// VolumeNames implements Hypervisor.
func (l *Libvirt) VolumeNames(pool string) ([]string, error) {
	p, err := l.pool(pool)
	if err != nil {
		return nil, err
	}
	defer p.Free()
	// Pick up volumes created or deleted behind libvirt's back.
	_ = p.Refresh(0)
	return p.ListStorageVolumes()
}

// VolumeCapacity implements Hypervisor. It asks libvirt first and falls back
// to reading the image header (qcow2) or size (raw) for a base that lives
// outside any pool.
func (l *Libvirt) VolumeCapacity(path string) (uint64, error) {
	if v, err := l.conn.LookupStorageVolByPath(path); err == nil {
		defer v.Free()
		if info, err := v.GetInfo(); err == nil {
			return info.Capacity, nil
		}
	}
	return imageVirtualSize(path)
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
	return uint64(st.Size()), nil
}

func (l *Libvirt) domain(name string) (*libvirt.Domain, error) {
	d, err := l.conn.LookupDomainByName(name)
	if err != nil {
		return nil, notFound(err, libvirt.ERR_NO_DOMAIN)
	}
	return d, nil
}

// Define implements Hypervisor.
func (l *Libvirt) Define(xml string) error {
	d, err := l.conn.DomainDefineXMLFlags(xml, libvirt.DOMAIN_DEFINE_VALIDATE)
	if err != nil {
		return err
	}
	return d.Free()
}

// Start implements Hypervisor.
func (l *Libvirt) Start(name string) error {
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
}

// Destroy implements Hypervisor.
func (l *Libvirt) Destroy(name string) error {
	d, err := l.domain(name)
	if err != nil {
		return err
	}
	defer d.Free()
	if err := d.Destroy(); err != nil && code(err) != libvirt.ERR_OPERATION_INVALID {
		return notFound(err, libvirt.ERR_NO_DOMAIN)
	}
	return nil
}

// Undefine implements Hypervisor.
func (l *Libvirt) Undefine(name string) error {
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
}

// Owner implements Hypervisor.
func (l *Libvirt) Owner(name string) (string, error) {
	d, err := l.domain(name)
	if err != nil {
		return "", err
	}
	defer d.Free()
	s, err := d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, OwnerNamespace, libvirt.DOMAIN_AFFECT_CONFIG)
	if err != nil {
		switch code(err) {
		case libvirt.ERR_NO_DOMAIN_METADATA:
			return "", ErrNoOwner
		case libvirt.ERR_NO_DOMAIN:
			return "", notFound(err, libvirt.ERR_NO_DOMAIN)
		}
		return "", err
	}
	return s, nil
}

// SetOwner implements Hypervisor.
func (l *Libvirt) SetOwner(name, ownerXML string) error {
	d, err := l.domain(name)
	if err != nil {
		return err
	}
	defer d.Free()
	flags := libvirt.DOMAIN_AFFECT_CONFIG
	if active, err := d.IsActive(); err == nil && active {
		flags |= libvirt.DOMAIN_AFFECT_LIVE
	}
	return d.SetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, ownerXML, "lve", OwnerNamespace, flags)
}

// DomainNames implements Hypervisor.
func (l *Libvirt) DomainNames() ([]string, error) {
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
}

// IsActive implements Hypervisor.
func (l *Libvirt) IsActive(name string) (bool, error) {
	d, err := l.domain(name)
	if err != nil {
		return false, err
	}
	defer d.Free()
	return d.IsActive()
}

// State implements Hypervisor.
func (l *Libvirt) State(name string) (DomainState, error) {
	d, err := l.domain(name)
	if err != nil {
		return DomainState{}, err
	}
	defer d.Free()
	st, reason, err := d.GetState()
	if err != nil {
		return DomainState{}, notFound(err, libvirt.ERR_NO_DOMAIN)
	}
	return describeState(st, reason), nil
}

func describeState(st libvirt.DomainState, reason int) DomainState {
	why := func(reasons map[int]string) string {
		if r, ok := reasons[reason]; ok {
			return " (" + r + ")"
		}
		return ""
	}
	switch st {
	case libvirt.DOMAIN_RUNNING, libvirt.DOMAIN_BLOCKED:
		return DomainState{Running: true, Summary: "running"}
	case libvirt.DOMAIN_PAUSED:
		return DomainState{
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
		return DomainState{Summary: "shutting down"}
	case libvirt.DOMAIN_SHUTOFF:
		return DomainState{Summary: "shut off" + why(map[int]string{
			int(libvirt.DOMAIN_SHUTOFF_SHUTDOWN):  "the guest shut down",
			int(libvirt.DOMAIN_SHUTOFF_DESTROYED): "destroyed",
			int(libvirt.DOMAIN_SHUTOFF_CRASHED):   "crashed",
			int(libvirt.DOMAIN_SHUTOFF_FAILED):    "failed to start",
		})}
	case libvirt.DOMAIN_CRASHED:
		return DomainState{Summary: "crashed" + why(map[int]string{int(libvirt.DOMAIN_CRASHED_PANICKED): "guest kernel panic"})}
	case libvirt.DOMAIN_PMSUSPENDED:
		return DomainState{Summary: "suspended by the guest"}
	}
	return DomainState{Summary: fmt.Sprintf("state %d, reason %d", st, reason)}
}

// ErrAgentNotReady means the guest agent does not answer yet.
var ErrAgentNotReady = errors.New("guest agent not answering yet")

// Addresses implements Hypervisor. With SourceLease libvirt matches the
// network's active, unexpired leases against this domain's own MACs.
func (l *Libvirt) Addresses(name string, source AddressSource) ([]Lease, error) {
	d, err := l.domain(name)
	if err != nil {
		return nil, err
	}
	defer d.Free()
	src := libvirt.DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
	if source == SourceAgent {
		src = libvirt.DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT
	}
	ifaces, err := d.ListAllInterfaceAddresses(src)
	if err != nil {
		if c := code(err); source == SourceAgent && (c == libvirt.ERR_AGENT_UNRESPONSIVE || c == libvirt.ERR_AGENT_UNSYNCED) {
			return nil, fmt.Errorf("%w: %v", ErrAgentNotReady, err)
		}
		return nil, err
	}
	var out []Lease
	for _, i := range ifaces {
		for _, a := range i.Addrs {
			if a.Type != libvirt.IP_ADDR_TYPE_IPV4 {
				continue
			}
			if ip := net.ParseIP(a.Addr); ip != nil {
				out = append(out, Lease{MAC: strings.ToLower(i.Hwaddr), IP: ip})
			}
		}
	}
	return out, nil
}

// NetworkLeaseMACs implements Hypervisor.
func (l *Libvirt) NetworkLeaseMACs(network string) ([]string, error) {
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
}

// Host facts for diagnostics (not part of Hypervisor: only the admin
// command's doctor uses them).

// Version returns the libvirt version (the daemon's, over a remote
// connection) and the hypervisor's (QEMU) version.
func (l *Libvirt) Version() (libvirtVersion, hypervisor uint32, err error) {
	if libvirtVersion, err = l.conn.GetLibVersion(); err != nil {
		return 0, 0, err
	}
	hypervisor, err = l.conn.GetVersion()
	return libvirtVersion, hypervisor, err
}

// PoolActive reports whether the storage pool exists and is active, and its
// target path.
func (l *Libvirt) PoolActive(name string) (active bool, path string, err error) {
	p, err := l.pool(name)
	if err != nil {
		return false, "", err
	}
	defer p.Free()
	if active, err = p.IsActive(); err != nil {
		return false, "", err
	}
	x, err := p.GetXMLDesc(0)
	if err != nil {
		return active, "", err
	}
	var px libvirtxml.StoragePool
	if err := px.Unmarshal(x); err == nil && px.Target != nil {
		path = px.Target.Path
	}
	return active, path, nil
}

// NetworkActive reports whether the network exists and is active, and
// whether libvirt serves DHCP on it.
func (l *Libvirt) NetworkActive(name string) (active, dhcp bool, err error) {
	n, err := l.conn.LookupNetworkByName(name)
	if err != nil {
		return false, false, err
	}
	defer n.Free()
	if active, err = n.IsActive(); err != nil {
		return false, false, err
	}
	x, err := n.GetXMLDesc(0)
	if err != nil {
		return active, false, err
	}
	var nx libvirtxml.Network
	if err := nx.Unmarshal(x); err != nil {
		return active, false, err
	}
	for _, ip := range nx.IPs {
		if ip.DHCP != nil {
			dhcp = true
		}
	}
	return active, dhcp, nil
}
