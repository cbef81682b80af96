package garm

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

const (
	ctrlA = "11111111-2222-3333-4444-555555555555"
	ctrlB = "99999999-2222-3333-4444-555555555555"
	poolA = "aaaaaaaa-0000-0000-0000-000000000001"
	poolB = "bbbbbbbb-0000-0000-0000-000000000002"
	token = "eyJhbGciOiJIUzI1NiJ9.secret-instance-token.sig"
)

func testConfig(t *testing.T) *config.Config {
	t.Helper()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, registrytest.Qcow2(1<<30, []byte("")), 0o644))
	cfg, err := config.Parse([]byte(`
storage_pool = "default-pool"
network = "default"
domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
default_image = "cloud"
[limits]
max_vcpus = 4
max_memory_mib = 4096
max_disk_gib = 40
[garm]
images = ["cloud"]
extra_specs = ["disk_gib"]
[garm.flavors.small]
vcpus = 1
memory_mib = 768
[images.cloud]
base = "` + base + `"
key_injection = "cloud-init"
user = "debian"
[images.tiny]
base = "` + base + `"
`))
	require.NoError(t, err)
	return cfg
}

type rig struct {
	t   *testing.T
	cfg *config.Config
	hv  *vmtest.Fake
	m   *lifecycle.Manager
}

func newRig(t *testing.T) *rig {
	cfg := testConfig(t)
	hv := vmtest.New()
	m, err := lifecycle.Open(cfg, lifecycle.Options{Connect: func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return &rig{t: t, cfg: cfg, hv: hv, m: m}
}

// call runs one command as garm would: env, stdin; stdout and the exit code.
func (r *rig) call(env map[string]string, stdin string) (string, int) {
	r.t.Helper()
	full := map[string]string{"GARM_PROVIDER_CONFIG_FILE": "/unused", "GARM_INTERFACE_VERSION": V011}
	for k, v := range env {
		full[k] = v
	}
	e, err := ReadEnv(func(k string) string { return full[k] })
	if err != nil {
		return err.Error(), ExitCode(err)
	}
	var out bytes.Buffer
	p := &Provider{M: r.m, Cfg: r.cfg, Env: e, Out: &out}
	if err := p.Run(context.Background(), strings.NewReader(stdin)); err != nil {
		return err.Error(), ExitCode(err)
	}
	return out.String(), ExitOK
}

func bootstrap(name string, mutate func(map[string]any)) string {
	b := map[string]any{
		"name": name, "os_type": "linux", "arch": "amd64", "image": "cloud", "flavor": "small",
		"callback-url": "http://10.0.0.1:20100/api/v1/callbacks", "metadata-url": "http://10.0.0.1:20100/api/v1/metadata",
		"instance-token": token, "repo_url": "https://github.com/o/r", "labels": []string{"a", "b"},
		"tools": []map[string]any{{"os": "linux", "architecture": "x64", "download_url": "http://10.0.0.1:20100/runner.tar.gz",
			"filename": "runner.tar.gz", "sha256_checksum": strings.Repeat("ab", 32)}},
		"ssh-keys":    []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB garm@example"},
		"extra_specs": map[string]any{},
	}
	if mutate != nil {
		mutate(b)
	}
	out, _ := json.Marshal(b)
	return string(out)
}

func create(r *rig, ctrl, pool, name string) Instance {
	r.t.Helper()
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrl, "GARM_POOL_ID": pool}, bootstrap(name, nil))
	require.Equal(r.t, ExitOK, code, out)
	var in Instance
	require.NoError(r.t, json.Unmarshal([]byte(out), &in))
	return in
}

