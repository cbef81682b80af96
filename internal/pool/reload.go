package pool

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// Reload asks the running service (Run) to read its configuration again
// (Service.Load) and run on with it: pools grow, shrink, appear and go as
// the new file says, and the idle machines of images whose settings did
// not change stay. A file that cannot be loaded, or that changes what
// only a restart can (restartOnly), is refused: the service keeps the
// configuration it has, says so in its log, and Reload returns why. It
// waits until Run has done it, or until ctx ends.
func (s *Service) Reload(ctx context.Context) error {
	if s.Load == nil {
		return errors.New("this service cannot reload its configuration (no Load)")
	}
	res := make(chan error, 1)
	select {
	case s.reloads() <- res:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// reloads is the channel of Reload's asks.
func (s *Service) reloads() chan chan error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.reloadReq == nil {
		s.reloadReq = make(chan chan error)
	}
	return s.reloadReq
}

// Hold keeps the configuration (M.Cfg) from being replaced by a reload
// until release is called: for readers outside Run's goroutine, such as
// the metrics endpoint. Not to be nested.
func (s *Service) Hold() (release func()) {
	s.cfgMu.RLock()
	return s.cfgMu.RUnlock
}

func (s *Service) notify(state string) {
	if s.Notify != nil {
		s.Notify(state)
	}
}

// follow starts the follower of the images with a source, after wait;
// stop ends it and waits for its end.
func (s *Service) follow(ctx context.Context, changed chan<- string, wait time.Duration) (stop func()) {
	s.mu.Lock()
	f := s.images
	s.mu.Unlock()
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); f.run(fctx, changed, wait) }()
	return func() { cancel(); <-done }
}

// reload is Reload's work in Run's goroutine: load, check, then with the
// follower stopped (stopFollow) and the boots in progress undone and the
// work in the background ended, replace the configuration, and start the
// follower again (startFollow). Boots undone are started again by the next
// look where the new file still wants them.
func (s *Service) reload(why string, t *time.Ticker, stopFollow func(), startFollow func(wait time.Duration)) error {
	old := s.M.Manager().Cfg
	s.notify("RELOADING=1")
	defer s.notify("READY=1")
	cfg, err := s.Load()
	if err == nil {
		err = restartOnly(old, cfg)
	}
	if err != nil {
		s.Log.Error("configuration refused: kept the one in use", "config", old.Path, "why", why, "err", err)
		return fmt.Errorf("configuration refused: %w", err)
	}
	stopFollow()
	if n := s.cancelBoots(); n > 0 {
		s.Log.Info("reloading: undid standby boots in progress", "boots", n)
	}
	s.wg.Wait()
	s.cfgMu.Lock()
	s.M.Manager().Cfg = cfg
	s.mu.Lock()
	s.sem = make(chan struct{}, cfg.Serve.BootParallelism)
	s.images = newFollower(cfg, s)
	s.mu.Unlock()
	s.cfgMu.Unlock()
	t.Reset(cfg.Serve.Interval.D())
	s.Log.Info("configuration reloaded", "config", cfg.Path, "why", why)
	logPoolChanges(s, old, cfg)
	startFollow(0)
	return nil
}

// restartOnly refuses a new configuration that changes what the service
// cannot change while it runs: where its state, machines and metrics
// endpoint are.
func restartOnly(old, cfg *config.Config) error {
	var changed []string
	for _, k := range []struct {
		key      string
		old, new string
	}{
		{"libvirt_uri", old.LibvirtURI, cfg.LibvirtURI},
		{"state_dir", old.StateDir, cfg.StateDir},
		{"name_prefix", old.NamePrefix, cfg.NamePrefix},
		{"storage_pool", old.StoragePool, cfg.StoragePool},
		{"serve.metrics_listen", old.Serve.MetricsListen, cfg.Serve.MetricsListen},
	} {
		if k.old != k.new {
			changed = append(changed, fmt.Sprintf("%s (%q, now %q)", k.key, k.old, k.new))
		}
	}
	if len(changed) == 0 {
		return nil
	}
	return fmt.Errorf("a reload cannot change %v: restart the service (systemctl restart libvirt-executor) to use them", changed)
}

// logPoolChanges says which pools a reload added, changed and removed.
func logPoolChanges(s *Service, old, cfg *config.Config) {
	was := map[string]*config.Pool{}
	for _, img := range old.Pooled() {
		was[img.Name] = img.Pool
	}
	var names []string
	for _, img := range cfg.Pooled() {
		names = append(names, img.Name)
		p, ok := was[img.Name]
		switch {
		case !ok:
			s.Log.Info("new standby pool", "image", img.Name, "idle_count", img.Pool.IdleCount, "max_idle", img.Pool.MaxIdle)
		case !reflect.DeepEqual(*p, *img.Pool):
			s.Log.Info("standby pool changed", "image", img.Name, "idle_count", img.Pool.IdleCount, "max_idle", img.Pool.MaxIdle,
				"was_idle_count", p.IdleCount, "was_max_idle", p.MaxIdle)
		}
	}
	for name := range was {
		if !slices.Contains(names, name) {
			s.Log.Info("standby pool removed: its idle VMs are retired", "image", name)
		}
	}
}
