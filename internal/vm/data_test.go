package vm_test

import (
	"bytes"
	"context"
	"errors"
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
	var got bytes.Buffer
	require.NoError(t, e.ReadScratch(context.Background(), s.Name, "jobs", &got))
	assert.Equal(t, "from the guest", got.String())

	// Another controller reads nothing of it.
	other := &Engine{HV: f, Controller: "ffffffff-0000-4000-8000-000000000000"}
	require.ErrorIs(t, other.ReadScratch(context.Background(), s.Name, "jobs", &got), ErrNotOurs)

	require.NoError(t, e.DropScratch(context.Background(), s.Name, "jobs"))
	assert.NotContains(t, f.Volumes, "jobs/"+ScratchVolume(s.Name))
	assert.NotContains(t, ownerVolumes(t, f, s.Name), ScratchVolume(s.Name))
	require.ErrorIs(t, e.ReadScratch(context.Background(), s.Name, "jobs", &got), ErrNotFound)

	// Both disks at once: each its own volume, removed with the machine.
	require.NoError(t, f.DetachDisk(context.Background(), s.Name, "/pool/jobs/"+ScratchVolume(s.Name)))
	require.NoError(t, e.AttachScratch(context.Background(), s.Name, "jobs", 1000))
	require.NoError(t, e.AttachData(context.Background(), s.Name, "jobs", strings.NewReader("x"), 1))
	require.NoError(t, e.Remove(context.Background(), s.Name, "jobs", false))
	assert.Empty(t, f.Volumes)
}