func TestCreateListGetDelete(t *testing.T) {
	r := newRig(t)
	a1 := create(r, ctrlA, poolA, "garm-Abc1")
	a2 := create(r, ctrlA, poolA, "garm-Abc2")
	b1 := create(r, ctrlA, poolB, "garm-Bcd1")
	other := create(r, ctrlB, poolA, "garm-Abc1") // the same name under another garm
	require.Equal(t, StatusRunning, a1.Status)
	require.NotEqual(t, a1.ProviderID, other.ProviderID)
	require.True(t, strings.HasPrefix(a1.ProviderID, lifecycle.MachinePrefix(r.cfg.NamePrefix, r.m.Controller)), a1.ProviderID)

	// The domain: our ownership, garm's tags, the flavor's size, the
	// token nowhere in its XML.
	d := r.hv.Domains[a1.ProviderID]
	require.NotNil(t, d)
	o, err := vm.ParseOwner(d.OwnerXML)
	require.NoError(t, err)
	require.Equal(t, Frontend, o.Frontend)
	require.Equal(t, ctrlA, o.Tag(TagController))
	require.Equal(t, poolA, o.Tag(TagPool))
	require.Equal(t, "garm-Abc1", o.Tag(TagName))
	require.Contains(t, d.XML, `<memory unit="MiB">768</memory>`)
	require.NotContains(t, d.XML, token)
	// The token is in the seed volume only.
	seed := r.hv.Volumes["default-pool/"+vm.SeedVolume(a1.ProviderID)]
	require.NotEmpty(t, seed)
	bs, err := ReadBootstrap(strings.NewReader(bootstrap("garm-Abc1", nil)))
	require.NoError(t, err)
	params, err := guestParams(bs)
	require.NoError(t, err)
	require.Contains(t, string(params), token)
	require.True(t, bytes.Contains(seed, params), "the seed carries the parameters with the token, as a file of its own")
	require.False(t, bytes.Contains(seed, []byte(base64.StdEncoding.EncodeToString(params))), "not in the user-data: cloud-init never copies them")
	require.Equal(t, 1, bytes.Count(seed, []byte(token)), "the token is once on the seed, in the parameters")
	for _, f := range tokenForms(token)[1:] {
		require.NotContains(t, string(seed), f, "nor in base64 anywhere")
	}
	files, _ := filepath.Glob(filepath.Join(r.cfg.StateDir, "*", "*", "*"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil {
			require.NotContains(t, string(b), token, "no file of the state directory holds the token: %s", f)
		}
	}

	// List: pool A of controller A only.
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdList, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, "")
	require.Equal(t, ExitOK, code, out)
	var list []Instance
	require.NoError(t, json.Unmarshal([]byte(out), &list))
	ids := []string{}
	for _, in := range list {
		ids = append(ids, in.ProviderID)
	}
	require.ElementsMatch(t, []string{a1.ProviderID, a2.ProviderID}, ids)

	// Get by provider id and by garm's name (after a failed create garm
	// only has the name).
	for _, id := range []string{a1.ProviderID, "garm-Abc1"} {
		out, code = r.call(map[string]string{"GARM_COMMAND": CmdGet, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": id}, "")
		require.Equal(t, ExitOK, code, out)
		var in Instance
		require.NoError(t, json.Unmarshal([]byte(out), &in))
		require.Equal(t, a1.ProviderID, in.ProviderID)
		require.Equal(t, "garm-Abc1", in.Name)
	}
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdGet, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": "garm-Nope"}, "")
	require.Equal(t, ExitNotFound, code)

	// Stop and start.
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdStop, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": a1.ProviderID}, "")
	require.Equal(t, ExitOK, code)
	require.False(t, r.hv.Domains[a1.ProviderID].Active)
	out, _ = r.call(map[string]string{"GARM_COMMAND": CmdGet, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": a1.ProviderID}, "")
	require.Contains(t, out, `"status":"stopped"`)
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdStart, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": a1.ProviderID}, "")
	require.Equal(t, ExitOK, code)
	require.True(t, r.hv.Domains[a1.ProviderID].Active)

	// Delete, then delete again, and delete a name that never existed.
	for range 2 {
		_, code = r.call(map[string]string{"GARM_COMMAND": CmdDelete, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": a1.ProviderID}, "")
		require.Equal(t, ExitOK, code)
	}
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdDelete, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": "garm-NeverMade"}, "")
	require.Equal(t, ExitOK, code)
	require.NotContains(t, r.hv.Domains, a1.ProviderID)
	require.NotContains(t, r.hv.Volumes, "default-pool/"+vm.SeedVolume(a1.ProviderID), "the seed volume (with the token) goes with the VM")

	// RemoveAll of controller A leaves controller B's instance.
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdRemoveAll, "GARM_CONTROLLER_ID": ctrlA}, "")
	require.Equal(t, ExitOK, code)
	require.NotContains(t, r.hv.Domains, a2.ProviderID)
	require.NotContains(t, r.hv.Domains, b1.ProviderID)
	require.Contains(t, r.hv.Domains, other.ProviderID)

	// A domain without our metadata is never touched.
	r.hv.Domains[lifecycle.MachinePrefix(r.cfg.NamePrefix, r.m.Controller)+"garm-foreign"] = &vmtest.Domain{Active: true}
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdRemoveAll, "GARM_CONTROLLER_ID": ctrlB}, "")
	require.Equal(t, ExitOK, code)
	require.Contains(t, r.hv.Domains, lifecycle.MachinePrefix(r.cfg.NamePrefix, r.m.Controller)+"garm-foreign")
	require.NotContains(t, r.hv.Domains, other.ProviderID)
}

func TestCreateDuplicate(t *testing.T) {
	r := newRig(t)
	in := create(r, ctrlA, poolA, "garm-Dup")
	d := r.hv.Domains[in.ProviderID]
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, bootstrap("garm-Dup", nil))
	require.Equal(t, ExitDuplicate, code, out)
	// The check is the engine's, under the machine's lock (two creates
	// racing): a duplicate, and the live instance is not replaced.
	_, err := r.m.Launch(context.Background(), lifecycle.Request{Name: in.ProviderID})
	require.ErrorIs(t, err, lifecycle.ErrExists)
	require.Same(t, d, r.hv.Domains[in.ProviderID])
}

// Hostile or wrong input: a clear error, exit 1, nothing made.
func TestCreateRefusesBadInput(t *testing.T) {
	r := newRig(t)
	cases := []struct {
		name   string
		stdin  string
		expect string
	}{
		{"not json", "{", "not valid JSON"},
		{"wrong type", `{"name": 5}`, `field "name" must be string`},
		{"oversized", strings.Repeat(" ", maxBootstrap+10), "exceed"},
		{"name with xml", bootstrap("<x>&", nil), "instance name"},
		{"name with path", bootstrap("../../etc", nil), "instance name"},
		{"windows", bootstrap("garm-W", func(b map[string]any) { b["os_type"] = "windows" }), "linux only"},
		{"arch", bootstrap("garm-A", func(b map[string]any) { b["arch"] = "s390x" }), `arch "s390x"`},
		{"image", bootstrap("garm-I", func(b map[string]any) { b["image"] = "tiny" }), `image "tiny" is not offered to garm pools: use one of cloud`},
		{"flavor", bootstrap("garm-F", func(b map[string]any) { b["flavor"] = "huge" }), `flavor "huge" is not defined: use one of default, small`},
		{"extra spec key", bootstrap("garm-E", func(b map[string]any) { b["extra_specs"] = map[string]any{"vcpus": 2} }), `extra_specs key "vcpus" is not permitted: this provider permits disk_gib`},
		{"extra spec range", bootstrap("garm-R", func(b map[string]any) { b["extra_specs"] = map[string]any{"disk_gib": 4000} }), "out of range 1-40"},
		{"checksum", bootstrap("garm-C", func(b map[string]any) {
			b["tools"] = []map[string]any{{"os": "linux", "architecture": "x64", "download_url": "http://h/x", "sha256_checksum": "x; rm -rf /"}}
		}), "not 64 hex digits"},
		{"no tool", bootstrap("garm-T", func(b map[string]any) { b["tools"] = []map[string]any{} }), "no runner tool"},
		{"callback url", bootstrap("garm-U", func(b map[string]any) { b["callback-url"] = "file:///etc/passwd" }), "not an http(s) URL"},
		{"package", bootstrap("garm-P", func(b map[string]any) {
			b["user_data_options"] = map[string]any{"extra_packages": []string{"git; curl evil"}}
		}), "not a Debian package name"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, tc.stdin)
			require.Equal(t, ExitError, code, out)
			require.Contains(t, out, tc.expect)
			require.Empty(t, r.hv.Domains, "nothing made")
		})
	}
}

