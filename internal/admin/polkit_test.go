package admin

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

func polkitConfig() *config.Config {
	return &config.Config{NamePrefix: "ci-a", StoragePool: "jobs.pool", Network: "ci_net"}
}

// polkitCase is one libvirt permission check as polkitd hands it to the
// rules: the action, the subject's user and the action's details.
type polkitCase struct {
	Want    string            `json:"-"` // "yes", "no" or "" (not handled: polkit's defaults)
	ID      string            `json:"id"`
	User    string            `json:"user"`
	Details map[string]string `json:"details"`
}

// polkitHarness loads the rules as polkitd does (polkit.addRule) and prints
// each case's result; the engine is ES5 (polkitd's duktape), node runs it.
const polkitHarness = `
var fs = require("fs");
var rules = [];
var polkit = {Result: {YES: "yes", NO: "no", NOT_HANDLED: null}, addRule: function (f) { rules.push(f); }, log: function () {}};
eval(fs.readFileSync(process.argv[2], "utf8"));
var cases = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
var out = cases.map(function (c) {
	var action = {id: c.id, lookup: function (k) { return c.details.hasOwnProperty(k) ? c.details[k] : undefined; }};
	var subject = {user: c.user, isInGroup: function () { return false; }};
	for (var i = 0; i < rules.length; i++) {
		var r = rules[i](action, subject);
		if (r !== null && r !== undefined) { return r; }
	}
	return "";
});
process.stdout.write(JSON.stringify(out));
`

