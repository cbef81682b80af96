package services

// Container jobs (#46 item 2): a job whose `image:` names a container image
// the administrator allows ([services.container_jobs]) runs in a VM of a
// configured image, as GitLab Runner's Docker executor runs it: the
// runner's own stages on the VM's OS, the job's scripts in one long-lived
// container of the job's image, on the job's network beside its services,
// with the builds and cache directories bind-mounted at the same paths.
// This file owns that plan: which VM image hosts the job, the container's
// podman argument vectors, and which stages run in it.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// ContainerHost is the VM image that hosts a job whose `image:` is name
// (after variable expansion) under c: the vm_images entry of the first
// allowed pattern name matches, else c.VMImage. ok is false when no
// pattern matches (or container jobs are off, or name is no image
// reference): then name is no container job's image.
func ContainerHost(c config.ContainerJobs, name string) (vmImage string, ok bool) {
	if len(c.AllowedImages) == 0 || name == "" {
		return "", false
	}
	ref, err := ParseRef(name)
	if err != nil {
		return "", false
	}
	allow, err := NewAllowlist(c.AllowedImages)
	if err != nil {
		return "", false
	}
	pat, ok := allow.Match(name, ref)
	if !ok {
		return "", false
	}
	if v := c.VMImages[pat]; v != "" {
		return v, true
	}
	return c.VMImage, true
}

// JobContainer is the plan of a container job's container.
type JobContainer struct {
	// Shown is how messages name the job's image: as expanded, or a
	// placeholder when that would show a secret's value (Hidden).
	Shown  string
	Ref    Ref
	Hidden bool
	// Name is the container's name (JobContainerName).
	Name string
	// Entrypoint is the job's `image: entrypoint:`, run with the waiting
	// process as its command (as the Docker executor runs it with the
	// shell); empty: the waiting process replaces the image's entrypoint.
	Entrypoint []string
	// Mounts are the VM's directories bind-mounted at the same paths (the
	// builds and cache directories).
	Mounts []string
	// PullPolicies are tried in order.
	PullPolicies []string
}

// JobContainerName is the name of job jobID's container in its VM.
func JobContainerName(jobID int64) string {
	return "lve-job-" + strconv.FormatInt(jobID, 10) + "-build"
}

// NewJobContainer plans the container of a container job from the
// payload's `image:` (name with the job's variables expanded, entrypoint,
// pull_policy): checked and bounded like a service's. mounts are the
// VM's builds and cache directories (the configuration's: absolute paths,
// without ',' which podman's --mount would split on). The image must be
// one the administrator allows (allow; the caller has chosen the hosting
// VM image by it). A job error is a build failure naming the image.
func NewJobContainer(p *Payload, jobID int64, mounts []string, allow *Allowlist, o Options) (*JobContainer, error) {
	x := expander{vars: p.Variables}
	name := x.expand(p.Image.Name)
	if x.tooLong {
		return nil, exitcodes.Userf("the job's image grows beyond %d bytes once variables are expanded", maxExpanded)
	}
	shown := "the job's image (its name holds a secret's value: not shown)"
	if !x.secret {
		shown = "the job's image " + strconv.Quote(cutText(name, 96))
	}
	ref, err := ParseRef(name)
	if err != nil {
		return nil, exitcodes.Userf("%s: %v", shown, err)
	}
	if _, ok := allow.Match(name, ref); !ok {
		return nil, exitcodes.Userf("%s is not among the container images this runner allows (services.container_jobs.allowed_images: %s)",
			shown, quoteList(allow.Patterns()))
	}
	c := &JobContainer{Shown: shown, Ref: ref, Hidden: x.secret, Name: JobContainerName(jobID)}
	ep := p.Image.Entrypoint
	if len(ep) > MaxArgs {
		return nil, exitcodes.Userf("%s: an entrypoint of %d arguments (at most %d)", shown, len(ep), MaxArgs)
	}
	size := 0
	for _, a := range ep {
		size += len(a) + 1
		if strings.IndexByte(a, 0) >= 0 {
			return nil, exitcodes.Userf("%s: an entrypoint argument holds a NUL byte", shown)
		}
	}
	if size > MaxArgBytes {
		return nil, exitcodes.Userf("%s: an entrypoint of %d bytes (at most %d)", shown, size, MaxArgBytes)
	}
	if len(ep) > 0 && (len(ep) != 1 || ep[0] != "") {
		c.Entrypoint = slices.Clone(ep)
	}
	for _, m := range mounts {
		if m == "" || m[0] != '/' || strings.ContainsAny(m, ",\n") {
			return nil, exitcodes.System(fmt.Errorf("services: the job container's mount %q is not an absolute path without ','", m))
		}
		if !slices.Contains(c.Mounts, m) {
			c.Mounts = append(c.Mounts, m)
		}
	}
	if c.PullPolicies, err = pullPolicies(shown, p.Image.PullPolicy, o); err != nil {
		return nil, err
	}
	return c, nil
}

// image is how messages name the job's image.
func (c JobContainer) image() string {
	if c.Hidden {
		return "(its name holds a secret's value: not shown)"
	}
	return c.Ref.String()
}