func TestEnv(t *testing.T) {
	env := func(kv ...string) func(string) string {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) string { return m[k] }
	}
	_, err := ReadEnv(env("GARM_COMMAND", "GetVersion", "GARM_INTERFACE_VERSION", "v0.2.0"))
	require.ErrorContains(t, err, `GARM_INTERFACE_VERSION "v0.2.0" is not supported: use v0.1.0 or v0.1.1`)
	_, err = ReadEnv(env("GARM_COMMAND", "ValidatePoolInfo"))
	require.ErrorContains(t, err, "is not a command of interface v0.1.0")
	_, err = ReadEnv(env("GARM_COMMAND", "Bogus", "GARM_INTERFACE_VERSION", "v0.1.1"))
	require.ErrorContains(t, err, "GetSupportedInterfaceVersions")
	_, err = ReadEnv(env("GARM_COMMAND", "ListInstances", "GARM_CONTROLLER_ID", ctrlA, "GARM_POOL_ID", poolA))
	require.ErrorContains(t, err, "GARM_PROVIDER_CONFIG_FILE is not set")
	_, err = ReadEnv(env("GARM_COMMAND", "ListInstances", "GARM_PROVIDER_CONFIG_FILE", "/c", "GARM_CONTROLLER_ID", "x", "GARM_POOL_ID", poolA))
	require.ErrorContains(t, err, `GARM_CONTROLLER_ID "x" is not a UUID`)
	_, err = ReadEnv(env("GARM_COMMAND", "ListInstances", "GARM_PROVIDER_CONFIG_FILE", "/c", "GARM_CONTROLLER_ID", ctrlA))
	require.ErrorContains(t, err, "GARM_POOL_ID")
	_, err = ReadEnv(env("GARM_COMMAND", "GetInstance", "GARM_PROVIDER_CONFIG_FILE", "/c", "GARM_CONTROLLER_ID", ctrlA, "GARM_INSTANCE_ID", "a/../b"))
	require.ErrorContains(t, err, "GARM_INSTANCE_ID")
	// v0.1.0 GetInstance needs no pool; v0.1.1 does.
	_, err = ReadEnv(env("GARM_COMMAND", "GetInstance", "GARM_PROVIDER_CONFIG_FILE", "/c", "GARM_CONTROLLER_ID", ctrlA, "GARM_INSTANCE_ID", "garm-X"))
	require.NoError(t, err)
	_, err = ReadEnv(env("GARM_COMMAND", "GetInstance", "GARM_INTERFACE_VERSION", "v0.1.1", "GARM_PROVIDER_CONFIG_FILE", "/c", "GARM_CONTROLLER_ID", ctrlA, "GARM_INSTANCE_ID", "garm-X"))
	require.ErrorContains(t, err, "GARM_POOL_ID")
	e, err := ReadEnv(env("GARM_COMMAND", "ValidatePoolInfo", "GARM_INTERFACE_VERSION", "v0.1.1", "GARM_PROVIDER_CONFIG_FILE", "/c", "GARM_CONTROLLER_ID", ctrlA,
		"GARM_POOL_ID", poolA, "GARM_POOL_EXTRASPECS", base64.StdEncoding.EncodeToString([]byte(`{"disk_gib": 8}`))))
	require.NoError(t, err)
	require.JSONEq(t, `{"disk_gib": 8}`, string(e.ExtraSpecs))
	require.Equal(t, 1, ExitCode(err2()))
}

