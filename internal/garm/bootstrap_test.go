package garm

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	diskfs "github.com/diskfs/go-diskfs"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
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
// write_files has them, at each of the three base64 alignments: what an
// older provider sent, kept as defence in depth), then runs the
// bootstrap's main on a seed (dev/vdb, made by the test) whose parameters
// do not parse (it fails at once, without network or users): it must wipe
// the seed and scrub.
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
spec = importlib.util.spec_from_file_location("boot", sys.argv[1])
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
sys.argv = ["lve-garm-bootstrap"]
try:
    boot.main()
    print("main returned")
except SystemExit as e:
    print("exit", e.code)
with open(os.path.join(root, inst + "obj.pkl"), "rb") as f:
    print("pickle keys", sorted(pickle.load(f)))
boot.main()  # a later boot: the seed is zeros
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
	// the seed as the provider makes it (parameters that do not parse)
	seed := seedISO(t, []byte(`{"token": "`+tok+`", "name": `))
	// a root disk that looks like a seed, but has another serial: never
	// read nor wiped
	putSeed(t, root, seed, seed)
	cmd := exec.Command(py, "-c", scrubHarness, script, root, tok)
	cmd.Env = append(os.Environ(), "LVE_BOOTSTRAP_ROOT="+root)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	o := string(out)
	require.Contains(t, o, "lve-garm-bootstrap: failed: ")
	require.Contains(t, o, "token scrubbed from /var/lib/cloud/instances/iid-garm-1/user-data.txt\n")
	require.Contains(t, o, SeedDoneMarker+"\nexit 1\n", "the marker ends the bootstrap, failed or not")
	require.Contains(t, o, "pickle keys ['userdata', 'userdata_raw']", "cloud-init's pickle still loads")
	require.Contains(t, o, "lve-garm-bootstrap: seed /dev/vdb wiped (1048576 bytes)\n")
	require.Contains(t, o, "no parameters on a seed (a later boot): nothing to do")
	require.NotContains(t, o, tok)
	requireZeros(t, filepath.Join(root, "dev/vdb"), len(seed))
	vda, err := os.ReadFile(filepath.Join(root, "dev/vda"))
	require.NoError(t, err)
	require.Equal(t, seed, vda, "a disk without the seed's serial is neither read nor wiped")

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

// seedISO is a NoCloud seed with params as the bootstrap's parameter
// file (seedParams), as CreateInstance makes it.
func seedISO(t *testing.T, params []byte) []byte {
	t.Helper()
	k, err := guestinit.NewKeys("x")
	require.NoError(t, err)
	ci := guestinit.CloudInit{InstanceID: "iid-garm-1", Hostname: "h", User: "debian",
		Extra: []guestinit.File{{Path: seedParams, Content: params}}}
	b, err := ci.SeedISO(k, "x", t.TempDir())
	require.NoError(t, err)
	return b
}

// putSeed makes seed the fake root's writable seed disk: dev/vdb, with
// the serial the host gives it in sys/class/block/vdb/serial, and vda its
// root disk (another serial).
func putSeed(t *testing.T, root string, seed, vda []byte) {
	t.Helper()
	for _, d := range []string{"dev", "sys/class/block/vdb", "sys/class/block/vda"} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, d), 0o755))
	}
	require.NoError(t, os.WriteFile(filepath.Join(root, "dev/vdb"), seed, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(root, "sys/class/block/vdb/serial"), []byte(guestinit.WritableSeedSerial+"\n"), 0o444))
	require.NoError(t, os.WriteFile(filepath.Join(root, "dev/vda"), vda, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(root, "sys/class/block/vda/serial"), []byte("root\n"), 0o444))
}

// requireZeros: the file at p has n bytes, all zero.
func requireZeros(t *testing.T, p string, n int) {
	t.Helper()
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	require.Len(t, b, n)
	require.Equal(t, n, bytes.Count(b, []byte{0}), "%s is wiped", p)
}

