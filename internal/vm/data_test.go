package vm_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// dataMachine is a running machine of the fake with its engine.
func dataMachine(t *testing.T) (*vmtest.Fake, *Engine, Spec) {
	t.Helper()
	f := vmtest.New()
	s := testSpec()
	e := &Engine{HV: f, Controller: s.Owner.Controller}
	_, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	return f, e, s
}

// dataDisks are the domain's disks with the data disk's serial.
func dataDisks(t *testing.T, f *vmtest.Fake, name string) []libvirtxml.DomainDisk {
	t.Helper()
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(f.Domains[name].XML))
	var out []libvirtxml.DomainDisk
	for _, d := range dx.Devices.Disks {
		if d.Serial == DataDiskSerial {
			out = append(out, d)
		}
	}
	return out
}

func ownerVolumes(t *testing.T, f *vmtest.Fake, name string) []string {
	t.Helper()
	o, err := ParseOwner(f.Domains[name].OwnerXML)
	require.NoError(t, err)
	return o.Volumes
}

func TestAttachDataHotPlugsAReadOnlyDisk(t *testing.T) {
	f, e, s := dataMachine(t)
	data := bytes.Repeat([]byte("x"), 1000)
	require.NoError(t, e.AttachData(context.Background(), s.Name, "jobs", bytes.NewReader(data), int64(len(data))))
	assert.Equal(t, data, f.Volumes["jobs/"+DataVolume(s.Name)])
	disks := dataDisks(t, f, s.Name)
	require.Len(t, disks, 1)
	assert.NotNil(t, disks[0].ReadOnly, "the guest cannot write it")
	assert.Equal(t, "virtio", disks[0].Target.Bus)
	assert.Equal(t, "raw", disks[0].Driver.Type, "never probed as an image format")
	assert.Empty(t, disks[0].Driver.Cache, "the hypervisor's default cache mode")
	assert.Contains(t, ownerVolumes(t, f, s.Name), DataVolume(s.Name), "recorded, so a teardown removes it")

	// Dropped: the volume and its record go.
	require.NoError(t, e.DropData(context.Background(), s.Name, "jobs"))
	assert.NotContains(t, f.Volumes, "jobs/"+DataVolume(s.Name))
	assert.NotContains(t, ownerVolumes(t, f, s.Name), DataVolume(s.Name))
	require.NoError(t, e.DropData(context.Background(), s.Name, "jobs"), "nothing to drop is success")
}

func TestAttachDataFailureLeavesNothing(t *testing.T) {
	for _, failing := range []string{"CreateVolume", "StreamToVolume", "AttachDisk"} {
		t.Run(failing, func(t *testing.T) {
			f, e, s := dataMachine(t)
			f.FailOn[failing] = errors.New("injected")
			err := e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("data"), 4)
			require.ErrorContains(t, err, "injected")
			assert.NotContains(t, f.Volumes, "jobs/"+DataVolume(s.Name), "no volume left")
			assert.NotContains(t, ownerVolumes(t, f, s.Name), DataVolume(s.Name), "no record left")
			assert.Empty(t, dataDisks(t, f, s.Name))
		})
	}
	t.Run("short data", func(t *testing.T) {
		f, e, s := dataMachine(t)
		err := e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("da"), 4)
		require.Error(t, err)
		assert.NotContains(t, f.Volumes, "jobs/"+DataVolume(s.Name))
		assert.Empty(t, dataDisks(t, f, s.Name))
	})
}

func TestAttachDataRefused(t *testing.T) {
	f, e, s := dataMachine(t)
	require.ErrorContains(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader(""), 0), "want at least 1")
	require.ErrorIs(t, e.AttachData(context.Background(), "lve-gone", "jobs", strings.NewReader("x"), 1), ErrNotFound)
	// Another controller's machine: nothing of it is touched.
	other := &Engine{HV: f, Controller: "ffffffff-0000-4000-8000-000000000000"}
	require.ErrorIs(t, other.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("x"), 1), ErrNotOurs)
	assert.NotContains(t, f.Volumes, "jobs/"+DataVolume(s.Name))
}

func TestRemoveDeletesTheDataVolume(t *testing.T) {
	f, e, s := dataMachine(t)
	require.NoError(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("data"), 4))
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", false))
	assert.Empty(t, f.Volumes)

	// A data volume left without its domain (a crash between define and
	// record): removed only with proof of ownership.
	f.Volumes["jobs/"+DataVolume(s.Name)] = []byte("x")
	require.ErrorIs(t, e.Remove(context.Background(), s.Name, "jobs", false), ErrNotOurs)
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", true))
	assert.Empty(t, f.Volumes)
}

