package services

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Guest runs one program in the job's VM: argv[0] looked up on the guest's
// PATH with the arguments argv[1:], the environment entries env (NAME=VALUE)
// added to the login's, stdin as its input. No shell parses argv or env.
// It returns the program's exit status (128+N for signal N) with a nil
// error, or an error when the program's end is unknown (the connection is
// gone, ctx ended). It must be safe for concurrent use (the port waits run
// side by side).
//
// sshexec.Client.Exec is one; a job's session (the job handle of issue
// #45) gives one by delegating to its connection's Exec.
type Guest interface {
	Exec(ctx context.Context, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (int, error)
}

var _ Guest = (*sshexec.Client)(nil)

// Bounds of what Start keeps of the guest's answers.
const (
	// maxAnswer bounds a podman answer Start parses (inspect output).
	maxAnswer = 64 << 10
	// maxErrText bounds the stderr shown for a failed command.
	maxErrText = 2 << 10
	// LogLines is how many of a service's last log lines a warning shows.
	LogLines = 20
	// maxLogText bounds those lines.
	maxLogText = 8 << 10
)

// Started is what Start did: the services that run and their addresses.
type Started struct {
	Network  string
	Services []Running
}

// Running is one started service.
type Running struct {
	Service
	Addr netip.Addr
}

// Start starts the plan's services in the job's VM, in this order: a check
// that the guest has podman, the registries.conf drop-in (when o has
// mirrors), the job's network, each image's pull (by its pull policies),
// each container's start, the /etc/hosts block with every alias, and the
// wait for each service's ports (HEALTHCHECK_TCP_PORT, else the image's
// exposed TCP ports) bounded by o.WaitTimeout. Each step's time goes to the
// job log (log).
//
// A guest without podman, a network that cannot be made, and an image that
// cannot be pulled are system failures (exitcodes.System) naming what
// failed; a service that does not start or does not answer in time is a
// warning with its last log lines, and the job goes on. An error of the
// connection itself is returned as a system failure.
func Start(ctx context.Context, g Guest, plan *Plan, o Options, log io.Writer) (*Started, error) {
	d := &driver{g: g, o: o, log: log}
	st := &Started{Network: plan.Network}
	for _, n := range plan.Notes {
		d.say("%s", n)
	}
	if len(plan.Services) == 0 && plan.Job == nil {
		return st, nil
	}
	t0 := time.Now()
	if err := d.checkRuntime(ctx); err != nil {
		return nil, err
	}
	if err := d.writeMirrors(ctx); err != nil {
		return nil, err
	}
	t := time.Now()
	if _, err := d.must(ctx, "create the job's network "+plan.Network, d.podman(NetworkCreateArgv(plan.Network)), nil); err != nil {
		return nil, err
	}
	d.say("Created network %s for the job's services in %s", plan.Network, since(t))

	if err := d.pullAll(ctx, plan); err != nil {
		return nil, err
	}
	for _, s := range plan.Services {
		r, err := d.run(ctx, plan.Network, s)
		if err != nil {
			return nil, err
		}
		if r != nil {
			st.Services = append(st.Services, *r)
		}
	}
	if err := d.writeHosts(ctx, st); err != nil {
		return nil, err
	}
	if plan.Job != nil {
		if err := d.runJob(ctx, plan.Network, *plan.Job); err != nil {
			return nil, err
		}
	}
	if err := d.waitAll(ctx, st); err != nil {
		return nil, err
	}
	if plan.Debug {
		for _, r := range st.Services {
			d.showLogs(ctx, r.Service, 0)
		}
	}
	if len(plan.Services) > 0 {
		d.say("Services ready in %s: %d started", since(t0), len(st.Services))
	}
	return st, nil
}

// writeMirrors writes the registries.conf drop-in of the driver's options
// (none without mirrors).
func (d *driver) writeMirrors(ctx context.Context) error {
	if len(d.o.Registries) == 0 {
		return nil
	}
	_, err := d.must(ctx, "write the registry mirrors ("+RegistriesPath+")",
		d.podman(WriteFileArgv(RegistriesPath, "0644")), bytes.NewReader(d.o.Registries))
	return err
}

// pullAll pulls the plan's images (by their pull policies); with the
// job's registry credentials written to AuthPath (0600, through stdin,
// never an argument) for the pulls and removed after them, also when one
// failed: no secret stays readable in the guest for the job's scripts.
func (d *driver) pullAll(ctx context.Context, plan *Plan) (err error) {
	if len(plan.Auth) > 0 {
		// The removal is set up first: a write cut half-way (a lost
		// connection) leaves neither the file nor its temporary copy.
		defer func() {
			d.authFile = ""
			rctx, cancel := detachctx.WithTimeout(ctx, 15*time.Second)
			defer cancel()
			if _, rerr := d.must(rctx, "remove the job's registry credentials ("+AuthPath+")", d.podman(RemoveFileArgv(AuthPath)), nil); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}()
		if _, err := d.must(ctx, "write the job's registry credentials ("+AuthPath+")",
			d.podman(WriteFileArgv(AuthPath, "0600")), bytes.NewReader(plan.Auth)); err != nil {
			return err
		}
		d.authFile = AuthPath
		d.say("Registry credentials of the job for its pulls: %s (removed after them)", AuthPath)
	}
	for _, s := range plan.Services {
		if err := d.pull(ctx, s); err != nil {
			return err
		}
	}
	if c := plan.Job; c != nil {
		if err := d.pullImage(ctx, c.Shown, c.Ref, c.image(), c.guestText, c.PullPolicies); err != nil {
			return err
		}
	}
	return nil
}

// runJob starts a container job's container: its mounts' directories
// made in the VM, then the container, detached on the job's network. A
// container that does not start fails the job as a system failure with
// podman's message (the job's scripts have nowhere to run).
func (d *driver) runJob(ctx context.Context, network string, c JobContainer) error {
	t := time.Now()
	if len(c.Mounts) > 0 {
		if _, err := d.must(ctx, "make the job container's directories", d.podman(MkdirArgv(c.Mounts)), nil); err != nil {
			return err
		}
	}
	code, _, errText, err := d.exec(ctx, d.podman(JobRunArgv(network, c)), nil, nil)
	if err != nil {
		return exitcodes.System(fmt.Errorf("services: start the job's container (%s): %w", c.Shown, err))
	}
	if code != 0 {
		return exitcodes.System(fmt.Errorf("services: the job's container %s (%s) did not start (podman run: exit status %d): %s",
			c.Name, c.Shown, code, c.guestText(errText)))
	}
	d.say("Started the job's container %s of image %s in %s; the job's scripts run in it", c.Name, c.image(), since(t))
	return nil
}

type driver struct {
	g   Guest
	o   Options
	log io.Writer
	mu  sync.Mutex // log lines from the concurrent waits
	// authFile is AuthPath while the job's credentials are there (pullAll).
	authFile string
}

func (d *driver) say(format string, args ...any) {
	d.mu.Lock()
	defer d.mu.Unlock()
	fmt.Fprintf(d.log, format+"\n", args...)
}

func since(t time.Time) string {
	return strconv.FormatFloat(time.Since(t).Seconds(), 'f', 1, 64) + "s"
}

// podman wraps argv in "sudo -n" when the login user is not root, keeping
// the names of env (never values) through sudo's environment reset.
func (d *driver) podman(argv []string, envNames ...string) []string {
	if !d.o.Sudo {
		return argv
	}
	pre := []string{"sudo", "-n"}
	if len(envNames) > 0 {
		pre = append(pre, "--preserve-env="+strings.Join(envNames, ","))
	}
	return append(append(pre, "--"), argv...)
}

// exec runs argv and returns its status, its stdout (at most maxAnswer)
// and its stderr (at most maxErrText).
func (d *driver) exec(ctx context.Context, argv, env []string, stdin io.Reader) (int, []byte, string, error) {
	out := &capped{limit: maxAnswer}
	errb := &capped{limit: maxErrText}
	code, err := d.g.Exec(ctx, argv, env, stdin, out, errb)
	return code, out.bytes(), strings.TrimSpace(string(errb.bytes())), err
}

// must runs argv; a non-zero status or a lost connection is a system
// failure saying what failed.
func (d *driver) must(ctx context.Context, what string, argv []string, stdin io.Reader) ([]byte, error) {
	code, out, errText, err := d.exec(ctx, argv, nil, stdin)
	if err != nil {
		return nil, exitcodes.System(fmt.Errorf("services: %s: %w", what, err))
	}
	if code != 0 {
		return nil, exitcodes.System(fmt.Errorf("services: %s failed (exit status %d): %s", what, code, strconv.Quote(errText)))
	}
	return out, nil
}

// checkRuntime fails with the fix when the guest has no podman.
func (d *driver) checkRuntime(ctx context.Context) error {
	code, _, _, err := d.exec(ctx, []string{"podman", "--version"}, nil, nil)
	if err != nil {
		return exitcodes.System(fmt.Errorf("services: check for podman in the guest: %w", err))
	}
	if code != 0 {
		img := "the job's VM image"
		if d.o.VMImage != "" {
			img = "VM image " + strconv.Quote(d.o.VMImage)
		}
		return exitcodes.System(fmt.Errorf("services: the job asks for services or a container image, but %s has no container runtime (podman not found in the guest, exit status %d): "+
			"run the job on an image with podman (deploy/images/build.sh podman builds one; docs/services.md), "+
			"or set [services] enabled = false so that such jobs get the warning instead", img, code))
	}
	return nil
}

// pull gets a service's image by its pull policies, tried in order.
func (d *driver) pull(ctx context.Context, s Service) error {
	return d.pullImage(ctx, "service "+s.Shown, s.Ref, s.image(), s.guestText, s.PullPolicies)
}

// pullImage gets ref (shown as image; guestText shows what podman said
// about it) for what (a service, the job's image) by its pull policies,
// tried in order.
func (d *driver) pullImage(ctx context.Context, what string, ref Ref, image string, guestText func(string) string, policies []string) error {
	var why []string
	for _, p := range policies {
		if p != PullAlways {
			code, _, errText, err := d.exec(ctx, d.podman(ImageExistsArgv(ref)), nil, nil)
			if err != nil {
				return exitcodes.System(fmt.Errorf("services: look for image %s of %s: %w", image, what, err))
			}
			if code == 0 {
				d.say("Using image %s for %s (pull policy %s: already in the VM)", image, what, p)
				return nil
			}
			if code != 1 {
				why = append(why, fmt.Sprintf("%s: podman image exists: exit status %d: %s", p, code, guestText(errText)))
				continue
			}
			if p == PullNever {
				why = append(why, "never: not in the VM")
				continue
			}
		}
		t := time.Now()
		d.say("Pulling image %s for %s...", image, what)
		code, _, errText, err := d.exec(ctx, d.podman(PullArgv(ref, d.authFile)), nil, nil)
		if err != nil {
			return exitcodes.System(fmt.Errorf("services: pull image %s of %s: %w", image, what, err))
		}
		if code == 0 {
			d.say("Pulled image %s in %s", image, since(t))
			return nil
		}
		why = append(why, fmt.Sprintf("%s: podman pull: exit status %d: %s", p, code, guestText(errText)))
	}
	return exitcodes.System(fmt.Errorf("services: cannot get image %s of %s (pull policies %s): %s",
		image, what, strings.Join(policies, ", "), strings.Join(why, "; ")))
}

// run starts a service's container and reads its address; a container that
// does not start is a warning (nil, nil).
func (d *driver) run(ctx context.Context, network string, s Service) (*Running, error) {
	t := time.Now()
	names := make([]string, 0, len(s.Env))
	for _, kv := range s.Env {
		n, _, _ := strings.Cut(kv, "=")
		names = append(names, n)
	}
	code, _, errText, err := d.exec(ctx, d.podman(RunArgv(network, s), names...), s.Env, nil)
	if err != nil {
		return nil, exitcodes.System(fmt.Errorf("services: start service %s: %w", s.Shown, err))
	}
	if code != 0 {
		d.say("WARNING: service %s did not start (podman run: exit status %d): %s", s.Shown, code, s.guestText(errText))
		d.showLogs(ctx, s, LogLines)
		return nil, nil
	}
	out, err := d.must(ctx, "read the address of service "+s.Shown, d.podman(AddressArgv(s.Container)), nil)
	if err != nil {
		return nil, err
	}
	addr, err := ParseAddress(out, network)
	if err != nil {
		return nil, exitcodes.System(fmt.Errorf("services: service %s: %w", s.Shown, err))
	}
	d.say("Started service %s as %s at %s (%s) in %s", s.Shown, s.Container, addr, strings.Join(s.Aliases, ", "), since(t))
	return &Running{Service: s, Addr: addr}, nil
}

// writeHosts puts every alias of the started services into the guest's
// /etc/hosts (the driver's block, replaced as a whole).
func (d *driver) writeHosts(ctx context.Context, st *Started) error {
	var entries []HostEntry
	for _, r := range st.Services {
		for _, a := range r.Aliases {
			entries = append(entries, HostEntry{Addr: r.Addr, Alias: a})
		}
	}
	old, err := d.must(ctx, "read "+HostsPath, ReadFileArgv(HostsPath), nil)
	if err != nil {
		return err
	}
	if len(old) >= maxAnswer {
		return exitcodes.System(fmt.Errorf("services: the guest's %s is larger than %d bytes", HostsPath, maxAnswer))
	}
	_, err = d.must(ctx, "write "+HostsPath, d.podman(WriteFileArgv(HostsPath, "0644")), bytes.NewReader(RewriteHosts(old, entries)))
	return err
}

// waitAll waits for the services' ports side by side, each bounded by
// o.WaitTimeout.
func (d *driver) waitAll(ctx context.Context, st *Started) error {
	if d.o.WaitTimeout <= 0 || len(st.Services) == 0 {
		return nil
	}
	d.say("Waiting for the services' ports (at most %s each)...", d.o.WaitTimeout)
	errs := make([]error, len(st.Services))
	var wg sync.WaitGroup
	for i, r := range st.Services {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = d.wait(ctx, r)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// wait waits for one service's ports; a timeout is a warning.
func (d *driver) wait(ctx context.Context, r Running) error {
	var ports []int
	if r.HealthPort != 0 {
		ports = []int{r.HealthPort}
	} else {
		out, err := d.must(ctx, "read the exposed ports of service "+r.Shown, d.podman(ExposedPortsArgv(r.Ref)), nil)
		if err != nil {
			return err
		}
		if ports, err = ParseExposedPorts(out); err != nil {
			return exitcodes.System(fmt.Errorf("services: the image of service %s: %w", r.Shown, err))
		}
	}
	if len(ports) == 0 {
		d.say("Service %s: its image exposes no TCP port and it sets no HEALTHCHECK_TCP_PORT: not waited for", r.Shown)
		return nil
	}
	t := time.Now()
	deadline := t.Add(d.o.WaitTimeout)
	for _, p := range ports {
		left := time.Until(deadline)
		secs := int((left + time.Second - 1) / time.Second)
		code := 124
		if left > 0 {
			var err error
			code, _, _, err = d.exec(ctx, WaitPortArgv(r.Addr, p, secs), nil, nil)
			if err != nil {
				return exitcodes.System(fmt.Errorf("services: wait for service %s: %w", r.Shown, err))
			}
		}
		if code != 0 {
			what := "did not answer"
			if code != 124 {
				what = fmt.Sprintf("could not be probed (exit status %d)", code)
			}
			d.say("WARNING: service %s %s on %s:%d within %s; the job goes on without waiting for it. Its last log lines:",
				r.Shown, what, r.Addr, p, d.o.WaitTimeout)
			d.showLogs(ctx, r.Service, LogLines)
			return nil
		}
	}
	d.say("Service %s answers on port %s after %s", r.Shown, joinInts(ports), since(t))
	return nil
}

// showLogs writes a service's last n log lines (all when n is 0, bounded)
// to the job log, each prefixed with its container.
func (d *driver) showLogs(ctx context.Context, s Service, n int) {
	argv := LogsArgv(s.Container, n)
	if n == 0 {
		argv = []string{"podman", "logs", s.Container}
	}
	out := &capped{limit: maxLogText}
	// podman logs writes the container's stderr to its own stderr: both go
	// to the same capped buffer, in the order they arrive.
	_, err := d.g.Exec(ctx, d.podman(argv), nil, nil, out, out)
	text := out.bytes()
	if err != nil && len(text) == 0 {
		d.say("  [%s] (its logs cannot be read: %v)", s.Container, err)
		return
	}
	lines := bytes.Split(bytes.TrimRight(text, "\n"), []byte("\n"))
	if len(text) == 0 {
		lines = nil
	}
	if n > 0 && len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	if len(lines) == 0 {
		d.say("  [%s] (no output)", s.Container)
	}
	for _, l := range lines {
		d.say("  [%s] %s", s.Container, printable(string(l)))
	}
	if out.over {
		d.say("  [%s] (more output not shown)", s.Container)
	}
}

// FollowLogs streams each started service's output (since: podman's
// --since, "" for all of it) into w, each line prefixed with the service's
// first alias, until ctx ends or the services end. It returns when ctx
// ends.
func FollowLogs(ctx context.Context, g Guest, st *Started, sudo bool, since string, w io.Writer) {
	followLogs(ctx, g, st, sudo, since, w, nil)
}

// followLogs is FollowLogs, counting each service's lines in seen (if
// set, one counter a service).
func followLogs(ctx context.Context, g Guest, st *Started, sudo bool, since string, w io.Writer, seen []atomic.Int64) {
	d := &driver{g: g, o: Options{Sudo: sudo}, log: w}
	var wg sync.WaitGroup
	for i, r := range st.Services {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pr, pw := io.Pipe()
			done := make(chan struct{})
			go func() {
				defer close(done)
				sc := bufio.NewScanner(pr)
				sc.Buffer(make([]byte, 4096), 64<<10)
				for sc.Scan() {
					d.say("[service %s] %s", r.Aliases[0], printable(sc.Text()))
					if seen != nil {
						seen[i].Add(1)
					}
				}
				_, _ = io.Copy(io.Discard, pr)
			}()
			_, _ = g.Exec(ctx, d.podman(FollowLogsArgv(r.Container, since)), nil, nil, pw, pw)
			_ = pw.Close()
			<-done // every line written before FollowLogs returns
		}()
	}
	wg.Wait()
}

// lineCount counts the lines written to it (stdout and stderr of one
// command, written from two goroutines).
type lineCount struct{ n atomic.Int64 }

func (c *lineCount) Write(p []byte) (int, error) {
	c.n.Add(int64(bytes.Count(p, []byte{'\n'})))
	return len(p), nil
}

// catchUp waits, until deadline, for each service's follower to have
// shown the lines its container has written since since (podman logs
// once, without following, counts them): a follower starts slowly in a
// slow guest, and a stage that ends before it printed would lose them.
func catchUp(ctx context.Context, d *driver, st *Started, since string, seen []atomic.Int64, deadline time.Time) {
	for i, r := range st.Services {
		var n lineCount
		argv := d.podman([]string{"podman", "logs", "--since", since, r.Container})
		cctx, cancel := context.WithDeadline(ctx, deadline)
		code, err := d.g.Exec(cctx, argv, nil, nil, &n, &n)
		cancel()
		if err != nil || code != 0 {
			continue // gone (the script removed it?): nothing to wait for
		}
		for seen[i].Load() < n.n.Load() && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond) // the follower's progress is polled
		}
	}
}

