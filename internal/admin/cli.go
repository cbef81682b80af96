package admin

// The admin tool's command tree (cmd/admin is its thin main): App is the
// urfave/cli application, ExitCode the exit status of its error.

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/progress"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/selftest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm"
)

// ExitNotOwner is the exit status of a command refused because the state
// directory belongs to another user (run as root on the runner user's
// state_dir): it would leave files there that user cannot change.
const ExitNotOwner = 3

// ExitCode is the exit status for a command's error: ExitNotOwner for a
// *state.OwnerError, ExitConfigInvalid for config check's problems, else 1.
func ExitCode(err error) int {
	if _, ok := errors.AsType[*state.OwnerError](err); ok {
		return ExitNotOwner
	}
	if _, ok := errors.AsType[*configInvalidError](err); ok {
		return ExitConfigInvalid
	}
	return 1
}

// openManager opens this installation's lifecycle manager; it connects to
// libvirt on first use. readOnly is for commands that change nothing
// (list, explain-machine): they may look as another user (root) than the
// state directory's owner, and then create nothing there. Others are
// refused with a *state.OwnerError (lifecycle.Open).
func openManager(c *cli.Context, readOnly bool) (*config.Config, *jobvm.Host, error) {
	cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
	if err != nil {
		return nil, nil, err
	}
	m, err := jobvm.Open(cfg, lifecycle.Options{Log: logger(c), ReadOnly: readOnly})
	return cfg, m, err
}

// withManager opens this installation's lifecycle manager (openManager),
// connected to libvirt, for fn.
func withManager(c *cli.Context, readOnly bool, fn func(*config.Config, *jobvm.Host) error) error {
	cfg, m, err := openManager(c, readOnly)
	if err != nil {
		return err
	}
	defer m.Close()
	if err := m.Dial(c.Context); err != nil {
		return err
	}
	return fn(cfg, m)
}

// cacheStore is the configuration and its host cache.
func cacheStore(c *cli.Context) (*config.Config, *hostcache.Store, error) {
	cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
	if err != nil {
		return nil, nil, err
	}
	store, err := CacheStore(cfg)
	return cfg, store, err
}