func err2() error { return os.ErrInvalid }

func TestInfoCommands(t *testing.T) {
	r := newRig(t)
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdVersions}, "")
	require.Equal(t, ExitOK, code)
	require.JSONEq(t, `["v0.1.0","v0.1.1"]`, out)
	for _, c := range []string{CmdConfigSchema, CmdExtraSpecSchema} {
		out, code = r.call(map[string]string{"GARM_COMMAND": c}, "")
		require.Equal(t, ExitOK, code)
		var v map[string]any
		require.NoError(t, json.Unmarshal([]byte(out), &v), c)
		require.Equal(t, "object", v["type"])
	}
	out, code = r.call(map[string]string{"GARM_COMMAND": CmdVersion}, "")
	require.Equal(t, ExitOK, code)
	require.NotEmpty(t, strings.TrimSpace(out))
	// ValidatePoolInfo as garm calls it: no pool id, the extra specs in
	// GARM_POOL_EXTRASPECS; image and flavor when stdin carries them.
	spec := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	validate := func(specs, stdin string) (string, int) {
		env := map[string]string{"GARM_COMMAND": CmdValidate, "GARM_CONTROLLER_ID": ctrlA}
		if specs != "" {
			env["GARM_POOL_EXTRASPECS"] = spec(specs)
		}
		return r.call(env, stdin)
	}
	out, code = validate(`{"disk_gib": 10}`, `{"image": "cloud", "flavor": "small"}`)
	require.Equal(t, ExitOK, code, out)
	out, code = validate(`{"disk_gib": 10}`, "")
	require.Equal(t, ExitOK, code, out)
	out, code = validate(`{"memory_mib": 1024}`, "")
	require.Equal(t, ExitError, code)
	require.Contains(t, out, `"memory_mib" is not permitted`)
	out, code = validate(`{"disk_gib": 400}`, "")
	require.Equal(t, ExitError, code)
	require.Contains(t, out, `"disk_gib" = 400 is out of range 1-40`)
	out, code = validate("", `{"image": "tiny"}`)
	require.Equal(t, ExitError, code)
	require.Contains(t, out, "not offered to garm pools")
	out, code = validate("", `{"image": "cloud", "flavor": "huge"}`)
	require.Equal(t, ExitError, code)
	require.Contains(t, out, `flavor "huge" is not defined: use one of default, small`)
	out, code = validate("", `{"image": ["cloud"]}`)
	require.Equal(t, ExitError, code)
	require.Contains(t, out, "stdin is not a JSON object with image and flavor")
	// an image garm may name must take a cloud-init seed
	r.cfg.Garm.Images = append(r.cfg.Garm.Images, "tiny")
	out, code = validate("", `{"image": "tiny"}`)
	require.Equal(t, ExitError, code)
	require.Contains(t, out, `image "tiny" does not take a cloud-init seed`)
}