// serviceContainerRE is a service container's name (containerName).
var serviceContainerRE = regexp.MustCompile(`^lve-service-[0-9]{1,3}$`)

// StartServiceLogs is what CI_DEBUG_SERVICES asks of a job's stage: what
// the job's service containers write from now on (from the guest's
// previous second: a line may show in two stages) streamed into w, each
// line prefixed "[service lve-service-N]". It returns once the guest's
// time is read and the containers are found (the running containers
// with the driver's label and a service's name; none: nothing follows);
// stop waits, at most grace, until each stream has shown what its
// container wrote so far (catchUp), then ends the streams.
func StartServiceLogs(ctx context.Context, g Guest, sudo bool, w io.Writer) (stop func(grace time.Duration), err error) {
	d := &driver{g: g, o: Options{Sudo: sudo}, log: io.Discard}
	code, out, errText, err := d.exec(ctx, []string{"date", "+%s"}, nil, nil)
	if err != nil {
		return nil, err
	}
	now, perr := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if code != 0 || perr != nil {
		return nil, fmt.Errorf("the guest's time: exit status %d: %s", code, printable(errText))
	}
	code, out, errText, err = d.exec(ctx, d.podman(ServiceContainersArgv()), nil, nil)
	if err != nil {
		return nil, err
	}
	if code != 0 {
		return nil, fmt.Errorf("podman ps: exit status %d: %s", code, printable(errText))
	}
	st := &Started{}
	for _, n := range strings.Fields(string(out)) {
		if serviceContainerRE.MatchString(n) && len(st.Services) < MaxServices {
			st.Services = append(st.Services, Running{Service: Service{Container: n, Aliases: []string{n}}})
		}
	}
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	since := strconv.FormatInt(now-1, 10)
	seen := make([]atomic.Int64, len(st.Services))
	go func() {
		defer close(done)
		followLogs(fctx, g, st, sudo, since, w, seen)
	}()
	return func(grace time.Duration) {
		if len(st.Services) > 0 && grace > 0 {
			catchUp(ctx, d, st, since, seen, time.Now().Add(grace))
		}
		cancel()
		<-done
	}, nil
}

// printable is a guest's line for the job log: control characters (a
// terminal escape, a carriage return) shown as \xNN, tabs kept.
func printable(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == '\t' || (r >= 0x20 && r != 0x7f && (r < 0x80 || r >= 0xa0)):
			b.WriteRune(r)
		default:
			fmt.Fprintf(&b, "\\x%02x", r)
		}
	}
	return b.String()
}

func joinInts(l []int) string {
	s := make([]string, len(l))
	for i, n := range l {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ", ")
}

// capped keeps the first limit bytes written to it and drops the rest,
// accepting every write (the guest's output keeps flowing).
type capped struct {
	mu    sync.Mutex
	limit int
	b     []byte
	over  bool
}

func (c *capped) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	room := c.limit - len(c.b)
	if room < len(p) {
		c.over = true
	}
	if room > 0 {
		c.b = append(c.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (c *capped) bytes() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.b)
}
