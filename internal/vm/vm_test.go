package vm_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

var update = flag.Bool("update", false, "rewrite golden files")

func testSpec() Spec {
	created := time.Date(2026, 11, 21, 15, 0, 0, 0, time.UTC)
	return Spec{
		Name: "lve-0123abcd-1000", DomainType: "qemu", VCPUs: 1, MemoryMiB: 512,
		Base: "/images/tiny.qcow2", BaseFormat: "qcow2", Machine: "pc",
		Kernel: "/images/vmlinuz", Initrd: "/images/initrd.img", Cmdline: "console=ttyS0 root=/dev/vda",
		Pool: "jobs", Network: "ci", MAC: "52:54:00:aa:bb:cc",
		OEMStrings: []string{"io.systemd.credential:ssh.authorized_keys.root=ssh-ed25519 AAAA <x>&\"y\""},
		ConsoleLog: "/state/lve-0123abcd-1000/console.log",
		Owner: Owner{Controller: "0123abcd-0000-4000-8000-000000000000", Frontend: "gitlab", Job: "1000",
			Created: created, Deadline: created.Add(90 * time.Minute)},
	}
}

func TestDomainXMLGolden(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*Spec)
		seed   string
	}{
		{"kernel-smbios", func(s *Spec) { s.Isolated = true }, ""},
		{"disk-seed-kvm-agent", func(s *Spec) {
			s.Kernel, s.Initrd, s.Cmdline, s.OEMStrings, s.DomainType = "", "", "", nil, "kvm"
			s.GuestAgent = true
			s.SeedSerial = "lve-credentials"
		}, "/pool/lve-0123abcd-1000-seed.img"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := testSpec()
			tc.mutate(&s)
			got, err := DomainXML(s, "/pool/lve-0123abcd-1000.qcow2", tc.seed)
			require.NoError(t, err)
			path := "testdata/" + tc.name + ".golden.xml"
			if *update {
				require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
			}
			want, err := os.ReadFile(path)
			require.NoError(t, err)
			require.Equal(t, string(want), got)
		})
	}
}

func TestDomainXMLEscapesValues(t *testing.T) {
	got, err := DomainXML(testSpec(), "/pool/d.qcow2", "")
	require.NoError(t, err)
	require.Contains(t, got, "&lt;x&gt;&amp;&#34;y&#34;")
	require.NotContains(t, got, `<x>&"y"`)
}

func TestHostileNamesRefusedBeforeXML(t *testing.T) {
	for _, name := range []string{
		"", "UPPER", "../etc/passwd", "a/b", "lve-1</name><devices>", "lve 1", "lve-1\x00", "lve-\n1",
		"-lve", "1lve", strings.Repeat("a", 64), "lve-ä",
	} {
		s := testSpec()
		s.Name = name
		_, err := DomainXML(s, "/d", "")
		require.Error(t, err, "name %q", name)
		require.ErrorContains(t, err, "refused")

		f := vmtest.New()
		e := &Engine{HV: f, Controller: s.Owner.Controller}
		_, err = e.Create(context.Background(), s)
		require.Error(t, err)
		require.Empty(t, f.Calls, "no hypervisor call for name %q", name)
	}
}

func TestOwnerRoundTrip(t *testing.T) {
	o := testSpec().Owner
	o.Volumes = []string{"a.qcow2"}
	s, err := MarshalOwner(o)
	require.NoError(t, err)
	// libvirt hands the element back with its own prefix.
	prefixed := strings.Replace(strings.Replace(s, "<owner xmlns=", "<lve:owner xmlns:lve=", 1), "</owner>", "</lve:owner>", 1)
	prefixed = strings.NewReplacer("<controller>", "<lve:controller>", "</controller>", "</lve:controller>").Replace(prefixed)
	for _, in := range []string{s, prefixed} {
		got, err := ParseOwner(in)
		require.NoError(t, err)
		require.Equal(t, o.Controller, got.Controller)
		require.Equal(t, o.Job, got.Job)
		require.True(t, o.Deadline.Equal(got.Deadline))
		require.Equal(t, o.Volumes, got.Volumes)
	}
	_, err = ParseOwner(`<owner><job>1</job></owner>`)
	require.ErrorContains(t, err, "no controller id")
	_, err = ParseOwner(`<owner><controller>x</contr`)
	require.Error(t, err)
}

