// Package registrytest runs a real OCI registry (Debian's docker-registry,
// the CNCF Distribution registry) for tests: on a free port of 127.0.0.1,
// storing into the test's temporary directory, stopped when the test ends.
package registrytest

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// Registry is a running registry.
type Registry struct {
	Host    string // 127.0.0.1:PORT
	Storage string // its root directory
	// User and Password, when set (StartWithLogin), are the one login the
	// registry accepts; it answers every other request 401.
	User, Password string
	cmd            *exec.Cmd
	exited         chan struct{}
	config         string
}

// Binary is the registry's executable, found on PATH; without it the test
// skips, or fails under make test (LVE_REQUIRE_PROMETHEUS=1: make deps
// installed the test tools, docker-registry among them).
func Binary(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("docker-registry")
	if err == nil {
		return p
	}
	if os.Getenv("LVE_E2E_REQUIRED") == "1" || os.Getenv("LVE_REQUIRE_PROMETHEUS") == "1" {
		t.Fatalf("%v: make deps installs it (Debian: apt-get install docker-registry)", err)
	}
	t.Skipf("%v: install it (Debian: apt-get install docker-registry) to run this test", err)
	return ""
}

// Start runs a registry until the test ends.
func Start(t *testing.T) *Registry {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return StartAt(t, addr)
}

// StartAt runs a registry on addr (HOST:PORT, e.g. a port of the rig
// network's gateway that guests may reach) until the test ends.
func StartAt(t *testing.T, addr string) *Registry {
	t.Helper()
	return start(t, addr, "", "")
}

// StartWithLogin is StartAt for a registry that asks for a login: user
// with password (htpasswd, bcrypt), over plain HTTP.
func StartWithLogin(t *testing.T, addr, user, password string) *Registry {
	t.Helper()
	return start(t, addr, user, password)
}

func start(t *testing.T, addr, user, password string) *Registry {
	t.Helper()
	bin := Binary(t)
	dir := t.TempDir()
	r := &Registry{Storage: filepath.Join(dir, "storage"), config: filepath.Join(dir, "config.yml"), Host: addr, User: user, Password: password}
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n",
		r.Storage, r.Host)
	if user != "" {
		hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		htpasswd := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(htpasswd, []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg += fmt.Sprintf("auth:\n  htpasswd:\n    realm: lve-test\n    path: %s\n", htpasswd)
	}
	if err := os.WriteFile(r.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	r.start(t, bin)
	t.Cleanup(r.stop)
	return r
}

func (r *Registry) start(t *testing.T, bin string) {
	t.Helper()
	log, err := os.Create(filepath.Join(filepath.Dir(r.config), fmt.Sprintf("registry-%d.log", time.Now().UnixNano())))
	if err != nil {
		t.Fatal(err)
	}
	r.cmd = exec.Command(bin, "serve", r.config)
	r.cmd.Stdout, r.cmd.Stderr = log, log
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	r.exited = exited
	go func() { _ = r.cmd.Wait(); _ = log.Close(); close(exited) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + r.Host + "/v2/")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK || (r.User != "" && resp.StatusCode == http.StatusUnauthorized) {
				return
			}
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(log.Name())
			t.Fatalf("docker-registry exited at its start: %s", b)
		case <-time.After(50 * time.Millisecond): // the poll's interval
		}
		if time.Now().After(deadline) {
			t.Fatalf("docker-registry on %s did not answer within 20 s", r.Host)
		}
	}
}

// Stop stops the registry (a test of an unreachable registry).
func (r *Registry) Stop() { r.stop() }

func (r *Registry) stop() {
	if r.exited == nil {
		return
	}
	select {
	case <-r.exited:
		return
	default:
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.exited:
	case <-time.After(10 * time.Second):
		_ = r.cmd.Process.Kill()
		<-r.exited
	}
}

// BlobPath is where the registry keeps the blob of digest "sha256:HEX"
// (to corrupt it in a test).
func (r *Registry) BlobPath(hex string) string {
	return filepath.Join(r.Storage, "docker", "registry", "v2", "blobs", "sha256", hex[:2], hex, "data")
}

// Qcow2 is a standalone qcow2 (version 3) header of a disk of virtual
// bytes followed by tail: what imagecheck accepts as a base image (no
// backing or data file), not a disk QEMU could boot. Tests push it where
// only the bytes matter.
func Qcow2(virtual uint64, tail []byte) []byte {
	h := make([]byte, 112) // the header (104 bytes) and the extensions' end
	copy(h, "QFI\xfb")
	binary.BigEndian.PutUint32(h[4:], 3)   // version
	binary.BigEndian.PutUint32(h[20:], 16) // cluster bits
	binary.BigEndian.PutUint64(h[24:], virtual)
	binary.BigEndian.PutUint32(h[96:], 4)    // refcount order
	binary.BigEndian.PutUint32(h[100:], 104) // header length
	return append(h, tail...)
}