func App() *cli.App {
	return &cli.App{
		Name:    "libvirt-executor",
		Usage:   "administer libvirt-executor job VMs",
		Version: buildinfo.String(),
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "config", Usage: "driver configuration file (default " + config.DefaultPath + ")", EnvVars: []string{config.EnvPath}},
		}, logFlags()...),
		Commands: withConfigFlag([]*cli.Command{
			configCommand(),
			{
				Name:  "list",
				Usage: "list this installation's job VMs, volumes and state with what a sweep would do",
				Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print one JSON array (for scripts) instead of the table"}},
				Action: func(c *cli.Context) error {
					return withManager(c, true, func(_ *config.Config, m *jobvm.Host) error {
						if c.Bool("json") {
							return ListJSON(c.Context, os.Stdout, m, time.Now())
						}
						return List(c.Context, os.Stdout, m, time.Now())
					})
				},
			},
			{
				Name:  "gc",
				Usage: "remove expired job VMs and orphaned volumes, state and locks of this installation",
				Flags: []cli.Flag{&cli.BoolFlag{Name: "dry-run", Usage: "only show what would be removed"}},
				Action: func(c *cli.Context) error {
					return withManager(c, false, func(cfg *config.Config, m *jobvm.Host) error {
						err := GC(c.Context, os.Stdout, m, c.Bool("dry-run"))
						if cfg.Cache.Enabled() && !c.Bool("dry-run") {
							store, serr := CacheStore(cfg)
							if serr == nil {
								serr = CachePrune(c.Context, os.Stdout, store, cfg.Cache.MaxAge.D())
							}
							err = errors.Join(err, serr)
						}
						return err
					})
				},
			},
			{
				Name:  "cache",
				Usage: "the host cache ([cache] dir): list the projects' caches, prune unused ones, remove one",
				Subcommands: []*cli.Command{
					{
						Name:  "list",
						Usage: "list the projects' caches, least recently used first, with size and last use",
						Action: func(c *cli.Context) error {
							cfg, store, err := cacheStore(c)
							if err != nil {
								return err
							}
							return CacheList(os.Stdout, cfg, store, time.Now())
						},
					},
					{
						Name:  "prune",
						Usage: "remove the caches no job used for --older-than (default cache.max_age)",
						Flags: []cli.Flag{&cli.DurationFlag{Name: "older-than", Usage: "unused for at least this long (default: cache.max_age)"}},
						Action: func(c *cli.Context) error {
							cfg, store, err := cacheStore(c)
							if err != nil {
								return err
							}
							age := cfg.Cache.MaxAge.D()
							if c.IsSet("older-than") {
								age = c.Duration("older-than")
							}
							return CachePrune(c.Context, os.Stdout, store, age)
						},
					},
					{
						Name:      "rm",
						Usage:     "remove the named projects' caches (names as cache list shows them)",
						ArgsUsage: "PROJECT...",
						Action: func(c *cli.Context) error {
							if c.NArg() == 0 {
								return fmt.Errorf("cache rm needs at least one project (see libvirt-executor cache list)")
							}
							_, store, err := cacheStore(c)
							if err != nil {
								return err
							}
							var errs []error
							for _, p := range c.Args().Slice() {
								if err := store.Remove(c.Context, p); err != nil {
									errs = append(errs, fmt.Errorf("%s: %w", p, err))
									continue
								}
								fmt.Println("removed cache", p)
							}
							return errors.Join(errs...)
						},
					},
				},
			},
			{
				Name:  "image",
				Usage: "VM images: build one from an installed recipe; in an OCI registry ([images.NAME] source = \"oci://...\"; docs/fleet.md): push, pull, list, prune",
				Subcommands: []*cli.Command{
					{
						Name:      "build",
						Usage:     "build a guest image from an installed recipe (as root; docs/images.md): one line per step, then the [images.NAME] table for the configuration and the image's path",
						ArgsUsage: "NAME",
						Flags: []cli.Flag{
							&cli.StringFlag{Name: "output", Value: DefaultImageDir, Usage: "where the image goes: DIR/NAME-HASH/, and DIR/NAME a link to the newest"},
							&cli.BoolFlag{Name: "force", Usage: "build again even when the recipe's image is there"},
							&cli.StringFlag{Name: "recipes", Usage: "the recipes' directory (default: the package's, " + RecipesSubdir + " from this executable; deploy/images in a source checkout)"},
						},
						Action: runImageBuild,
					},
					{
						Name:      "push",
						Usage:     "push an image's disk (and kernel and initrd) to a registry as one artifact; prints its digest",
						ArgsUsage: "oci://HOST/REPO:TAG",
						Flags: []cli.Flag{
							&cli.StringFlag{Name: "image", Usage: "push the files of this configured image (base, kernel, initrd)"},
							&cli.StringFlag{Name: "disk", Usage: "the qcow2 disk to push (instead of --image)"},
							&cli.StringFlag{Name: "kernel", Usage: "the kernel, for an image that boots one"},
							&cli.StringFlag{Name: "initrd", Usage: "the initrd, for an image that boots a kernel"},
						},
						Action: func(c *cli.Context) error {
							if c.NArg() != 1 {
								return fmt.Errorf("image push takes one destination, oci://HOST/REPO:TAG")
							}
							cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
							if err != nil {
								return err
							}
							files, err := pushFiles(cfg, c.String("image"), c.String("disk"), c.String("kernel"), c.String("initrd"))
							if err != nil {
								return err
							}
							return ImagePush(progress.With(c.Context, progress.ForFile(os.Stderr)), os.Stdout, cfg, c.Args().First(), files)
						},
					},
					{
						Name:      "pull",
						Usage:     "pull images into this host's store now (configured names or oci:// sources; none: every image with a source)",
						ArgsUsage: "[NAME|oci://...]...",
						Action: func(c *cli.Context) error {
							cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
							if err != nil {
								return err
							}
							return ImagePull(progress.With(c.Context, progress.ForFile(os.Stderr)), os.Stdout, cfg, c.Args().Slice())
						},
					},
					{
						Name:  "list",
						Usage: "list the images in this host's store: digest, size, files, the configured images and sources that name each",
						Action: func(c *cli.Context) error {
							cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
							if err != nil {
								return err
							}
							return ImageList(os.Stdout, cfg, time.Now())
						},
					},
					{
						Name:      "snapshot",
						Usage:     "make the memory snapshot of a configured image (snapshot = true), from which its jobs start when no standby VM is idle (docs/pool.md); --remove removes it",
						ArgsUsage: "NAME",
						Flags:     []cli.Flag{&cli.BoolFlag{Name: "remove", Usage: "remove the image's snapshot instead"}},
						Action: func(c *cli.Context) error {
							if c.NArg() != 1 {
								return fmt.Errorf("image snapshot takes one configured image name")
							}
							return withManager(c, false, func(_ *config.Config, m *jobvm.Host) error {
								return ImageSnapshot(c.Context, os.Stdout, m, c.Args().First(), c.Bool("remove"))
							})
						},
					},
					{
						Name:  "snapshots",
						Usage: "list the images' memory snapshots: template, size, age, and whether jobs start from them",
						Action: func(c *cli.Context) error {
							return withManager(c, true, func(_ *config.Config, m *jobvm.Host) error {
								return SnapshotList(c.Context, os.Stdout, m, time.Now())
							})
						},
					},
					{
						Name:  "prune",
						Usage: "remove stored images no configured source names and no VM's disk uses",
						Flags: []cli.Flag{&cli.BoolFlag{Name: "dry-run", Usage: "only show what would be removed"}},
						Action: func(c *cli.Context) error {
							return withManager(c, true, func(cfg *config.Config, m *jobvm.Host) error {
								inUse, err := m.Manager().Volumes().BackingFiles(c.Context)
								if err != nil {
									return err
								}
								return ImagePrune(c.Context, os.Stdout, cfg, inUse, c.Bool("dry-run"))
							})
						},
					},
				},
			},
			{
				Name:      "rm",
				Usage:     "remove the named job VMs of this installation with their volumes and state (foreign domains are refused)",
				ArgsUsage: "NAME...",
				Action: func(c *cli.Context) error {
					if c.NArg() == 0 {
						return fmt.Errorf("rm needs at least one machine name (see libvirt-executor list)")
					}
					return withManager(c, false, func(_ *config.Config, m *jobvm.Host) error {
						var errs []error
						for _, name := range c.Args().Slice() {
							if err := m.Manager().Machine(name).Teardown(c.Context); err != nil {
								errs = append(errs, fmt.Errorf("%s: %w", name, err))
								continue
							}
							fmt.Println("removed", name)
						}
						return errors.Join(errs...)
					})
				},
			},
			{
				Name:  "serve",
				Usage: "keep the standby pools (images with a [images.NAME.pool] table) booted for warm starts, and serve Prometheus metrics (serve.metrics_listen), until SIGTERM; SIGHUP reloads the configuration",
				Flags: logFlags(),
				Action: func(c *cli.Context) error {
					cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
					if err != nil {
						return err
					}
					return Serve(c.Context, cfg, logger(c), nil)
				},
			},
			{
				// For libvirt-executor-run, which is built without libvirt:
				// it asks here when a guest stops answering. Manager.Explain
				// gives up on libvirt after 5 s.
				Name:      jobvm.ExplainCommand,
				Hidden:    true,
				Usage:     "say in one sentence what became of a job VM whose guest stopped answering (nothing if it runs normally or libvirt cannot tell within 5 s)",
				ArgsUsage: "NAME",
				Action: func(c *cli.Context) error {
					if c.NArg() != 1 {
						return fmt.Errorf("%s takes one machine name, got %d arguments", jobvm.ExplainCommand, c.NArg())
					}
					// No eager Dial: a hung libvirtd must not hold the
					// explanation past Manager.Explain's own bound.
					_, m, err := openManager(c, true)
					if err != nil {
						return err
					}
					defer m.Close()
					return ExplainMachine(c.Context, os.Stdout, m, c.Args().First())
				},
			},
			{
				// For libvirt-executor-run, which is built without libvirt:
				// it asks here to hand a project's host cache to the job's
				// machine on hot-plugged disks and to take it back, one
				// typed request on stdin, one typed answer on stdout
				// (cachexfer.AdminRequest, cachexfer.AdminAnswer).
				Name:   cachexfer.AdminCommand,
				Hidden: true,
				Usage:  "move a project's host cache to and from a job VM on hot-plugged disks: one JSON request on stdin (op attach, scratch, keep or drop), one JSON answer on stdout",
				Action: func(c *cli.Context) error {
					if c.NArg() != 0 {
						return fmt.Errorf("%s takes its request as JSON on stdin, not arguments (got %d)", cachexfer.AdminCommand, c.NArg())
					}
					return withManager(c, false, func(cfg *config.Config, m *jobvm.Host) error {
						store, err := CacheStore(cfg)
						if err != nil {
							return err
						}
						return cachexfer.ServeAdmin(c.Context, os.Stdin, os.Stdout, cachexfer.StoreDisk(m, store))
					})
				},
			},
			{
				Name:  "selftest",
				Usage: "run two sample jobs through gitlab-runner and this host's configuration (no GitLab needed): VMs, stages, artifacts and a cache; prints a verdict",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "runner", Usage: "the gitlab-runner binary (default: gitlab-runner on PATH)"},
					&cli.StringFlag{Name: "listen", Usage: "host:port for the fake GitLab job API, reachable from the guests (default: this host's address on the configured network, a free port)"},
					&cli.StringFlag{Name: "image", Usage: "the image the jobs ask for (default: the configuration's default image)"},
					&cli.BoolFlag{Name: "steps", Usage: "also run a GitLab Steps job (run:) through gitlab-runner run, in a fresh VM (docs/steps.md)"},
					&cli.StringFlag{Name: "services", Usage: "also run a job with this container image as its service (alias " + selftest.ServiceAlias + "), in a fresh VM of --services-image: the image is pulled and started in the VM and the job finds it (docs/services.md)"},
					&cli.StringFlag{Name: "services-image", Usage: "the VM image (with podman) of the --services job (default: --image, else the configuration's default image)"},
					&cli.BoolFlag{Name: "sample-jobs", Value: true, Usage: "run the two sample jobs (artifacts and a cache, and the GitLab probe); --sample-jobs=false runs only --steps and --services"},
					&cli.IntFlag{Name: "service-port", Usage: "a TCP port the --services job connects to at its service's alias (default: none; the driver waits for the image's exposed ports either way)"},
					&cli.StringFlag{Name: "url", Usage: "the GitLab the runner is registered with, probed from the guest (DNS, route, TLS, certificate); default: the first [[runners]] url of --runner-config"},
					&cli.StringFlag{Name: "tls-ca-file", Usage: "the CA file the runner trusts for --url (default: --runner-config's tls-ca-file; none: the system store)"},
					&cli.StringFlag{Name: "runner-config", Value: "/etc/gitlab-runner/config.toml", Usage: "the runner's config.toml, read for url and tls-ca-file when --url is not given (skipped when it cannot be read)"},
					&cli.DurationFlag{Name: "timeout", Value: 15 * time.Minute, Usage: "give up after this long"},
					&cli.BoolFlag{Name: "verbose", Usage: "print the job logs also when all passed"},
				},
				Action: runSelftest,
			},
			{
				Name:  "polkit-rules",
				Usage: "print polkit rules that confine the runner's user to this configuration's prefix, pool, network and filters under libvirt's polkit access driver (docs/security.md)",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "user", Value: "gitlab-runner", Usage: "the user the stages run as"},
				},
				Action: func(c *cli.Context) error {
					cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
					if err != nil {
						return err
					}
					return PolkitRules(os.Stdout, cfg, c.String("user"))
				},
			},
			{
				Name:  "doctor",
				Usage: "check libvirt, KVM, pool, network, images and permissions, with the fix for each problem",
				Action: func(c *cli.Context) error {
					cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
					if err != nil {
						fmt.Println("[FAIL] configuration:", err)
						return err
					}
					return PrintChecks(os.Stdout, Doctor(c.Context, cfg, libvirtvm.Connect))
				},
			},
		}),
	}
}

