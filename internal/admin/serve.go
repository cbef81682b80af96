package admin

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/garm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/pool"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sdnotify"
)

// Serve is libvirt-executor serve: the standby pools (internal/pool) and,
// once the service holds its lock, the metrics endpoint
// (serve.metrics_listen), until ctx ends. connect opens libvirt (nil: the
// linked-in default). SIGHUP reloads the configuration file (pool.Service.
// Reload); systemd hears READY once the first look at the pools is done
// and STOPPING when it stops (Type=notify, internal/sdnotify).
func Serve(ctx context.Context, cfg *config.Config, log *slog.Logger, connect lifecycle.Connector) error {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP) // before anything: SIGHUP's default ends the process
	defer signal.Stop(hup)
	if !cfg.LocalLibvirt() {
		// Standby VMs are GitLab's, whose stages run on their VMs' host.
		return fmt.Errorf("libvirt_uri %q is another host's libvirt: the service (standby pools, metrics) runs on the host of its VMs; run it there with libvirt_uri = \"qemu:///system\"", cfg.LibvirtURI)
	}
	var m *jobvm.Host
	m, err := jobvm.Open(cfg, lifecycle.Options{
		Connect: connect, Log: log,
		OnReconnect: func(error) { m.Manager().Record(log, obs.Event{Kind: obs.KindReconnect}) },
	})
	if err != nil {
		return err
	}
	defer m.Close()
	if err := m.Dial(ctx); err != nil {
		return err
	}
	svc := &pool.Service{M: m, Log: log, Notify: func(state string) {
		if _, err := sdnotify.Notify(state); err != nil {
			log.Warn("cannot tell systemd the service's state", "state", state, "err", err)
		}
	}}
	if cfg.Path != "" {
		svc.Load = func() (*config.Config, error) { return config.Load(cfg.Path) }
	}
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				if svc.Load == nil {
					log.Warn("SIGHUP: no configuration file to reload")
					continue
				}
				log.Info("SIGHUP: reloading the configuration", "config", cfg.Path)
				_ = svc.Reload(ctx) // refused: logged by the service
			}
		}
	}()
	svc.Started = func(context.Context) (func(), error) {
		if cfg.Serve.MetricsListen == config.MetricsOff {
			log.Info("no metrics endpoint (serve.metrics_listen = \"off\")")
			return func() {}, nil
		}
		col := NewCollector(m, svc, log)
		h, err := metrics.Handler(col)
		if err != nil {
			return nil, err
		}
		stop, err := metrics.Serve(ctx, cfg.Serve.MetricsListen, h, log)
		if err != nil {
			return nil, err
		}
		lctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); col.Run(lctx, liveEvery) }()
		return func() { stop(); cancel(); <-done }, nil
	}
	return svc.Run(ctx)
}

// liveEvery is how often the service looks at the live gauges (VMs in
// libvirt, pools, capacity); a scrape serves the latest look.
const liveEvery = 2 * time.Second

// NewCollector is the metrics collector of this installation: the event
// spool's folder and the live gauges of libvirt, the pools and capacity.
// Its looks hold svc's configuration (pool.Service.Hold) against a reload.
func NewCollector(m *jobvm.Host, svc *pool.Service, log *slog.Logger) *metrics.Collector {
	c := &metrics.Collector{
		Folder: &metrics.Folder{Spool: m.Manager().Events(), Images: m.Manager().Cfg.ImageNames(), Log: log},
		Live: metrics.Live{
			VMs: func(ctx context.Context) (map[[2]string]int, error) {
				defer svc.Hold()()
				return m.Manager().CountMachines(ctx, jobvm.OwnerKind)
			},
			Orphans: func(ctx context.Context) (int, error) {
				defer svc.Hold()()
				now := time.Now()
				items, err := m.Manager().Inventory(ctx, now)
				n := 0
				for _, it := range items {
					if garm.Orphan(m.Manager().Cfg.StateDir, it.Owner, now, m.Manager().Cfg.Garm.OrphanAfter.D()) != "" {
						n++
					}
				}
				return n, err
			},
			Pools: svc.Gauges,
			Capacity: func() (int, int, int, int, error) {
				defer svc.Hold()()
				vms, mem, err := m.Manager().Capacity().Used()
				return vms, mem, m.Manager().Cfg.Capacity.MaxVMs, m.Manager().Cfg.Capacity.MemoryBudgetMiB, err
			},
		},
	}
	for _, img := range m.Manager().Cfg.Images {
		if img != nil && img.Source != "" {
			c.Live.Images = svc.ImageGauges
			break
		}
	}
	if m.Manager().Cfg.Cache.Dir != "" {
		c.Live.Cache = cacheGauge(hostcache.ForConfig(m.Manager().Cfg.Cache), cacheGaugeEvery, time.Now)
	}
	return c
}

// cacheGaugeEvery is how often the host cache's size is measured: a walk of
// every project's tree, too much for each look at the live gauges.
const cacheGaugeEvery = 30 * time.Second

// cacheGauge measures the store at most once per every, and answers with
// the last measure in between.
func cacheGauge(s *hostcache.Store, every time.Duration, now func() time.Time) func() (metrics.CacheGauge, error) {
	var (
		mu   sync.Mutex
		at   time.Time
		last metrics.CacheGauge
		err  error
	)
	return func() (metrics.CacheGauge, error) {
		mu.Lock()
		defer mu.Unlock()
		if !at.IsZero() && now().Sub(at) < every {
			return last, err
		}
		at = now()
		var list []hostcache.Usage
		list, err = s.ListExisting()
		last = metrics.CacheGauge{Projects: len(list), Limit: s.TotalLimit}
		for _, u := range list {
			last.Bytes += u.Bytes
		}
		return last, err
	}
}