func TestPolkitRulesDecide(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("no node to run the rules with")
	}
	var buf bytes.Buffer
	require.NoError(t, PolkitRules(&buf, polkitConfig(), "runner"))
	dom := func(name string) map[string]string {
		return map[string]string{"connect_driver": "QEMU", "domain_name": name}
	}
	vol := func(pool, name string) map[string]string {
		return map[string]string{"pool_name": pool, "vol_name": name}
	}
	cases := []polkitCase{
		// what the driver does
		{Want: "yes", ID: "org.libvirt.api.connect.getattr", User: "runner", Details: map[string]string{"connect_driver": "QEMU"}},
		{Want: "yes", ID: "org.libvirt.api.connect.search-domains", User: "runner", Details: map[string]string{"connect_driver": "QEMU"}},
		{Want: "yes", ID: "org.libvirt.api.domain.save", User: "runner", Details: dom("ci-a-0123abcd-89abcdef-17")},
		{Want: "yes", ID: "org.libvirt.api.domain.start", User: "runner", Details: dom("ci-a-0123abcd-89abcdef-17")},
		{Want: "yes", ID: "org.libvirt.api.domain.delete", User: "runner", Details: dom("ci-a-0123abcd-89abcdef-17")},
		{Want: "yes", ID: "org.libvirt.api.storage-pool.refresh", User: "runner", Details: map[string]string{"pool_name": "jobs.pool"}},
		{Want: "yes", ID: "org.libvirt.api.storage-vol.create", User: "runner", Details: vol("jobs.pool", "ci-a-0123abcd-89abcdef-17.qcow2")},
		{Want: "yes", ID: "org.libvirt.api.storage-vol.data-write", User: "runner", Details: vol("jobs.pool", "ci-a-0123abcd-89abcdef-17-seed.img")},
		{Want: "yes", ID: "org.libvirt.api.network.write", User: "runner", Details: map[string]string{"network_name": "ci_net"}},
		{Want: "yes", ID: "org.libvirt.api.network-port.create", User: "runner", Details: map[string]string{"network_name": "ci_net", "connect_driver": "network"}},
		{Want: "yes", ID: "org.libvirt.api.nwfilter.save", User: "runner", Details: map[string]string{"nwfilter_name": "lve-vm-v1"}},
		{Want: "yes", ID: "org.libvirt.api.nwfilter.read", User: "runner", Details: map[string]string{"nwfilter_name": "clean-traffic"}},
		{Want: "yes", ID: "org.libvirt.api.nwfilter-binding.create", User: "runner", Details: map[string]string{"nwfilter_binding_filter": "lve-vm-egress-v1", "nwfilter_binding_portdev": "vnet3"}},
		// what it must not do
		{Want: "no", ID: "org.libvirt.api.storage-pool.save", User: "runner", Details: map[string]string{"pool_name": "jobs.pool"}},
		{Want: "no", ID: "org.libvirt.api.storage-pool.write", User: "runner", Details: map[string]string{"pool_name": "evil"}},
		{Want: "no", ID: "org.libvirt.api.storage-pool.getattr", User: "runner", Details: map[string]string{"pool_name": "other"}},
		{Want: "no", ID: "org.libvirt.api.storage-vol.create", User: "runner", Details: vol("jobs.pool", "notours.img")},
		{Want: "no", ID: "org.libvirt.api.storage-vol.data-read", User: "runner", Details: vol("other", "ci-a-x.qcow2")},
		{Want: "no", ID: "org.libvirt.api.domain.save", User: "runner", Details: dom("other-vm")},
		{Want: "no", ID: "org.libvirt.api.domain.getattr", User: "runner", Details: dom("ci-b-0123abcd-89abcdef-17")},
		{Want: "no", ID: "org.libvirt.api.domain.save", User: "runner", Details: dom("ci-a")},     // the prefix alone
		{Want: "no", ID: "org.libvirt.api.domain.save", User: "runner", Details: dom("ci-abc-1")}, // a longer prefix
		{Want: "no", ID: "org.libvirt.api.domain.read-secure", User: "runner", Details: dom("ci-a-0123abcd-89abcdef-17")},
		{Want: "no", ID: "org.libvirt.api.domain.migrate", User: "runner", Details: dom("ci-a-0123abcd-89abcdef-17")},
		{Want: "no", ID: "org.libvirt.api.domain.start", User: "runner", Details: map[string]string{}},
		{Want: "no", ID: "org.libvirt.api.network.stop", User: "runner", Details: map[string]string{"network_name": "ci_net"}},
		{Want: "no", ID: "org.libvirt.api.network.write", User: "runner", Details: map[string]string{"network_name": "default"}},
		{Want: "no", ID: "org.libvirt.api.nwfilter.save", User: "runner", Details: map[string]string{"nwfilter_name": "clean-traffic"}},
		{Want: "no", ID: "org.libvirt.api.nwfilter.delete", User: "runner", Details: map[string]string{"nwfilter_name": "lve-vm-v1"}},
		{Want: "no", ID: "org.libvirt.api.nwfilter-binding.create", User: "runner", Details: map[string]string{"nwfilter_binding_filter": "allow-ipv4"}},
		{Want: "no", ID: "org.libvirt.api.connect.write", User: "runner", Details: map[string]string{"connect_driver": "QEMU"}},
		{Want: "no", ID: "org.libvirt.api.connect.search-node-devices", User: "runner", Details: map[string]string{}},
		{Want: "no", ID: "org.libvirt.api.node-device.detach", User: "runner", Details: map[string]string{}},
		{Want: "no", ID: "org.libvirt.api.secret.read-secure", User: "runner", Details: map[string]string{}},
		{Want: "no", ID: "org.libvirt.api.interface.write", User: "runner", Details: map[string]string{}},
		// not this file's business
		{Want: "", ID: "org.libvirt.api.domain.save", User: "alice", Details: dom("other-vm")},
		{Want: "", ID: "org.libvirt.unix.manage", User: "runner", Details: map[string]string{}},
		{Want: "", ID: "org.freedesktop.login1.reboot", User: "runner", Details: map[string]string{}},
	}
	dir := t.TempDir()
	rules, input := filepath.Join(dir, "50-libvirt-executor.rules"), filepath.Join(dir, "cases.json")
	harness := filepath.Join(dir, "harness.js")
	require.NoError(t, os.WriteFile(rules, buf.Bytes(), 0o644))
	b, err := json.Marshal(cases)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(input, b, 0o644))
	require.NoError(t, os.WriteFile(harness, []byte(polkitHarness), 0o644))
	out, err := exec.Command(node, harness, rules, input).Output()
	require.NoError(t, err)
	var got []string
	require.NoError(t, json.Unmarshal(out, &got))
	require.Len(t, got, len(cases))
	for i, c := range cases {
		assert.Equal(t, c.Want, got[i], "%s by %s on %v", c.ID, c.User, c.Details)
	}
}

