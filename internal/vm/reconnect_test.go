package vm_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func TestReconnectingRetriesOnceAfterLostConnection(t *testing.T) {
	first, second := vmtest.New(), vmtest.New()
	second.Domains["lve-a-1"] = &vmtest.Domain{Active: true}
	lost := libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_RPC, Message: "Cannot recv data: Connection reset by peer"}
	first.FailOn["DomainNames"] = lost
	dials := 0
	r, err := NewReconnecting(func() (Hypervisor, error) {
		dials++
		if dials == 1 {
			return first, nil
		}
		return second, nil
	})
	require.NoError(t, err)
	var causes []error
	r.OnReconnect = func(c error) { causes = append(causes, c) }

	names, err := r.DomainNames()
	require.NoError(t, err, "repeated on the new connection")
	require.Equal(t, []string{"lve-a-1"}, names)
	require.Equal(t, 1, r.Reconnects())
	require.Len(t, causes, 1)

	// Errors that are not about the connection are returned, no reconnect.
	_, err = r.IsActive("nope")
	require.ErrorIs(t, err, ErrNotFound)
	require.Equal(t, 1, r.Reconnects())

	// A second loss on the new connection: reconnect once more, then give up
	// if dialing fails.
	second.FailOn["DomainNames"] = lost
	dialErr := errors.New("libvirtd not running")
	r2, err := NewReconnecting(func() (Hypervisor, error) {
		if dials++; dials > 3 {
			return nil, dialErr
		}
		return second, nil
	})
	require.NoError(t, err)
	r2.Wait, r2.Interval = 100*time.Millisecond, 10*time.Millisecond
	start := time.Now()
	_, err = r2.DomainNames()
	require.ErrorIs(t, err, ErrConnectionLost)
	require.ErrorContains(t, err, "libvirtd not running")
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "kept redialling for Wait")
}

func TestReconnectingWaitsForTheDaemon(t *testing.T) {
	first, second := vmtest.New(), vmtest.New()
	first.FailOn["DomainNames"] = libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_RPC}
	second.Domains["lve-a-1"] = &vmtest.Domain{}
	dials := 0
	r, err := NewReconnecting(func() (Hypervisor, error) {
		dials++
		switch {
		case dials == 1:
			return first, nil
		case dials < 5: // the daemon is still restarting
			return nil, errors.New("Failed to connect socket")
		}
		return second, nil
	})
	require.NoError(t, err)
	r.Interval = time.Millisecond
	names, err := r.DomainNames()
	require.NoError(t, err)
	require.Equal(t, []string{"lve-a-1"}, names)
	require.Equal(t, 5, dials)
}

func TestConnectionLostClassification(t *testing.T) {
	for _, tc := range []struct {
		err  error
		lost bool
	}{
		{libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_RPC}, true},
		{libvirt.Error{Code: libvirt.ERR_INVALID_CONN, Domain: libvirt.FROM_NONE}, true},
		{fmt.Errorf("wrapped: %w", libvirt.Error{Code: libvirt.ERR_NO_CONNECT}), true},
		{libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_QEMU}, false},
		{libvirt.Error{Code: libvirt.ERR_NO_DOMAIN}, false},
		{errors.New("x"), false},
	} {
		require.Equal(t, tc.lost, ConnectionLost(tc.err), "%v", tc.err)
	}
}
