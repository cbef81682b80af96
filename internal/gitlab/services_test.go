package gitlab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// servicesPayload writes a JOB_RESPONSE_FILE whose services are as the
// runner writes them (names expanded, with fields the driver never reads).
func servicesPayload(t *testing.T, services []map[string]any, vars ...payloadVar) string {
	t.Helper()
	p := map[string]any{
		"id": 42, "token": "glcbt-secret-token",
		"runner_info": map[string]any{"timeout": 3600},
		"image":       map[string]any{"name": "tiny"},
		"services":    services,
		"variables":   vars,
	}
	b, err := json.Marshal(p)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(path, b, 0o600))
	return path
}

// prepareServices runs prepare on a hypervisor that cannot be reached, so
// a job that gets past the services check fails at once at the connect.
func prepareServices(t *testing.T, mode, payload string) (out string, connected int, err error) {
	t.Helper()
	cfg := testConfig(t)
	if mode != "" {
		cfg.GitLab.Services = mode
	}
	var buf bytes.Buffer
	r := &recorder{}
	e := r.env(map[string]string{"JOB_RESPONSE_FILE": payload}, &buf)
	e.Connect = func(context.Context, string) (vm.Hypervisor, error) {
		r.connected++
		return nil, errors.New("no hypervisor in this test")
	}
	err = Prepare(context.Background(), e, cfg)
	return buf.String(), r.connected, err
}

func TestServicesWarnInTheJobLog(t *testing.T) {
	path := servicesPayload(t, []map[string]any{
		{"name": "postgres:15", "alias": "db", "entrypoint": []string{"x"}, "command": []string{"y"},
			"variables": []map[string]any{{"key": "POSTGRES_PASSWORD", "value": "pw-in-service-vars"}}},
		{"name": "redis:7"},
	})
	out, connected, err := prepareServices(t, "", path)
	require.Error(t, err, "the unreachable hypervisor")
	require.Equal(t, 1, connected, "warn goes on to prepare the VM")
	line := logLine(out, "Warning: this runner does not provide services")
	require.NotEmpty(t, line, out)
	require.Contains(t, line, `2 services of the job will not be started`)
	require.Contains(t, line, `"postgres:15" (alias "db"), "redis:7"`)
	require.Contains(t, line, "docs/services.md")
	require.NotContains(t, out, "pw-in-service-vars", "a service's variables are never read")
	require.Less(t, strings.Index(out, "does not provide services"), strings.Index(out, "Preparing a fresh"), "said first")

	// No services: not a word.
	out, _, _ = prepareServices(t, "", servicesPayload(t, nil))
	require.NotContains(t, out, "services")
	out, _, _ = prepareServices(t, "", servicesPayload(t, []map[string]any{}))
	require.NotContains(t, out, "services")
}

func TestServicesFailBeforeAnyVM(t *testing.T) {
	path := servicesPayload(t, []map[string]any{{"name": "postgres:15"}})
	out, connected, err := prepareServices(t, config.ServicesFail, path)
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "a build failure: retrying cannot fix it")
	require.ErrorContains(t, err, `gitlab.services = "fail"`)
	require.ErrorContains(t, err, `the job asks for 1 service: "postgres:15"`)
	require.ErrorContains(t, err, "docs/services.md")
	require.Zero(t, connected, "no hypervisor touched")
	require.Empty(t, out)

	// Without services, fail changes nothing.
	_, connected, err = prepareServices(t, config.ServicesFail, servicesPayload(t, nil))
	require.Equal(t, 1, connected)
	require.NotEqual(t, exitcodes.BuildClass, exitcodes.Classify(err))
}