func TestPolkitRulesQuoteNames(t *testing.T) {
	// The configuration validates its names; the rules quote them as JS
	// string literals anyway, so a quote or a line break cannot end one.
	cfg := &config.Config{NamePrefix: `x"; polkit.Result.YES; "`, StoragePool: "p\u2028", Network: `n\`}
	var buf bytes.Buffer
	require.NoError(t, PolkitRules(&buf, cfg, "runner"))
	s := buf.String()
	assert.Contains(t, s, `var prefix = "x\"; polkit.Result.YES; \"-", pool = "p\u2028", network = "n\\";`)
	assert.Contains(t, s, `var user = "runner";`)

	for _, bad := range []string{"", "Root", `a"b`, "a b", "a\nb", strings.Repeat("a", 33)} {
		assert.Error(t, PolkitRules(&bytes.Buffer{}, polkitConfig(), bad), "%q", bad)
	}
}

// The package installs deploy/polkit/50-libvirt-executor.rules: the rules
// for the example configuration and gitlab-runner.
func TestShippedPolkitRules(t *testing.T) {
	cfg, err := config.Load("../../deploy/config.example.toml")
	require.NoError(t, err)
	var buf bytes.Buffer
	require.NoError(t, PolkitRules(&buf, cfg, "gitlab-runner"))
	shipped, err := os.ReadFile("../../deploy/polkit/50-libvirt-executor.rules")
	require.NoError(t, err)
	assert.Equal(t, buf.String(), string(shipped), "regenerate: go run ./cmd/admin --config deploy/config.example.toml polkit-rules > deploy/polkit/50-libvirt-executor.rules")
}

func TestAccessModeCheck(t *testing.T) {
	dir := t.TempDir()
	conf := func(name, text string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(text), 0o644))
		return p
	}
	rulesDir := filepath.Join(dir, "rules.d")
	require.NoError(t, os.Mkdir(rulesDir, 0o755))
	missing := filepath.Join(dir, "virtqemud.conf")

	// Debian's libvirtd.conf: the setting is commented out.
	off := conf("off.conf", "#access_drivers = [ \"polkit\" ]\nunix_sock_group = \"libvirt\"\n")
	c := accessModeCheck([]string{off, missing}, []string{rulesDir})
	assert.True(t, c.OK)
	assert.True(t, c.Warn)
	assert.Contains(t, c.Info, "root-equivalent")
	assert.Contains(t, c.Fix, "polkit-rules")

	on := conf("on.conf", "unix_sock_group = \"libvirt\"\naccess_drivers = [ \"polkit\" ]\n")
	c = accessModeCheck([]string{on, missing}, []string{rulesDir})
	assert.True(t, c.OK)
	assert.True(t, c.Warn, "no rules found")
	assert.Contains(t, c.Info, "polkit access driver is on")

	require.NoError(t, os.WriteFile(filepath.Join(rulesDir, "50-libvirt-executor.rules"), []byte("// libvirt-executor: ...\n"), 0o644))
	c = accessModeCheck([]string{on, missing}, []string{rulesDir})
	assert.True(t, c.OK)
	assert.False(t, c.Warn, c.Info)
	assert.Contains(t, c.Info, filepath.Join(rulesDir, "50-libvirt-executor.rules"))
	assert.Contains(t, c.Info, "any host file", "the limit is said")

	// Modular daemons: one without the driver lets the user do anything there.
	c = accessModeCheck([]string{on, off}, []string{rulesDir})
	assert.True(t, c.Warn)
	assert.Contains(t, c.Info, "not in "+off)

	// The last setting wins; a later "none" turns it off.
	last := conf("last.conf", "access_drivers = [ \"polkit\" ]\naccess_drivers = [ ]\n")
	c = accessModeCheck([]string{last}, []string{rulesDir})
	assert.Contains(t, c.Info, "root-equivalent")
}