func TestAttachDataAgain(t *testing.T) {
	f, e, s := dataMachine(t)
	require.NoError(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("one"), 3))
	// The first disk still in the guest takes the target: a second attach
	// fails (as libvirt's does) and leaves nothing.
	require.Error(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("two"), 3))
	assert.NotContains(t, f.Volumes, "jobs/"+DataVolume(s.Name))
	// Once the guest let it go (an unplug), the next attach works.
	require.NoError(t, f.DetachDisk(context.Background(), s.Name, "/pool/jobs/"+DataVolume(s.Name)))
	require.NoError(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("two"), 3))
	assert.Equal(t, []byte("two"), f.Volumes["jobs/"+DataVolume(s.Name)])
	assert.Equal(t, 1, strings.Count(strings.Join(ownerVolumes(t, f, s.Name), " "), DataVolume(s.Name)))
}

func TestScratchDiskRoundTrip(t *testing.T) {
	f, e, s := dataMachine(t)
	require.NoError(t, e.AttachScratch(context.Background(), s.Name, "jobs", 1000))
	var disks []libvirtxml.DomainDisk
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(f.Domains[s.Name].XML))
	for _, d := range dx.Devices.Disks {
		if d.Serial == ScratchDiskSerial {
			disks = append(disks, d)
		}
	}
	require.Len(t, disks, 1)
	assert.Nil(t, disks[0].ReadOnly, "the guest writes it")
	assert.Equal(t, "raw", disks[0].Driver.Type)
	assert.Equal(t, "unsafe", disks[0].Driver.Cache, "the guest's flush is no host fsync of a volume read right away and deleted")
	assert.Contains(t, ownerVolumes(t, f, s.Name), ScratchVolume(s.Name))

	// What the guest wrote comes back as it is.
	f.Lock()
	f.Volumes["jobs/"+ScratchVolume(s.Name)] = []byte("from the guest")
	f.Unlock()
	read := func() (bool, string) {
		t.Helper()
		var got bytes.Buffer
		fromFile, err := e.ReadScratch(context.Background(), s.Name, "jobs", &got)
		require.NoError(t, err)
		return fromFile, got.String()
	}
	fromFile, got := read()
	assert.False(t, fromFile, "no file to read: libvirt's stream")
	assert.Equal(t, "from the guest", got)

	// Where this process may read the volume's file, the file is read.
	file := filepath.Join(t.TempDir(), "vol")
	require.NoError(t, os.WriteFile(file, []byte("the file's bytes"), 0o640))
	f.Lock()
	f.Files = map[string]string{"jobs/" + ScratchVolume(s.Name): file}
	f.Unlock()
	fromFile, got = read()
	assert.True(t, fromFile)
	assert.Equal(t, "the file's bytes", got)
	// A link in its place is not followed: the stream is read.
	require.NoError(t, os.Remove(file))
	require.NoError(t, os.Symlink("/etc/hostname", file))
	fromFile, got = read()
	assert.False(t, fromFile)
	assert.Equal(t, "from the guest", got)
	// A cancelled read stops.
	require.NoError(t, os.Remove(file))
	require.NoError(t, os.WriteFile(file, []byte("x"), 0o640))
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := e.ReadScratch(cctx, s.Name, "jobs", io.Discard)
	require.Error(t, err)

	// Another controller reads nothing of it.
	other := &Engine{HV: f, Controller: "ffffffff-0000-4000-8000-000000000000"}
	_, err = other.ReadScratch(context.Background(), s.Name, "jobs", io.Discard)
	require.ErrorIs(t, err, ErrNotOurs)

	require.NoError(t, e.DropScratch(context.Background(), s.Name, "jobs"))
	assert.NotContains(t, f.Volumes, "jobs/"+ScratchVolume(s.Name))
	assert.NotContains(t, ownerVolumes(t, f, s.Name), ScratchVolume(s.Name))
	_, err = e.ReadScratch(context.Background(), s.Name, "jobs", io.Discard)
	require.ErrorIs(t, err, ErrNotFound)

	// Both disks at once: each its own volume, removed with the machine.
	require.NoError(t, f.DetachDisk(context.Background(), s.Name, "/pool/jobs/"+ScratchVolume(s.Name)))
	require.NoError(t, e.AttachScratch(context.Background(), s.Name, "jobs", 1000))
	require.NoError(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("x"), 1))
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", false))
	assert.Empty(t, f.Volumes)
}

