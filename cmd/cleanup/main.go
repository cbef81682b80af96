// Command libvirt-executor-cleanup is GitLab Runner's cleanup_exec: it removes
// the job's VM, disks, seed media, keys and state.
package main

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stagecli"
)

func main() {
	stagecli.Main("libvirt-executor-cleanup", "remove the job's VM and everything it used", "", 0,
		func(ctx context.Context, env gitlab.Env, cfg *config.Config, _ []string) error {
			return gitlab.Cleanup(ctx, env, cfg)
		}, stagecli.RunsToCompletion())
}