func (c JobContainer) guestText(t string) string {
	if c.Hidden {
		return "(podman's message not shown)"
	}
	return strconv.Quote(t)
}

// waitProcess is the job container's long-lived process: a shell that
// waits until it is stopped (the job's scripts run beside it, through
// podman exec). The image needs sh and sleep, as the job's scripts need a
// shell.
var waitProcess = []string{"sh", "-c", `trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done`}

// JobRunArgv starts the job's container detached on the job's network,
// with the mounts at the same paths, the waiting process as its
// entrypoint (or as the command of the job's own entrypoint). No variable
// is given: the runner's stage scripts export the job's variables
// themselves.
func JobRunArgv(network string, c JobContainer) []string {
	argv := []string{"podman", "run", "--detach", "--pull", "never", "--name", c.Name,
		"--label", Label, "--network", network}
	for _, m := range c.Mounts {
		argv = append(argv, "--mount", "type=bind,source="+m+",destination="+m)
	}
	ep, cmd := waitProcess, []string(nil)
	if len(c.Entrypoint) > 0 {
		ep, cmd = c.Entrypoint, waitProcess
	}
	b, _ := json.Marshal(ep) // a []string always marshals
	argv = append(argv, "--entrypoint="+string(b), c.Ref.String())
	return append(argv, cmd...)
}

// MkdirArgv makes the mounts' directories in the VM (a bind mount needs
// its source).
func MkdirArgv(dirs []string) []string {
	return append([]string{"mkdir", "-p", "--"}, dirs...)
}

// detectShell runs the script on stdin with bash where the image has it,
// else sh, as the Docker executor's shell detection does.
const detectShell = `if command -v bash >/dev/null 2>&1; then exec bash; fi; exec sh`

// ExecArgv runs one stage's script (on the command's stdin) in the job's
// container: a fixed argument vector, the script never on it.
func ExecArgv(container string) []string {
	return []string{"podman", "exec", "--interactive", container, "sh", "-c", detectShell}
}

// stopScripts ends every process of the container but its waiting process
// (PID 1) and itself: SIGTERM, then SIGKILL after 5 s.
const stopScripts = `kill -TERM -1 2>/dev/null; sleep 5; kill -KILL -1 2>/dev/null; exit 0`

// StopScriptsArgv stops a stage's script in the job's container (a stage
// cancelled or timed out: the podman exec that ran it ended with the
// connection, its processes in the container did not).
func StopScriptsArgv(container string) []string {
	return []string{"podman", "exec", container, "sh", "-c", stopScripts}
}

// InContainer says whether a stage of a container job runs in its
// container: the job's own scripts (build_script, step_script, any step_*
// stage, after_script). The runner's stages (prepare_script, get_sources,
// clear_worktree, restore_cache, download_artifacts, archive_cache*,
// upload_artifacts*, cleanup_file_variables) and any stage not known here
// run on the VM's OS, where the runner's helper is.
func InContainer(stage string) bool {
	switch {
	case stage == "build_script", stage == "step_script", stage == "after_script":
		return true
	case strings.HasPrefix(stage, "step_"):
		return true
	}
	return false
}

// RunStage runs one stage's script (the runner's, as it gave it) in a
// container job's container through g: ExecArgv with the script on its
// stdin, the container's output to stdout and stderr. A script that ends
// non-zero is a build failure carrying its status (exitcodes.ScriptError);
// a container that is not running (podman exec's 125, checked) and a lost
// connection are system failures. When ctx ends first, the script's
// processes in the container are stopped (StopScriptsArgv, on a context of
// its own, bounded) and the stage fails as a system failure.
func RunStage(ctx context.Context, g Guest, container string, sudo bool, script []byte, stdout, stderr io.Writer) error {
	d := &driver{g: g, o: Options{Sudo: sudo}, log: io.Discard}
	code, err := g.Exec(ctx, d.podman(ExecArgv(container)), nil, bytes.NewReader(script), stdout, stderr)
	if ctx.Err() != nil {
		sctx, cancel := detachctx.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		_, serr := g.Exec(sctx, d.podman(StopScriptsArgv(container)), nil, nil, nil, nil)
		why := fmt.Errorf("the script in the job's container %s stopped: %w", container, context.Cause(ctx))
		if serr != nil {
			why = fmt.Errorf("%w; stopping its processes in the container failed: %v", why, serr)
		}
		return exitcodes.System(why)
	}
	if err != nil {
		return exitcodes.System(fmt.Errorf("the job's container %s: %w", container, err))
	}
	if code == 125 {
		// podman's own failure, or the script's exit 125: ask whether the
		// container still runs.
		_, out, _, ierr := d.exec(ctx, d.podman(RunningArgv(container)), nil, nil)
		if ierr != nil || strings.TrimSpace(string(out)) != "true" {
			return exitcodes.System(fmt.Errorf("the job's container %s is not running (podman exec: exit status 125)", container))
		}
	}
	if code != 0 {
		return &exitcodes.ScriptError{Code: code}
	}
	return nil
}

// RunningArgv prints "true" while the container runs.
func RunningArgv(container string) []string {
	return []string{"podman", "container", "inspect", "--format", "{{.State.Running}}", container}
}
