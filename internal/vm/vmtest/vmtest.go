// Package vmtest provides an in-memory vm.Hypervisor for tests of the logic
// above the libvirt seam.
package vmtest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"

	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Fake is an in-memory Hypervisor for the engine's logic. Like libvirt's
// calls, its calls ignore ctx: they return at once, or, while Hang is set,
// not before Hang is closed. Code that must give up on them wraps the Fake
// as it wraps libvirt (vm.Reconnecting, which lifecycle.Open uses).
type Fake struct {
	mu sync.Mutex
	// Volumes maps "pool/name" to the uploaded data.
	Volumes map[string][]byte
	// Backing maps "pool/name" to the volume's backing file, if any.
	Backing map[string]string
	// Files maps "pool/name" to a file VolumeFile opens for the volume
	// (a test's stand-in for the volume's file on the host).
	Files map[string]string
	// Perms maps "pool/name" to the permissions the volume was created
	// with, if any.
	Perms map[string]libvirtxml.StorageVolumeTargetPermissions
	// Domains maps names to defined domains.
	Domains map[string]*Domain
	// LeaseMap maps a domain to its reported leases.
	LeaseMap map[string][]vm.Lease
	// NetMACs are the MACs holding leases on the network.
	NetMACs []string
	// Gateway is the network's own address NetworkGateway reports (New:
	// 192.168.150.1).
	Gateway string
	// DHCP, if set, is the network's libvirt DHCP (NetworkDHCP reports it
	// with NetIPs as its leases; AddDHCPHost and DeleteDHCPHost change its
	// Hosts); nil: a network without libvirt's DHCP.
	DHCP *vm.DHCPInfo
	// NWFilters are the network filters libvirt has, by name (New: libvirt's
	// clean-traffic); EnsureNWFilters adds to them.
	NWFilters map[string]string
	// Bindings are libvirt's network filter bindings (FilterBindings;
	// DeleteFilterBinding removes from them). Start does not add to them.
	Bindings []vm.FilterBinding
	// FailOn makes the named method fail with the error.
	FailOn map[string]error
	// Calls records method names in order.
	Calls []string
	// OnStart, if set, runs when a domain starts (a fake boot).
	OnStart func(name string, d *libvirtxml.Domain)
	// OnPlug, if set, runs after a hot plug into a running domain, with
	// its devices then, without f's lock (a restored clone's guest going
	// on when its credentials disk arrives).
	OnPlug func(name string, d *libvirtxml.Domain)
	// StartErr, if set, is asked first when a domain starts: an error it
	// returns is Start's, and the domain does not start (QEMU exited).
	StartErr func(name string, d *libvirtxml.Domain) error
	// KVM is what KVMAvailable reports: libvirt offers the kvm domain type.
	KVM bool
	// LibVersion and HVVersion are what Version reports (New: libvirt
	// 9.0.0, QEMU 7.2.0).
	LibVersion, HVVersion uint32
	// Hang, if set, stands for a hung libvirtd: every call but Close blocks
	// until Hang is closed, whatever its ctx says, as libvirt's C calls do.
	Hang chan struct{}
	// BeforeCall, if set, runs first in every call but Close, with the
	// method's name (a test sets Hang from it to hang one particular call).
	BeforeCall func(method string)
	// hung counts the calls that Hang blocked.
	hung int
}

// Domain is a defined domain.
type Domain struct {
	XML      string
	OwnerXML string
	Active   bool
	// Paused: Suspend paused it (it still counts as active).
	Paused bool
	// Transient: undefined while running; it is gone once destroyed.
	Transient bool
	// State, if set, is what State reports (else running or shut off,
	// from Active).
	State *vm.DomainState
}

// New returns an empty Fake.
func New() *Fake {
	return &Fake{Volumes: map[string][]byte{}, Domains: map[string]*Domain{}, LeaseMap: map[string][]vm.Lease{}, FailOn: map[string]error{}, Gateway: "192.168.150.1",
		LibVersion: 9000000, HVVersion: 7002000,
		NWFilters: map[string]string{vm.FilterBase: "<filter name='clean-traffic'/>"}}
}

var _ vm.Hypervisor = (*Fake)(nil)

// LostConnection is the error of a call on a connection that broke (libvirtd
// restarted, or its keepalive gave up), as a Hypervisor reports it: marked
// vm.ErrConnectionLost. A test puts it in FailOn to make vm.Reconnecting
// reconnect.
func LostConnection(detail string) error { return fmt.Errorf("%w: %s", vm.ErrConnectionLost, detail) }

