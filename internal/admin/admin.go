// Package admin implements the administrator's command (libvirt-executor):
// its command tree (cli.go: App, flags, the config and log flags, exit
// statuses; cmd/admin is a thin main over it) and what the commands do:
// list what exists, sweep leftovers, check the host, the image and cache
// commands, the metrics server.
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/garm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm"
)

// List prints every machine of this installation with its job, age, state,
// address and what a sweep would do with it.
func List(ctx context.Context, w io.Writer, m *jobvm.Host, now time.Time) error {
	items, err := m.Manager().Inventory(ctx, now)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tJOB\tPOOL\tAGE\tSTATE\tADDRESS\tVERDICT")
	for _, it := range items {
		job, age, st, pool := "-", "-", "no domain", "-"
		if it.Owner != nil {
			job = it.Owner.Frontend + ":" + it.Owner.Job
			age = now.Sub(it.Owner.Created).Round(time.Second).String()
		}
		if p := it.Pool(); p != "" {
			pool = p
			if r := it.Standby.Record; r != nil && r.Standby != nil {
				pool += " (" + r.Standby.Image + ")"
			}
		} else if m.Manager().Machine(it.Name).IsSnapshotTemplate() {
			pool = "snapshot"
		}
		if it.Domain {
			st = "shut off"
			if it.Active {
				st = "running"
			}
		}
		addr := it.Address
		if addr == "" {
			addr = "-"
		}
		reason := it.Reason
		if o := garm.Orphan(m.Manager().Cfg.StateDir, it.Owner, now, m.Manager().Cfg.Garm.OrphanAfter.D()); o != "" {
			reason += "; ORPHAN: " + o
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s (%s)\n", it.Name, job, pool, age, st, addr, it.Verdict, reason)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(items) == 0 {
		fmt.Fprintf(w, "no machines of controller %s\n", m.Manager().Controller)
	}
	return nil
}

// ListItem is one machine of `list --json`.
type ListItem struct {
	// Host is this host's name (os.Hostname): lists gathered from a
	// fleet tell the hosts apart.
	Host string `json:"host"`
	Name string `json:"name"`
	// Frontend and Job: the owner's front end and job id ("" without
	// ownership metadata).
	Frontend string `json:"frontend"`
	Job      string `json:"job"`
	// Pool is the standby state (idle, booting, claimed, retiring) and
	// PoolImage its image, for standby machines.
	Pool      string     `json:"pool,omitempty"`
	PoolImage string     `json:"pool_image,omitempty"`
	Created   *time.Time `json:"created,omitempty"`
	Deadline  *time.Time `json:"deadline,omitempty"`
	AgeSec    float64    `json:"age_seconds,omitempty"`
	// State is running, shutoff or "no domain" (volumes or state only).
	State   string   `json:"state"`
	Address string   `json:"address,omitempty"`
	Volumes []string `json:"volumes"`
	Verdict string   `json:"verdict"`
	Reason  string   `json:"reason"`
	// Orphan says why a garm instance is an orphan (its pool not named by
	// garm for garm.orphan_after); absent otherwise.
	Orphan string `json:"orphan,omitempty"`
}

// ListJSON prints what List prints as one JSON array, for scripts.
func ListJSON(ctx context.Context, w io.Writer, m *jobvm.Host, now time.Time) error {
	items, err := m.Manager().Inventory(ctx, now)
	if err != nil {
		return err
	}
	out := make([]ListItem, 0, len(items))
	host, _ := os.Hostname()
	for _, it := range items {
		li := ListItem{Host: host, Name: it.Name, State: "no domain", Address: it.Address, Volumes: it.Volumes, Verdict: it.Verdict, Reason: it.Reason, Pool: it.Pool()}
		if li.Volumes == nil {
			li.Volumes = []string{}
		}
		if it.Owner != nil {
			li.Frontend, li.Job = it.Owner.Frontend, it.Owner.Job
			created, deadline := it.Owner.Created, it.Owner.Deadline
			li.Created, li.Deadline = &created, &deadline
			li.AgeSec = now.Sub(created).Seconds()
			li.Orphan = garm.Orphan(m.Manager().Cfg.StateDir, it.Owner, now, m.Manager().Cfg.Garm.OrphanAfter.D())
		}
		if r := it.Standby; r != nil && r.Record != nil && r.Record.Standby != nil {
			li.PoolImage = r.Record.Standby.Image
		}
		if it.Domain {
			li.State = "shutoff"
			if it.Active {
				li.State = "running"
			}
		}
		out = append(out, li)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

// GC sweeps (or with dryRun, shows what a sweep would remove).
func GC(ctx context.Context, w io.Writer, m *jobvm.Host, dryRun bool) error {
	rep, err := m.Manager().Sweep(ctx, time.Now(), dryRun)
	if !dryRun {
		m.Manager().RecordSweep(nil, lifecycle.SweepByGC, rep)
	}
	if rep != nil {
		for _, it := range rep.Items {
			switch {
			case it.Removable() && dryRun:
				fmt.Fprintf(w, "would remove %s (%s: %s)\n", it.Name, it.Verdict, it.Reason)
			case it.Removable():
				// reported below
			default:
				fmt.Fprintf(w, "keep %s (%s: %s)\n", it.Name, it.Verdict, it.Reason)
			}
		}
		for _, n := range rep.Removed {
			fmt.Fprintf(w, "removed %s\n", n)
		}
		for _, v := range rep.SharedVolumes {
			if dryRun {
				fmt.Fprintf(w, "would remove guest tools volume %s (an earlier gitlab-runner's; no machine uses it)\n", v)
			} else {
				fmt.Fprintf(w, "removed guest tools volume %s (an earlier gitlab-runner's; no machine used it)\n", v)
			}
		}
		for _, b := range rep.Bindings {
			if dryRun {
				fmt.Fprintf(w, "would remove stale network filter binding %s (its machine does not run)\n", b)
			} else {
				fmt.Fprintf(w, "removed stale network filter binding %s (its machine did not run)\n", b)
			}
		}
		if len(rep.Items) == 0 {
			fmt.Fprintf(w, "nothing of controller %s found\n", m.Manager().Controller)
		}
	}
	return err
}

// ExplainMachine prints in one sentence what became of the named machine of
// this installation whose guest stopped answering (gone, shut off, paused
// after a failed disk write: lifecycle.Manager.Explain, which gives up on
// libvirt after 5 s), or nothing when its domain runs normally or libvirt
// cannot tell. It is the admin tool's hidden explain-machine command, which
// the run stage (built without libvirt) asks. A name that is not of the
// engine's shape or not under this installation's prefix is refused.
func ExplainMachine(ctx context.Context, w io.Writer, m *jobvm.Host, name string) error {
	if err := vm.CheckName(name); err != nil {
		return err
	}
	if p := lifecycle.MachinePrefix(m.Manager().Cfg.NamePrefix, m.Manager().Controller); !strings.HasPrefix(name, p) {
		return fmt.Errorf("machine name %q refused: not a machine of this installation (its names start with %q)", name, p)
	}
	if why := m.Manager().Machine(name).Explain(ctx); why != "" {
		_, err := fmt.Fprintln(w, why)
		return err
	}
	return nil
}

// Check is one doctor finding.
type Check struct {
	Name string
	OK   bool
	Warn bool
	Info string
	Fix  string
}

// snapshotCheck says whether the jobs of img (snapshot = true) start from
// its memory snapshot now: made, and current (docs/pool.md).
func snapshotCheck(cfg *config.Config, img *config.Image, host string, now time.Time) Check {
	c := Check{Name: "snapshot of image " + img.Name,
		Fix: "the pool service (libvirt-executor serve) makes it; or libvirt-executor image snapshot " + img.Name + " (as the stages' user)"}
	rec, err := state.Store{Dir: cfg.StateDir}.SnapshotOf(img.Name)
	switch {
	case err != nil:
		c.Info = err.Error()
		return c
	case rec == nil || !rec.Ready():
		c.OK, c.Warn, c.Info = true, true, "none made yet: jobs with no idle standby VM boot cold"
		return c
	}
	age := now.Sub(rec.Saved).Round(time.Second)
	domainType := cfg.DomainType
	if domainType == config.DomainAuto {
		domainType = rec.DomainType // what the stages resolve it to: the probe's, not doctor's to run
	}
	if lifecycle.SnapshotFingerprint(lifecycle.SnapshotInputs(cfg, cfg.ResolveFiles(img), domainType, cfg.ImageSize(img), host)) != rec.Fingerprint {
		c.OK, c.Warn = true, true
		c.Info = fmt.Sprintf("stale (made %s ago; the image, its files, the configuration, libvirt, QEMU or the driver changed since): jobs with no idle standby VM boot cold", age)
		return c
	}
	if ok, err := (state.Store{Dir: cfg.StateDir}).Has(rec.Template); err != nil || !ok {
		c.Info = fmt.Sprintf("its template %s is gone: jobs with no idle standby VM boot cold", rec.Template)
		return c
	}
	if rec.Failures >= state.MaxSnapshotFailures {
		c.Info = fmt.Sprintf("its last %d restores failed: jobs with no idle standby VM boot cold", rec.Failures)
		return c
	}
	c.OK = true
	c.Info = fmt.Sprintf("template %s, made %s ago (%d vCPU, %d MiB, %s): jobs with no idle standby VM start from it", rec.Template, age, rec.VCPUs, rec.MemoryMiB, rec.DomainType)
	return c
}

// unusedSnapshotChecks warns of the memory snapshots of images this
// configuration does not snapshot (no longer configured, or snapshot =
// false): they hold disk until removed.
func unusedSnapshotChecks(cfg *config.Config) []Check {
	recs, _ := state.Store{Dir: cfg.StateDir}.Snapshots()
	var out []Check
	for _, r := range recs {
		if img, ok := cfg.Images[r.Image]; ok && img.Snapshot {
			continue
		}
		out = append(out, Check{Name: "snapshot of image " + r.Image, OK: true, Warn: true,
			Info: fmt.Sprintf("not used by this configuration (the image is not configured, or snapshot = false); its template %s holds %d MiB", r.Template, r.SaveBytes>>20),
			Fix:  "libvirt-executor image snapshot --remove " + r.Image + " (unless another configuration of this host uses it)"})
	}
	return out
}

// Doctor checks that the host can run jobs with this configuration; it
// gives up on libvirt when ctx ends.
func Doctor(ctx context.Context, cfg *config.Config, connect func(context.Context, string) (*libvirtvm.Conn, error)) []Check {
	var out []Check
	add := func(c Check) { out = append(out, c) }
	add(configFileCheck(cfg.Path))

	u, uerr := user.Current()
	root := uerr == nil && u.Uid == "0"
	local := cfg.LocalLibvirt()
	switch {
	case !local:
		// Another host's libvirt decides who may use it (its SSH user's
		// groups, or its TLS settings): nothing of this host's to check.
	case uerr != nil:
		add(Check{Name: "user", Info: uerr.Error(), Fix: "run doctor as the user the runner runs the stages as"})
	case root:
		add(Check{Name: "user root", OK: true, Warn: true,
			Info: "checked as root; the stages should run as an unprivileged user in the libvirt group",
			Fix:  "run this check as that user: runuser -u gitlab-runner -- libvirt-executor doctor (docs/install.md)"})
	default:
		inGroup := false
		if gids, err := u.GroupIds(); err == nil {
			if g, err := user.LookupGroup("libvirt"); err == nil {
				for _, id := range gids {
					inGroup = inGroup || id == g.Gid
				}
			}
		}
		add(Check{Name: "user " + u.Username, OK: inGroup, Info: "member of the libvirt group",
			Fix: "usermod -aG libvirt " + u.Username + " (then log in again / restart gitlab-runner)"})
	}

	l, err := connect(ctx, cfg.LibvirtURI)
	if uerr == nil && local {
		add(polkitCheck(polkitRuleDirs, err == nil, root))
		add(accessModeCheck(libvirtConfPaths, polkitRuleDirs))
	}
	if err != nil {
		add(Check{Name: "libvirt", Info: err.Error(),
			Fix: "start libvirtd (systemctl start libvirtd) and check libvirt_uri and the socket permissions"})
		add(stateDirCheck(cfg.StateDir))
		return out
	}
	defer l.Close()
	lv, hv, err := l.Version(ctx)
	add(Check{Name: "libvirt", OK: err == nil, Info: fmt.Sprintf("%s, libvirt %s, hypervisor %s", cfg.LibvirtURI, ver(lv), ver(hv)), Fix: "check libvirtd"})

	if !local {
		add(remoteHostCheck(cfg))
	}
	kvm, kerr := l.KVMAvailable(ctx)
	// /dev/kvm of this host says nothing of another's: there libvirt's
	// answer is all doctor has.
	devOK := !local || unix.Access("/dev/kvm", unix.R_OK|unix.W_OK) == nil
	switch {
	case cfg.DomainType == config.DomainQEMU:
		add(Check{Name: "domain type", OK: true, Warn: true, Info: "qemu (software emulation, much slower than kvm)",
			Fix: "use domain_type = \"auto\" or \"kvm\" on hosts with working KVM"})
	case kerr != nil:
		add(Check{Name: "domain type", Info: kerr.Error(), Fix: "check libvirtd"})
	case kvm && !local:
		add(kvmProbeCheck(ctx, cfg, l, "kvm available (that host's libvirt says so)"))
	case kvm && devOK:
		add(kvmProbeCheck(ctx, cfg, l, "kvm available (/dev/kvm usable)"))
	case cfg.DomainType == config.DomainKVM:
		add(Check{Name: "domain type", Info: "domain_type = \"kvm\" but KVM is not usable",
			Fix: "load kvm_intel/kvm_amd, enable virtualization in the firmware, chgrp kvm /dev/kvm && chmod 660 /dev/kvm; or use \"auto\""})
	default:
		add(Check{Name: "domain type", OK: true, Warn: true, Info: "auto: no usable KVM, jobs run under TCG software emulation",
			Fix: "enable KVM for normal speed"})
	}

	if active, path, err := l.PoolActive(ctx, cfg.StoragePool); err != nil {
		add(Check{Name: "storage pool " + cfg.StoragePool, Info: err.Error(),
			Fix: "virsh pool-define-as " + cfg.StoragePool + " dir --target /var/lib/libvirt/images/ci && virsh pool-start " + cfg.StoragePool + " && virsh pool-autostart " + cfg.StoragePool})
	} else {
		add(Check{Name: "storage pool " + cfg.StoragePool, OK: active, Info: path, Fix: "virsh pool-start " + cfg.StoragePool + " && virsh pool-autostart " + cfg.StoragePool})
	}
	needDHCP := false
	for _, n := range cfg.ImageNames() {
		img, _ := cfg.Image(n)
		needDHCP = needDHCP || img.AddressSource == "lease"
	}
	if active, dhcp, err := l.NetworkActive(ctx, cfg.Network); err != nil {
		add(Check{Name: "network " + cfg.Network, Info: err.Error(), Fix: "define the network (see docs/configuration.md) and virsh net-start " + cfg.Network})
	} else {
		add(Check{Name: "network " + cfg.Network, OK: active && (dhcp || !needDHCP),
			Info: fmt.Sprintf("active=%v dhcp=%v", active, dhcp),
			Fix:  "virsh net-start " + cfg.Network + "; images with address_source = \"lease\" need libvirt's DHCP on it"})
	}
	if cfg.StaticAddresses == nil || *cfg.StaticAddresses {
		if d, err := l.NetworkDHCP(ctx, cfg.Network); err == nil {
			add(dhcpRangeCheck(cfg.Network, d))
		}
	}

	for _, c := range servicesChecks(ctx, cfg.Services, &http.Client{Timeout: 5 * time.Second}) {
		add(c)
	}

	if cfg.L2Filter == nil || *cfg.L2Filter {
		add(nwfilterCheck(func(name string) (bool, error) { return l.NWFilterDefined(ctx, name) }))
		if local {
			add(bridgeNFCheck(bridgeNFPath))
		}
	}

	for _, n := range cfg.ImageNames() {
		img, _ := cfg.Image(n)
		if img.Source != "" && !img.Pulled() {
			probe := *img
			if err := cfg.ResolveSource(&probe); errors.Is(err, ociimage.ErrRefused) {
				add(Check{Name: "image " + n, OK: false, Info: err.Error(),
					Fix: "push a standalone image within limits.max_disk_gib (qemu-img convert -O qcow2 IMAGE NEW; libvirt-executor image push), then libvirt-executor image pull " + n})
				continue
			}
			add(Check{Name: "image " + n, OK: true, Warn: true, Info: img.Source + ": not pulled on this host yet (the first job pulls it)",
				Fix: "libvirt-executor image pull " + n + " (as the stages' user)"})
			continue
		}
		files := []string{img.Base}
		if img.Boot == config.BootKernel {
			files = append(files, img.Kernel)
			if img.Initrd != "" {
				files = append(files, img.Initrd)
			}
		}
		var problems, unseen []string
		missing := false
		for i, f := range files {
			if !local {
				// Another host's files: libvirt knows them as volumes of
				// its pools, or nobody here can tell. The base must be
				// one (the clone is made through the pool); a kernel or
				// initrd need only be a file there.
				if _, err := l.VolumeCapacity(ctx, f); err != nil {
					if i == 0 {
						problems = append(problems, err.Error())
					} else {
						unseen = append(unseen, f)
					}
				}
				continue
			}
			if fh, err := os.Open(f); err != nil {
				problems = append(problems, err.Error())
				missing = missing || errors.Is(err, fs.ErrNotExist)
			} else {
				fh.Close()
				if i == 0 {
					if err := cfg.CheckBase(img); err != nil {
						problems = append(problems, err.Error())
					}
				}
			}
		}
		fix := "make the files readable by this user and by libvirt (see docs/images.md)"
		if recipe := BuiltBy(img.Base); local && missing && recipe != "" {
			fix = "build it: libvirt-executor image build " + recipe + " (as root; docs/images.md), or pull it (source = \"oci://...\"; docs/fleet.md)"
		}
		if !local {
			fix = "put the image's files into a storage pool of that host (its libvirt must list them as volumes: virsh pool-refresh POOL there; docs/garm.md)"
		}
		c := Check{Name: "image " + n, OK: len(problems) == 0, Info: strings.Join(append([]string{img.Base}, problems...), "; "), Fix: fix}
		if c.OK && len(unseen) > 0 {
			c.Warn = true
			c.Info += "; not checked (no volume of that host's pools, so only a file there): " + strings.Join(unseen, ", ")
			c.Fix = "make sure they exist on that host, or put them into one of its pools so that doctor can see them"
		}
		add(c)
		if img.Snapshot {
			add(snapshotCheck(cfg, img, lifecycle.HostVersions(lv, hv), time.Now()))
		}
	}

	for _, c := range unusedSnapshotChecks(cfg) {
		add(c)
	}
	if len(cfg.Garm.Endpoints) > 0 {
		gw, _ := l.NetworkAddress(ctx, cfg.Network)
		for _, c := range garmEndpointChecks(ctx, cfg, gw, guardConfPath()) {
			add(c)
		}
	}
	add(stateDirCheck(cfg.StateDir))
	add(stateHostCheck(cfg))
	if c, ok := imageStoreCheck(cfg); ok {
		add(c)
	}
	if cfg.Cache.Enabled() {
		add(cacheDirCheck(cfg.Cache, cfg.StateDir))
	}
	if !local {
		// The guest tools, the step-runner and the service are GitLab's,
		// on the host of its VMs: none of them is this entry's.
		return out
	}
	add(guestToolsCheck(cfg))
	add(stepRunnerCheck(cfg))
	add(agentCheck(cfg))
	svc := serviceCheck(cfg)
	add(svc)
	if svc.OK && !svc.Warn {
		add(metricsCheck(ctx, cfg.Serve.MetricsListen))
	}
	return out
}

// remoteHostCheck says what doctor cannot see of another host's libvirt:
// what lives outside libvirt there is that host's own setup.
func remoteHostCheck(cfg *config.Config) Check {
	return Check{Name: "libvirt host", OK: true, Warn: true,
		Info: fmt.Sprintf("%s is another host's libvirt: its network, storage pool, network filters and images are checked over that connection below; "+
			"its network guard (the libvirt hook), br_netfilter, /dev/kvm and free memory are not", cfg.LibvirtURI),
		Fix: "run libvirt-executor doctor on that host too, with a configuration naming qemu:///system (docs/garm.md, \"Across hosts\")"}
}

// nwfilterCheck checks that libvirt has the network filter the project's
// filters build on (l2_filter): without it no VM starts. The project's own
// filters are defined by the engine when it starts a VM; not having them
// yet is fine.
func nwfilterCheck(defined func(string) (bool, error)) Check {
	c := Check{Name: "network filters"}
	ok, err := defined(vm.FilterBase)
	switch {
	case err != nil:
		c.Info = vm.FilterBase + ": " + err.Error()
	case !ok:
		c.Info = "libvirt has no network filter " + vm.FilterBase
	}
	if c.Info != "" {
		c.Fix = "apt-get install libvirt-daemon-config-nwfilter ebtables (" + vm.FilterBase + " comes with it; restart libvirtd), " +
			"or l2_filter = false. Until then no VM can start"
		return c
	}
	var missing []string
	for _, n := range vm.FilterNames {
		ok, err := defined(n)
		if err != nil {
			c.Info = n + ": " + err.Error()
			return c
		}
		if !ok {
			missing = append(missing, n)
		}
	}
	c.OK, c.Info = true, "l2_filter: "+vm.FilterBase+", "+strings.Join(vm.FilterNames, ", ")+" defined"
	if len(missing) > 0 {
		c.Warn = true
		c.Info = "l2_filter: " + vm.FilterBase + " defined; " + strings.Join(missing, ", ") + " not yet (libvirt-executor defines them when it starts the first VM)"
	}
	return c
}

// metricsCheck asks the running service's metrics endpoint for its
// metrics.
func metricsCheck(ctx context.Context, listen string) Check {
	c := Check{Name: "metrics endpoint", Fix: "check serve.metrics_listen and the service's log (journalctl -u libvirt-executor)"}
	if listen == config.MetricsOff {
		c.OK, c.Warn, c.Info = true, true, `serve.metrics_listen = "off": no metrics endpoint`
		return c
	}
	url := MetricsURL(listen)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		c.Info = err.Error()
		return c
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		c.Info = fmt.Sprintf("%s does not answer: %v", url, err)
		return c
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	switch {
	case err != nil:
		c.Info = fmt.Sprintf("%s: reading the answer failed: %v", url, err)
	case resp.StatusCode != http.StatusOK:
		c.Info = fmt.Sprintf("%s answered %s", url, resp.Status)
	case !strings.Contains(string(body), "libvirt_executor_build_info"):
		c.Info = fmt.Sprintf("%s answers, but not with this service's metrics (another program on that port?)", url)
	default:
		c.OK = true
		c.Info = fmt.Sprintf("%s answers", url)
	}
	return c
}

// MetricsURL is the URL of the metrics endpoint that listen
// (serve.metrics_listen) serves; an unspecified host means loopback.
func MetricsURL(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "http://" + listen + "/metrics"
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/metrics"
}

// guestToolsCheck: the gitlab-runner the guests get on the tools disk
// (caches and artifacts), or why there is none.
func guestToolsCheck(cfg *config.Config) Check {
	c := Check{Name: "guest tools"}
	src, err := guesttools.GuestToolsSource(cfg)
	switch {
	case errors.Is(err, guesttools.ErrNoTools):
		c.OK, c.Warn, c.Info = true, true, err.Error()+": caches and artifacts need a gitlab-runner in the images"
		c.Fix = "set [guest_tools] gitlab_runner to this host's gitlab-runner (docs/images.md, \"The guest tools disk\")"
	case err != nil:
		c.Info, c.Fix = err.Error(), "point [guest_tools] gitlab_runner at a linux/amd64 gitlab-runner binary this user can read"
	default:
		c.OK, c.Info = true, "gitlab-runner "+src+" goes read-only into every VM (built into the tools disk at the first job)"
	}
	return c
}

// stepRunnerCheck: the step-runner the guests get on the tools disk
// (GitLab Steps, run: jobs), or why there is none: "none" is the admin's
// choice (OK), none found by "auto" only a note.
func stepRunnerCheck(cfg *config.Config) Check {
	c := Check{Name: "guest step-runner"}
	src, err := guesttools.GuestStepRunnerSource(cfg)
	switch {
	case errors.Is(err, guesttools.ErrNoTools) && cfg.GuestTools.StepRunner == config.GuestToolsNone:
		c.OK, c.Info = true, err.Error()+": run: jobs (GitLab Steps) need a step-runner in the images"
	case errors.Is(err, guesttools.ErrNoTools):
		// Not a warning: steps are optional; a run: job fails at prepare
		// naming the fix.
		c.OK, c.Info = true, err.Error()+": run: jobs (GitLab Steps) fail at prepare unless the image has a step-runner; set [guest_tools] step_runner to give the guests one (docs/steps.md)"
	case err != nil:
		c.Info, c.Fix = err.Error(), "point [guest_tools] step_runner at a linux/amd64 step-runner binary this user can read"
	default:
		c.OK, c.Info = true, "step-runner "+src+" goes read-only into every VM (run: jobs, GitLab Steps)"
	}
	return c
}

// agentCheck: the guest agent the guests get on the tools disk (the
// stages run through it), or why there is none: "none" is the admin's
// choice, none installed a warning (every stage then costs an SSH session
// and the wrapper's processes).
func agentCheck(cfg *config.Config) Check {
	c := Check{Name: "guest agent"}
	src, err := guesttools.GuestAgentSource(cfg)
	switch {
	case errors.Is(err, guesttools.ErrNoTools) && cfg.GuestTools.Agent == config.GuestToolsNone:
		c.OK, c.Info = true, err.Error()+": stages run through the wrapper (an SSH session and a few processes each)"
	case errors.Is(err, guesttools.ErrNoTools):
		c.OK, c.Warn, c.Info = true, true, err.Error()+": stages run through the wrapper, slower"
		c.Fix = "install lve-agent with the executables (make install, or the package: /usr/lib/libvirt-executor/lve-agent), or set [guest_tools] agent to its path"
	case err != nil:
		c.Info, c.Fix = err.Error(), "point [guest_tools] agent at the lve-agent built with this version (static, linux/amd64), or set it to \"auto\""
	default:
		c.OK, c.Info = true, "lve-agent "+src+" goes read-only into every VM; the stages run through it"
	}
	return c
}

// serviceCheck checks the service (libvirt-executor serve): its lock is
// held and it looked at its pools lately. Not running is a failure when an
// image has a pool (every job goes cold), else a warning (no metrics).
func serviceCheck(cfg *config.Config) Check {
	pooled := cfg.Pooled()
	c := Check{Name: "service", Fix: "systemctl enable --now libvirt-executor.service (or run libvirt-executor serve); journalctl -u libvirt-executor shows why it stopped"}
	m := jobvm.New(&lifecycle.Manager{Cfg: cfg, Store: state.Store{Dir: cfg.StateDir}})
	locked, age, looked := m.ServiceStatus()
	if !locked {
		if len(pooled) == 0 {
			c.OK, c.Warn = true, true
			c.Info = "libvirt-executor serve is not running: no metrics (the stages' event records wait in the spool, up to serve.event_spool_mib)"
			return c
		}
		c.Info = fmt.Sprintf("libvirt-executor serve is not running: %d image(s) with a pool, every job takes the cold path; no metrics", len(pooled))
		return c
	}
	if !m.ServiceRunning() {
		c.Info = "libvirt-executor serve holds its lock but has not looked at its pools lately: hung? Jobs take the cold path"
		if looked {
			c.Info = fmt.Sprintf("libvirt-executor serve holds its lock but has not looked at its pools for %s: hung? Jobs take the cold path", age.Round(time.Second))
		}
		return c
	}
	c.OK = true
	c.Info = fmt.Sprintf("running, last look %s ago", vm.Round(age))
	return c
}

// polkitRuleDirs are where polkit reads JavaScript rules.
var polkitRuleDirs = []string{"/etc/polkit-1/rules.d", "/usr/share/polkit-1/rules.d"}

// polkitCheck looks for a rule that grants libvirt's manage action (Debian's
// 60-libvirt.rules grants it to the libvirt group). Without one, a system
// libvirtd with polkit authentication refuses unprivileged users; a libvirtd
// that authorises by socket permissions instead does not need it, so for a
// user whose connection works a missing rule is only a warning. The rule
// directories are usually readable by root and polkitd only.
func polkitCheck(dirs []string, connected, asRoot bool) Check {
	c := Check{Name: "polkit rule",
		Fix: "install a rule granting org.libvirt.unix.manage to the libvirt group (docs/install.md), or use socket permissions (unix_sock_group, auth_unix_rw = \"none\")"}
	var unreadable []string
	for _, d := range dirs {
		entries, err := os.ReadDir(d)
		if errors.Is(err, os.ErrPermission) {
			unreadable = append(unreadable, d)
			continue
		}
		for _, e := range entries {
			f := filepath.Join(d, e.Name())
			if !strings.HasSuffix(f, ".rules") {
				continue
			}
			if b, err := os.ReadFile(f); err == nil && strings.Contains(string(b), "org.libvirt.unix.manage") {
				c.OK, c.Info = true, f+" mentions org.libvirt.unix.manage"
				return c
			}
		}
	}
	switch {
	case asRoot:
		c.OK, c.Warn = true, true
		c.Info = "no rule for org.libvirt.unix.manage in " + strings.Join(dirs, " or ") +
			": unprivileged users are refused unless libvirtd authorises by socket permissions"
	case len(unreadable) > 0:
		c.OK, c.Warn = connected, true
		c.Info = "cannot read " + strings.Join(unreadable, " and ") + " as this user; run doctor as root to see the rules"
	default:
		c.OK, c.Warn = connected, connected
		c.Info = "no rule for org.libvirt.unix.manage in " + strings.Join(dirs, " or ")
	}
	if connected && !asRoot {
		c.Info += " (the connection works: libvirtd lets this user in)"
	}
	return c
}

// configFileCheck: the admin's file decides what jobs get, so only its owner
// (root or the runner's user) may change it.
func configFileCheck(path string) Check {
	c := Check{Name: "configuration", OK: true, Info: path}
	st, err := os.Stat(path)
	if err != nil {
		return c // loaded already; a vanished file is not this check's business
	}
	switch perm := st.Mode().Perm(); {
	case perm&0o002 != 0:
		c.OK = false
		c.Info = fmt.Sprintf("%s is %o: anyone on the host can change which images and sizes jobs get", path, perm)
		c.Fix = "chmod 0644 " + path
	case perm&0o020 != 0:
		c.Warn = true
		c.Info = fmt.Sprintf("%s is %o: its group can change which images and sizes jobs get", path, perm)
		c.Fix = "chmod 0644 " + path
	}
	return c
}

// cacheDirCheck checks the host cache's directory as the state directory
// (the stages' user's, 0700, or creatable), that it is no symlink, that
// it belongs to the state directory's owner (the stages' user; doctor as
// root would otherwise pass a root-owned one), and that its filesystem has
// room for cache.total_limit_mib.
func cacheDirCheck(c config.Cache, stateDir string) Check {
	ch := stateDirCheck(c.Dir)
	ch.Name = "cache dir"
	if fi, err := os.Lstat(c.Dir); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		ch.OK, ch.Warn = false, false
		ch.Info = c.Dir + " is a symlink: the host cache refuses it"
		ch.Fix = "set cache.dir to the directory itself"
		return ch
	}
	if bad, ok := cacheOwnerCheck(c.Dir, stateDir); !ok {
		return bad
	}
	dir := c.Dir
	if _, err := os.Stat(dir); err != nil {
		dir = filepath.Dir(dir)
	}
	var st unix.Statfs_t
	if ch.OK && unix.Statfs(dir, &st) == nil {
		free := st.Bavail * uint64(st.Bsize) >> 20 //nolint:gosec // G115: block sizes are positive
		if free < uint64(c.TotalLimitMiB) {        //nolint:gosec // G115: validated 1..16Mi
			ch.Warn = true
			ch.Info += fmt.Sprintf("; %d MiB free there, less than cache.total_limit_mib (%d): the disk fills before the limit evicts", free, c.TotalLimitMiB)
			ch.Fix = "lower cache.total_limit_mib or give the cache a larger filesystem"
		}
		if int64(st.Type) == unix.TMPFS_MAGIC || int64(st.Type) == unix.RAMFS_MAGIC {
			ch.Warn = true
			ch.Info += "; it is in memory (tmpfs): every cache is gone after a reboot, and it takes the host's RAM"
			ch.Fix = strings.TrimPrefix(ch.Fix+"; set cache.dir on a disk, e.g. /var/cache/libvirt-executor/jobs", "; ")
		}
	}
	return ch
}

// cacheOwnerCheck fails (false) when the state directory exists and the
// cache directory belongs to another user, or does not exist yet and that
// user cannot make it (its parent is another user's, not writable by all):
// the stages would fail every job that uses the host cache.
func cacheOwnerCheck(dir, stateDir string) (Check, bool) {
	st, err := os.Stat(stateDir)
	if err != nil {
		return Check{}, true
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return Check{}, true
	}
	name := func(uid uint32) string {
		if u, err := user.LookupId(fmt.Sprint(uid)); err == nil {
			return u.Username
		}
		return fmt.Sprint(uid)
	}
	runner := name(sys.Uid)
	c := Check{Name: "cache dir", Fix: fmt.Sprintf("install -d -m 0700 -o %s %s (the package makes /var/cache/libvirt-executor/jobs so)", runner, dir)}
	if fi, err := os.Stat(dir); err == nil {
		if cs, ok := fi.Sys().(*syscall.Stat_t); ok && cs.Uid != sys.Uid {
			c.Info = fmt.Sprintf("%s belongs to %s, but state_dir %s to %s (the stages' user): no job could use the host cache", dir, name(cs.Uid), stateDir, runner)
			c.Fix = fmt.Sprintf("chown -R %s %s && chmod 0700 %s", runner, dir, dir)
			return c, false
		}
		return Check{}, true
	}
	parent := filepath.Dir(dir)
	fi, err := os.Stat(parent)
	if err != nil {
		return Check{}, true // the state dir check's "will be created" says whether it can be
	}
	if ps, ok := fi.Sys().(*syscall.Stat_t); ok && ps.Uid != sys.Uid && fi.Mode().Perm()&0o002 == 0 && fi.Mode().Perm()&0o020 == 0 {
		c.Info = fmt.Sprintf("%s does not exist, and %s (state_dir %s's owner, the stages' user) cannot make it in %s (%s's)", dir, runner, stateDir, parent, name(ps.Uid))
		return c, false
	}
	return Check{}, true
}

func stateDirCheck(dir string) Check {
	c := Check{Name: "state dir", Info: dir, Fix: "install -d -m 0700 -o <runner user> " + dir}
	st, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		// Created on first use if the parent allows it.
		c.OK = unix.Access(filepath.Dir(dir), unix.W_OK) == nil
		c.Info = dir + " (will be created)"
		return c
	}
	if err != nil {
		c.Info = err.Error()
		return c
	}
	c.OK = unix.Access(dir, unix.W_OK) == nil
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		// Key files and locks are made by the stages: the directory must be
		// the stages' user's, or a second user could read or replace them.
		owner := fmt.Sprint(sys.Uid)
		if u, err := user.LookupId(owner); err == nil {
			owner = u.Username
		}
		if os.Geteuid() != 0 {
			c.OK = false
			c.Info = fmt.Sprintf("%s belongs to %s, but this user (uid %d) runs the stages", dir, owner, os.Geteuid())
			c.Fix = fmt.Sprintf("sudo chown -R %d %s && sudo chmod 0700 %s", os.Geteuid(), dir, dir)
			return c
		}
		// Root checks on behalf of the stages' user; the modes still count.
		c.Warn = true
		c.Info = fmt.Sprintf("%s belongs to %s: if the stages run as %s, check as that user", dir, owner, owner)
		c.Fix = "runuser -u " + owner + " -- libvirt-executor doctor"
	}
	switch perm := st.Mode().Perm(); {
	case perm&0o022 != 0:
		c.OK = false
		c.Info = fmt.Sprintf("%s is %o: others could replace job state and keys", dir, perm)
		c.Fix = "chmod 0700 " + dir
	case perm&0o077 != 0:
		c.Warn = true
		c.Info = fmt.Sprintf("%s is %o (key files inside are 0600 in 0700 directories)", dir, perm)
		c.Fix = "chmod 0700 " + dir
	}
	return c
}

