// Command libvirt-executor-prepare is GitLab Runner's prepare_exec: it boots a
// fresh VM for the job and waits until SSH answers with the pinned host key.
package main

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stagecli"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // this stage talks to libvirt
)

func main() {
	stagecli.Main(stagecli.Exe{
		Name:  "libvirt-executor-prepare",
		Usage: "create and boot the job's VM",
		Stage: func(ctx context.Context, env gitlab.Env, cfg *config.Config, _ []string) error {
			return gitlab.Prepare(ctx, env, cfg)
		},
	})
}
