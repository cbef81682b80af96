//go:build e2e

package e2e

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
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"
)

// fakeGarm is garm's side of a runner's bootstrap: the callback and
// metadata endpoints (bearer token checked), the runner tool download,
// and what the fake runner service says when it runs.
type fakeGarm struct {
	base     string
	tarball  []byte
	mu       sync.Mutex
	statuses map[string][]string // token -> status sequence
	messages map[string][]string
	agent    map[string]any
	info     map[string]map[string]any
	ran      map[string]int // what the runner services said they ran as
	config   []string       // config.sh's arguments, as the fake runner got them
	badAuth  []string
	// downFor: for this long from the first request to them, garm's
	// callback and metadata endpoints answer 503 (unavailable counts the
	// 503s; firstCall is when the first request came)
	downFor     time.Duration
	firstCall   time.Time
	unavailable int
	// patterns are what the guest's job searches for (/patterns); job is
	// what it reported (/job)
	patterns string
	job      []string
}

func (g *fakeGarm) handler(tokens map[string]string) http.Handler {
	mux := http.NewServeMux()
	auth := func(w http.ResponseWriter, r *http.Request) (string, bool) {
		tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		if _, ok := tokens[tok]; !ok {
			g.mu.Lock()
			g.badAuth = append(g.badAuth, r.Method+" "+r.URL.Path)
			g.mu.Unlock()
			http.Error(w, "bad token", http.StatusUnauthorized)
			return "", false
		}
		return tok, true
	}
	mux.HandleFunc("POST /api/v1/callbacks/status", func(w http.ResponseWriter, r *http.Request) {
		tok, ok := auth(w, r)
		if !ok {
			return
		}
		var body map[string]any
		_ = json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&body)
		g.mu.Lock()
		st, _ := body["status"].(string)
		msg, _ := body["message"].(string)
		g.statuses[tok] = append(g.statuses[tok], st)
		g.messages[tok] = append(g.messages[tok], msg)
		if a, ok := body["agent_id"]; ok {
			g.agent[tok] = a
		}
		g.mu.Unlock()
	})
	mux.HandleFunc("POST /api/v1/callbacks/system-info/", func(w http.ResponseWriter, r *http.Request) {
		tok, ok := auth(w, r)
		if !ok {
			return
		}
		var body map[string]any
		_ = json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&body)
		g.mu.Lock()
		g.info[tok] = body
		g.mu.Unlock()
	})
	mux.HandleFunc("GET /api/v1/metadata/runner-registration-token/", func(w http.ResponseWriter, r *http.Request) {
		if _, ok := auth(w, r); ok {
			_, _ = io.WriteString(w, "fake-registration-token\n")
		}
	})
	mux.HandleFunc("GET /runner.tar.gz", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(g.tarball) })
	mux.HandleFunc("POST /configured", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(io.LimitReader(r.Body, 1<<16))
		g.mu.Lock()
		g.config = strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
		g.mu.Unlock()
	})
	mux.HandleFunc("POST /ran", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(io.LimitReader(r.Body, 256))
		g.mu.Lock()
		g.ran[string(b)]++
		g.mu.Unlock()
	})
	// JIT: the runner's credentials, service name and unit, as garm's
	// metadata service hands them out
	jit := map[string]string{
		"credentials/runner":                `{"agentId": 5151, "agentName": "jit"}`,
		"credentials/credentials":           `{"scheme": "OAuth"}`,
		"credentials/credentials_rsaparams": `{"d": "fake"}`,
		"system/service-name":               "actions.runner.example-repo.garm-Jit1",
		"systemd/unit-file":                 "[Unit]\nDescription=fake JIT runner\n[Service]\nUser=runner\nWorkingDirectory=/home/runner/actions-runner\nExecStart=/home/runner/actions-runner/run.sh jit\n[Install]\nWantedBy=multi-user.target\n",
	}
	for path, body := range jit {
		mux.HandleFunc("GET /api/v1/metadata/"+path, func(w http.ResponseWriter, r *http.Request) {
			if _, ok := auth(w, r); !ok {
				return
			}
			if path == "systemd/unit-file" && r.URL.Query().Get("runAsUser") != "runner" {
				http.Error(w, "runAsUser", http.StatusBadRequest)
				return
			}
			_, _ = io.WriteString(w, body)
		})
	}
	mux.HandleFunc("GET /patterns", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, g.patterns) })
	mux.HandleFunc("POST /job", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		g.mu.Lock()
		g.job = append(g.job, string(b))
		g.mu.Unlock()
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		api := strings.HasPrefix(r.URL.Path, "/api/v1/")
		g.mu.Lock()
		if api && g.firstCall.IsZero() {
			g.firstCall = time.Now()
		}
		down := api && g.downFor > 0 && time.Since(g.firstCall) < g.downFor
		if down {
			g.unavailable++
		}
		g.mu.Unlock()
		if down {
			http.Error(w, "garm is down", http.StatusServiceUnavailable)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func (g *fakeGarm) seq(tok string) []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.statuses[tok])
}

