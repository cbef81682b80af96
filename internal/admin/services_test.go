package admin

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// doctor's services lines: nothing when off; each mirror asked for the
// registry API: a registry (200, or 401 asking for a login) passes; another
// answer or none is a warning with the fix, never a failure (podman falls
// back to the registry itself).
func TestServicesChecks(t *testing.T) {
	require.Empty(t, servicesChecks(context.Background(), config.Services{}, http.DefaultClient))

	answer := func(code int) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v2/" {
				http.NotFound(w, r)
				return
			}
			w.WriteHeader(code)
		}))
		t.Cleanup(srv.Close)
		return strings.TrimPrefix(srv.URL, "http://")
	}
	reg, login, web := answer(http.StatusOK), answer(http.StatusUnauthorized), answer(http.StatusTeapot)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := l.Addr().String()
	require.NoError(t, l.Close())
	s := config.Services{Enabled: true,
		Mirrors:       map[string][]string{"docker.io": {reg, login + "/cache"}, "quay.io": {web, closed}},
		PlainHTTP:     []string{reg, login + "/cache", web, closed},
		ContainerJobs: config.ContainerJobs{AllowedImages: []string{"python:*"}, VMImage: "podman"}}
	cs := servicesChecks(context.Background(), s, http.DefaultClient)
	require.Len(t, cs, 5)
	require.Equal(t, "services", cs[0].Name)
	require.Contains(t, cs[0].Info, "container jobs on VM image podman for python:*")
	byName := map[string]Check{}
	for _, c := range cs[1:] {
		require.True(t, c.OK, "a mirror is never a failure: %+v", c)
		byName[c.Name] = c
	}
	require.False(t, byName["services mirror "+reg+" for docker.io"].Warn)
	require.Contains(t, byName["services mirror "+login+"/cache for docker.io"].Info, "401")
	require.False(t, byName["services mirror "+login+"/cache for docker.io"].Warn)
	for _, m := range []string{web, closed} {
		c := byName["services mirror "+m+" for quay.io"]
		require.True(t, c.Warn, "%+v", c)
		require.Contains(t, c.Info, "jobs pull from quay.io itself")
		require.Contains(t, c.Fix, "pull-through cache")
	}
}