// TestEndpointsBoundTheCallbackURLs: with garm.endpoints declared, a
// callback or metadata URL of another origin is refused (naming the
// endpoints) with nothing made; one of a declared origin is taken.
func TestEndpointsBoundTheCallbackURLs(t *testing.T) {
	r := newRig(t)
	r.cfg.Garm.Endpoints = []string{"http://10.0.0.1:20100", "https://github.com"}
	env := map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}
	for _, c := range []struct{ key, url string }{
		{"callback-url", "http://10.0.0.1:20101/api/v1/callbacks"},
		{"metadata-url", "http://evil.example:20100/api/v1/metadata"},
		{"callback-url", "https://10.0.0.1:20100/api/v1/callbacks"},
	} {
		out, code := r.call(env, bootstrap("garm-Ep1", func(b map[string]any) { b[c.key] = c.url }))
		require.Equal(t, ExitError, code, out)
		require.Contains(t, out, c.key)
		require.Contains(t, out, "http://10.0.0.1:20100, https://github.com")
		require.Empty(t, r.hv.Domains, "nothing made for %s", c.url)
	}
	// the default port written out or not is the same origin
	out, code := r.call(env, bootstrap("garm-Ep2", func(b map[string]any) {
		b["callback-url"] = "http://10.0.0.1:20100/api/v1/callbacks"
		b["metadata-url"] = "http://10.0.0.1:20100/api/v1/metadata"
	}))
	require.Equal(t, ExitOK, code, out)
	require.Len(t, r.hv.Domains, 1)
}

