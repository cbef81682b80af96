package garm

import (
	"crypto/sha256"
	"encoding/base64"
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

// scrubHarness makes a fake guest root with cloud-init's copies of a
// user-data that carries the parameters (token included, base64 as
// write_files has them, at each of the three base64 alignments), then runs
// the bootstrap's main on a parameter file that does not parse (it fails
// at once, without network or users), whose finally must scrub.
const scrubHarness = `
import base64, importlib.util, json, os, pickle, sys
root, token = sys.argv[2], sys.argv[3]
def put(rel, data, mode=0o600):
    p = os.path.join(root, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    os.chmod(p, mode)
    return p
def userdata(name):
    params = json.dumps({"name": name, "token": token, "callback_url": "http://10.0.0.1/cb"}).encode()
    return "#cloud-config\n" + json.dumps({"write_files": [{"path": "/etc/libvirt-executor-garm/bootstrap.json",
        "encoding": "b64", "content": base64.b64encode(params).decode(), "permissions": "0600"}]}) + "\n"
ud = [userdata("a"), userdata("ab"), userdata("abc")]
inst = "var/lib/cloud/instances/iid-garm-1/"
put(inst + "user-data.txt", ud[0])
put(inst + "user-data.txt.i", "Content-Type: multipart/mixed\n\n" + ud[1])
put(inst + "cloud-config.txt", ud[2])
put(inst + "obj.pkl", pickle.dumps({"userdata_raw": ud[0].encode(), "userdata": ud[1]}))
put(inst + "sem/config_write_files", "sem\n")
os.symlink("instances/iid-garm-1", os.path.join(root, "var/lib/cloud/instance"))
put("run/cloud-init/combined-cloud-config.json", json.dumps({"write_files": [{"content": ud[2]}]}))
put("run/cloud-init/instance-data-sensitive.json", json.dumps({"token": token}))
put("var/log/cloud-init.log", "2025 DEBUG util.py: read user-data: " + token + "\n")
put("var/log/cloud-init-output.log", ud[0])
put("var/log/other.log", "not cloud-init's: " + token + "\n")
outside = put("outside/secret", token + "\n")
os.symlink(outside, os.path.join(root, "var/lib/cloud/link-to-outside"))
params = put("etc/libvirt-executor-garm/bootstrap.json", '{"token": "' + token + '", "name": ')  # does not parse

spec = importlib.util.spec_from_file_location("boot", sys.argv[1])
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
sys.argv = ["lve-garm-bootstrap", params]
try:
    boot.main()
    print("main returned")
except SystemExit as e:
    print("exit", e.code)
with open(os.path.join(root, inst + "obj.pkl"), "rb") as f:
    print("pickle keys", sorted(pickle.load(f)))
sys.argv = ["lve-garm-bootstrap", params]
boot.main()  # a later boot: the parameters are gone
`

// tokenForms are the token and the base64 of its bytes from each offset
// that may fall on a base64 group boundary: what a file holding the token
// inside base64 text (write_files' b64 content) contains.
func tokenForms(tok string) []string {
	out := []string{tok}
	for k := range 3 {
		n := (len(tok) - k) / 3 * 3
		out = append(out, base64.StdEncoding.EncodeToString([]byte(tok[k:k+n])))
	}
	return out
}

// TestBootstrapScrubsToken: when the bootstrap ends (here: it fails at
// once), no file of cloud-init's under the guest's /var/lib/cloud,
// /run/cloud-init or its /var/log/cloud-init*.log holds the token, as it
// is or inside base64; the files stay in place and in shape (the pickle
// loads); the parameters are gone; files that are not cloud-init's and
// links out of its trees are left alone; the last line is the marker the
// host waits for (SeedDoneMarker); a later boot finds no parameters.
func TestBootstrapScrubsToken(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		if os.Getenv("LVE_REQUIRE_PROMETHEUS") != "" {
			t.Fatal("python3 is missing (make deps installs it)")
		}
		t.Skip("no python3 on this host")
	}
	require.Contains(t, string(bootstrapScript), `DONE_MARKER = "`+SeedDoneMarker+`"`, "the guest writes the marker the host looks for")
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	script := filepath.Join(dir, "bootstrap.py")
	require.NoError(t, os.WriteFile(script, bootstrapScript, 0o600))
	const tok = "eyJhbGciOiJIUzI1NiJ9.eyJpbnN0YW5jZSI6Imdhcm0tQWJjMSJ9.c2lnbmF0dXJl-_x"
	cmd := exec.Command(py, "-c", scrubHarness, script, root, tok)
	cmd.Env = append(os.Environ(), "LVE_BOOTSTRAP_ROOT="+root)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	o := string(out)
	require.Contains(t, o, "lve-garm-bootstrap: failed: ")
	require.Contains(t, o, "token scrubbed from /var/lib/cloud/instances/iid-garm-1/user-data.txt\n")
	require.Contains(t, o, SeedDoneMarker+"\nexit 1\n", "the marker ends the bootstrap, failed or not")
	require.Contains(t, o, "pickle keys ['userdata', 'userdata_raw']", "cloud-init's pickle still loads")
	require.Contains(t, o, "no parameters (a later boot): nothing to do")
	require.NotContains(t, o, tok)
	require.NoFileExists(t, filepath.Join(root, "etc/libvirt-executor-garm/bootstrap.json"))

	forms := tokenForms(tok)
	checked := 0
	for _, tree := range []string{"var/lib/cloud", "run/cloud-init", "var/log"} {
		require.NoError(t, filepath.WalkDir(filepath.Join(root, tree), func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.Type().IsRegular() || filepath.Base(p) == "other.log" {
				return err
			}
			b, err := os.ReadFile(p)
			require.NoError(t, err)
			for _, f := range forms {
				require.NotContains(t, string(b), f, "%s still holds the token", p)
			}
			checked++
			return nil
		}))
	}
	require.Equal(t, 9, checked)
	// scrubbed in place: the user-data still reads as before but for the token
	ud, err := os.ReadFile(filepath.Join(root, "var/lib/cloud/instances/iid-garm-1/user-data.txt"))
	require.NoError(t, err)
	require.Contains(t, string(ud), `"path": "/etc/libvirt-executor-garm/bootstrap.json"`)
	for _, p := range []string{"var/log/other.log", "outside/secret"} {
		b, err := os.ReadFile(filepath.Join(root, p))
		require.NoError(t, err)
		require.Contains(t, string(b), tok, "%s is not cloud-init's: untouched", p)
	}
}
