// Command libvirt-executor-cleanup is GitLab Runner's cleanup_exec: it removes
// the job's VM, disks, seed media, keys and state.
package main

import (
	"context"
	"os"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stagecli"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // this stage talks to libvirt
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == jobvm.ReaperCommand {
		// Started by a cleanup stage to finish removing ended machines.
		os.Exit(stagecli.Reap(os.Args[2:], os.Stdin, os.Stderr))
	}
	stagecli.Main(stagecli.Exe{
		Name:  "libvirt-executor-cleanup",
		Usage: "remove the job's VM and everything it used",
		Stage: func(ctx context.Context, env gitlab.Env, cfg *config.Config, _ []string) error {
			return gitlab.Cleanup(ctx, env, cfg)
		},
		RunsToCompletion: true,
	})
}
