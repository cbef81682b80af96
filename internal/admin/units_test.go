package admin

import (
	"bufio"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// serviceSection reads a unit file's [Service] directives: name to its
// values, in order (a directive may be given more than once).
func serviceSection(t *testing.T, path string) map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	out := map[string][]string{}
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "["):
			in = line == "[Service]"
		case in:
			k, v, ok := strings.Cut(line, "=")
			require.True(t, ok, "%s: %q is no directive", path, line)
			out[strings.TrimSpace(k)] = append(out[strings.TrimSpace(k)], strings.TrimSpace(v))
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// The gc timer's service is hardened like the pool service (#42): every
// directive of libvirt-executor.service is in libvirt-executor-gc.service
// with the same value, but for those that say how the service runs (not
// what it may do) and the exceptions below, each with its reason.
func TestGCUnitHardenedLikeTheService(t *testing.T) {
	const dir = "../../deploy/systemd/"
	svc := serviceSection(t, dir+"libvirt-executor.service")
	gc := serviceSection(t, dir+"libvirt-executor-gc.service")
	// How the service runs, not what it may do.
	notHardening := map[string]string{
		"Type":           "gc is a oneshot, the service a long-running notify",
		"NotifyAccess":   "gc sends no readiness",
		"ExecStart":      "another command",
		"ExecReload":     "gc reads the configuration at each start",
		"Restart":        "the timer starts gc again",
		"RestartSec":     "the timer starts gc again",
		"KillSignal":     "the service's stop undoes boots in progress",
		"KillMode":       "the service's connection holders outlive a restart",
		"TimeoutStopSec": "the service's stop waits for timeouts.cleanup",
	}
	// Hardening that differs, and what gc has instead.
	differs := map[string][]string{
		// gc writes state_dir and prunes the host cache; it pulls no image,
		// so the image store stays read-only to it.
		"ReadWritePaths": {"/var/lib/libvirt-executor -/var/cache/libvirt-executor/jobs"},
	}
	hardening := 0
	for k, v := range svc {
		if _, ok := notHardening[k]; ok {
			continue
		}
		hardening++
		if want, ok := differs[k]; ok {
			require.Equal(t, want, gc[k], "gc's %s", k)
			continue
		}
		require.Equal(t, v, gc[k], "libvirt-executor-gc.service's %s: the service's (or list it here with a reason)", k)
	}
	require.GreaterOrEqual(t, hardening, 20, "the service's hardening was read (User, Environment and the sandboxing directives)")
	for k := range gc {
		_, inSvc := svc[k]
		_, run := notHardening[k]
		require.True(t, inSvc || run, "gc's %s is not the service's: say why here, or give the service it too", k)
	}
}