// runSelftest is the selftest command.
func runSelftest(c *cli.Context) error {
	cfg, err := config.Load(config.Resolve(c.String("config"), os.Getenv))
	if err != nil {
		return err
	}
	runner := c.String("runner")
	if runner == "" {
		if runner, err = exec.LookPath("gitlab-runner"); err != nil {
			return fmt.Errorf("no gitlab-runner on PATH: pass --runner /path/to/gitlab-runner")
		}
	}
	if c.String("image") != "" {
		if _, ok := cfg.Image(c.String("image")); !ok {
			return fmt.Errorf("--image %q: not an image of the configuration (%s)", c.String("image"), strings.Join(cfg.ImageNames(), ", "))
		}
	}
	if err := selftestServicesFlags(c, cfg); err != nil {
		return err
	}
	listen := c.String("listen")
	if listen == "" {
		conn, err := libvirtvm.Connect(c.Context, cfg.LibvirtURI)
		if err != nil {
			return err
		}
		addr, err := conn.NetworkAddress(c.Context, cfg.Network)
		_ = conn.Close()
		if err != nil {
			return fmt.Errorf("%w (or pass --listen)", err)
		}
		listen = net.JoinHostPort(addr, "0")
	}
	gitlabURL, caFile := c.String("url"), c.String("tls-ca-file")
	if gitlabURL == "" && c.Bool("sample-jobs") {
		if u, ca, err := selftest.RunnerGitLab(c.String("runner-config")); err == nil {
			gitlabURL, caFile = u, cmp.Or(caFile, ca)
			fmt.Printf("GitLab from %s: %s\n", c.String("runner-config"), u)
		} else if c.IsSet("runner-config") {
			return err
		} else {
			fmt.Printf("no GitLab to probe from the guest (%v): pass --url\n", err)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	rep, err := selftest.Run(c.Context, selftest.Options{
		Config: cfg.Path, BinDir: filepath.Dir(exe), Runner: runner, Listen: listen,
		GitLabURL: gitlabURL, GitLabCA: caFile,
		Image: c.String("image"), Steps: c.Bool("steps"), Timeout: c.Duration("timeout"), Progress: os.Stdout,
		Services: c.String("services"), ServicesImage: c.String("services-image"), ServicePort: c.Int("service-port"),
		SkipSamples: !c.Bool("sample-jobs"),
	})
	if err != nil {
		return err
	}
	rep.Print(os.Stdout)
	if c.Bool("verbose") && rep.OK() {
		for _, j := range rep.Jobs {
			fmt.Printf("\n--- %s ---\n%s\n", j.Name, j.Trace)
		}
	}
	if !rep.OK() {
		return errors.New("selftest failed")
	}
	return nil
}

// selftestServicesFlags checks selftest's --services flags against the
// configuration before any VM is made.
func selftestServicesFlags(c *cli.Context, cfg *config.Config) error {
	if !c.Bool("sample-jobs") {
		if !c.Bool("steps") && c.String("services") == "" {
			return errors.New("--sample-jobs=false leaves nothing to run: add --steps or --services IMAGE")
		}
		if c.IsSet("url") || c.IsSet("tls-ca-file") {
			return errors.New("--url and --tls-ca-file: the GitLab probe runs in the first sample job, which --sample-jobs=false leaves out")
		}
	}
	if c.String("services") == "" {
		for _, f := range []string{"services-image", "service-port"} {
			if c.IsSet(f) {
				return fmt.Errorf("--%s needs --services IMAGE", f)
			}
		}
		return nil
	}
	if !cfg.Services.Enabled {
		return fmt.Errorf("--services: this configuration does not start services ([services] enabled = false in %s; docs/services.md)", cfg.Path)
	}
	ref, err := services.ParseRef(c.String("services"))
	if err != nil {
		return fmt.Errorf("--services %q: %w", c.String("services"), err)
	}
	allow, err := services.NewAllowlist(cfg.Services.AllowedImages)
	if err != nil {
		return err
	}
	if !allow.Allows(c.String("services"), ref) {
		return fmt.Errorf("--services %q: not among the images this configuration allows for services ([services] allowed_images: %s)",
			c.String("services"), strings.Join(cfg.Services.AllowedImages, ", "))
	}
	if img := c.String("services-image"); img != "" {
		if _, ok := cfg.Image(img); !ok {
			return fmt.Errorf("--services-image %q: not an image of the configuration (%s)", img, strings.Join(cfg.ImageNames(), ", "))
		}
	}
	if p := c.Int("service-port"); c.IsSet("service-port") && (p < 1 || p > 65535) {
		return fmt.Errorf("--service-port %d: must be a TCP port, 1 to 65535", p)
	}
	return nil
}

// runImageBuild is the image build command.
func runImageBuild(c *cli.Context) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	recipes, err := RecipesDir(c.String("recipes"), exe)
	if err != nil {
		return err
	}
	if c.NArg() > 1 {
		return fmt.Errorf("image build takes one recipe name, got %d arguments (options go before the name: image build --force NAME)", c.NArg())
	}
	o := BuildOptions{Name: c.Args().First(), Recipes: recipes, Output: c.String("output"), Force: c.Bool("force")}
	if err := o.Check(); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("image build runs the recipe as root (it installs its build tools with apt-get and assembles the image in a chroot): run it with sudo")
	}
	res, err := ImageBuild(c.Context, progress.ForFile(os.Stderr), o)
	if err != nil {
		return err
	}
	return PrintBuild(os.Stdout, o.Name, res)
}

