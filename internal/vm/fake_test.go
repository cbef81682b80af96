package vm

import (
	"errors"
	"fmt"
	"net"
	"sort"
	"sync"

	"libvirt.org/go/libvirtxml"
)

// fakeHV is an in-memory Hypervisor for the engine's logic.
type fakeHV struct {
	mu      sync.Mutex
	volumes map[string][]byte // pool/name -> data
	domains map[string]*fakeDomain
	leases  map[string][]Lease // domain -> leases
	netMACs []string
	failOn  map[string]error // method name -> error
	calls   []string
}

type fakeDomain struct {
	xml    string
	owner  string
	active bool
}

func newFake() *fakeHV {
	return &fakeHV{volumes: map[string][]byte{}, domains: map[string]*fakeDomain{}, leases: map[string][]Lease{}, failOn: map[string]error{}}
}

var _ Hypervisor = (*fakeHV)(nil)

func (f *fakeHV) call(name string) error {
	f.calls = append(f.calls, name)
	return f.failOn[name]
}

func (f *fakeHV) KVMAvailable() (bool, error) { return false, f.call("KVMAvailable") }
func (f *fakeHV) CreateVolume(pool string, vol *libvirtxml.StorageVolume) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("CreateVolume"); err != nil {
		return "", err
	}
	key := pool + "/" + vol.Name
	if _, ok := f.volumes[key]; ok {
		return "", fmt.Errorf("volume %s already exists", key)
	}
	f.volumes[key] = nil
	return "/pool/" + key, nil
}
func (f *fakeHV) UploadVolume(pool, name string, data []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("UploadVolume"); err != nil {
		return err
	}
	f.volumes[pool+"/"+name] = data
	return nil
}
func (f *fakeHV) DeleteVolume(pool, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DeleteVolume"); err != nil {
		return err
	}
	if _, ok := f.volumes[pool+"/"+name]; !ok {
		return ErrNotFound
	}
	delete(f.volumes, pool+"/"+name)
	return nil
}
func (f *fakeHV) VolumeNames(pool string) ([]string, error) {
	var out []string
	for k := range f.volumes {
		out = append(out, k)
	}
	sort.Strings(out)
	return out, nil
}
func (f *fakeHV) VolumeCapacity(path string) (uint64, error) {
	return 1 << 30, f.call("VolumeCapacity")
}
func (f *fakeHV) Define(x string) error {
	if err := f.call("Define"); err != nil {
		return err
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil {
		return err
	}
	if _, ok := f.domains[d.Name]; ok {
		return errors.New("domain already exists")
	}
	f.domains[d.Name] = &fakeDomain{xml: x, owner: d.Metadata.XML}
	return nil
}
func (f *fakeHV) Start(name string) error {
	if err := f.call("Start"); err != nil {
		return err
	}
	d, ok := f.domains[name]
	if !ok {
		return ErrNotFound
	}
	d.active = true
	return nil
}
func (f *fakeHV) Destroy(name string) error {
	if err := f.call("Destroy"); err != nil {
		return err
	}
	d, ok := f.domains[name]
	if !ok {
		return ErrNotFound
	}
	d.active = false
	return nil
}
func (f *fakeHV) Undefine(name string) error {
	if err := f.call("Undefine"); err != nil {
		return err
	}
	if _, ok := f.domains[name]; !ok {
		return ErrNotFound
	}
	delete(f.domains, name)
	return nil
}
func (f *fakeHV) Owner(name string) (string, error) {
	d, ok := f.domains[name]
	if !ok {
		return "", ErrNotFound
	}
	if d.owner == "" {
		return "", ErrNoOwner
	}
	return d.owner, nil
}
func (f *fakeHV) DomainNames() ([]string, error) {
	var out []string
	for k := range f.domains {
		out = append(out, k)
	}
	return out, nil
}
func (f *fakeHV) IsActive(name string) (bool, error) {
	d, ok := f.domains[name]
	if !ok {
		return false, ErrNotFound
	}
	return d.active, nil
}
func (f *fakeHV) Leases(name string) ([]Lease, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.domains[name]; !ok {
		return nil, ErrNotFound
	}
	return f.leases[name], nil
}
func (f *fakeHV) NetworkLeaseMACs(string) ([]string, error) { return f.netMACs, nil }
func (f *fakeHV) Close() error                              { return nil }

func (f *fakeHV) setLeases(name string, l ...Lease) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leases[name] = l
}

func ip(s string) net.IP { return net.ParseIP(s) }