// stateHostCheck says which libvirt's machines the state directory keeps,
// and fails when that is not this configuration's (state.BindHost).
func stateHostCheck(cfg *config.Config) Check {
	key := vm.HostKey(cfg.LibvirtURI)
	c := Check{Name: "state dir libvirt", OK: true}
	st := state.Store{Dir: cfg.StateDir}
	if err := st.BindHost(key, !cfg.LocalLibvirt(), true); err != nil {
		c.OK, c.Info = false, err.Error()
		c.Fix = "set state_dir to a directory of this configuration's own"
		return c
	}
	switch kept, err := st.BoundHost(); {
	case err != nil:
		c.OK, c.Info, c.Fix = false, err.Error(), "remove the file once no machine is left (libvirt-executor list)"
	case kept == "":
		c.Info = "not tied to a libvirt yet: the first use ties it to " + key
	default:
		c.Info = "keeps the machines of " + kept
	}
	return c
}

func ver(v uint32) string { return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000) }

// PrintChecks writes the findings and returns an error if any failed.
func PrintChecks(w io.Writer, checks []Check) error {
	failed := 0
	for _, c := range checks {
		mark := "ok  "
		switch {
		case !c.OK:
			mark = "FAIL"
			failed++
		case c.Warn:
			mark = "warn"
		}
		fmt.Fprintf(w, "[%s] %s: %s\n", mark, c.Name, c.Info)
		if (!c.OK || c.Warn) && c.Fix != "" {
			fmt.Fprintf(w, "       fix: %s\n", c.Fix)
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d check(s) failed", failed)
	}
	return nil
}

// dhcpRangeCheck warns about a dynamic DHCP range on the network of VMs
// with static host entries (static_addresses): a guest can take addresses
// of the range with other client identifiers, a second lease or all of
// them.
func dhcpRangeCheck(network string, d vm.DHCPInfo) Check {
	c := Check{Name: "network " + network + " DHCP", OK: true}
	switch {
	case !d.Enabled:
		c.Info = "no libvirt DHCP: VM addresses are learnt from the guests (no static host entries)"
	case len(d.Ranges) == 0:
		c.Info = fmt.Sprintf("static host entries only (%d now): one lease per VM", len(d.Hosts))
	default:
		var rs []string
		for _, r := range d.Ranges {
			rs = append(rs, r[0].String()+"-"+r[1].String())
		}
		c.Warn = true
		c.Info = "a dynamic range (" + strings.Join(rs, ", ") + "): a guest that asks with other client identifiers can take more addresses of it, or all"
		c.Fix = "remove the <range> from the network's <dhcp> (virsh net-edit " + network + "; keep one <host> entry of its own: docs/configuration.md, \"The libvirt network\"), then restart the network"
	}
	return c
}
