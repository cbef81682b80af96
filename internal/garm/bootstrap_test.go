package garm

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// bootstrapHarness drives the guest's bootstrap (bootstrap.py, embedded)
// from Python on this host, function by function (no user, no systemd):
// what its HTTP calls send where.
const bootstrapHarness = `
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("boot", sys.argv[1])
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
boot.REACH_SECONDS = 3
args = json.loads(sys.argv[2])
g = boot.Garm({"token": "instance-secret", "callback_url": args["base"] + "/cb", "metadata_url": args["base"] + "/md"})
out = {}
try:
    boot.download(g, {"download_url": args["base"] + "/redirect", "temp_download_token": "download-secret",
                      "sha256_checksum": args["sum"], "filename": "r.tgz"}, args["dest"])
    out["download"] = "ok"
except Exception as e:
    out["download"] = str(e)
try:
    boot.download(g, {"download_url": args["base"] + "/redirect", "sha256_checksum": "0" * 64, "filename": "r.tgz"}, args["dest"])
    out["badsum"] = "ok"
except Exception as e:
    out["badsum"] = str(e)
try:
    g.metadata("runner-registration-token/")
    out["meta"] = "ok"
except Exception as e:
    out["meta"] = str(e)
g.status("installing", "x")  # best effort: no exception though garm answers 404
g2 = boot.Garm({"token": "t", "callback_url": "http://127.0.0.1:" + args["closed"] + "/cb", "metadata_url": "http://127.0.0.1:" + args["closed"] + "/md"})
try:
    g2.metadata("x")
    out["closed"] = "ok"
except Exception as e:
    out["closed"] = str(e)
print(json.dumps(out))
`

// TestBootstrapHTTP: the bootstrap sends its tokens only to the host they
// are for (a redirect to another host gets no Authorization header), checks
// the download's sha256, takes a 4xx as final, retries an unreachable garm
// until its deadline and then gives up naming it; a status garm refuses
// does not stop it.
func TestBootstrapHTTP(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		if os.Getenv("LVE_REQUIRE_PROMETHEUS") != "" { // under make test, after make deps
			t.Fatal("python3 is missing (make deps installs it)")
		}
		t.Skip("no python3 on this host")
	}
	payload := []byte("runner tarball")
	sum := sha256.Sum256(payload)
	var mu sync.Mutex
	auth := map[string][]string{} // server -> Authorization headers seen
	record := func(who string, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		auth[who] = append(auth[who], r.Header.Get("Authorization"))
	}
	// the download's final host: another address than garm's
	other, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Skipf("no 127.0.0.2 here: %v", err)
	}
	otherSrv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		record("other", r)
		_, _ = w.Write(payload)
	})}
	go func() { _ = otherSrv.Serve(other) }()
	defer func() { _ = otherSrv.Close() }()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		record("garm", r)
		switch r.URL.Path {
		case "/redirect":
			http.Redirect(w, r, "http://"+other.Addr().String()+"/blob", http.StatusFound)
		default:
			http.NotFound(w, r)
		}
	})}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Close() }()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closedPort := fmt.Sprint(closed.Addr().(*net.TCPAddr).Port)
	require.NoError(t, closed.Close())

	dir := t.TempDir()
	script := filepath.Join(dir, "bootstrap.py")
	require.NoError(t, os.WriteFile(script, bootstrapScript, 0o600))
	args := fmt.Sprintf(`{"base": "http://%s", "sum": %q, "dest": %q, "closed": %q}`, ln.Addr(), hex.EncodeToString(sum[:]), filepath.Join(dir, "dl"), closedPort)
	out, err := exec.Command(py, "-c", bootstrapHarness, script, args).CombinedOutput()
	require.NoError(t, err, string(out))
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	res := lines[len(lines)-1]

	require.Contains(t, res, `"download": "ok"`)
	require.Contains(t, res, `"badsum": "runner download r.tgz: sha256 `+hex.EncodeToString(sum[:])+`, expected 0000`)
	require.Contains(t, res, `"meta": "GET http://`+ln.Addr().String()+`/md/runner-registration-token/: HTTP 404"`)
	require.Contains(t, res, `"closed": "GET http://127.0.0.1:`+closedPort+`/md/x: `)
	require.Contains(t, res, `gave up after 3 s`)
	require.Contains(t, string(out), "status installing not reported")

	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, auth["garm"], "Bearer download-secret", "the download's own host gets its token")
	require.Contains(t, auth["garm"], "Bearer instance-secret", "garm gets the instance token")
	for _, h := range auth["other"] {
		require.Empty(t, h, "a redirect to another host carries no token")
	}
	require.Len(t, auth["other"], 2)
}