// orderHarness runs the bootstrap's main in a fake guest root that the
// test made from a real seed (see TestBootstrapStartsRunnerLast), with the
// guest's programs, users and exec faked: it records, in order, each
// request to garm, each program run and the exec, and, whenever the
// runner service is started (svc.sh start, systemctl start or enable
// --now, by a program or by exec), which files of the fake root
// (the seed device included) still hold the token in any form.
const orderHarness = `
import collections, importlib.machinery, importlib.util, json, os, subprocess, sys, types
script, root, argv, forms = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), [f.encode() for f in json.loads(sys.argv[4])]
spec = importlib.util.spec_from_file_location("boot", script, loader=importlib.machinery.SourceFileLoader("boot", script))
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
boot.REACH_SECONDS = 5
events = []
home = os.path.join(root, "home/runner")
os.makedirs(home, exist_ok=True)
os.makedirs(os.path.join(root, "etc/systemd/system"), exist_ok=True)
boot.runner_home = lambda: home
PW = collections.namedtuple("PW", "pw_uid pw_gid pw_dir")
boot.pwd = types.SimpleNamespace(getpwnam=lambda n: PW(os.getuid(), os.getgid(), home))
def leftovers():
    found = []
    for dirpath, dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                data = f.read()
            if any(x in data for x in forms):
                found.append(p[len(root):])
    return sorted(found)
def starts(a):
    return a[:2] == ["./svc.sh", "start"] or (a[:1] == ["systemctl"] and ("start" in a or "--now" in a))
def fake_run(args, cwd=None, check=False, env=None, **kw):
    a = list(args)
    if a[:3] == ["runuser", "-u", "runner"]:
        a = a[4:]
    events.append({"run": a})
    if starts(a):
        events.append({"service": a, "left": leftovers()})
    if a[:1] == ["./config.sh"]:
        with open(os.path.join(cwd, ".runner"), "w") as f:
            f.write('{"agentId": 77}')
    return subprocess.CompletedProcess(args, 0)
boot.subprocess = types.SimpleNamespace(run=fake_run, CompletedProcess=subprocess.CompletedProcess)
def fake_exec(file, a, env):
    events.append({"exec": list(a), "env": sorted(env)})
    if starts(list(a)):
        events.append({"service": list(a), "left": leftovers()})
    raise SystemExit(0)
os.execvpe = fake_exec
orig = boot.Garm.request
def request(self, method, url, body=None, token=None):
    events.append({"http": method + " " + url.split("/api/v1/")[-1], "status": (body or {}).get("status")})
    return orig(self, method, url, body, token)
boot.Garm.request = request
sys.argv = ["lve-garm-bootstrap"] + [root + a if a.startswith("/") and os.path.exists(root + a) else a for a in argv]
try:
    boot.main()
    events.append({"exit": None})
except SystemExit as e:
    events.append({"exit": e.code})
print("EVENTS " + json.dumps(events))
`

// fakeCloudInit does for the fake root at root what cloud-init does with
// seed in the guest: write_files of its user-data, a copy of the
// user-data under /var/lib/cloud; and puts the seed disk in place
// (putSeed). It returns bootcmd's program's arguments (after python3).
func fakeCloudInit(t *testing.T, root string, seed []byte) []string {
	t.Helper()
	iso := filepath.Join(t.TempDir(), "seed.iso")
	require.NoError(t, os.WriteFile(iso, seed, 0o600))
	d, err := diskfs.Open(iso, diskfs.WithOpenMode(diskfs.ReadOnly))
	require.NoError(t, err)
	fs, err := d.GetFilesystem(0)
	require.NoError(t, err)
	f, err := fs.OpenFile("/user-data", os.O_RDONLY)
	require.NoError(t, err)
	ud, err := io.ReadAll(f)
	require.NoError(t, err)
	var doc struct {
		WriteFiles []struct{ Path, Content, Encoding string } `json:"write_files"`
		BootCmd    [][]string                                 `json:"bootcmd"`
	}
	require.NoError(t, json.Unmarshal(bytes.TrimPrefix(ud, []byte("#cloud-config\n")), &doc))
	for _, wf := range doc.WriteFiles {
		b, err := base64.StdEncoding.DecodeString(wf.Content)
		require.NoError(t, err)
		p := filepath.Join(root, wf.Path)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, b, 0o600))
	}
	cl := filepath.Join(root, "var/lib/cloud/instances/iid/user-data.txt")
	require.NoError(t, os.MkdirAll(filepath.Dir(cl), 0o755))
	require.NoError(t, os.WriteFile(cl, ud, 0o600))
	putSeed(t, root, seed, []byte("the root disk"))
	require.Len(t, doc.BootCmd, 1)
	i := slices.Index(doc.BootCmd[0], "python3")
	require.GreaterOrEqual(t, i, 0, "bootcmd %v", doc.BootCmd)
	return doc.BootCmd[0][i+1:]
}