// Names come from the job: bounded in length and count, and escaped, so a
// name cannot forge log lines or escape sequences.
func TestServicesHostileNames(t *testing.T) {
	var many []map[string]any
	for i := range 5000 {
		many = append(many, map[string]any{"name": "svc" + strings.Repeat("x", i%7)})
	}
	long := strings.Repeat("é", 10000) // 2 bytes each: the cut must not split one
	hostile := append([]map[string]any{
		{"name": "evil\n\x1b[31mJob succeeded\r", "alias": "a\x00b"},
		{"name": long, "alias": long},
		{"name": "bidi\u202egpj.exe\u200b"},
	}, many...)
	path := servicesPayload(t, hostile)

	_, _, err := prepareServices(t, config.ServicesFail, path)
	msg := err.Error()
	require.Less(t, len(msg), 2000, "bounded however many and long the names")
	require.Contains(t, msg, "the job asks for 5003 services")
	require.Contains(t, msg, "4995 more")
	require.Contains(t, msg, `"evil\n\x1b[31mJob succeeded\r" (alias "a\x00b")`)
	require.NotContains(t, msg, "\x1b")
	require.NotContains(t, msg, "\n")
	require.NotContains(t, msg, "\x00")
	require.Contains(t, msg, `"bidi\u202egpj.exe\u200b"`, "invisible and reordering characters are escaped")
	require.Contains(t, msg, `"`+strings.Repeat("é", maxServiceName/2)+`..." (alias "`)
	require.NotContains(t, msg, `\x`+"c3", "no character cut in half")

	out, _, err := prepareServices(t, "", path)
	require.Error(t, err)
	line := logLine(out, "does not provide services")
	require.Less(t, len(line), 2000)
	require.NotContains(t, out, "\x1b")
	require.Equal(t, 1, strings.Count(out, "Job succeeded"), "only inside the quoted name, on the warning's line")
}

// The runner expands the job's variables in the service names before it
// writes the payload: a name that contains a secret's or a CI/CD
// setting's value is counted, never shown.
func TestServicesNeverShowSecrets(t *testing.T) {
	const secret, setting = "s3cr3t-Value-9f2c", "registry.internal.example"
	path := servicesPayload(t, []map[string]any{
		{"name": "postgres:15"},
		{"name": "img-" + secret},
		{"name": setting + "/redis", "alias": "cache"},
		{"name": "mysql", "alias": "db-" + secret},
		{"name": "flag-1-on"},
	},
		payloadVar{Key: "MY_SECRET", Value: secret, Masked: true},
		payloadVar{Key: "REGISTRY", Value: setting}, // not public: a CI/CD setting
		payloadVar{Key: "DEBUG", Value: "1"},        // too short to look for
		payloadVar{Key: "PGVER", Value: "15", Public: true},
	)
	for _, mode := range []string{config.ServicesWarn, config.ServicesFail} {
		out, _, err := prepareServices(t, mode, path)
		text := out + err.Error()
		require.NotContains(t, text, secret, mode)
		require.NotContains(t, text, setting, mode)
		require.Contains(t, text, `"postgres:15", "flag-1-on", 3 not named here`, mode)
		require.Contains(t, text, "5 services", mode)
	}
}

func TestServicesWithoutPayloadFile(t *testing.T) {
	for _, tc := range []struct {
		env   string
		count int
	}{
		{"", 0}, {"null", 0}, {"[]", 0},
		{`[{"name":"postgres:15","alias":"db","entrypoint":null,"command":null},{"name":"redis:7"}]`, 2},
		{`not json`, 1},
		{`[` + strings.Repeat(`{"name":"x"},`, 20000) + `{"name":"x"}]`, 1}, // over the bound: unread
	} {
		s := servicesFromEnv(tc.env)
		require.Equal(t, tc.count, s.Count, tc.env)
		for _, sv := range s.Shown {
			require.True(t, sv.Hidden, "which variables are secret is not known: no name shown")
		}
	}
	var out bytes.Buffer
	cfg := testConfig(t)
	err := checkServices(cfg, servicesFromEnv(`[{"name":"postgres:15"}]`), func(f string, a ...any) {
		fmt.Fprintf(&out, f+"\n", a...)
	})
	require.NoError(t, err)
	require.Contains(t, out.String(), "1 service of the job will not be started")
	require.NotContains(t, out.String(), "postgres")
}

// logLine is the first line of s that contains sub, or "".
func logLine(s, sub string) string {
	for l := range strings.Lines(s) {
		if strings.Contains(l, sub) {
			return l
		}
	}
	return ""
}
