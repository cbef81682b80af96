package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// The executable's exit codes as garm reads them, and its messages on
// stderr (never on stdout, which garm parses).
func TestExitCodes(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "garm.toml")
	require.NoError(t, os.WriteFile(cfg, []byte("state_dir = \""+filepath.Join(dir, "state")+"\"\n[images.a]\nbase = \"/a.qcow2\"\nkey_injection = \"cloud-init\"\nuser = \"debian\"\n"), 0o600))
	hv := vmtest.New()
	var connect lifecycle.Connector = func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }
	call := func(env map[string]string) (string, string, int) {
		var out, errb bytes.Buffer
		code := run(context.Background(), func(k string) string { return env[k] }, strings.NewReader(""), &out, &errb, connect)
		return out.String(), errb.String(), code
	}
	base := func(kv ...string) map[string]string {
		m := map[string]string{"GARM_PROVIDER_CONFIG_FILE": cfg, "GARM_CONTROLLER_ID": "11111111-2222-3333-4444-555555555555",
			"GARM_POOL_ID": "aaaaaaaa-0000-0000-0000-000000000001", "GARM_INTERFACE_VERSION": "v0.1.1"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	out, _, code := call(base("GARM_COMMAND", "GetVersion"))
	require.Equal(t, 0, code)
	require.NotEmpty(t, out)
	_, errs, code := call(base("GARM_COMMAND", "GetInstance", "GARM_INSTANCE_ID", "garm-Missing"))
	require.Equal(t, 30, code, errs)
	out, errs, code = call(base("GARM_COMMAND", "DeleteInstance", "GARM_INSTANCE_ID", "garm-Missing"))
	require.Equal(t, 0, code, errs)
	require.Empty(t, out)
	out, errs, code = call(base("GARM_COMMAND", "Explode"))
	require.Equal(t, 1, code)
	require.Empty(t, out)
	require.Contains(t, errs, `GARM_COMMAND "Explode" is not a command`)
	_, errs, code = call(base("GARM_COMMAND", "ListInstances", "GARM_PROVIDER_CONFIG_FILE", filepath.Join(dir, "none.toml")))
	require.Equal(t, 1, code)
	require.Contains(t, errs, "none.toml")
	out, _, code = call(base("GARM_COMMAND", "ListInstances"))
	require.Equal(t, 0, code)
	require.Equal(t, "[]\n", out)
}
