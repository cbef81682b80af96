//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// TestDomainTypeAutoProbesKVM: with domain_type = "auto", doctor boots a
// kernel under KVM for real and says whether this host's KVM runs guests,
// remembering it; a job's prepare on a host never probed probes once
// itself, and its VM gets the domain type the probe chose, and boots. On a
// nested host whose /dev/kvm opens but whose CPU shows no vmx/svm, QEMU
// cannot run a guest under KVM: both must find that and fall back to qemu.
func TestDomainTypeAutoProbesKVM(t *testing.T) {
	r := setup(t)
	ra := r.withConfig(t, setKey("domain_type", `"auto"`))
	record := filepath.Join(ra.cfg.StateDir, "cache", "kvm-probe.json")
	if _, err := os.Stat(record); err == nil {
		b, _ := os.ReadFile(record)
		t.Cleanup(func() { _ = os.WriteFile(record, b, 0o600) })
	} else {
		t.Cleanup(func() { _ = os.Remove(record) })
	}
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	require.NoError(t, err)
	virt := regexp.MustCompile(`(?m)^flags\s*:.*\b(vmx|svm)\b`).Match(cpuinfo)
	_, devErr := os.Stat("/dev/kvm")
	t.Logf("/dev/kvm: %v; vmx/svm in /proc/cpuinfo: %v", devErr == nil, virt)

	out, _ := ra.admin("doctor").CombinedOutput()
	t.Logf("doctor:\n%s", out)
	line := regexp.MustCompile(`(?m)^\[[a-z ]+\] domain type: .*(\n +fix: .*)?`).Find(out)
	require.NotNil(t, line, "doctor has a domain type line")
	var rec lifecycle.KVMRecord
	if devErr == nil && strings.Contains(string(line), "kvm available") {
		b, err := os.ReadFile(record)
		require.NoError(t, err, "doctor remembers the probe's verdict")
		require.NoError(t, json.Unmarshal(b, &rec))
		t.Logf("record: %s", b)
		if !virt {
			require.False(t, rec.Works, "a KVM without vmx/svm cannot run guests")
			require.Contains(t, string(line), "[warn] domain type: auto: kvm available (/dev/kvm usable), but this host's KVM cannot run guests (")
			require.Contains(t, string(line), "jobs run under qemu")
		}
		require.NoError(t, os.Remove(record), "the prepare probes itself")
	}

	opts, lw := ra.options(t)
	res, err := harness.RunJob(context.Background(), opts, harness.Job{Script: []string{"echo probed-$((6*7))"}})
	require.NoError(t, err)
	require.Equal(t, harness.StateSuccess, res.State, "%s: %s", res.FailureReason, res.Message)
	log := lw.buf.String()
	require.Contains(t, log, "probed-42")
	require.Equal(t, 1, res.PrepareAttempts)
	created := regexp.MustCompile(`Created \S+ from image \S+ \((kvm|qemu),`).FindStringSubmatch(log)
	require.NotNil(t, created, "prepare says the domain type")
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "KVM") || strings.Contains(l, "Created ") {
			t.Logf("job log: %s", strings.TrimSpace(l))
		}
	}
	if devErr == nil && strings.Contains(string(line), "kvm available") {
		require.Contains(t, log, "Probing whether this host's KVM runs guests")
		if !rec.Works {
			require.Equal(t, "qemu", created[1])
			require.Contains(t, log, `Warning: domain_type = "auto": this host's KVM cannot run guests (`)
		} else {
			require.Equal(t, "kvm", created[1])
		}
	}
}
