package admin

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// TestGarmEndpointChecks: an endpoint on the network's own address is
// checked against the guard's port list and for an answer; one elsewhere
// only for an answer; a silent one, a port the guard keeps closed and an
// unguarded network are each reported with what to do.
func TestGarmEndpointChecks(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	silentPort := silent.Addr().(*net.TCPAddr).Port
	require.NoError(t, silent.Close()) // nothing listens there now

	conf := filepath.Join(t.TempDir(), "guard.conf")
	write := func(s string) { require.NoError(t, os.WriteFile(conf, []byte(s), 0o644)) }
	cfg := &config.Config{Network: "ci"}
	check := func(gateway string, endpoints ...string) []Check {
		cfg.Garm.Endpoints = endpoints
		return garmEndpointChecks(context.Background(), cfg, gateway, conf)
	}
	ep := fmt.Sprintf("http://127.0.0.1:%d", port)

	// guarded, port listed in a range, answering
	write(fmt.Sprintf("# comment\nother 1\nci 22,%d:%d\n", port-1, port+1))
	cs := check("127.0.0.1", ep)
	require.Len(t, cs, 1)
	require.True(t, cs[0].OK, cs[0].Info)
	require.False(t, cs[0].Warn)
	require.Contains(t, cs[0].Info, "the guard lets the guests reach port")

	// guarded, port not listed: fails naming the list and the fix
	write("ci 22,8080\n")
	cs = check("127.0.0.1", ep)
	require.Len(t, cs, 1)
	require.False(t, cs[0].OK)
	require.Contains(t, cs[0].Info, "allowed: 22,8080")
	require.Contains(t, cs[0].Fix, fmt.Sprintf("list port %d", port))

	// a guarded network without ports
	write("ci\n")
	cs = check("127.0.0.1", ep)
	require.False(t, cs[0].OK)
	require.Contains(t, cs[0].Info, "allowed: none")

	// the network not guarded: a warning, then the answer
	write("other 1-2\n")
	cs = check("127.0.0.1", ep)
	require.Len(t, cs, 2)
	require.True(t, cs[0].OK && cs[0].Warn)
	require.Contains(t, cs[0].Info, "is not guarded")
	require.True(t, cs[1].OK && !cs[1].Warn)

	// not the network's address: no guard check, only the answer
	write("ci 22\n")
	cs = check("10.9.9.9", ep)
	require.Len(t, cs, 1)
	require.True(t, cs[0].OK)
	require.Contains(t, cs[0].Info, "not checked from inside a guest")

	// nothing answers
	cs = check("", fmt.Sprintf("http://127.0.0.1:%d", silentPort))
	require.Len(t, cs, 1)
	require.False(t, cs[0].OK)
	require.Contains(t, cs[0].Info, "does not answer")

	// the configuration unreadable: a warning, the answer still checked
	require.NoError(t, os.Remove(conf))
	cs = check("127.0.0.1", ep)
	require.Len(t, cs, 2)
	require.True(t, cs[0].Warn)
	require.True(t, strings.HasPrefix(cs[0].Info, "cannot read the guard's configuration"), cs[0].Info)

	// another host's libvirt: its guests are there, and so is its guard
	// (this host's configuration says nothing of it): a warning naming
	// what that host must allow, even for an endpoint nothing answers here
	write("ci 1\n")
	cfg.LibvirtURI = "qemu+ssh://kvm2.example/system"
	cs = check("127.0.0.1", fmt.Sprintf("http://127.0.0.1:%d", silentPort))
	require.Len(t, cs, 1)
	require.True(t, cs[0].OK && cs[0].Warn, cs[0].Info)
	require.Contains(t, cs[0].Info, fmt.Sprintf("not checked from here: the guests run on the host of qemu+ssh://kvm2.example/system; its guard configuration must let network \"ci\" reach port %d", silentPort))
}

func TestPortListed(t *testing.T) {
	require.True(t, portListed("8080", 8080))
	require.True(t, portListed("22,20000:20999", 20500))
	require.False(t, portListed("22,20000:20999", 21000))
	require.False(t, portListed("x,1:y", 1))
}
