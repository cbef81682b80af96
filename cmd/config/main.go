// Command libvirt-executor-config is GitLab Runner's config_exec: it prints the
// JSON that tells the runner where builds live in the job's VM.
package main

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stagecli"
)

func main() {
	stagecli.Main(stagecli.Exe{
		Name:  "libvirt-executor-config",
		Usage: "print the Custom executor configuration JSON",
		Stage: func(ctx context.Context, env gitlab.Env, cfg *config.Config, _ []string) error {
			return gitlab.Config(ctx, env, cfg)
		},
	})
}
