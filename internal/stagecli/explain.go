package stagecli

import (
	"bytes"
	"context"
	"fmt"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detach"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// explainWait bounds the admin tool's explanation, start-up included (the
// tool gives up on libvirt after 5 s: lifecycle.Manager.Explain).
const explainWait = 6 * time.Second

// maxExplanation caps what is read of the admin tool's output.
const maxExplanation = 4096

// adminTool asks the admin tool what became of a machine.
type adminTool struct {
	// exeDir is the running executable's directory ("" if unknown).
	exeDir string
	// lookPath finds an executable on PATH (exec.LookPath).
	lookPath func(file string) (string, error)
	// configPath is the configuration file the stage read.
	configPath string
	// environ is the child's environment.
	environ []string
	// timeout bounds the child (explainWait).
	timeout time.Duration
	log     *slog.Logger
}

// newAdminTool is the explainer of a stage that read configPath.
func newAdminTool(configPath string, log *slog.Logger) *adminTool {
	a := &adminTool{lookPath: exec.LookPath, configPath: configPath, environ: withoutJobVariables(os.Environ()),
		timeout: explainWait, log: log}
	if exe, err := os.Executable(); err == nil {
		a.exeDir = filepath.Dir(exe)
	}
	return a
}

// withoutJobVariables drops the job's variables (CUSTOM_ENV_*, which may
// hold its secrets) from environ: the admin tool reads only the runner
// host's environment.
func withoutJobVariables(environ []string) []string {
	out := make([]string, 0, len(environ))
	for _, kv := range environ {
		if !strings.HasPrefix(kv, "CUSTOM_ENV_") {
			out = append(out, kv)
		}
	}
	return out
}

// find returns the admin tool's path: next to the running executable, else
// on PATH.
func (a *adminTool) find() (string, error) {
	if a.exeDir != "" {
		p := filepath.Join(a.exeDir, jobvm.AdminExecutable)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return a.lookPath(jobvm.AdminExecutable)
}

// Explain implements gitlab.Env.Explain: the admin tool's one sentence, ""
// when it has nothing to say or fails (logged), or a note that the tool was
// not found.
func (a *adminTool) Explain(ctx context.Context, name string) string {
	if err := vm.CheckName(name); err != nil {
		a.log.Warn("no explanation of what became of the VM", "err", err)
		return ""
	}
	path, err := a.find()
	if err != nil {
		where := "on PATH"
		if a.exeDir != "" {
			where = "in " + a.exeDir + " or on PATH"
		}
		// The stage's error carries the note: no log line of its own.
		return fmt.Sprintf("what became of VM %s is not known: the admin tool %s, which asks libvirt, was not found %s", name, jobvm.AdminExecutable, where)
	}
	out, err := a.run(ctx, path, a.timeout, nil, maxExplanation, jobvm.ExplainCommand, "--", name)
	if err != nil {
		a.log.Warn("no explanation of what became of the VM: the admin tool failed", "tool", path, "err", err)
		return ""
	}
	why, _, _ := strings.Cut(strings.TrimSpace(out), "\n")
	return strings.TrimSpace(why)
}

// run runs the admin tool at path with the stage's configuration file and
// args, stdin (nil: none) on its stdin, for at most timeout, and returns
// the first limit bytes of its output (an error carries the start of what
// it wrote to stderr).
func (a *adminTool) run(ctx context.Context, path string, timeout time.Duration, stdin io.Reader, limit int, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, append([]string{"--config=" + a.configPath}, args...)...)
	cmd.Env = a.environ
	stdout, stderr := capped{limit: limit}, capped{limit: maxExplanation}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, &stdout, &stderr
	// Its own process group, all of which is killed when ctx ends: nothing
	// it started outlives the bound or holds its output open.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = time.Second
	t0 := time.Now()
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("stopped after %s: %w (%v)", vm.Round(time.Since(t0)), context.Cause(ctx), err)
		}
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return "", err
	}
	return stdout.String(), nil
}

// capped keeps the first limit bytes written to it and discards the rest.
type capped struct {
	buf   bytes.Buffer
	limit int
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.limit - c.buf.Len(); room > 0 {
		c.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (c *capped) String() string { return c.buf.String() }

// refreshImage implements gitlab.Env.Refresh: the admin tool's
// `image pull NAME`, detached (it outlives the stage), with the host's
// proxy settings and nothing of the job's environment; its errors go to
// state_dir/log/image-pull.log.
func (a *adminTool) refreshImage(stateDir string) func(image string) error {
	return func(image string) error {
		path, err := a.find()
		if err != nil {
			return err
		}
		var proxy []string
		for _, kv := range a.environ {
			name, _, _ := strings.Cut(kv, "=")
			switch strings.ToUpper(name) {
			case "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY":
				proxy = append(proxy, kv)
			}
		}
		logDir := filepath.Join(stateDir, "log")
		if err := os.MkdirAll(logDir, 0o700); err != nil {
			return err
		}
		_, err = detach.Start(detach.Spec{Exe: path, Args: []string{"--config", a.configPath, "image", "pull", "--", image},
			Log: filepath.Join(logDir, "image-pull.log"), EnvExtra: proxy})
		return err
	}
}