func TestCreateAndRemove(t *testing.T) {
	f := vmtest.New()
	s := testSpec()
	s.Seed = []byte("seed")
	var lines []string
	e := &Engine{HV: f, Controller: s.Owner.Controller, Progress: func(format string, a ...any) { lines = append(lines, format) }}
	m, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.Equal(t, "/pool/jobs/lve-0123abcd-1000.qcow2", m.DiskPath)
	require.True(t, f.Domains[s.Name].Active)
	require.Equal(t, []byte("seed"), f.Volumes["jobs/lve-0123abcd-1000-seed.img"])
	require.Len(t, lines, 5)

	// The domain's ownership record is the proof: no record of the caller's needed.
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", false))
	require.Empty(t, f.Domains)
	require.Empty(t, f.Volumes)
	// Idempotent: nothing left, nothing to prove.
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", false))
}

func TestCreateFailureUndoesEverything(t *testing.T) {
	for _, failing := range []string{"CreateVolume", "UploadVolume", "Define", "Start"} {
		t.Run(failing, func(t *testing.T) {
			f := vmtest.New()
			f.FailOn[failing] = errors.New("injected")
			s := testSpec()
			s.Seed = []byte("seed")
			e := &Engine{HV: f, Controller: s.Owner.Controller}
			_, err := e.Create(context.Background(), s)
			require.ErrorContains(t, err, "injected")
			require.Empty(t, f.Domains, "no domain left")
			require.Empty(t, f.Volumes, "no volume left")
		})
	}
}

func TestRemoveRefusesForeignDomains(t *testing.T) {
	f := vmtest.New()
	s := testSpec()
	e := &Engine{HV: f, Controller: s.Owner.Controller}
	// A look-alike without metadata, with a volume of our naming scheme.
	f.Domains[s.Name] = &vmtest.Domain{Active: true}
	f.Volumes["jobs/"+DiskVolume(s.Name)] = nil
	err := e.Remove(context.Background(), s.Name, "jobs", true)
	require.ErrorIs(t, err, ErrNotOurs)
	require.True(t, f.Domains[s.Name].Active, "look-alike untouched")
	require.Contains(t, f.Volumes, "jobs/"+DiskVolume(s.Name), "its volume untouched")

	// One owned by another controller.
	other := s.Owner
	other.Controller = "ffffffff-0000-4000-8000-000000000000"
	x, err := MarshalOwner(other)
	require.NoError(t, err)
	f.Domains[s.Name] = &vmtest.Domain{Active: true, OwnerXML: x}
	err = e.Remove(context.Background(), s.Name, "jobs", true)
	require.ErrorIs(t, err, ErrNotOurs)
	require.ErrorContains(t, err, "ffffffff")
	require.True(t, f.Domains[s.Name].Active)
}

func TestRemoveLeftoverVolumesWithoutDomain(t *testing.T) {
	f := vmtest.New()
	s := testSpec()
	e := &Engine{HV: f, Controller: s.Owner.Controller}
	f.Volumes["jobs/"+DiskVolume(s.Name)] = nil
	f.Volumes["jobs/"+SeedVolume(s.Name)] = nil
	f.Volumes["jobs/unrelated.qcow2"] = nil
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", true))
	require.Equal(t, []string{"unrelated.qcow2"}, mustNames(t, f))
}

// Without a domain, only the caller's record says whose the volumes of a
// name are. Without one, Remove deletes nothing: "debian-12" may be a base
// image kept in the same pool.
func TestRemoveVolumesWithoutDomainNeedsProof(t *testing.T) {
	f := vmtest.New()
	e := &Engine{HV: f, Controller: testSpec().Owner.Controller}
	for _, name := range []string{"debian-12", testSpec().Name} {
		f.Volumes["jobs/"+DiskVolume(name)] = nil
	}
	f.Volumes["jobs/"+SeedVolume(testSpec().Name)] = nil
	err := e.Remove(context.Background(), "debian-12", "jobs", false)
	require.ErrorIs(t, err, ErrNotOurs)
	require.ErrorContains(t, err, "debian-12: not owned by this controller: no domain and no state record of ours: volumes debian-12.qcow2 left alone")
	err = e.Remove(context.Background(), testSpec().Name, "jobs", false)
	require.ErrorIs(t, err, ErrNotOurs)
	require.ErrorContains(t, err, "volumes lve-0123abcd-1000.qcow2, lve-0123abcd-1000-seed.img left alone")
	require.Len(t, f.Volumes, 3, "nothing deleted")
	require.NotContains(t, f.Calls, "DeleteVolume")

	// Nothing there: nothing to prove, nothing to do.
	require.NoError(t, e.Remove(context.Background(), "lve-0123abcd-1001", "jobs", false))
}

