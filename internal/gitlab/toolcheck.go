package gitlab

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// outputter runs a fixed command in the guest (sshexec.Client).
type outputter interface {
	Output(ctx context.Context, cmd string) ([]byte, error)
}

// toolCheck is what the guest tool check found for one version of an image.
type toolCheck struct {
	// Format is toolCheckFormat when the entry was made: entries of an
	// older check (which did not look for the image's shell) are asked again.
	Format  int    `json:"format"`
	Base    string `json:"base"`
	Size    int64  `json:"size"`
	ModTime int64  `json:"mtime_ns"`
	User    string `json:"user"`
	Shell   string `json:"shell"`
	// Tools is the guest tools disk's volume the machine had ("" for
	// none): it decides whether gitlab-runner is there.
	Tools   string   `json:"tools"`
	Missing []string `json:"missing"`
}

// toolCheckKey names what the check found for img's machines with the
// tools disk tools: one entry per tools volume, so that configurations
// sharing a state directory with different [guest_tools] (another
// runner's, or make bench's wrapper round) do not evict each other's.
func toolCheckKey(img *config.Image, tools *jobvm.Tools) string {
	if tools == nil || tools.Volume == "" {
		return "tools-" + img.Name
	}
	return "tools-" + img.Name + "-" + tools.Volume
}

// toolCheckFormat is the version of what the check looks for.
const toolCheckFormat = 5

// missingShell stands in the check's answer for the image's configured
// shell (no tool has this name).
const missingShell = "@shell"

// imageVersion identifies the image file and the account the check runs as
// (its PATH decides what is found); nil if the file cannot be examined.
func imageVersion(img *config.Image) *toolCheck {
	st, err := os.Stat(img.Base)
	if err != nil {
		return nil
	}
	return &toolCheck{Format: toolCheckFormat, Base: img.Base, Size: st.Size(), ModTime: st.ModTime().UnixNano(), User: img.User, Shell: img.Shell}
}

func (a *toolCheck) sameVersion(b *toolCheck) bool {
	return a.Format == b.Format && a.Base == b.Base && a.Size == b.Size && a.ModTime == b.ModTime && a.User == b.User && a.Shell == b.Shell && a.Tools == b.Tools
}

// withTools is the version of a machine of the image with the guest tools
// disk tools (nil for none); nil stays nil.
func (a *toolCheck) withTools(tools *jobvm.Tools) *toolCheck {
	if a == nil {
		return nil
	}
	v := *a
	v.Tools = ""
	if tools != nil {
		v.Tools = tools.Volume
	}
	return &v
}

// toolCheckCommand lists, one a line, what the guest lacks: the tools
// GitLab's stages use, and missingShell when the image's configured shell
// (a name on PATH, or an absolute path) cannot be run. The shell comes from
// the administrator's configuration, never from the job, and is quoted all
// the same.
func toolCheckCommand(shell string) string {
	return `for t in bash git git-lfs gitlab-runner step-runner setsid mkfifo; do command -v "$t" >/dev/null 2>&1 || echo "$t"; done; ` +
		`s=` + jobvm.ShellQuote(shell) + `; case $s in /*) [ -f "$s" ] && [ -x "$s" ] ;; *) command -v "$s" >/dev/null 2>&1 ;; esac || echo ` + missingShell
}

