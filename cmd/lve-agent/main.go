// lve-agent is the job-long agent in the guest (internal/agent): started
// once per job in one SSH session of the job's connection, it runs the
// job's stages, one fork each. Its protocol is on stdin and stdout; it
// takes no arguments, but for `cache-save` (agent.CacheSave: the host
// cache's save on a scratch disk, started by the host in a session of
// its own). Built static (CGO_ENABLED=0): it runs on any guest.
package main

import (
	"fmt"
	"os"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/agent"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
)

func main() {
	if len(os.Args) > 1 {
		if os.Args[1] == "--version" {
			fmt.Println("lve-agent version " + buildinfo.String())
			return
		}
		if os.Args[1] == "cache-save" {
			os.Exit(agent.CacheSave(os.Args[2:], os.Stdin, os.Stdout, os.Stderr))
		}
		fmt.Fprintln(os.Stderr, "lve-agent takes no arguments: the host starts it and speaks to it on stdin and stdout (--version prints its version; cache-save [--armed] DEVICE DIR writes the host cache's save on its scratch disk)")
		os.Exit(2)
	}
	if err := agent.Serve(os.Stdin, os.Stdout, buildinfo.Version); err != nil {
		fmt.Fprintln(os.Stderr, "lve-agent:", err)
		os.Exit(1)
	}
}
