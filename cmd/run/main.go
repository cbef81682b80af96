// Command libvirt-executor-run is GitLab Runner's run_exec: it runs one stage
// script in the job's VM over SSH.
package main

import (
	"context"
	"os"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stagecli"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stepsvc"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == jobvm.HolderCommand {
		// Started by prepare as the job's connection holder.
		os.Exit(stagecli.Hold(os.Args[2:], os.Stdin, os.Stderr))
	}
	stagecli.Main(stagecli.Exe{
		Name:      "libvirt-executor-run",
		Usage:     "run a stage script in the job's VM",
		ArgsUsage: "<script-path> <stage-name>",
		NArgs:     2,
		Stage: func(ctx context.Context, env gitlab.Env, cfg *config.Config, args []string) error {
			return gitlab.Run(ctx, env, cfg, args[0], args[1])
		},
		ExplainViaAdminTool: true,
		Steps:               runSteps,
	})
}

// runSteps runs a GitLab Steps job's steps natively (gitlab.steps =
// "native"): the Step Runner's gRPC client is linked here only.
func runSteps(ctx context.Context, j gitlab.StepsJob) error {
	return stepsvc.RunJob(ctx, stepsvc.Job{
		PayloadPath: j.PayloadPath, Environ: j.Environ, Stream: j.Stream,
		Stdout: j.Stdout, Stderr: j.Stderr, Log: j.Log, Span: j.Span,
	})
}