// runnerTarball is a fake actions runner: config.sh records its arguments
// and writes .runner (agent 4242), svc.sh installs and starts a systemd
// unit that runs run.sh, which tells the fake garm it ran.
func runnerTarball(t *testing.T, ranURL, configuredURL string) []byte {
	return jobTarball(t, ranURL, configuredURL, "")
}

// tokenJob is a job of the runner: with the runner's sudo it reads every
// regular file of the guest (all but /proc and /sys) and every block
// device (whole disks; a partition is part of its disk) for the patterns
// garm's /patterns serves (never written to a file), and posts what it
// found to /job: FOUND lines, counts, who it ran as.
const tokenJob = `import os, stat, sys, urllib.request
base = sys.argv[1]
pats = [p for p in urllib.request.urlopen(base + "/patterns").read().split(b"\n") if p]
keep = max(map(len, pats))
def holds(path):
    with open(path, "rb", buffering=0) as f:
        prev = b""
        while True:
            b = f.read(8 << 20)
            if not b:
                return False
            buf = prev + b
            if any(p in buf for p in pats):
                return True
            prev = buf[-keep:]
out, files, devs, size = [], 0, 0, 0
for dirpath, dirs, names in os.walk("/"):
    if dirpath == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
    for n in names:
        p = os.path.join(dirpath, n)
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            files += 1
            if holds(p):
                out.append("FOUND file " + p)
        except OSError:
            pass
for n in sorted(os.listdir("/sys/class/block")):
    if os.path.exists("/sys/class/block/%s/partition" % n):
        continue
    try:
        if holds("/dev/" + n):
            out.append("FOUND device /dev/" + n)
        devs += 1
        with open("/sys/class/block/%s/size" % n) as f:
            size += int(f.read()) * 512
    except OSError as e:
        out.append("UNREADABLE /dev/%s %s" % (n, e.strerror))
out += ["FILES %d" % files, "DEVICES %d" % devs, "DEVICE_BYTES %d" % size, "UID %d" % os.getuid(), "SUDO_USER " + os.environ.get("SUDO_USER", "")]
urllib.request.urlopen(base + "/job", data="\n".join(out).encode())
`

// jobTarball is runnerTarball whose runner service, when it starts, first
// runs job (python, with the runner's sudo; its argument the fake garm's
// base URL) as a job would, the moment the runner can take one.
func jobTarball(t *testing.T, ranURL, configuredURL, job string) []byte {
	t.Helper()
	files := map[string]string{
		"config.sh": "#!/bin/sh\nset -e\ncd \"$(dirname \"$0\")\"\nprintf '%s\\n' \"$@\" > config.args\n" +
			"python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], data=open(\"config.args\", \"rb\").read())' " + configuredURL + "\n" +
			"printf '{\"agentId\": 4242, \"agentName\": \"fake\"}' > .runner\n",
		"svc.sh": "#!/bin/sh\nset -e\ndir=$(cd \"$(dirname \"$0\")\" && pwd)\ncase \"$1\" in\n" +
			"install) printf '[Service]\\nUser=%s\\nExecStart=%s/run.sh\\n' \"$2\" \"$dir\" > /etc/systemd/system/actions.runner.fake.service; systemctl daemon-reload ;;\n" +
			"start) systemctl start actions.runner.fake.service ;;\nesac\n",
		"run.sh": "#!/bin/sh\nexec python3 -c 'import sys, time, urllib.request; urllib.request.urlopen(sys.argv[1], data=\"-\".join([\"ran\"] + sys.argv[2:]).encode()); time.sleep(1e9)' " + ranURL + " \"$@\"\n",
	}
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	names := []string{"config.sh", "svc.sh", "run.sh"}
	if job != "" {
		files["job.py"] = job
		files["run.sh"] = "#!/bin/sh\ndir=$(cd \"$(dirname \"$0\")\" && pwd)\nsudo -n python3 \"$dir/job.py\" " + strings.TrimSuffix(ranURL, "/ran") + "\n" + files["run.sh"][len("#!/bin/sh\n"):]
		names = append(names, "job.py")
	}
	for _, name := range names {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(files[name])), ModTime: time.Now()}))
		_, err := tw.Write([]byte(files[name]))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	require.NoError(t, gz.Close())
	return buf.Bytes()
}

