package vm_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// These tests run the Libvirt implementation against libvirt's in-process
// test driver (no daemon, no QEMU): real XML parsing, metadata handling and
// error codes.
func testDriver(t *testing.T) *Libvirt {
	t.Helper()
	l, err := Connect(context.Background(), "test:///default")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// testDriverSpec is testSpec on the test driver's pool and network, with
// nothing the test driver cannot boot.
func testDriverSpec() Spec {
	s := testSpec()
	s.Pool = "default-pool"
	s.Network = "default"
	s.Base = "/default-pool/base.qcow2"
	s.Kernel, s.Initrd, s.Cmdline = "", "", ""
	s.ConsoleLog = ""
	return s
}

// addBaseVolume creates the spec's base image in the test driver's pool.
func addBaseVolume(t *testing.T, l *Libvirt, s Spec) {
	t.Helper()
	_, err := l.CreateVolume(context.Background(), s.Pool, &libvirtxml.StorageVolume{
		Name: "base.qcow2", Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 1 << 30},
	})
	require.NoError(t, err)
}

func TestLibvirtLifecycle(t *testing.T) {
	l := testDriver(t)
	s := testDriverSpec()
	addBaseVolume(t, l, s)

	e := &Engine{HV: l, Controller: s.Owner.Controller}
	m, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.NotEmpty(t, m.DiskPath)

	active, err := l.IsActive(context.Background(), s.Name)
	require.NoError(t, err)
	require.True(t, active)

	ownerXML, err := l.Owner(context.Background(), s.Name)
	require.NoError(t, err)
	o, err := ParseOwner(ownerXML)
	require.NoError(t, err)
	require.Equal(t, s.Owner.Controller, o.Controller)
	require.Equal(t, []string{DiskVolume(s.Name)}, o.Volumes)

	vols, err := l.VolumeNames(context.Background(), s.Pool)
	require.NoError(t, err)
	require.Contains(t, vols, DiskVolume(s.Name))

	// The deadline can be moved (keep-on-failure) through libvirt's metadata API.
	later := time.Now().Add(3 * time.Hour).UTC().Truncate(time.Second)
	require.NoError(t, e.Extend(context.Background(), s.Name, later))
	ownerXML, err = l.Owner(context.Background(), s.Name)
	require.NoError(t, err)
	o, err = ParseOwner(ownerXML)
	require.NoError(t, err)
	require.True(t, later.Equal(o.Deadline), "deadline %s", o.Deadline)
	require.Equal(t, []string{DiskVolume(s.Name)}, o.Volumes, "the rest of the record is kept")
	require.ErrorIs(t, (&Engine{HV: l, Controller: "other"}).Extend(context.Background(), s.Name, later), ErrNotOurs)

	// Another controller may not remove it.
	other := &Engine{HV: l, Controller: "someone-else"}
	require.ErrorIs(t, other.Remove(context.Background(), s.Name, s.Pool, true), ErrNotOurs)

	require.NoError(t, e.Remove(context.Background(), s.Name, s.Pool, false))
	_, err = l.Owner(context.Background(), s.Name)
	require.ErrorIs(t, err, ErrNotFound)
	vols, err = l.VolumeNames(context.Background(), s.Pool)
	require.NoError(t, err)
	require.NotContains(t, vols, DiskVolume(s.Name))
	require.NoError(t, e.Remove(context.Background(), s.Name, s.Pool, false), "idempotent")
}

func TestLibvirtNotFoundAndNoOwner(t *testing.T) {
	l := testDriver(t)
	require.ErrorIs(t, l.Destroy(context.Background(), "lve-nope-1"), ErrNotFound)
	require.ErrorIs(t, l.Undefine(context.Background(), "lve-nope-1"), ErrNotFound)
	require.ErrorIs(t, l.DeleteVolume(context.Background(), "default-pool", "lve-nope-1.qcow2"), ErrNotFound)
	_, err := l.Owner(context.Background(), "lve-nope-1")
	require.ErrorIs(t, err, ErrNotFound)

	// The test driver's stock domain "test" has no ownership metadata.
	_, err = l.Owner(context.Background(), "test")
	require.True(t, errors.Is(err, ErrNoOwner), "got %v", err)
	e := &Engine{HV: l, Controller: "c"}
	require.ErrorIs(t, e.Remove(context.Background(), "test", "default-pool", true), ErrNotOurs)
	active, err := l.IsActive(context.Background(), "test")
	require.NoError(t, err)
	require.True(t, active, "look-alike left running")
}

func TestLibvirtKVMAvailable(t *testing.T) {
	l := testDriver(t)
	_, err := l.KVMAvailable(context.Background())
	require.NoError(t, err)
}

// A domain undefined while running (transient) keeps its ownership record in
// its live definition: Owner reads it there, so teardown and the sweep can
// still prove it ours and remove it.
func TestOwnerOfATransientDomain(t *testing.T) {
	l := testDriver(t)
	s := testDriverSpec()
	ctx := context.Background()
	addBaseVolume(t, l, s)
	e := &Engine{HV: l, Controller: s.Owner.Controller}
	_, err := e.Create(ctx, s)
	require.NoError(t, err)
	require.NoError(t, l.Undefine(ctx, s.Name), "undefined while running: transient")
	ownerXML, err := l.Owner(ctx, s.Name)
	require.NoError(t, err)
	o, err := ParseOwner(ownerXML)
	require.NoError(t, err)
	require.Equal(t, s.Owner.Controller, o.Controller)
	require.NoError(t, e.Remove(ctx, s.Name, s.Pool, false))
	_, err = l.Owner(ctx, s.Name)
	require.ErrorIs(t, err, ErrNotFound, "the transient domain is gone")
}
