package gitlab

import (
	"fmt"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// keepProject is the job's project for debug.keep_max_per_project: its
// GitLab instance and project id (from the runner's payload, which the
// job cannot set).
func keepProject(j *Job) string {
	return fmt.Sprintf("%s#%d", j.ServerURL, j.ProjectID)
}

// keepPlan is what keeping a failed job's VM takes: whether it is kept
// (Why says why not), and the project's own kept VMs to remove first so
// that it holds no more than debug.keep_max_per_project.
type keepPlan struct {
	Keep    bool
	Release []jobvm.KeptMachine
	Why     string
}

// planKeep decides about keeping machine self of project, given the
// machines kept now (oldest first; those past their deadline are the
// sweep's and count for nothing). A project at its cap gives up its
// oldest kept VM for the new one (the newest failure is the one to look
// at); a host at its cap keeps no more, and never removes another
// project's VM for it.
func planKeep(kept []jobvm.KeptMachine, self, project string, now time.Time, d config.Debug) keepPlan {
	var mine []jobvm.KeptMachine
	live := 0
	for _, k := range kept {
		if k.Name == self || !k.Until.After(now) {
			continue
		}
		live++
		if k.Project == project {
			mine = append(mine, k)
		}
	}
	var p keepPlan
	if n := len(mine) - (d.KeepMaxPerProject - 1); n > 0 {
		p.Release = mine[:n]
	}
	if live-len(p.Release) >= d.KeepMax {
		return keepPlan{Why: fmt.Sprintf("the host already keeps %d VM(s) of failed jobs, its most (debug.keep_max = %d)", live, d.KeepMax)}
	}
	p.Keep = true
	if len(p.Release) > 0 {
		names := make([]string, len(p.Release))
		for i, k := range p.Release {
			names[i] = k.Name
		}
		p.Why = fmt.Sprintf("this project's oldest kept VM (%s) is removed for it: a project keeps at most %d (debug.keep_max_per_project)",
			strings.Join(names, ", "), d.KeepMaxPerProject)
	}
	return p
}

// sayKeepPlan tells the job log, when the job's script failed, what the
// caps will do at cleanup (which decides again, under the keep lock): it
// reports true when the VM will not be kept (nothing more to say about
// reaching it), and says which of the project's kept VMs goes for it.
func sayKeepPlan(e Env, j *job, cfg *config.Config, name string) bool {
	kept, err := j.vm.KeptVMs()
	if err != nil {
		return false
	}
	p := planKeep(kept, name, keepProject(j.job), time.Now(), cfg.Debug)
	if !p.Keep {
		fmt.Fprintf(e.Stderr, "libvirt-executor: %s is set, but VM %s will not be kept if the job fails: %s.\n", VarKeep, name, p.Why)
		return true
	}
	if p.Why != "" {
		fmt.Fprintf(e.Stderr, "libvirt-executor: if the job fails and VM %s is kept, %s.\n", name, p.Why)
	}
	return false
}