// garmCall runs libvirt-executor-garm as garm does.
func garmCall(t *testing.T, bin, cfg, ctrl, pool, command, instance, stdin string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "libvirt-executor-garm"))
	if confined != nil && bin == confined.bin {
		// The confined mode: the provider runs as the runner's user, whose
		// state directory it shares.
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: confined.user.cred}
	}
	cmd.Env = append(os.Environ(), "GARM_COMMAND="+command, "GARM_CONTROLLER_ID="+ctrl, "GARM_POOL_ID="+pool,
		"GARM_INSTANCE_ID="+instance, "GARM_PROVIDER_CONFIG_FILE="+cfg, "GARM_INTERFACE_VERSION=v0.1.1")
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return out.String(), errb.String(), code
}

// TestGarmProvider: garm's provider interface on a real cloud-init guest
// against a fake garm: CreateInstance returns at once and the guest
// reports installing ... idle with its token, registers through config.sh
// and runs the runner service; a wrong checksum reports failed; Get, List
// (by pool and controller), Stop/Start, Delete (twice), RemoveAll (another
// controller's instance stays); the instance token never on a host command
// line, in the domain XML, the provider's output or the state directory.
func TestGarmProvider(t *testing.T) {
	base := setup(t)
	requireCloudImage(t, base)
	ln := base.serviceListener(t)
	// garm's endpoint, and one on a port of the network's address that
	// the guard keeps closed (doctor must say so)
	closed := "http://" + net.JoinHostPort(base.gateway(t), "19999")
	r := base.withConfig(t, func(s string) string {
		return s + fmt.Sprintf("\n[garm]\nimages = [\"cloud\"]\nendpoints = [%q, %q]\n[garm.flavors.small]\nvcpus = 1\nmemory_mib = 768\n",
			"http://"+ln.Addr().String(), closed)
	})
	g := &fakeGarm{base: "http://" + ln.Addr().String(), statuses: map[string][]string{}, messages: map[string][]string{},
		agent: map[string]any{}, info: map[string]map[string]any{}, ran: map[string]int{}}
	g.tarball = runnerTarball(t, g.base+"/ran", g.base+"/configured")
	sum := sha256.Sum256(g.tarball)
	good, bad := "garm-token-good-"+fmt.Sprint(time.Now().UnixNano()), "garm-token-bad-"+fmt.Sprint(time.Now().UnixNano())
	jitTok := "garm-token-jit-" + fmt.Sprint(time.Now().UnixNano())
	srv := &http.Server{Handler: g.handler(map[string]string{good: "", bad: "", jitTok: ""}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })

	// doctor: garm's endpoint answers and the guard lets the guests reach
	// it; the closed one is a failure naming the guard's ports.
	// (As root: the guard's configuration is in the rig's private run
	// directory; doctor only reads the state directory.)
	doc := exec.Command(filepath.Join(r.bin, "libvirt-executor"), "--config", r.cfgPath, "doctor")
	doc.Env = append(os.Environ(), "LIBVIRT_EXECUTOR_GUARD_CONF="+filepath.Join(filepath.Dir(base.rigConfigPath()), "run", "hooks", "libvirt-executor-guard.conf"))
	docOut, _ := doc.CombinedOutput()
	require.Contains(t, string(docOut), "[ok  ] garm endpoint http://"+ln.Addr().String()+": answers; the guard lets the guests reach port", string(docOut))
	require.Contains(t, string(docOut), "[FAIL] garm endpoint "+closed+": the guard keeps the guests of network", string(docOut))

	const (
		ctrlA = "11111111-2222-3333-4444-555555555555"
		ctrlB = "99999999-2222-3333-4444-555555555555"
		poolA = "aaaaaaaa-0000-0000-0000-000000000001"
		poolB = "bbbbbbbb-0000-0000-0000-000000000002"
		poolC = "cccccccc-0000-0000-0000-000000000003"
	)
	bootJIT := func(name, token, checksum string, jit bool) string {
		b, _ := json.Marshal(map[string]any{
			"name": name, "os_type": "linux", "arch": "amd64", "image": "cloud", "flavor": "small",
			"callback-url": g.base + "/api/v1/callbacks", "metadata-url": g.base + "/api/v1/metadata",
			"instance-token": token, "repo_url": "https://github.com/example/repo", "labels": []string{"lve", "e2e"},
			"tools": []map[string]any{{"os": "linux", "architecture": "x64", "download_url": g.base + "/runner.tar.gz",
				"filename": "runner.tar.gz", "sha256_checksum": checksum}},
			"extra_specs": map[string]any{}, "jit_config_enabled": jit,
		})
		return string(b)
	}
	boot := func(name, token, checksum string) string { return bootJIT(name, token, checksum, false) }
	cfg := r.cfgPath
	var provOut strings.Builder
	call := func(ctrl, pool, command, instance, stdin string) (string, int) {
		out, errs, code := garmCall(t, r.bin, cfg, ctrl, pool, command, instance, stdin)
		provOut.WriteString(out + errs)
		return out, code
	}
	t.Cleanup(func() {
		call(ctrlA, "", "RemoveAllInstances", "", "")
		call(ctrlB, "", "RemoveAllInstances", "", "")
	})

	t0 := time.Now()
	out, code := call(ctrlA, poolA, "CreateInstance", "", boot("garm-Good1", good, hex.EncodeToString(sum[:])))
	require.Equal(t, 0, code, out)
	require.Less(t, time.Since(t0), 60*time.Second, "CreateInstance does not wait for the boot")
	var inst struct {
		ProviderID string `json:"provider_id"`
		Name       string `json:"name"`
		Status     string `json:"status"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &inst))
	require.Equal(t, "garm-Good1", inst.Name)
	out, code = call(ctrlB, poolB, "CreateInstance", "", boot("garm-Bad1", bad, strings.Repeat("0", 64)))
	require.Equal(t, 0, code, out)
	var badInst struct {
		ProviderID string `json:"provider_id"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &badInst))
	// a JIT runner (credentials from garm's metadata, garm's unit) of a
	// third pool of controller A
	out, code = call(ctrlA, poolC, "CreateInstance", "", bootJIT("garm-Jit1", jitTok, hex.EncodeToString(sum[:]), true))
	require.Equal(t, 0, code, out)
	var jitInst struct {
		ProviderID string `json:"provider_id"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &jitInst))

	// The token: not on any command line, not in the domain XML, not in
	// the state directory.
	tokens := []string{good, bad, jitTok}
	checkNoToken := func(where string) {
		t.Helper()
		cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		for _, c := range cmdlines {
			b, _ := os.ReadFile(c)
			for _, tok := range tokens {
				require.NotContains(t, string(b), tok, "token on the command line of %s (%s)", c, where)
			}
		}
		for _, name := range []string{inst.ProviderID, badInst.ProviderID, jitInst.ProviderID} {
			d, err := r.conn.LookupDomainByName(name)
			if err != nil {
				continue
			}
			x, err := d.GetXMLDesc(libvirt.DOMAIN_XML_SECURE)
			_ = d.Free()
			require.NoError(t, err)
			for _, tok := range tokens {
				require.NotContains(t, x, tok, "token in the domain XML (%s)", where)
			}
		}
		_ = filepath.Walk(r.cfg.StateDir, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.Mode().IsRegular() && fi.Size() < 8<<20 {
				b, _ := os.ReadFile(p)
				for _, tok := range tokens {
					require.NotContains(t, string(b), tok, "token in %s (%s)", p, where)
				}
			}
			return nil
		})
	}
	checkNoToken("after create")
	// the seed volume (the one place on the host with the token) is
	// readable by its owner only
	_, dir, err := poolPath(r)
	require.NoError(t, err)
	require.NotEmpty(t, dir)
	fi, err := os.Stat(filepath.Join(dir, inst.ProviderID+"-seed.img"))
	require.NoError(t, err)
	require.Zero(t, fi.Mode().Perm()&0o077, "seed volume mode %v", fi.Mode())
	t.Cleanup(func() {
		if t.Failed() {
			for i, name := range []string{inst.ProviderID, badInst.ProviderID, jitInst.ProviderID} {
				b, _ := os.ReadFile(filepath.Join(r.cfg.StateDir, "machines", name, "console.log"))
				t.Logf("console of %s (last 4 KiB):\n%s", name, b[max(0, len(b)-4096):])
				t.Logf("guest journal of %s:\n%s", name, guestDebug(t, r, []string{ctrlA, ctrlB, ctrlA}[i], []string{poolA, poolB, poolC}[i], name))
			}
			g.mu.Lock()
			t.Logf("statuses %v messages %v bad auth %v", g.statuses, g.messages, g.badAuth)
			g.mu.Unlock()
		}
	})

	// The guest bootstraps: installing ... idle with agent 4242; the fake
	// runner service runs.
	waitFor(t, 6*time.Minute, "the good instance reports idle", func() bool {
		s := g.seq(good)
		return len(s) > 0 && (s[len(s)-1] == "idle" || s[len(s)-1] == "failed")
	})
	seq := g.seq(good)
	require.Equal(t, "installing", seq[0])
	require.Equal(t, "idle", seq[len(seq)-1], "statuses %v, messages %v", seq, g.messages[good])
	g.mu.Lock()
	require.EqualValues(t, 4242, g.agent[good])
	require.Equal(t, "Debian GNU/Linux", g.info[good]["os_name"])
	g.mu.Unlock()
	waitFor(t, 60*time.Second, "the fake runner service runs", func() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.ran["ran"] > 0 })
	// registered as an ephemeral runner of the repository, with garm's
	// name, labels and registration token
	g.mu.Lock()
	require.Equal(t, []string{"--unattended", "--url", "https://github.com/example/repo", "--token", "fake-registration-token",
		"--name", "garm-Good1", "--labels", "lve,e2e", "--no-default-labels", "--ephemeral"}, g.config)
	g.mu.Unlock()
	waitFor(t, 3*time.Minute, "the bad instance reports failed", func() bool {
		s := g.seq(bad)
		return len(s) > 0 && s[len(s)-1] == "failed"
	})
	// the JIT runner: garm's credentials and unit, no config.sh; its
	// service runs (garm's unit passes "jit")
	waitFor(t, 3*time.Minute, "the JIT instance reports idle", func() bool {
		s := g.seq(jitTok)
		return len(s) > 0 && (s[len(s)-1] == "idle" || s[len(s)-1] == "failed")
	})
	waitFor(t, 60*time.Second, "the JIT runner service runs", func() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.ran["ran-jit"] > 0 })
	g.mu.Lock()
	require.Equal(t, "idle", g.statuses[jitTok][len(g.statuses[jitTok])-1], "JIT statuses %v, messages %v", g.statuses[jitTok], g.messages[jitTok])
	require.EqualValues(t, 5151, g.agent[jitTok], "the agent id of garm's .runner")
	require.Contains(t, strings.Join(g.messages[bad], "\n"), "sha256")
	require.Empty(t, g.badAuth, "every call carried its instance's token")
	g.mu.Unlock()
	checkNoToken("after the bootstrap")

	// The token's lifetime in the guest ends with the bootstrap: each
	// bootstrap (idle or failed) scrubs cloud-init's copies and says so on
	// the console; garm's next Get/List then wipes, detaches and deletes
	// the seed. Afterwards nothing the runner user can read, with its
	// sudo, holds a token, as it is or inside base64: cloud-init's state,
	// run-time data and logs, the parameters' directory, the journal, a
	// cidata device (there is none, mounted or not); nor the host's
	// console log of the machine (checkNoToken walks the state directory).
	type guest struct{ ctrl, pool, name string }
	guests := []guest{{ctrlA, poolA, inst.ProviderID}, {ctrlB, poolB, badInst.ProviderID}, {ctrlA, poolC, jitInst.ProviderID}}
	waitFor(t, 2*time.Minute, "garm's Get drops the seeds", func() bool {
		left := 0
		for _, gu := range guests {
			out, code := call(gu.ctrl, gu.pool, "GetInstance", gu.name, "")
			require.Equal(t, 0, code, out)
			if r.volumeExists(gu.name + "-seed.img") {
				left++
			}
		}
		return left == 0
	})
	var patterns []string
	for _, tok := range tokens {
		patterns = append(patterns, tokenForms(tok)...)
	}
	for _, gu := range guests {
		d, err := r.conn.LookupDomainByName(gu.name)
		require.NoError(t, err)
		for _, flags := range []libvirt.DomainXMLFlags{0, libvirt.DOMAIN_XML_INACTIVE} {
			x, err := d.GetXMLDesc(flags)
			require.NoError(t, err)
			require.NotContains(t, x, `-seed.img"`, "no seed disk in the domain (XML flags %d)", flags)
		}
		_ = d.Free()
		// The patterns travel on stdin into a file, never on a command
		// line (sudo would log it in the journal).
		script := "umask 022; cat > /tmp/lve-patterns; sudo -u runner -H sudo sh -c '" +
			"grep -rlaF -f /tmp/lve-patterns /var/lib/cloud /run/cloud-init /etc/libvirt-executor-garm /var/log/cloud-init.log /var/log/cloud-init-output.log 2>/dev/null | sed s/^/FOUND:/; " +
			"echo JOURNAL:$(journalctl -b --no-pager -o cat | grep -caF -f /tmp/lve-patterns); " +
			"echo LABELS:$(ls /dev/disk/by-label 2>/dev/null); echo CIDATA:$(blkid -t LABEL=cidata -o device); " +
			"echo SEEDMOUNT:$(grep -ci cidata /proc/self/mounts); echo RUNNER:$(id -un)'; rm -f /tmp/lve-patterns"
		var out string
		waitFor(t, time.Minute, "the seed device leaves "+gu.name, func() bool {
			out, err = guestSSH(t, r, gu.ctrl, gu.pool, gu.name, script, strings.Join(patterns, "\n")+"\n")
			return err == nil && strings.Contains(out, "CIDATA:\n") && !strings.Contains(strings.ToLower(out), "labels:cidata") &&
				!strings.Contains(strings.ToLower(out), " cidata")
		})
		require.Contains(t, out, "RUNNER:root\n", "the check ran with the runner's sudo: %s", out)
		require.NotContains(t, out, "FOUND:", "a file of the guest still holds a token: %s", out)
		require.Contains(t, out, "JOURNAL:0\n", "the guest's journal holds a token: %s", out)
		require.Contains(t, out, "SEEDMOUNT:0\n", out)
		for _, tok := range tokens {
			require.NotContains(t, out, tok)
		}
	}
	checkNoToken("after the seeds were dropped")

	// Get (with its address) and List by pool and controller.
	out, code = call(ctrlA, poolA, "GetInstance", inst.ProviderID, "")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, `"status":"running"`)
	require.Contains(t, out, `"addresses":[{"address":"`)
	list := func(ctrl, pool string) []string {
		out, code := call(ctrl, pool, "ListInstances", "", "")
		require.Equal(t, 0, code, out)
		var l []struct {
			ProviderID string `json:"provider_id"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &l))
		var ids []string
		for _, i := range l {
			ids = append(ids, i.ProviderID)
		}
		return ids
	}
	require.Equal(t, []string{inst.ProviderID}, list(ctrlA, poolA))
	require.Equal(t, []string{jitInst.ProviderID}, list(ctrlA, poolC))
	require.Empty(t, list(ctrlA, poolB))
	require.Equal(t, []string{badInst.ProviderID}, list(ctrlB, poolB))

	// Stop and start.
	_, code = call(ctrlA, poolA, "StopInstance", inst.ProviderID, "")
	require.Equal(t, 0, code)
	out, _ = call(ctrlA, poolA, "GetInstance", inst.ProviderID, "")
	require.Contains(t, out, `"status":"stopped"`)
	_, code = call(ctrlA, poolA, "StartInstance", inst.ProviderID, "")
	require.Equal(t, 0, code)
	out, _ = call(ctrlA, poolA, "GetInstance", "garm-Good1", "")
	require.Contains(t, out, `"status":"running"`)

	// Delete twice; RemoveAll of controller A leaves B's instance.
	for range 2 {
		out, code = call(ctrlA, poolA, "DeleteInstance", inst.ProviderID, "")
		require.Equal(t, 0, code, out)
	}
	exists, _ := r.domainState(inst.ProviderID)
	require.False(t, exists)
	require.False(t, r.volumeExists(inst.ProviderID+"-seed.img"), "the seed volume (with the token) is gone with the VM")
	_, code = call(ctrlA, "", "RemoveAllInstances", "", "")
	require.Equal(t, 0, code)
	exists, _ = r.domainState(jitInst.ProviderID)
	require.False(t, exists, "RemoveAll removed controller A's other pool's instance")
	exists, _ = r.domainState(badInst.ProviderID)
	require.True(t, exists, "another controller's instance is untouched")
	_, code = call(ctrlB, "", "RemoveAllInstances", "", "")
	require.Equal(t, 0, code)
	exists, _ = r.domainState(badInst.ProviderID)
	require.False(t, exists)
	for _, tok := range tokens {
		require.NotContains(t, provOut.String(), tok, "the provider never printed a token")
	}
}

// guestDebug is what a failed bootstrap left in the guest's journal and
// cloud-init's log, read over SSH with the machine's own key and pinned
// host key (a diagnostic for a failed test).
func guestDebug(t *testing.T, r *rig, ctrl, pool, name string) string {
	out, err := guestSSH(t, r, ctrl, pool, name,
		"sudo journalctl -b --no-pager -u lve-garm-bootstrap | tail -60; sudo systemctl status --no-pager lve-garm-bootstrap.service; sudo tail -40 /var/log/cloud-init.log; ls -l /usr/local/sbin /etc/libvirt-executor-garm", "")
	return fmt.Sprintf("%s (ssh: %v)", out, err)
}

// tokenForms are a token and the base64 of its bytes from each offset
// that may fall on a base64 group boundary: what a file holding the token
// inside base64 text (cloud-init's copies of write_files' b64 content)
// contains.
func tokenForms(tok string) []string {
	out := []string{tok}
	for k := range 3 {
		n := (len(tok) - k) / 3 * 3
		out = append(out, base64.StdEncoding.EncodeToString([]byte(tok[k:k+n])))
	}
	return out
}

// guestSSH runs script in a garm instance's guest as the image's user,
// over SSH with the machine's own key and pinned host key, stdin on its
// standard input.
func guestSSH(t *testing.T, r *rig, ctrl, pool, name, script, stdin string) (string, error) {
	dir := filepath.Join(r.cfg.StateDir, "machines", name)
	b, err := os.ReadFile(filepath.Join(dir, "machine.json"))
	if err != nil {
		return "", fmt.Errorf("no machine record: %w", err)
	}
	var m struct {
		HostKey string `json:"host_key"`
		User    string `json:"user"`
	}
	_ = json.Unmarshal(b, &m)
	out, _, _ := garmCall(t, r.bin, r.cfgPath, ctrl, pool, "GetInstance", name, "")
	var inst struct {
		Addresses []struct{ Address string } `json:"addresses"`
	}
	_ = json.Unmarshal([]byte(out), &inst)
	if len(inst.Addresses) == 0 {
		return "", fmt.Errorf("no address: %s", out)
	}
	addr := inst.Addresses[0].Address
	kh := filepath.Join(t.TempDir(), "known_hosts")
	_ = os.WriteFile(kh, []byte(addr+" "+strings.TrimSpace(m.HostKey)+"\n"), 0o600)
	cmd := exec.Command("ssh", "-i", filepath.Join(dir, "id_ed25519"), "-o", "UserKnownHostsFile="+kh, "-o", "BatchMode=yes",
		"-o", "ConnectTimeout=10", m.User+"@"+addr, script)
	cmd.Stdin = strings.NewReader(stdin)
	o, err := cmd.CombinedOutput()
	return string(o), err
}

// TestGarmTokenGoneBeforeJobs: garm's token is gone from the guest before
// the runner can take a job, without garm calling the provider again.
// garm answers 503 for 5 s from the bootstrap's first call (the bootstrap
// waits it out, retrying: asserted), and the test
// makes no provider call after CreateInstance: the first thing the runner
// service does is a job that, as the runner user with its sudo, reads
// every file and every block device of the guest (the seed disk included)
// for the token, plain or base64, and finds it nowhere. The seed volume is
// still attached (the host did nothing) and holds only zeros. Before this
// change the job found the token on the seed device (and the service
// started before the bootstrap's scrub).
func TestGarmTokenGoneBeforeJobs(t *testing.T) {
	base := setup(t)
	requireCloudImage(t, base)
	ln := base.serviceListener(t)
	r := base.withConfig(t, func(s string) string {
		return s + fmt.Sprintf("\n[garm]\nimages = [\"cloud\"]\nendpoints = [%q]\n[garm.flavors.small]\nvcpus = 1\nmemory_mib = 768\n", "http://"+ln.Addr().String())
	})
	g := &fakeGarm{base: "http://" + ln.Addr().String(), statuses: map[string][]string{}, messages: map[string][]string{},
		agent: map[string]any{}, info: map[string]map[string]any{}, ran: map[string]int{}}
	g.tarball = jobTarball(t, g.base+"/ran", g.base+"/configured", tokenJob)
	sum := sha256.Sum256(g.tarball)
	tok := "garm-token-job-" + fmt.Sprint(time.Now().UnixNano())
	g.patterns = strings.Join(tokenForms(tok), "\n") + "\n"
	// Down from the bootstrap's first call, not from CreateInstance: the
	// wait is the bootstrap's retries (1, 2, then 4 s apart: its calls at
	// 0, 1 and 3 s meet the 503), not the guest's boot.
	g.downFor = 5 * time.Second
	srv := &http.Server{Handler: g.handler(map[string]string{tok: ""}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	const (
		ctrl = "77777777-2222-3333-4444-555555555555"
		pool = "dddddddd-0000-0000-0000-000000000004"
	)
	t.Cleanup(func() { _, _, _ = garmCall(t, r.bin, r.cfgPath, ctrl, "", "RemoveAllInstances", "", "") })
	b, _ := json.Marshal(map[string]any{
		"name": "garm-Job1", "os_type": "linux", "arch": "amd64", "image": "cloud", "flavor": "small",
		"callback-url": g.base + "/api/v1/callbacks", "metadata-url": g.base + "/api/v1/metadata",
		"instance-token": tok, "repo_url": "https://github.com/example/repo", "labels": []string{"lve"},
		"tools": []map[string]any{{"os": "linux", "architecture": "x64", "download_url": g.base + "/runner.tar.gz",
			"filename": "runner.tar.gz", "sha256_checksum": hex.EncodeToString(sum[:])}},
		"extra_specs": map[string]any{},
	})
	out, errs, code := garmCall(t, r.bin, r.cfgPath, ctrl, pool, "CreateInstance", "", string(b))
	require.Equal(t, 0, code, out+errs)
	var inst struct {
		ProviderID string `json:"provider_id"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &inst))
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(r.cfg.StateDir, "machines", inst.ProviderID, "console.log"))
			t.Logf("console (last 6 KiB):\n%s", b[max(0, len(b)-6144):])
			g.mu.Lock()
			t.Logf("statuses %v messages %v bad auth %v job %q", g.statuses, g.messages, g.badAuth, g.job)
			g.mu.Unlock()
		}
	})

	// No provider call from here until the job has reported.
	waitFor(t, 10*time.Minute, "the runner's first job reports", func() bool { g.mu.Lock(); defer g.mu.Unlock(); return len(g.job) > 0 })
	g.mu.Lock()
	job, seq := g.job[0], slices.Clone(g.statuses[tok])
	g.mu.Unlock()
	t.Logf("job: %s", job)
	g.mu.Lock()
	unavailable := g.unavailable
	g.mu.Unlock()
	require.GreaterOrEqual(t, unavailable, 2, "the bootstrap met a garm that answered 503 and waited it out")
	require.NotContains(t, job, "FOUND", "the runner's job found garm's token")
	require.Contains(t, job, "UID 0\n", "the job searched with the runner's sudo")
	require.Contains(t, job, "SUDO_USER runner")
	require.Regexp(t, `DEVICES ([2-9]|[1-9][0-9]+)\n`, job, "the root disk and the seed disk were read")
	require.NotEmpty(t, seq)
	require.Equal(t, "idle", seq[len(seq)-1], "statuses %v", seq)
	// the host did nothing: the seed volume is still there, zeros only
	_, dir, err := poolPath(r)
	require.NoError(t, err)
	seed, err := os.ReadFile(filepath.Join(dir, inst.ProviderID+"-seed.img"))
	require.NoError(t, err, "the seed volume is still attached (no provider call took it)")
	require.NotEmpty(t, seed)
	require.Equal(t, len(seed), bytes.Count(seed, []byte{0}), "the guest wiped the seed volume")
}