// pushFiles are the files image push sends: a configured image's, or the
// ones named.
func pushFiles(cfg *config.Config, image, disk, kernel, initrd string) ([]transfer.PushFile, error) {
	if image != "" {
		if disk != "" || kernel != "" || initrd != "" {
			return nil, fmt.Errorf("image push: --image or --disk/--kernel/--initrd, not both")
		}
		img, ok := cfg.Image(image)
		if !ok {
			return nil, fmt.Errorf("image push --image %q: not a configured image (%s)", image, strings.Join(cfg.ImageNames(), ", "))
		}
		if img.Format != "qcow2" || img.Base == "" {
			return nil, fmt.Errorf("image push --image %s: a qcow2 base file is needed (format %q, base %q)", image, img.Format, img.Base)
		}
		disk, kernel, initrd = img.Base, img.Kernel, img.Initrd
	}
	if disk == "" {
		return nil, fmt.Errorf("image push: name the disk (--disk FILE) or a configured image (--image NAME)")
	}
	files := []transfer.PushFile{{Name: ociimage.DiskFile, Path: disk}}
	if kernel != "" {
		files = append(files, transfer.PushFile{Name: ociimage.KernelFile, Path: kernel})
	}
	if initrd != "" {
		files = append(files, transfer.PushFile{Name: ociimage.InitrdFile, Path: initrd})
	}
	return files, nil
}
