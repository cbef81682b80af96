// Command libvirt-executor-prepare is GitLab Runner's prepare_exec: it boots a
// fresh VM for the job and waits until SSH answers with the pinned host key.
package main

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
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
		// A signal after the machine was ready: it goes again at once.
		Undo: func(ctx context.Context, env gitlab.Env, cfg *config.Config, _ []string) error {
			return gitlab.UndoPrepare(ctx, env, cfg)
		},
		Pull: pull,
	})
}

// pull pulls an image with a source on its first use (only this stage
// links the registry client).
func pull(ctx context.Context, cfg *config.Config, src ociimage.Source) (jobvm.PullReport, error) {
	res, err := transfer.Pull(ctx, cfg.Registry.Store(), transfer.RemoteOf(cfg.Registry, "libvirt-executor/"+buildinfo.Version), src)
	if err != nil {
		return jobvm.PullReport{}, err
	}
	return jobvm.PullReport{Digest: res.Record.Digest.String(), Received: res.Fetched, Stored: res.Image.Bytes}, nil
}