// TestGarmCreateRetiresIdleStandby: garm's provider opens the engine with
// the hooks GitLab's stages use, so on a host full of idle standby VMs
// (capacity.max_vms = 1, one idle standby of the pool service) a
// CreateInstance retires the idle standby and makes its instance instead
// of failing with "no room"; the pool service holds its refill while the
// host is full.
func TestGarmCreateRetiresIdleStandby(t *testing.T) {
	base := setup(t)
	requireCloudImage(t, base)
	ln := base.serviceListener(t)
	endpoint := "http://" + ln.Addr().String()
	r := base.withPool(t, 1).withConfig(t, func(s string) string {
		return s + fmt.Sprintf("\n[capacity]\nmax_vms = 1\n[garm]\nimages = [\"cloud\"]\nendpoints = [%q]\n[garm.flavors.small]\nvcpus = 1\nmemory_mib = 768\n", endpoint)
	})
	r.serve(t)
	idle := r.waitIdle(t, 1, 3*time.Minute)

	const (
		ctrl = "55555555-2222-3333-4444-555555555555"
		pool = "eeeeeeee-0000-0000-0000-000000000005"
	)
	t.Cleanup(func() { _, _, _ = garmCall(t, r.bin, r.cfgPath, ctrl, "", "RemoveAllInstances", "", "") })
	b, _ := json.Marshal(map[string]any{
		"name": "garm-Room1", "os_type": "linux", "arch": "amd64", "image": "cloud", "flavor": "small",
		"callback-url": endpoint + "/api/v1/callbacks", "metadata-url": endpoint + "/api/v1/metadata",
		"instance-token": "garm-token-room-" + fmt.Sprint(time.Now().UnixNano()), "repo_url": "https://github.com/example/repo",
		"labels": []string{"lve"},
		"tools": []map[string]any{{"os": "linux", "architecture": "x64", "download_url": endpoint + "/runner.tar.gz",
			"filename": "runner.tar.gz", "sha256_checksum": strings.Repeat("ab", 32)}},
		"extra_specs": map[string]any{},
	})
	out, errs, code := garmCall(t, r.bin, r.cfgPath, ctrl, pool, "CreateInstance", "", string(b))
	require.Equal(t, 0, code, "a full host of idle standbys makes room for garm's instance: %s%s", out, errs)
	var inst struct {
		ProviderID string `json:"provider_id"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &inst))
	exists, _ := r.domainState(idle[0])
	require.False(t, exists, "the idle standby VM %s was retired for the instance", idle[0])
	exists, _ = r.domainState(inst.ProviderID)
	require.True(t, exists, "garm's instance runs")
	idleNow, other := r.standbys(t)
	require.Empty(t, idleNow, "no standby took the room back")
	require.Empty(t, other, "no standby boots on the full host")

	out, errs, code = garmCall(t, r.bin, r.cfgPath, ctrl, pool, "DeleteInstance", inst.ProviderID, "")
	require.Equal(t, 0, code, out+errs)
	// The room is the pool's again once the instance is gone.
	r.waitIdle(t, 1, 3*time.Minute)
}

// requireCloudImage skips the test on a rig without the cloud-init image
// garm's bootstrap needs, and fails it where LVE_E2E_IMAGES says there is one.
func requireCloudImage(t *testing.T, r *rig) {
	t.Helper()
	if _, ok := r.cfg.Images["cloud"]; !ok {
		if strings.Contains(os.Getenv("LVE_E2E_IMAGES"), "cloud") {
			t.Fatal("LVE_E2E_IMAGES names cloud but the rig has no cloud image")
		}
		t.Skip("the rig has no cloud-init image (LVE_RIG_IMAGES=cloud)")
	}
}
