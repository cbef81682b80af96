package gitlab

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// The run stage end to end, without libvirt or a VM: the job's machine is
// recorded as prepare records it (state directory, client key, address,
// port, user, shell and pinned host key), its guest is an in-process SSH
// server holding that job's keys (sshtest), and the hypervisor that run asks
// when the guest stops answering is a fake whose domain runs.

// runJob is one job whose machine prepare has made.
type runJob struct {
	cfg    *config.Config
	guest  *sshtest.Server
	hv     *vmtest.Fake
	name   string
	e      Env
	stdout *sshtest.Buffer
	stderr *sshtest.Buffer
	// exitFile is the job's BUILD_EXIT_CODE_FILE (not created).
	exitFile string
	// dir is the job's working directory (the "guest" is this host).
	dir string
}

func preparedJob(t *testing.T) *runJob {
	t.Helper()
	// The keepalive is generous (10 s without a reply): these tests are not
	// about it, and the host may be loaded.
	cfg, err := config.Parse([]byte(`
state_dir = "` + t.TempDir() + `"
storage_pool = "jobs"
default_image = "tiny"
[ssh]
keepalive_interval = "1s"
keepalive_count = 10
[images.tiny]
base = "/img/tiny.qcow2"
builds_dir = "/builds"
`))
	require.NoError(t, err)
	img, ok := cfg.Image("tiny")
	require.True(t, ok)

	// The job's keys, made by prepare; the guest serves with them.
	keys, err := guestinit.NewKeys("job-1000")
	require.NoError(t, err)
	hostKey, err := ssh.ParsePrivateKey(keys.HostPEM)
	require.NoError(t, err)
	guest := sshtest.Start(t)
	guest.SetHostKey(hostKey)
	guest.SetAuthorizedKey(keys.Client.PublicKey())

	dir := t.TempDir()
	j := &runJob{cfg: cfg, guest: guest, hv: vmtest.New(), stdout: &sshtest.Buffer{}, stderr: &sshtest.Buffer{},
		exitFile: filepath.Join(dir, "build-exit-code"), dir: dir}
	logs := &sshtest.Buffer{}
	j.e = Env{
		Getenv: envOf(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json", "BUILD_EXIT_CODE_FILE": j.exitFile}),
		Stdout: j.stdout, Stderr: j.stderr, Log: slog.New(slog.NewTextHandler(logs, nil)),
		Connect: fake(j.hv),
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("stdout:\n%s\nstderr:\n%s\nlog:\n%s", j.stdout, j.stderr, logs)
		}
	})

	// What prepare leaves: a running domain of ours and the machine's record.
	loaded, err := j.e.load(cfg)
	require.NoError(t, err)
	defer loaded.jobs.Close()
	j.name = loaded.name
	owner, err := vm.MarshalOwner(vm.Owner{Controller: loaded.jobs.Controller(), Job: "1000", Deadline: time.Now().Add(time.Hour)})
	require.NoError(t, err)
	j.hv.Domains[j.name] = &vmtest.Domain{OwnerXML: owner, Active: true}
	store := state.Store{Dir: cfg.StateDir}
	_, err = store.Create(j.name)
	require.NoError(t, err)
	require.NoError(t, store.SaveKey(j.name, keys.ClientPEM))
	require.NoError(t, store.Save(state.Machine{
		Name: j.name, Image: img.Name, Address: guest.Host(), Port: guest.Port(), User: img.User, Shell: img.Shell,
		HostKey: keys.HostPublicLine(), MAC: "52:54:00:00:00:01", Created: time.Now(),
		BuildsDir: img.BuildsDir, CacheDir: img.CacheDir,
	}))
	return j
}

// bashQuote quotes s as a bash ANSI-C string, as the runner's scripts do.
func bashQuote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `'`, `\'`, "\n", `\n`, "\x1b", `\x1b`)
	return "$'" + r.Replace(s) + "'"
}

// runnerScript is a stage script in the shape GitLab Runner 16.11 hands to
// run_exec (internal/testkit/harness/testdata/gitlab-runner-16.11-trace): the job's
// commands, each echoed first, run by an eval under errexit.
func runnerScript(dir string, cmds ...string) string {
	var body strings.Builder
	body.WriteString("export CI_JOB_ID=1000\nexport CI_PROJECT_DIR=" + bashQuote(dir) + "\n")
	body.WriteString("$'cd' " + bashQuote(dir) + "\n")
	for _, c := range cmds {
		body.WriteString("echo " + bashQuote("\x1b[32;1m$ "+c+"\x1b[0;m") + "\n" + c + "\n")
	}
	return "#!/usr/bin/env bash\n\ntrap exit 1 TERM\n\n" +
		"if set -o | grep pipefail > /dev/null; then set -o pipefail; fi; set -o errexit\n" +
		"set +o noclobber\n" +
		": | eval " + bashQuote(body.String()) + "\n" +
		"exit 0\n"
}

// run runs the build_script stage with the job's commands and returns how
// long it took and its result.
func (j *runJob) run(t *testing.T, cmds ...string) (time.Duration, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "script.")
	require.NoError(t, os.WriteFile(path, []byte(runnerScript(j.dir, cmds...)), 0o700))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	err := Run(ctx, j.e, j.cfg, path, "build_script")
	return time.Since(start), err
}