// checkGuestTools tells the job log which of the tools GitLab's stages use are
// missing in the guest. A missing tool is only reported (a job may not need
// it). A missing shell of the image is an error (a system failure: the
// image or the configuration must change): every stage would exit 127, and
// that would pass for the script's own failure. The only other error is the
// stage being cancelled. The answer is remembered per version of the image
// (file, size, modification time, user, shell): every job of an unchanged
// image would get the same answer, and asking costs an SSH session. version
// is nil when the image cannot be identified: then the guest is always asked.
// A GitLab Steps job (steps) needs step-runner: without it the check fails
// (a system failure naming the fix), before any stage of the job runs.
func checkGuestTools(ctx context.Context, c outputter, say func(string, ...any), store jobvm.Memory, img *config.Image, version *toolCheck, tools *jobvm.Tools, steps bool) error {
	key := toolCheckKey(img, tools)
	if version != nil {
		var old toolCheck
		if store.Recall(key, &old) && old.sameVersion(version) {
			return checked(img, old.Missing, tools, steps, say)
		}
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := c.Output(cctx, toolCheckCommand(img.Shell))
	if err != nil {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		say("Could not check the guest's tools: %v", err)
		return nil
	}
	missing := strings.Fields(string(out))
	// A VM with the tools disk whose guest lacks a program of the disk:
	// the image may mount the disk late or not at all; not remembered, so
	// that one slow mount does not stand for every later job of the image.
	if version != nil && !unmounted(tools, missing) {
		found := *version
		found.Missing = missing
		_ = store.Remember(key, found) // a lost cache entry costs one more check
	}
	return checked(img, missing, tools, steps, say)
}

// checked tells the job log what the check found missing, and which
// step-runner a GitLab Steps job gets where the tools disk has none; an
// error where the job cannot run.
func checked(img *config.Image, missing []string, tools *jobvm.Tools, steps bool, say func(string, ...any)) error {
	reportMissingTools(missing, tools != nil && tools.Source != "", say)
	if steps && (tools == nil || tools.StepRunner == nil) && !slices.Contains(missing, "step-runner") {
		say("step-runner for this run: job: the image's own (the VM's guest tools disk has none: [guest_tools] step_runner)")
	}
	return cmp.Or(shellMissing(img, missing), stepRunnerMissing(img, missing, tools, steps))
}

// unmounted says the guest lacks a program its tools disk has.
func unmounted(tools *jobvm.Tools, missing []string) bool {
	return tools != nil && ((tools.Source != "" && slices.Contains(missing, "gitlab-runner")) ||
		(tools.StepRunner != nil && slices.Contains(missing, "step-runner")))
}

// knownStepRunnerMissing fails a GitLab Steps job before a VM is booted
// when the remembered tool check of this version of the image, with the
// tools disk a machine booted now gets (tools), found no step-runner: the
// runner retries a failed prepare twice, and each try would boot a VM only
// to find the same. Nil when the check is not remembered, or found one.
func knownStepRunnerMissing(store jobvm.Memory, img *config.Image, version *toolCheck, tools *jobvm.Tools) error {
	if version == nil {
		return nil
	}
	var old toolCheck
	if !store.Recall(toolCheckKey(img, tools), &old) || !old.sameVersion(version.withTools(tools)) {
		return nil
	}
	return stepRunnerMissing(img, old.Missing, tools, true)
}

// stepRunnerMissing is the error for a GitLab Steps job whose guest has no
// step-runner on PATH: its one stage would fail with "step-runner: command
// not found", which would pass for the steps' own failure.
func stepRunnerMissing(img *config.Image, missing []string, tools *jobvm.Tools, steps bool) error {
	if !steps || !slices.Contains(missing, "step-runner") {
		return nil
	}
	if tools != nil && tools.StepRunner != nil {
		return exitcodes.System(fmt.Errorf("this run: job (GitLab Steps) needs step-runner, and the VM's guest tools disk has it at %s, but image %q does not put it on PATH: "+
			"link /usr/local/bin/step-runner to it in the image (see docs/images.md, \"The guest tools disk\")", jobvm.GuestStepRunnerPath, img.Name))
	}
	return exitcodes.System(fmt.Errorf("this run: job (GitLab Steps) needs step-runner in the guest, and image %q has none on PATH: "+
		"set [guest_tools] step_runner in the driver configuration to a linux/amd64 step-runner binary (or \"auto\" with one on this host's PATH), "+
		"or install step-runner in the image (see docs/steps.md)", img.Name))
}

// shellMissing is the error for an image whose shell the check did not find.
func shellMissing(img *config.Image, missing []string) error {
	if slices.Contains(missing, "mkfifo") {
		return exitcodes.System(fmt.Errorf("image %q: mkfifo is not installed in the guest; the driver needs it (with cat, wc, mv and sleep: coreutils or busybox) to run every stage; install it in the image (see docs/images.md)", img.Name))
	}
	if !slices.Contains(missing, missingShell) {
		return nil
	}
	return exitcodes.System(fmt.Errorf("image %q: its shell %q is not installed in the guest (or not executable by %s), so every stage would fail with exit status 127; "+
		"install it in the image, or set images.%s.shell in the driver configuration to a shell the image has (\"bash\", \"sh\" or an absolute path)",
		img.Name, img.Shell, img.User, img.Name))
}

// reportMissingTools says what the guest lacks. hasToolsDisk: the machine
// got a guest tools disk with gitlab-runner, so a missing gitlab-runner
// means the image does not mount it.
func reportMissingTools(missing []string, hasToolsDisk bool, say func(string, ...any)) {
	for _, t := range missing {
		switch t {
		case "git":
			say("Warning: git is not installed in the guest: get_sources will fail unless GIT_STRATEGY is none")
		case "git-lfs":
			say("Note: git-lfs is not installed in the guest (needed only for LFS repositories)")
		case "gitlab-runner":
			if hasToolsDisk {
				say("Warning: gitlab-runner is not on the guest's PATH although the VM has the guest tools disk: the image does not mount it (serial %s at %s, see docs/images.md); caches and artifacts will not work", jobvm.ToolsDiskSerial, jobvm.ToolsMountPoint)
			} else {
				say("Note: gitlab-runner is not on the guest's PATH: caches and artifacts will not work (see docs/images.md)")
			}
		case "setsid":
			say("Warning: setsid is not installed in the guest (util-linux or busybox): processes a stage leaves running in the background are not stopped when it ends")
		case "bash":
			say("Warning: bash is not installed in the guest: GitLab's job scripts need it")
		}
	}
}
