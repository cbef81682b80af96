// Command lve-panels draws the panels of a Grafana dashboard into one
// self-contained SVG file, with the data of a Prometheus (see
// internal/testkit/panels, where all of it is):
//
//	lve-panels -prometheus http://127.0.0.1:9090 -dashboard deploy/grafana/libvirt-executor.json \
//	  -from -30m [-to now] [-step 15s] -out docs/observability-dashboard.svg
//
// It exits 2 on a usage error, and 1, naming the panel and the
// expression, when Prometheus cannot be reached or a query fails.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/panels"
)

func main() {
	o, err := panels.ParseFlags(os.Args[1:], time.Now())
	if err != nil {
		fmt.Fprintln(os.Stderr, "lve-panels:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := panels.Run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "lve-panels:", err)
		os.Exit(1)
	}
}