// Where libvirt says the machine's QEMU opens its disks as a DAC owner,
// the scratch volume is made that owner's, readable to this process's
// group (mode 0640), and the disk tells libvirt not to relabel it: the
// host's read then opens the file. Without a label it is made as the
// others: 0600, relabelled by libvirt.
func TestScratchDiskReadableToItsGroup(t *testing.T) {
	f, e, s := dataMachine(t)
	scratch := func() libvirtxml.DomainDisk {
		var dx libvirtxml.Domain
		require.NoError(t, dx.Unmarshal(f.Domains[s.Name].XML))
		for _, d := range dx.Devices.Disks {
			if d.Serial == ScratchDiskSerial {
				return d
			}
		}
		t.Fatal("no scratch disk")
		return libvirtxml.DomainDisk{}
	}
	require.NoError(t, e.AttachScratch(context.Background(), s.Name, "jobs", 1000))
	assert.Equal(t, libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"}, f.Perms["jobs/"+ScratchVolume(s.Name)])
	assert.Empty(t, scratch().Source.File.SecLabel)
	require.NoError(t, e.DropScratch(context.Background(), s.Name, "jobs"))
	require.NoError(t, f.DetachDisk(context.Background(), s.Name, "/pool/jobs/"+ScratchVolume(s.Name)))

	// A running domain's live XML, as libvirt's DAC driver writes it.
	f.Lock()
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(f.Domains[s.Name].XML))
	dx.SecLabel = []libvirtxml.DomainSecLabel{{Type: "dynamic", Model: "dac", Relabel: "yes", Label: "+64055:+994", ImageLabel: "+64055:+993"}}
	x, err := dx.Marshal()
	require.NoError(t, err)
	f.Domains[s.Name].XML = x
	f.Unlock()
	e.ScratchGroup = func() (int, bool) { return 127, true }
	require.NoError(t, e.AttachScratch(context.Background(), s.Name, "jobs", 1000))
	assert.Equal(t, libvirtxml.StorageVolumeTargetPermissions{Owner: "64055", Group: "127", Mode: "0640"}, f.Perms["jobs/"+ScratchVolume(s.Name)])
	assert.Equal(t, []libvirtxml.DomainDeviceSecLabel{{Model: "dac", Relabel: "no"}}, scratch().Source.File.SecLabel)
	require.NoError(t, e.DropScratch(context.Background(), s.Name, "jobs"))
	require.NoError(t, f.DetachDisk(context.Background(), s.Name, "/pool/jobs/"+ScratchVolume(s.Name)))

	// A process outside the libvirt group: as the others, whatever the
	// label.
	e.ScratchGroup = func() (int, bool) { return 0, false }
	require.NoError(t, e.AttachScratch(context.Background(), s.Name, "jobs", 1000))
	assert.Equal(t, libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"}, f.Perms["jobs/"+ScratchVolume(s.Name)])
	assert.Empty(t, scratch().Source.File.SecLabel)
}

// The group is root's for root, else the libvirt group if this process is
// in it, never the primary group.
func TestLibvirtGroupOfProcess(t *testing.T) {
	gid, ok := LibvirtGroupOfProcess()
	if os.Geteuid() == 0 {
		assert.True(t, ok)
		assert.Equal(t, 0, gid)
		return
	}
	g, err := user.LookupGroup("libvirt")
	if err != nil {
		assert.False(t, ok, "no libvirt group")
		return
	}
	groups, _ := os.Getgroups()
	want, _ := strconv.Atoi(g.Gid)
	assert.Equal(t, slices.Contains(groups, want) || os.Getegid() == want, ok)
}

func TestParseDACLabel(t *testing.T) {
	for label, want := range map[string][3]int{
		"+64055:+994":                        {64055, 994, 1},
		"+0:+0":                              {0, 0, 1},
		"64055:994":                          {0, 0, 0},
		"+a:+1":                              {0, 0, 0},
		"+1:+1:+1":                           {0, 0, 0},
		"+99999999999:+1":                    {0, 0, 0},
		"":                                   {0, 0, 0},
		"system_u:system_r:svirt_t:s0:c1,c2": {0, 0, 0},
	} {
		uid, gid, ok := ParseDACLabel(label)
		okInt := 0
		if ok {
			okInt = 1
		}
		assert.Equal(t, want, [3]int{uid, gid, okInt}, label)
	}
}