func mustNames(t *testing.T, f *vmtest.Fake) []string {
	n, err := f.VolumeNames(context.Background(), "jobs")
	require.NoError(t, err)
	return n
}

func TestWaitAddressOnlyOwnMAC(t *testing.T) {
	f := vmtest.New()
	f.Domains["lve-x-1"] = &vmtest.Domain{Active: true}
	e := &Engine{HV: f, PollInterval: 5 * time.Millisecond}
	f.SetLeases("lve-x-1", Lease{MAC: "52:54:00:00:00:99", IP: net.ParseIP("10.0.0.9")})
	go func() {
		time.Sleep(30 * time.Millisecond)
		f.SetLeases("lve-x-1", Lease{MAC: "52:54:00:00:00:99", IP: net.ParseIP("10.0.0.9")}, Lease{MAC: "52:54:00:aa:bb:cc", IP: net.ParseIP("10.0.0.5")})
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr, err := e.WaitAddress(ctx, "lve-x-1", "52:54:00:AA:BB:CC", SourceLease)
	require.NoError(t, err)
	require.Equal(t, "10.0.0.5", addr)
}

func TestWaitAddressStops(t *testing.T) {
	f := vmtest.New()
	f.Domains["lve-x-1"] = &vmtest.Domain{Active: false}
	e := &Engine{HV: f, PollInterval: 5 * time.Millisecond}
	_, err := e.WaitAddress(context.Background(), "lve-x-1", "52:54:00:aa:bb:cc", SourceLease)
	require.ErrorContains(t, err, "stopped before it got an address")

	f.Domains["lve-x-1"].Active = true
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = e.WaitAddress(ctx, "lve-x-1", "52:54:00:aa:bb:cc", SourceLease)
	require.ErrorContains(t, err, "no address for lve-x-1")
}

func TestWaitAddressAgentNotReadyYet(t *testing.T) {
	f := vmtest.New()
	f.Domains["lve-x-1"] = &vmtest.Domain{Active: true}
	f.FailOn["Addresses"] = fmt.Errorf("%w: agent starting", ErrAgentNotReady)
	e := &Engine{HV: f, PollInterval: 5 * time.Millisecond}
	go func() {
		time.Sleep(30 * time.Millisecond)
		f.Lock()
		delete(f.FailOn, "Addresses")
		f.Unlock()
		f.SetLeases("lve-x-1", Lease{MAC: "52:54:00:aa:bb:cc", IP: net.ParseIP("192.0.2.7")})
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr, err := e.WaitAddress(ctx, "lve-x-1", "52:54:00:aa:bb:cc", SourceAgent)
	require.NoError(t, err)
	require.Equal(t, "192.0.2.7", addr)

	f.FailOn["Addresses"] = errors.New("permission denied")
	_, err = e.WaitAddress(ctx, "lve-x-1", "52:54:00:aa:bb:cc", SourceAgent)
	require.ErrorContains(t, err, "permission denied", "other errors end the wait")
}

func TestFreshMACAvoidsLeased(t *testing.T) {
	f := vmtest.New()
	e := &Engine{HV: f}
	mac, err := e.FreshMAC(context.Background(), "ci")
	require.NoError(t, err)
	require.Regexp(t, `^52:54:00:[0-9a-f]{2}:[0-9a-f]{2}:[0-9a-f]{2}$`, mac)
}

func TestResolveDomainType(t *testing.T) {
	e := &Engine{HV: vmtest.New()}
	got, err := e.ResolveDomainType(context.Background(), "auto")
	require.NoError(t, err)
	require.Equal(t, "qemu", got, "fake reports no kvm")
	got, err = e.ResolveDomainType(context.Background(), "kvm")
	require.NoError(t, err)
	require.Equal(t, "kvm", got)
}

// Remove, Explain and WaitAddress give up on a hung hypervisor when their
// ctx ends.
func TestEngineGivesUpWithCtx(t *testing.T) {
	f := vmtest.New()
	f.Domains["lve-x-1"] = &vmtest.Domain{Active: true}
	hang := make(chan struct{})
	defer close(hang)
	f.Hang = hang
	e := &Engine{HV: NewReconnecting(func(context.Context) (Hypervisor, error) { return f, nil }), Controller: "c",
		PollInterval: 5 * time.Millisecond}
	within := func(what string, call func(ctx context.Context)) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		start := time.Now()
		call(ctx)
		require.Less(t, time.Since(start), 3*time.Second, what)
	}
	within("remove", func(ctx context.Context) {
		require.ErrorIs(t, e.Remove(ctx, "lve-x-1", "jobs", true), context.DeadlineExceeded)
	})
	within("explain", func(ctx context.Context) {
		require.Empty(t, e.Explain(ctx, "lve-x-1", "jobs"), "libvirt cannot tell")
	})
	within("wait address", func(ctx context.Context) {
		_, err := e.WaitAddress(ctx, "lve-x-1", "52:54:00:00:00:01", SourceLease)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorContains(t, err, "no address for lve-x-1")
	})
	require.Equal(t, 3, f.Hung())
}

// A cancel that lands while libvirt starts the domain: the start is let
// finish (it would happen anyway), so its undo runs and nothing is left. When
// the start was abandoned instead, the define's undo met a running domain,
// which libvirt keeps as a transient one: a leaked VM (seen in the fault
// suite's SIGTERM-during-prepare test).
func TestCancelDuringStartLeavesNothing(t *testing.T) {
	f := cancelDuringStart(t, 100*time.Millisecond)
	f.Lock()
	defer f.Unlock()
	require.Empty(t, f.Domains, "no domain left, running or not")
	require.Empty(t, f.Volumes)
}

// cancelDuringStart runs Create on a fake whose start takes effect and then
// blocks; ctx is cancelled once the start has begun, and the start returns
// after startTakes (never, within the test, when startTakes is 0). It
// returns the fake after Create has returned a cancellation.
func cancelDuringStart(t *testing.T, startTakes time.Duration) *vmtest.Fake {
	t.Helper()
	f := vmtest.New()
	started, release := make(chan struct{}), make(chan struct{})
	f.OnStart = func(string, *libvirtxml.Domain) {
		close(started)
		<-release
	}
	s := testSpec()
	e := &Engine{HV: NewReconnecting(func(context.Context) (Hypervisor, error) { return f, nil }), Controller: s.Owner.Controller,
		UndoTimeout: 5 * time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-started
		cancel()
		if startTakes > 0 {
			time.Sleep(startTakes)
			close(release)
		}
	}()
	if startTakes == 0 {
		defer close(release)
	}
	_, err := e.Create(ctx, s)
	require.ErrorIs(t, err, context.Canceled)
	return f
}

// A start that outlives MutationGrace after a cancel is abandoned without
// knowing whether it happened: the define's undo destroys before it
// undefines, so a start that did happen leaves no running transient domain.
func TestStartOutlivingTheGraceLeavesNothing(t *testing.T) {
	old := MutationGrace
	MutationGrace = 50 * time.Millisecond
	defer func() { MutationGrace = old }()
	f := cancelDuringStart(t, 0)
	f.Lock()
	defer f.Unlock()
	require.Empty(t, f.Domains, "no domain left, running or transient")
	require.Empty(t, f.Volumes)
}

// A machine with a filter: the project's filters are defined on first use
// (and not again); without libvirt's clean-traffic the machine is not
// made at all, with an error naming the package to install.
func TestCreateDefinesFilters(t *testing.T) {
	f := vmtest.New()
	s := testSpec()
	s.Filter = &Filter{}
	e := &Engine{HV: f, Controller: s.Owner.Controller}
	_, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.Contains(t, f.NWFilters, FilterName)
	require.Contains(t, f.NWFilters, FilterEgressName)
	require.Contains(t, f.NWFilters[FilterEgressName], "<filterref filter='"+FilterName+"'/>", "the egress filter builds on this version's base filter")
	for _, nf := range Filters() {
		require.Contains(t, nf.XML, "<filter name='"+nf.Name+"' chain='root'>", "file and name agree")
	}

	f = vmtest.New()
	delete(f.NWFilters, FilterBase)
	e.HV = f
	_, err = e.Create(context.Background(), s)
	require.ErrorContains(t, err, "no network filter clean-traffic")
	require.Empty(t, f.Domains)
	require.Empty(t, f.Volumes)
	require.NotContains(t, f.NWFilters, FilterName)
}

// A filter of our name that libvirt has with other rules (defined by
// someone else) is refused, not trusted by its name: the machine is not
// made, and the error names the filter and the fix.
func TestCreateRefusesAForeignFilterOfOurName(t *testing.T) {
	s := testSpec()
	s.Filter = &Filter{}
	f := vmtest.New()
	foreign := "<filter name='" + FilterName + "' chain='root'><filterref filter='allow-all'/></filter>"
	f.NWFilters[FilterName] = foreign
	e := &Engine{HV: f, Controller: s.Owner.Controller}
	_, err := e.Create(context.Background(), s)
	require.ErrorContains(t, err, "network filter named "+FilterName+" that is not this project's")
	require.ErrorContains(t, err, "virsh nwfilter-undefine "+FilterName)
	require.Empty(t, f.Domains)
	require.Empty(t, f.Volumes)
	require.Equal(t, foreign, f.NWFilters[FilterName], "left as it was")
	require.NotContains(t, f.NWFilters, FilterEgressName, "nothing built on it")

	// Ours, as libvirt hands it back: used.
	f.NWFilters[FilterName] = Filters()[0].XML
	f.NWFilters[FilterEgressName] = strings.ReplaceAll(Filters()[1].XML, "'", "\"")
	_, err = e.Create(context.Background(), s)
	require.NoError(t, err)
}

// Each version of a filter has a UUID of its own, and none of the retired
// ones: libvirt refuses a new name under a UUID it already has (a host
// upgraded from a version that defined lve-vm could start no VM).
func TestFilterUUIDsAreNew(t *testing.T) {
	retired := []string{
		"6f1f7a52-3c1e-4d55-9b0e-2a7c51d0e101", // lve-vm
		"6f1f7a52-3c1e-4d55-9b0e-2a7c51d0e102", // lve-vm-egress
	}
	re := regexp.MustCompile(`<uuid>([0-9a-f-]{36})</uuid>`)
	seen := map[string]string{}
	for _, f := range Filters() {
		m := re.FindStringSubmatch(f.XML)
		require.NotNil(t, m, "%s has a fixed UUID (two processes defining it at once update the same filter)", f.Name)
		require.NotContains(t, retired, m[1], "%s reuses a retired filter's UUID", f.Name)
		require.NotContains(t, seen, m[1], "%s and %s share a UUID", f.Name, seen[m[1]])
		seen[m[1]] = f.Name
	}
}

// Shared directories: a virtiofs filesystem per directory, its socket the
// caller's virtiofsd's, and the guest memory shared (memfd), as a libvirt
// 9.0 domain accepted them in a trial on the rig (docs/github-hooks.md).
func TestDomainXMLSharedDirs(t *testing.T) {
	s := testSpec()
	s.Dirs = []SharedDir{{Socket: "/run/lve/vfs/work.sock", Tag: "work"}}
	x, err := DomainXML(s, "/pool/d.qcow2", "")
	require.NoError(t, err)
	var d libvirtxml.Domain
	require.NoError(t, d.Unmarshal(x))
	require.Len(t, d.Devices.Filesystems, 1)
	fs := d.Devices.Filesystems[0]
	require.Equal(t, "virtiofs", fs.Driver.Type)
	require.Equal(t, "/run/lve/vfs/work.sock", fs.Source.Mount.Socket)
	require.Empty(t, fs.Source.Mount.Dir, "libvirt starts no virtiofsd of its own")
	require.Equal(t, "work", fs.Target.Dir)
	require.Equal(t, "memfd", d.MemoryBacking.MemorySource.Type)
	require.Equal(t, "shared", d.MemoryBacking.MemoryAccess.Mode)

	plain, err := DomainXML(testSpec(), "/pool/d.qcow2", "")
	require.NoError(t, err)
	require.NotContains(t, plain, "memoryBacking", "no shared memory without a shared directory")

	for _, bad := range [][]SharedDir{
		{{Socket: "/run/x.sock", Tag: "Work"}},
		{{Socket: "/run/x.sock", Tag: "a b"}},
		{{Socket: "/run/x.sock", Tag: "w"}, {Socket: "/run/y.sock", Tag: "w"}},
		{{Socket: "run/x.sock", Tag: "w"}},
		{{Socket: "/run/../x.sock", Tag: "w"}},
	} {
		s := testSpec()
		s.Dirs = bad
		_, err := DomainXML(s, "/pool/d.qcow2", "")
		require.Error(t, err, "%+v", bad)
	}
}