// TestBootstrapStartsRunnerLast: CreateInstance's seed, given to the
// guest's bootstrap as cloud-init would (a fake root) against a fake garm:
// the seed disk is writable and carries the serial the guest looks for;
// the bootstrap reports installing ... idle with the instance token,
// registers the runner (config.sh with the registration token; or JIT:
// garm's credentials, which stay for the runner), and starts the runner
// service last, by exec, when no file of the guest (the seed device, the
// parameters, cloud-init's copies) holds the token in any form: the seed
// reads as zeros, and no job can run while a copy exists. Before this
// change the service started (svc.sh start) while the parameter file,
// cloud-init's copy of the user-data and the seed still held it.
func TestBootstrapStartsRunnerLast(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		if os.Getenv("LVE_REQUIRE_PROMETHEUS") != "" {
			t.Fatal("python3 is missing (make deps installs it)")
		}
		t.Skip("no python3 on this host")
	}
	var tb bytes.Buffer
	gz := gzip.NewWriter(&tb)
	tw := tar.NewWriter(gz)
	body := "#!/bin/sh\n"
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "config.sh", Mode: 0o755, Size: int64(len(body))}))
	_, _ = tw.Write([]byte(body))
	require.NoError(t, tw.Close())
	require.NoError(t, gz.Close())
	sum := sha256.Sum256(tb.Bytes())

	var mu sync.Mutex
	var statuses []string
	badAuth := 0
	mux := http.NewServeMux()
	authed := func(w http.ResponseWriter, r *http.Request) bool {
		if r.Header.Get("Authorization") != "Bearer "+token {
			mu.Lock()
			badAuth++
			mu.Unlock()
			http.Error(w, "bad token", http.StatusUnauthorized)
			return false
		}
		return true
	}
	mux.HandleFunc("POST /api/v1/callbacks/status", func(w http.ResponseWriter, r *http.Request) {
		if authed(w, r) {
			var b struct{ Status string }
			_ = json.NewDecoder(r.Body).Decode(&b)
			mu.Lock()
			statuses = append(statuses, b.Status)
			mu.Unlock()
		}
	})
	mux.HandleFunc("POST /api/v1/callbacks/system-info/", func(w http.ResponseWriter, r *http.Request) { authed(w, r) })
	meta := map[string]string{
		"runner-registration-token/":        "fake-registration-token",
		"credentials/runner":                `{"agentId": 5151}`,
		"credentials/credentials":           `{"scheme": "OAuth"}`,
		"credentials/credentials_rsaparams": `{"d": "runner-key"}`,
		"system/service-name":               "actions.runner.o-r.jit",
		"systemd/unit-file":                 "[Service]\nExecStart=/bin/true\n",
	}
	for p, b := range meta {
		mux.HandleFunc("GET /api/v1/metadata/"+p, func(w http.ResponseWriter, r *http.Request) {
			if authed(w, r) {
				_, _ = io.WriteString(w, b)
			}
		})
	}
	mux.HandleFunc("GET /runner.tar.gz", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(tb.Bytes()) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Close() }()
	base := "http://" + ln.Addr().String()

	for _, jit := range []bool{false, true} {
		t.Run(fmt.Sprintf("jit=%v", jit), func(t *testing.T) {
			mu.Lock()
			statuses, badAuth = nil, 0
			mu.Unlock()
			r := newRig(t)
			name := fmt.Sprintf("garm-Order%v", jit)
			out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA},
				bootstrap(name, func(b map[string]any) {
					b["callback-url"], b["metadata-url"] = base+"/api/v1/callbacks", base+"/api/v1/metadata"
					b["tools"] = []map[string]any{{"os": "linux", "architecture": "x64", "download_url": base + "/runner.tar.gz",
						"filename": "runner.tar.gz", "sha256_checksum": hex.EncodeToString(sum[:])}}
					b["jit_config_enabled"] = jit
				}))
			require.Equal(t, ExitOK, code, out)
			var in Instance
			require.NoError(t, json.Unmarshal([]byte(out), &in))
			seed := r.hv.Volumes["default-pool/"+vm.SeedVolume(in.ProviderID)]
			require.NotEmpty(t, seed)
			// the seed disk: writable (the guest wipes it), with its serial
			x := r.hv.Domains[in.ProviderID].XML
			i := strings.Index(x, vm.SeedVolume(in.ProviderID)+`"></source>`)
			require.Greater(t, i, 0)
			disk := x[strings.LastIndex(x[:i], "<disk"):]
			disk = disk[:strings.Index(disk, "</disk>")]
			require.NotContains(t, disk, "<readonly", "the seed is writable: %s", disk)
			require.Contains(t, disk, "<serial>"+guestinit.WritableSeedSerial+"</serial>")

			dir := t.TempDir()
			root := filepath.Join(dir, "root")
			argv := fakeCloudInit(t, root, seed)
			script := filepath.Join(root, strings.TrimPrefix(argv[0], "/"))
			args, _ := json.Marshal(argv[1:])
			forms, _ := json.Marshal(tokenForms(token))
			cmd := exec.Command(py, "-c", orderHarness, script, root, string(args), string(forms))
			cmd.Env = append(os.Environ(), "LVE_BOOTSTRAP_ROOT="+root)
			o, err := cmd.CombinedOutput()
			require.NoError(t, err, string(o))
			require.NotContains(t, string(o[:bytes.Index(o, []byte("EVENTS "))]), token, "the bootstrap never prints the token")
			var events []map[string]any
			require.NoError(t, json.Unmarshal([]byte(strings.TrimSpace(string(o[bytes.Index(o, []byte("EVENTS "))+7:]))), &events), string(o))
			ev, _ := json.Marshal(events)

			// the runner service is started once, last, by exec, when
			// nothing holds the token
			var starts []int
			idle := -1
			for i, e := range events {
				if _, ok := e["service"]; ok {
					starts = append(starts, i)
					require.Empty(t, e["left"], "the runner service started while these held the token: %v\n%s\n%s", e["left"], ev, o)
				}
				if e["status"] == "idle" {
					idle = i
				}
			}
			require.Len(t, starts, 1, "%s", ev)
			require.Equal(t, len(events)-2, starts[0], "starting the service is the last act: %s", ev)
			require.Contains(t, events[starts[0]-1], "exec", "by exec: the bootstrap's memory (the token) is gone: %s", ev)
			require.Equal(t, []any{"LANG", "PATH"}, events[starts[0]-1]["env"], "no proxy or other parameter in the service start's environment")
			require.Equal(t, map[string]any{"exit": 0.0}, events[len(events)-1])
			require.Greater(t, idle, 0, "idle reported before the start: %s", ev)
			require.Less(t, idle, starts[0])
			if jit {
				require.Equal(t, []any{"systemctl", "start", "actions.runner.o-r.jit.service"}, events[starts[0]]["service"])
				require.Contains(t, string(ev), `{"run":["systemctl","enable","actions.runner.o-r.jit.service"]}`)
				cred, err := os.ReadFile(filepath.Join(root, "home/runner/actions-runner/.credentials_rsaparams"))
				require.NoError(t, err)
				require.Equal(t, `{"d": "runner-key"}`, string(cred), "the runner's own credentials stay: it needs them")
			} else {
				require.Equal(t, []any{"./svc.sh", "start"}, events[starts[0]]["service"])
				require.Contains(t, string(ev), `"--token","fake-registration-token"`)
				require.Contains(t, string(ev), `{"run":["./svc.sh","install","runner"]}`)
			}
			require.Contains(t, string(o), SeedDoneMarker)
			requireZeros(t, filepath.Join(root, "dev/vdb"), len(seed))
			mu.Lock()
			require.Equal(t, []string{"installing", "installing", "idle"}, statuses)
			require.Zero(t, badAuth)
			mu.Unlock()
		})
	}
}