// TestOrphansOfASilentPool: every command naming a pool notes it; the
// instances of a pool garm has not named for orphan_after are orphans,
// those of a pool it still lists are not; foreign and GitLab machines
// never are.
func TestOrphansOfASilentPool(t *testing.T) {
	r := newRig(t)
	t0 := time.Now()
	a := create(r, ctrlA, poolA, "garm-Orph1")
	b := create(r, ctrlA, poolB, "garm-Orph2")
	seen, ok := PoolSeen(r.cfg.StateDir, ctrlA, poolA)
	require.True(t, ok)
	require.WithinDuration(t, t0, seen, 5*time.Second)
	fi, err := os.Stat(filepath.Join(r.cfg.StateDir, "garm", "pools"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())

	owner := func(name string) *vm.Owner {
		o, err := vm.ParseOwner(r.hv.Domains[name].OwnerXML)
		require.NoError(t, err)
		return &o
	}
	hour := time.Hour
	require.Empty(t, Orphan(r.cfg.StateDir, owner(a.ProviderID), t0.Add(30*time.Minute), hour))
	why := Orphan(r.cfg.StateDir, owner(a.ProviderID), t0.Add(2*hour), hour)
	require.Contains(t, why, "has not named pool "+poolA)

	// garm lists pool A again (later): A's instance is no orphan, B's is.
	require.NoError(t, MarkPoolSeen(r.cfg.StateDir, ctrlA, poolA, t0.Add(110*time.Minute)))
	require.Empty(t, Orphan(r.cfg.StateDir, owner(a.ProviderID), t0.Add(2*hour), hour))
	require.Contains(t, Orphan(r.cfg.StateDir, owner(b.ProviderID), t0.Add(2*hour), hour), poolB)

	// a ListInstances call notes the pool too
	require.NoError(t, MarkPoolSeen(r.cfg.StateDir, ctrlA, poolB, t0.Add(-hour)))
	_, code := r.call(map[string]string{"GARM_COMMAND": CmdList, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolB}, "")
	require.Equal(t, ExitOK, code)
	seen, _ = PoolSeen(r.cfg.StateDir, ctrlA, poolB)
	require.WithinDuration(t, time.Now(), seen, 5*time.Second)

	// not garm's: never an orphan
	require.Empty(t, Orphan(r.cfg.StateDir, &vm.Owner{Frontend: "gitlab", Created: t0.Add(-48 * hour)}, t0, hour))
	require.Empty(t, Orphan(r.cfg.StateDir, nil, t0, hour))
	_, ok = PoolSeen(r.cfg.StateDir, "../../etc", poolA)
	require.False(t, ok, "no path from a non-UUID")
	require.Error(t, MarkPoolSeen(r.cfg.StateDir, "../x", poolA, t0))
}

// TestCapacityCountsGarmInstances: garm's instances take host capacity
// like GitLab jobs: with room for two, a third create fails at once
// (garm retries later) naming the limit, with nothing made; a delete
// gives the room back.
func TestCapacityCountsGarmInstances(t *testing.T) {
	r := newRig(t)
	r.cfg.Capacity.MaxVMs = 2
	a := create(r, ctrlA, poolA, "garm-Cap1")
	create(r, ctrlB, poolB, "garm-Cap2")
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, bootstrap("garm-Cap3", nil))
	require.Equal(t, ExitError, code, out)
	require.Contains(t, out, "max_vms")
	require.Len(t, r.hv.Domains, 2, "nothing made for the refused create")
	_, code = r.call(map[string]string{"GARM_COMMAND": CmdDelete, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": a.ProviderID}, "")
	require.Equal(t, ExitOK, code)
	create(r, ctrlA, poolA, "garm-Cap3")
}

// A create on a full host asks the engine's MakeRoom hook (jobvm's: idle
// standby machines go first) before it fails, as a GitLab job's prepare
// does; what the hook frees is used.
func TestCreateAsksForRoom(t *testing.T) {
	r := newRig(t)
	r.cfg.Capacity.MaxVMs = 1
	a := create(r, ctrlA, poolA, "garm-Room1")
	var asked []lifecycle.Shortfall
	free := false
	r.m.SetHooks(lifecycle.Hooks{MakeRoom: func(ctx context.Context, m *lifecycle.Manager, short lifecycle.Shortfall, reason string) string {
		asked = append(asked, short)
		if !free {
			return ""
		}
		free = false
		require.NoError(t, m.Machine(a.ProviderID).Teardown(ctx))
		return a.ProviderID
	}})
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, bootstrap("garm-Room2", nil))
	require.Equal(t, ExitError, code, out)
	require.Contains(t, out, "max_vms")
	require.Equal(t, []lifecycle.Shortfall{{VMs: 1}}, asked, "the hook was asked for one VM")

	free = true
	in := create(r, ctrlA, poolA, "garm-Room2")
	require.Len(t, asked, 2)
	require.Contains(t, r.hv.Domains, in.ProviderID)
	require.NotContains(t, r.hv.Domains, a.ProviderID, "the room the hook freed was used")
}

// TestSeedDroppedWhenBootstrapDone: the seed (garm's token) stays while
// the guest's bootstrap runs; once its console says it is done (or the
// instance is older than garm.seed_keep), the next Get or List wipes the
// seed volume, detaches its disk and deletes it; a marker the guest could
// place behind a link, or far back in a long console, does not count;
// Delete still removes everything afterwards.
// On another host's libvirt a machine has no console log here: the domain
// names no log file, nothing is made in its state directory for one, a
// done line planted at that path is not read, and the seed goes at
// garm.seed_keep.
func TestRemoteHostSeedAndConsole(t *testing.T) {
	cfg := testConfig(t)
	cfg.LibvirtURI = "qemu+tls://kvm2.example/system"
	hv := vmtest.New()
	m, err := lifecycle.Open(cfg, lifecycle.Options{Connect: func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	r := &rig{t: t, cfg: cfg, hv: hv, m: m}
	name := create(r, ctrlA, poolA, "garm-Remote1").ProviderID
	require.Empty(t, m.Machine(name).ConsoleLog())
	require.NotContains(t, hv.Domains[name].XML, "<log ")
	console := filepath.Join(m.Store.MachineDir(name), "console.log")
	_, err = os.Stat(console)
	require.True(t, os.IsNotExist(err), "a console log made on this host")
	require.NoError(t, os.WriteFile(console, []byte(SeedDoneMarker+"\n"), 0o600))
	seedKey := "default-pool/" + vm.SeedVolume(name)
	list := func() {
		t.Helper()
		out, code := r.call(map[string]string{"GARM_COMMAND": CmdList, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, "")
		require.Equal(t, ExitOK, code, out)
		require.Contains(t, out, name)
	}
	list()
	hv.Lock()
	require.Contains(t, hv.Volumes, seedKey, "a file of this host decided for the remote guest")
	hv.Unlock()
	cfg.Garm.SeedKeep = config.Duration(time.Nanosecond)
	list()
	hv.Lock()
	require.NotContains(t, hv.Volumes, seedKey, "the seed outlived seed_keep")
	hv.Unlock()
}

func TestSeedDroppedWhenBootstrapDone(t *testing.T) {
	r := newRig(t)
	in := create(r, ctrlA, poolA, "garm-Seed1")
	name := in.ProviderID
	seedKey := "default-pool/" + vm.SeedVolume(name)
	seedPath := "/pool/" + seedKey
	console := filepath.Join(r.m.Store.MachineDir(name), "console.log")
	list := func() {
		t.Helper()
		out, code := r.call(map[string]string{"GARM_COMMAND": CmdList, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA}, "")
		require.Equal(t, ExitOK, code, out)
		require.Contains(t, out, name)
	}
	hasSeed := func() bool {
		r.hv.Lock()
		defer r.hv.Unlock()
		_, vol := r.hv.Volumes[seedKey]
		require.Equal(t, vol, strings.Contains(r.hv.Domains[name].XML, seedPath), "the seed disk and its volume go together")
		return vol
	}
	require.True(t, hasSeed())

	// still booting: the seed stays
	require.NoError(t, os.WriteFile(console, []byte("lve-garm-bootstrap: downloading the runner (runner.tar.gz)\n"), 0o600))
	list()
	require.True(t, hasSeed())

	// the marker far back in a long console: not read (bounded tail)
	long := append([]byte(SeedDoneMarker+"\n"), bytes.Repeat([]byte("spam from the guest\n"), 4096)...)
	require.NoError(t, os.WriteFile(console, long, 0o600))
	list()
	require.True(t, hasSeed())

	// the marker behind a link: not followed
	target := filepath.Join(t.TempDir(), "elsewhere")
	require.NoError(t, os.WriteFile(target, []byte(SeedDoneMarker+"\n"), 0o600))
	require.NoError(t, os.Remove(console))
	require.NoError(t, os.Symlink(target, console))
	list()
	require.True(t, hasSeed())

	// the bootstrap is done: the next Get drops the seed, wiped first (and,
	// the instance having its lease now, pins its address in the filter)
	require.NoError(t, os.Remove(console))
	require.NoError(t, os.WriteFile(console, []byte("[  42.0] cloud-init[1]: ok\n"+SeedDoneMarker+"\nDebian GNU/Linux 12 login: "), 0o600))
	rec, err := r.m.Store.Record(name)
	require.NoError(t, err)
	r.hv.SetLeases(name, vm.Lease{MAC: rec.MAC, IP: net.ParseIP("192.168.150.77")})
	require.NotContains(t, r.hv.Domains[name].XML, `value="192.168.150.77"`)
	r.hv.Lock()
	before := len(r.hv.Calls)
	r.hv.Unlock()
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdGet, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": name}, "")
	require.Equal(t, ExitOK, code, out)
	require.Contains(t, out, `"status":"running"`)
	require.False(t, hasSeed(), "the seed disk is detached and its volume deleted")
	r.hv.Lock()
	calls := slices.Clone(r.hv.Calls[before:])
	r.hv.Unlock()
	up, det, del := slices.Index(calls, "UploadVolume"), slices.Index(calls, "DetachDisk"), slices.Index(calls, "DeleteVolume")
	require.True(t, up >= 0 && up < det && det < del, "wiped, then detached, then deleted: %v", calls)
	require.Contains(t, calls, "PinFilterAddress")
	require.Contains(t, r.hv.Domains[name].XML, `<parameter name="IP" value="192.168.150.77">`)
	require.NotContains(t, r.hv.Domains[name].XML, `CTRL_IP_LEARNING`)
	require.True(t, r.hv.Domains[name].Active, "the instance runs on")

	// again: nothing more to do
	r.hv.Lock()
	before = len(r.hv.Calls)
	r.hv.Unlock()
	list()
	r.hv.Lock()
	require.NotContains(t, r.hv.Calls[before:], "DetachDisk")
	// the ownership record lists no seed any more: not even a look at
	// the pool for it on the calls garm makes again and again
	require.NotContains(t, r.hv.Calls[before:], "VolumePath")
	require.NotContains(t, r.hv.Calls[before:], "PinFilterAddress", "pinned once since its start")
	r.hv.Unlock()

	// started again (a new boot learns its address again): pinned again
	require.NoError(t, r.m.Machine(name).Stop(context.Background()))
	require.NoError(t, r.m.Machine(name).Start(context.Background()))
	require.False(t, r.m.Machine(name).Pinned())
	list()
	require.True(t, r.m.Machine(name).Pinned())

	// the backstop: an instance older than garm.seed_keep loses its seed
	// without any marker, even when its filter cannot be pinned (the pin is
	// tried again on the next call; the token does not wait for it)
	old := create(r, ctrlA, poolA, "garm-Seed2")
	oldRec, err := r.m.Store.Record(old.ProviderID)
	require.NoError(t, err)
	r.hv.SetLeases(old.ProviderID, vm.Lease{MAC: oldRec.MAC, IP: net.ParseIP("192.168.150.78")})
	r.hv.Lock()
	r.hv.FailOn["PinFilterAddress"] = errors.New("update device: refused")
	r.hv.Unlock()
	r.cfg.Garm.SeedKeep = config.Duration(time.Nanosecond)
	list()
	require.False(t, r.m.Machine(old.ProviderID).Pinned())
	r.hv.Lock()
	delete(r.hv.FailOn, "PinFilterAddress")
	require.NotContains(t, r.hv.Volumes, "default-pool/"+vm.SeedVolume(old.ProviderID))
	require.NotContains(t, r.hv.Domains[old.ProviderID].XML, "/pool/default-pool/"+vm.SeedVolume(old.ProviderID), "no seed disk")
	r.hv.Unlock()

	// Delete still removes everything (the seed is already gone)
	for _, id := range []string{name, old.ProviderID} {
		out, code = r.call(map[string]string{"GARM_COMMAND": CmdDelete, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": id}, "")
		require.Equal(t, ExitOK, code, out)
		require.NotContains(t, r.hv.Domains, id)
		require.NotContains(t, r.hv.Volumes, "default-pool/"+vm.DiskVolume(id))
		require.NoDirExists(t, r.m.Store.MachineDir(id))
	}
}