// wait blocks while Hang says libvirtd hangs; it is the first thing every
// call but Close does, before it takes f.mu, after BeforeCall.
func (f *Fake) wait(method string) {
	f.mu.Lock()
	before := f.BeforeCall
	f.mu.Unlock()
	if before != nil {
		before(method)
	}
	f.mu.Lock()
	hang := f.Hang
	if hang != nil {
		f.hung++
	}
	f.mu.Unlock()
	if hang != nil {
		<-hang
	}
}

// Hung counts the calls that Hang blocked so far.
func (f *Fake) Hung() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hung
}

// call records a call; the caller holds f.mu.
func (f *Fake) call(name string) error {
	f.Calls = append(f.Calls, name)
	return f.FailOn[name]
}

// Lock and Unlock guard the exported maps for tests that read them while the
// code under test runs.
func (f *Fake) Lock()   { f.mu.Lock() }
func (f *Fake) Unlock() { f.mu.Unlock() }

func (f *Fake) KVMAvailable(ctx context.Context) (bool, error) {
	f.wait("KVMAvailable")
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.KVM, f.call("KVMAvailable")
}

// Version implements vm.Hypervisor.
func (f *Fake) Version(ctx context.Context) (libvirtVersion, hypervisor uint32, err error) {
	f.wait("Version")
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.LibVersion, f.HVVersion, f.call("Version")
}
func (f *Fake) CreateVolume(ctx context.Context, pool string, vol *libvirtxml.StorageVolume) (string, error) {
	f.wait("CreateVolume")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("CreateVolume"); err != nil {
		return "", err
	}
	key := pool + "/" + vol.Name
	if _, ok := f.Volumes[key]; ok {
		return "", fmt.Errorf("volume %s already exists", key)
	}
	f.Volumes[key] = nil
	if vol.Target != nil && vol.Target.Permissions != nil {
		if f.Perms == nil {
			f.Perms = map[string]libvirtxml.StorageVolumeTargetPermissions{}
		}
		f.Perms[key] = *vol.Target.Permissions
	}
	if vol.BackingStore != nil {
		if f.Backing == nil {
			f.Backing = map[string]string{}
		}
		f.Backing[key] = vol.BackingStore.Path
	}
	return "/pool/" + key, nil
}
func (f *Fake) UploadVolume(ctx context.Context, pool, name string, data []byte) error {
	f.wait("UploadVolume")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("UploadVolume"); err != nil {
		return err
	}
	f.Volumes[pool+"/"+name] = data
	return nil
}

// StreamToVolume implements vm.Hypervisor: the volume gets size bytes of r
// (an error if r has fewer).
func (f *Fake) StreamToVolume(ctx context.Context, pool, name string, r io.Reader, size int64) error {
	f.wait("StreamToVolume")
	data := make([]byte, size)
	_, rerr := io.ReadFull(r, data)
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("StreamToVolume"); err != nil {
		return err
	}
	if rerr != nil {
		return rerr
	}
	key := pool + "/" + name
	if _, ok := f.Volumes[key]; !ok {
		return vm.ErrNotFound
	}
	f.Volumes[key] = data
	return nil
}

