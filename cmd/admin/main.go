// Command libvirt-executor is the administrator's tool: list the job VMs of
// this installation, sweep leftovers (also from a systemd timer), and check
// the host. Its commands are internal/admin's (App).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/admin"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	err := admin.App().RunContext(ctx, os.Args)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "libvirt-executor:", err)
		os.Exit(admin.ExitCode(err))
	}
}