func (j *runJob) requireExitFile(t *testing.T, code int) {
	t.Helper()
	b, err := os.ReadFile(j.exitFile)
	require.NoError(t, err, "BUILD_EXIT_CODE_FILE written")
	require.Equal(t, fmt.Sprintf("%d", code), strings.TrimSpace(string(b)))
}

// The script's own non-zero exit is the job's failure: BUILD class, and its
// code goes to BUILD_EXIT_CODE_FILE for the runner to report.
func TestRunStageScriptFailureIsBuildFailure(t *testing.T) {
	j := preparedJob(t)
	_, err := j.run(t, "echo about to exit 3", "exit 3")
	require.Error(t, err)
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "%v", err)
	code, ok := exitcodes.ScriptCode(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, 3, code)
	j.requireExitFile(t, 3)
	require.Contains(t, j.stdout.String(), "$ exit 3")
	require.Contains(t, j.stdout.String(), "about to exit 3\n")
	require.Equal(t, 1, j.guest.Logins(), "one connection, with the recorded client key and pinned host key")
}

// A script that succeeds: no error, no BUILD_EXIT_CODE_FILE, and its output
// reaches Env.Stdout while it runs (the script goes on only once the test
// has seen its first line there).
func TestRunStageSuccessStreamsOutput(t *testing.T) {
	j := preparedJob(t)
	goAhead := filepath.Join(j.dir, "go-ahead")
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			if strings.Contains(j.stdout.String(), "first line\n") {
				_ = os.WriteFile(goAhead, nil, 0o600)
				return
			}
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	_, err := j.run(t,
		"echo first line",
		"for i in $(seq 1 600); do [ -e go-ahead ] && break; sleep 0.05; done",
		`[ -e go-ahead ] || { echo "the first line never reached the stage's output while the script ran"; exit 9; }`,
		"echo second line >&2",
	)
	require.NoError(t, err)
	out := j.stdout.String()
	require.Contains(t, out, "first line\n")
	require.Contains(t, out, "second line\n", "stderr is merged into the job log")
	require.Less(t, strings.Index(out, "first line\n"), strings.Index(out, "second line\n"))
	require.NoFileExists(t, j.exitFile, "nothing to report for a success")
}

// The connection drops while the script runs: a system failure (the runner
// may retry; the job is not blamed), and no BUILD_EXIT_CODE_FILE. Run asks
// the (fake) hypervisor what became of the VM, and says so when it knows.
func TestRunStageConnectionLostIsSystemFailure(t *testing.T) {
	j := preparedJob(t)
	j.guest.DropOn("DROP-NOW")
	cmds := []string{"echo before", "sleep 0.2", "echo DROP-NOW", "sleep 10", "exit 3"}

	took, err := j.run(t, cmds...)
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "connection to guest lost")
	require.NotContains(t, err.Error(), "VM "+j.name, "the domain runs: nothing to explain")
	require.Less(t, took, 20*time.Second, "noticed at once, not at the keepalive's verdict")
	require.NoFileExists(t, j.exitFile, "a lost connection is never the script's exit code")
	require.Contains(t, j.stdout.String(), "before\n")
	require.NotContains(t, j.stdout.String(), "DROP-NOW\n")
	j.hv.Lock()
	require.Contains(t, j.hv.Calls, "State", "run asked the hypervisor (the fake, not libvirt)")
	j.hv.Domains[j.name].State = &vm.DomainState{Code: vm.StateShutOff, Summary: "shut off (crashed)"}
	j.hv.Unlock()

	_, err = j.run(t, cmds...)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "connection to guest lost")
	require.ErrorContains(t, err, "VM "+j.name+" is shut off (crashed)")
	require.NoFileExists(t, j.exitFile)
}

// A stage that leaves a process running in the background ends with its
// script, with the script's code: not after the background process, and
// that process is stopped.
func TestRunStageBackgroundProcessDoesNotHoldIt(t *testing.T) {
	for _, code := range []int{0, 4} {
		t.Run(fmt.Sprintf("exit %d", code), func(t *testing.T) {
			j := preparedJob(t)
			pidfile := filepath.Join(j.dir, "bg.pid")
			took, err := j.run(t, "sleep 300 &", "echo $! > "+pidfile, "echo started", fmt.Sprintf("exit %d", code))
			require.Less(t, took, 15*time.Second, "the stage ends within seconds of its script")
			require.Contains(t, j.stdout.String(), "started\n")
			if code == 0 {
				require.NoError(t, err)
				require.NoFileExists(t, j.exitFile)
			} else {
				require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "%v", err)
				got, ok := exitcodes.ScriptCode(err)
				require.True(t, ok, "%v", err)
				require.Equal(t, code, got)
				j.requireExitFile(t, code)
			}
			require.Contains(t, j.stderr.String(), "stopping the processes it left running")
			b, err := os.ReadFile(pidfile)
			require.NoError(t, err)
			pid := strings.TrimSpace(string(b))
			require.Eventually(t, func() bool {
				st, err := os.ReadFile("/proc/" + pid + "/stat")
				return err != nil || strings.Fields(string(st))[2] == "Z"
			}, 10*time.Second, 20*time.Millisecond, "the background sleep %s is stopped", pid)
		})
	}
}