// StreamFromVolume implements vm.Hypervisor.
func (f *Fake) StreamFromVolume(ctx context.Context, pool, name string, w io.Writer) error {
	f.wait("StreamFromVolume")
	f.mu.Lock()
	if err := f.call("StreamFromVolume"); err != nil {
		f.mu.Unlock()
		return err
	}
	data, ok := f.Volumes[pool+"/"+name]
	f.mu.Unlock()
	if !ok {
		return vm.ErrNotFound
	}
	_, err := w.Write(data)
	return err
}
func (f *Fake) VolumePath(ctx context.Context, pool, name string) (string, error) {
	f.wait("VolumePath")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("VolumePath"); err != nil {
		return "", err
	}
	key := pool + "/" + name
	if _, ok := f.Volumes[key]; !ok {
		return "", vm.ErrNotFound
	}
	return "/pool/" + key, nil
}
func (f *Fake) DeleteVolume(ctx context.Context, pool, name string) error {
	f.wait("DeleteVolume")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DeleteVolume"); err != nil {
		return err
	}
	if _, ok := f.Volumes[pool+"/"+name]; !ok {
		return vm.ErrNotFound
	}
	delete(f.Volumes, pool+"/"+name)
	delete(f.Backing, pool+"/"+name)
	return nil
}
func (f *Fake) VolumeBacking(ctx context.Context, pool, name string) (string, error) {
	f.wait("VolumeBacking")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("VolumeBacking"); err != nil {
		return "", err
	}
	if _, ok := f.Volumes[pool+"/"+name]; !ok {
		return "", vm.ErrNotFound
	}
	return f.Backing[pool+"/"+name], nil
}
func (f *Fake) VolumeNames(ctx context.Context, pool string) ([]string, error) {
	f.wait("VolumeNames")
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for k := range f.Volumes {
		if name, ok := strings.CutPrefix(k, pool+"/"); ok {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out, nil
}
func (f *Fake) VolumeCapacity(ctx context.Context, path string) (uint64, error) {
	f.wait("VolumeCapacity")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("VolumeCapacity"); err != nil {
		return 0, err
	}
	if data, ok := f.Volumes[strings.TrimPrefix(path, "/pool/")]; ok && strings.HasPrefix(path, "/pool/") {
		return uint64(len(data)), nil // a volume of the fake: its data's size
	}
	return 1 << 30, nil
}
func (f *Fake) Define(ctx context.Context, x string) error {
	f.wait("Define")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("Define"); err != nil {
		return err
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil {
		return err
	}
	if old, ok := f.Domains[d.Name]; ok {
		if !old.Transient {
			return errors.New("domain already exists")
		}
		// libvirt: a running transient domain becomes persistent.
		old.Transient, old.XML, old.OwnerXML = false, x, d.Metadata.XML
		return nil
	}
	f.Domains[d.Name] = &Domain{XML: x, OwnerXML: d.Metadata.XML}
	return nil
}
func (f *Fake) Start(ctx context.Context, name string) error {
	f.wait("Start")
	f.mu.Lock()
	if err := f.call("Start"); err != nil {
		f.mu.Unlock()
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		f.mu.Unlock()
		return vm.ErrNotFound
	}
	x := d.XML
	startErr := f.StartErr
	if startErr == nil {
		d.Active = true
	}
	f.mu.Unlock()
	if f.OnStart == nil && startErr == nil {
		return nil
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(x); err != nil {
		return err
	}
	if startErr != nil {
		if err := startErr(name, &dx); err != nil {
			return err
		}
		f.mu.Lock()
		d.Active = true
		f.mu.Unlock()
	}
	if f.OnStart != nil {
		f.OnStart(name, &dx)
	}
	return nil
}
func (f *Fake) Destroy(ctx context.Context, name string) error {
	f.wait("Destroy")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("Destroy"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	d.Active = false
	if d.Transient {
		delete(f.Domains, name)
	}
	return nil
}
func (f *Fake) Suspend(ctx context.Context, name string) error {
	f.wait("Suspend")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("Suspend"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	if d.Active {
		d.Paused = true
	}
	return nil
}
func (f *Fake) Undefine(ctx context.Context, name string) error {
	f.wait("Undefine")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("Undefine"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	if d.Active {
		// As libvirt does: a running domain loses its persistent
		// definition but goes on running (transient) until destroyed.
		d.Transient = true
		return nil
	}
	delete(f.Domains, name)
	return nil
}
func (f *Fake) Owner(ctx context.Context, name string) (string, error) {
	f.wait("Owner")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("Owner"); err != nil {
		return "", err
	}
	d, ok := f.Domains[name]
	if !ok {
		return "", vm.ErrNotFound
	}
	if d.OwnerXML == "" {
		return "", vm.ErrNoOwner
	}
	return d.OwnerXML, nil
}

// VolumeFile implements vm.Hypervisor: the file in Files, where a test
// put one for the volume, else nil (the caller streams the volume).
func (f *Fake) VolumeFile(ctx context.Context, pool, name string) (*os.File, error) {
	f.wait("VolumeFile")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("VolumeFile"); err != nil {
		return nil, err
	}
	key := pool + "/" + name
	if _, ok := f.Volumes[key]; !ok {
		return nil, vm.ErrNotFound
	}
	if p, ok := f.Files[key]; ok {
		return vm.OpenVolumeFile(p), nil
	}
	return nil, nil
}

// DACImageLabel implements vm.Hypervisor: the label in the running
// domain's XML (a test puts a <seclabel model='dac'> with an imagelabel in
// it, as libvirt does for a running domain).
func (f *Fake) DACImageLabel(ctx context.Context, name string) (string, error) {
	f.wait("DACImageLabel")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DACImageLabel"); err != nil {
		return "", err
	}
	d, ok := f.Domains[name]
	if !ok {
		return "", vm.ErrNotFound
	}
	if !d.Active {
		return "", nil
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.XML); err != nil {
		return "", err
	}
	return vm.DACImageLabelOf(&dx), nil
}

// AttachDisk implements vm.Hypervisor: disk joins the domain's XML (the
// Fake keeps one definition, live and persistent alike). The domain must
// run, and no disk of the same target may be there.
func (f *Fake) AttachDisk(ctx context.Context, name string, disk *libvirtxml.DomainDisk) error {
	return f.plug("AttachDisk", name, func(dev *libvirtxml.DomainDeviceList) error {
		for _, have := range dev.Disks {
			if have.Target != nil && disk.Target != nil && have.Target.Dev == disk.Target.Dev {
				return fmt.Errorf("target %s already exists", disk.Target.Dev)
			}
		}
		dev.Disks = append(dev.Disks, *disk)
		return nil
	})
}

// plug is a hot plug (op) into the running domain name: add changes its
// devices in the domain's XML.
func (f *Fake) plug(op, name string, add func(*libvirtxml.DomainDeviceList) error) error {
	f.wait(op)
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(op); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	if !d.Active {
		return fmt.Errorf("domain %s is not running", name)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.XML); err != nil {
		return err
	}
	if dx.Devices == nil {
		dx.Devices = &libvirtxml.DomainDeviceList{}
	}
	if err := add(dx.Devices); err != nil {
		return err
	}
	x, err := dx.Marshal()
	if err != nil {
		return err
	}
	d.XML = x
	if on := f.OnPlug; on != nil {
		f.mu.Unlock()
		on(name, &dx)
		f.mu.Lock()
	}
	return nil
}

// DetachDisk implements vm.Hypervisor: the disks whose source is the
// file source leave the domain's XML.
func (f *Fake) DetachDisk(ctx context.Context, name, source string) error {
	f.wait("DetachDisk")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DetachDisk"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	if d.XML == "" {
		return nil
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.XML); err != nil {
		return err
	}
	if dx.Devices == nil {
		return nil
	}
	kept := dx.Devices.Disks[:0]
	for _, disk := range dx.Devices.Disks {
		if disk.Source == nil || disk.Source.File == nil || disk.Source.File.File != source {
			kept = append(kept, disk)
		}
	}
	dx.Devices.Disks = kept
	x, err := dx.Marshal()
	if err != nil {
		return err
	}
	d.XML = x
	return nil
}

// SetOwner implements vm.Hypervisor.
func (f *Fake) SetOwner(ctx context.Context, name, ownerXML string) error {
	f.wait("SetOwner")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("SetOwner"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	d.OwnerXML = ownerXML
	return nil
}

// DomainNames implements vm.Hypervisor.
func (f *Fake) DomainNames(ctx context.Context) ([]string, error) {
	f.wait("DomainNames")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DomainNames"); err != nil {
		return nil, err
	}
	var out []string
	for k := range f.Domains {
		out = append(out, k)
	}
	return out, nil
}
func (f *Fake) IsActive(ctx context.Context, name string) (bool, error) {
	f.wait("IsActive")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("IsActive"); err != nil {
		return false, err
	}
	d, ok := f.Domains[name]
	if !ok {
		return false, vm.ErrNotFound
	}
	return d.Active, nil
}

// Addresses implements vm.Hypervisor; FailOn["Addresses"] injects an error.
func (f *Fake) Addresses(ctx context.Context, name string, source vm.AddressSource) ([]vm.Lease, error) {
	f.wait("Addresses")
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.Domains[name]; !ok {
		return nil, vm.ErrNotFound
	}
	if err := f.FailOn["Addresses"]; err != nil {
		return nil, err
	}
	return f.LeaseMap[name], nil
}
func (f *Fake) NetworkLeaseMACs(ctx context.Context, _ string) ([]string, error) {
	f.wait("NetworkLeaseMACs")
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.NetMACs...), nil
}

// NetworkDHCP implements vm.Hypervisor: DHCP, or a network without
// libvirt's DHCP. Not recorded in Calls; FailOn["NetworkDHCP"] injects an
// error.
func (f *Fake) NetworkDHCP(ctx context.Context, _ string) (vm.DHCPInfo, error) {
	f.wait("NetworkDHCP")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.FailOn["NetworkDHCP"]; err != nil {
		return vm.DHCPInfo{}, err
	}
	if f.DHCP == nil {
		return vm.DHCPInfo{}, nil
	}
	d := *f.DHCP
	d.Hosts = append([]vm.DHCPHost(nil), f.DHCP.Hosts...)
	return d, nil
}

// AddDHCPHost implements vm.Hypervisor as libvirt does: an entry whose
// MAC, name or address one has is refused (vm.ErrAddressTaken).
func (f *Fake) AddDHCPHost(ctx context.Context, _ string, h vm.DHCPHost) error {
	f.wait("AddDHCPHost")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("AddDHCPHost"); err != nil {
		return err
	}
	if f.DHCP == nil {
		return errors.New("the network has no DHCP")
	}
	for _, have := range f.DHCP.Hosts {
		if have.MAC == h.MAC || have.Name == h.Name || have.IP == h.IP {
			return vm.ErrAddressTaken
		}
	}
	f.DHCP.Hosts = append(f.DHCP.Hosts, h)
	return nil
}

// DeleteDHCPHost implements vm.Hypervisor. Not recorded in Calls.
func (f *Fake) DeleteDHCPHost(ctx context.Context, _ string, name string) error {
	f.wait("DeleteDHCPHost")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.FailOn["DeleteDHCPHost"]; err != nil {
		return err
	}
	if f.DHCP == nil {
		return vm.ErrNotFound
	}
	for i, have := range f.DHCP.Hosts {
		if have.Name == name {
			f.DHCP.Hosts = slices.Delete(f.DHCP.Hosts, i, i+1)
			return nil
		}
	}
	return vm.ErrNotFound
}

// NetworkGateway implements vm.Hypervisor: it reports Gateway. It is not
// recorded in Calls; FailOn["NetworkGateway"] injects an error.
func (f *Fake) NetworkGateway(ctx context.Context, _ string) (string, error) {
	f.wait("NetworkGateway")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.FailOn["NetworkGateway"]; err != nil {
		return "", err
	}
	return f.Gateway, nil
}
func (f *Fake) Close() error { return nil }

// SetLeases replaces the leases reported for a domain.
func (f *Fake) SetLeases(name string, l ...vm.Lease) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.LeaseMap[name] = l
}

// State implements vm.Hypervisor.
func (f *Fake) State(ctx context.Context, name string) (vm.DomainState, error) {
	f.wait("State")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("State"); err != nil {
		return vm.DomainState{}, err
	}
	d, ok := f.Domains[name]
	switch {
	case !ok:
		return vm.DomainState{}, vm.ErrNotFound
	case d.State != nil:
		return *d.State, nil
	case d.Active:
		return vm.DomainState{Code: vm.StateRunning, Running: true, Summary: "running"}, nil
	}
	return vm.DomainState{Code: vm.StateShutOff, Summary: "shut off"}, nil
}

// PinFilterAddress implements vm.Hypervisor on the domain's XML (active
// domains only, as libvirt's live update).
func (f *Fake) PinFilterAddress(ctx context.Context, name, mac, ip string) error {
	f.wait("PinFilterAddress")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("PinFilterAddress"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	if !d.Active {
		return fmt.Errorf("domain %s is not running", name)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.XML); err != nil {
		return err
	}
	_, changed, err := vm.PinDomainFilterIP(&dx, mac, ip)
	if err != nil || !changed {
		return err
	}
	x, err := dx.Marshal()
	if err != nil {
		return err
	}
	d.XML = x
	return nil
}

// FilterBindings implements vm.Hypervisor.
func (f *Fake) FilterBindings(ctx context.Context) ([]vm.FilterBinding, error) {
	f.wait("FilterBindings")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("FilterBindings"); err != nil {
		return nil, err
	}
	return append([]vm.FilterBinding(nil), f.Bindings...), nil
}

// DeleteFilterBinding implements vm.Hypervisor.
func (f *Fake) DeleteFilterBinding(ctx context.Context, portDev, owner string) error {
	f.wait("DeleteFilterBinding")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DeleteFilterBinding"); err != nil {
		return err
	}
	for i, b := range f.Bindings {
		if b.PortDev == portDev && b.OwnerName == owner {
			f.Bindings = append(f.Bindings[:i], f.Bindings[i+1:]...)
			return nil
		}
	}
	return vm.ErrNotFound
}

// EnsureNWFilters implements vm.Hypervisor on NWFilters: a name in
// requires must be there (New puts clean-traffic there), a def missing is
// added, a def there must match (vm.CheckFilter) as libvirtvm's does.
func (f *Fake) EnsureNWFilters(ctx context.Context, requires []string, defs []vm.NWFilter) error {
	f.wait("EnsureNWFilters")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("EnsureNWFilters"); err != nil {
		return err
	}
	for _, n := range requires {
		if _, ok := f.NWFilters[n]; !ok {
			return fmt.Errorf("libvirt has no network filter %s", n)
		}
	}
	for _, d := range defs {
		have, ok := f.NWFilters[d.Name]
		if !ok {
			f.NWFilters[d.Name] = d.XML
			continue
		}
		if err := vm.CheckFilter(d, have); err != nil {
			return err
		}
	}
	return nil
}

// AttachFilesystem implements vm.Hypervisor: the running domain's XML
// gets fs; refused, as QEMU refuses it, when the domain's memory is not
// shared.
func (f *Fake) AttachFilesystem(ctx context.Context, name string, fs *libvirtxml.DomainFilesystem) error {
	f.mu.Lock()
	d, ok := f.Domains[name]
	shared := ok && strings.Contains(d.XML, `<access mode="shared">`)
	f.mu.Unlock()
	if ok && !shared {
		return fmt.Errorf("domain %s: vhost-user-fs needs shared memory", name)
	}
	return f.plug("AttachFilesystem", name, func(dev *libvirtxml.DomainDeviceList) error {
		dev.Filesystems = append(dev.Filesystems, *fs)
		return nil
	})
}

// AttachInterface implements vm.Hypervisor: the running domain's XML gets
// iface.
func (f *Fake) AttachInterface(ctx context.Context, name string, iface *libvirtxml.DomainInterface) error {
	return f.plug("AttachInterface", name, func(dev *libvirtxml.DomainDeviceList) error {
		dev.Interfaces = append(dev.Interfaces, *iface)
		return nil
	})
}

// Save implements vm.Hypervisor: the domain stops and its XML is written
// to path (the fake's save file).
func (f *Fake) Save(ctx context.Context, name, path string) error {
	f.wait("Save")
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("Save"); err != nil {
		return err
	}
	d, ok := f.Domains[name]
	if !ok {
		return vm.ErrNotFound
	}
	if !d.Active {
		return fmt.Errorf("domain %s is not running", name)
	}
	if key, ok := strings.CutPrefix(path, "/pool/"); ok {
		// A volume's path (CreateVolume's): the volume holds a save file
		// of libvirt's format with the domain's XML and a stand-in stream.
		if _, ok := f.Volumes[key]; !ok {
			return fmt.Errorf("no volume at %s", path)
		}
		f.Volumes[key] = SaveFile(d.XML, []byte("fake migration stream"))
	} else if err := os.WriteFile(path, []byte(d.XML), 0o600); err != nil {
		return err
	}
	d.Active, d.Paused = false, false
	if d.Transient {
		delete(f.Domains, name)
	}
	return nil
}

// SaveFile is a save file of libvirt's format (version 2, raw) holding
// xml, then stream: what the fake's Save writes into a volume.
func SaveFile(xml string, stream []byte) []byte {
	block := make([]byte, len(xml)+1+4096)
	copy(block, xml)
	hdr := make([]byte, 92)
	copy(hdr, "LibvirtQemudSave")
	binary.LittleEndian.PutUint32(hdr[16:], 2)
	binary.LittleEndian.PutUint32(hdr[20:], uint32(len(block))) //nolint:gosec // G115: a test's XML
	binary.LittleEndian.PutUint32(hdr[24:], 1)
	return append(append(hdr, block...), stream...)
}

// RestoreStream implements vm.Hypervisor: r must be a save file whose
// head vm.ReadSaveHead reads, followed by a stream; the domain its XML
// names runs, transient. pipeDir must exist.
func (f *Fake) RestoreStream(ctx context.Context, r io.Reader, pipeDir string) error {
	f.wait("RestoreStream")
	head, herr := vm.ReadSaveHead(r)
	if herr == nil {
		_, herr = io.Copy(io.Discard, r)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("RestoreStream"); err != nil {
		return err
	}
	if herr != nil {
		return herr
	}
	if st, err := os.Stat(pipeDir); err != nil || !st.IsDir() {
		return fmt.Errorf("pipe directory %s: not a directory", pipeDir)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(head.XML); err != nil {
		return err
	}
	if _, ok := f.Domains[dx.Name]; ok {
		return errors.New("domain already exists")
	}
	var owner string
	if dx.Metadata != nil {
		owner = dx.Metadata.XML
	}
	f.Domains[dx.Name] = &Domain{XML: head.XML, OwnerXML: owner, Active: true, Transient: true}
	return nil
}
