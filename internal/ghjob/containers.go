package ghjob

// The job's other containers (issue #47): its service containers, started
// by prepare_job on the job's network beside the job container, each by
// its contextName; and run_container_step's one-off container. They are
// built from the same pieces as the job container (runArgv) and the
// services layer's podman argument vectors (services.NetworkCreateArgv,
// PullArgv, Label, ParseRef, the allow-list), in the job's VM.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghhooks"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghshare"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// runArgv is head (podman run and its mode) followed by what every
// container of the job gets: its name, the driver's label, the job's
// network (and aliases there), its working directory, its variables
// (names on the command line, values in env: podman takes them from its
// environment), its mounts (those under the work directory at their paths
// in the VM, those under the externals read-only when they are shared,
// named volumes; others left out and said so), its published
// ports and its allowed create options. The caller adds the entry point,
// the image and the arguments.
func (h *hook) runArgv(head []string, c *ghhooks.Container, name, network string, aliases, createArgs []string) (argv, env []string) {
	argv = append(slices.Clone(head), "--name", name, "--label", services.Label, "--network", network)
	for _, a := range aliases {
		argv = append(argv, "--network-alias", a)
	}
	if c.WorkingDir != "" {
		argv = append(argv, "--workdir", c.WorkingDir)
	}
	for _, k := range slices.Sorted(mapsKeys(c.Env)) {
		if k == "PATH" {
			argv = append(argv, "--env", "PATH="+c.Env[k])
			continue
		}
		argv = append(argv, "--env", k)
		env = append(env, k+"="+c.Env[k])
	}
	for _, m := range append(slices.Clone(c.SystemMounts), c.UserMounts...) {
		src := ghhooks.HostPath(m.Source)
		if !filepath.IsAbs(src) {
			// a named volume, made in the VM
			argv = append(argv, "--mount", "type=volume,source="+src+",destination="+m.Target+roOpt(m.ReadOnly))
			continue
		}
		shared, ro := h.inVM(src)
		if !shared {
			h.say("Not mounted in %s: %s at %s (not shared with the VM)", name, src, m.Target)
			continue
		}
		argv = append(argv, "--mount", "type=bind,source="+src+",destination="+m.Target+roOpt(m.ReadOnly || ro))
	}
	for _, p := range c.PortMappings {
		pp, err := ghhooks.ParsePort(p)
		if err != nil {
			continue // checked by ghhooks before
		}
		argv = append(argv, "--publish", publishArg(pp))
	}
	return append(argv, createArgs...), env
}

// publishArg is podman's --publish value of a port mapping: the VM's
// port as asked, or one podman picks.
func publishArg(p ghhooks.Port) string {
	s := strconv.Itoa(p.Container) + "/" + p.Proto
	if p.VM > 0 {
		s = strconv.Itoa(p.VM) + ":" + s
	}
	return s
}

// entryArgv is a service's or container step's entry point (when it
// names one) as podman's JSON --entrypoint, the image, then its arguments.
func entryArgv(c *ghhooks.Container, ref services.Ref) []string {
	var argv []string
	if c.EntryPoint != nil && *c.EntryPoint != "" {
		b, _ := json.Marshal([]string{*c.EntryPoint}) // a []string always marshals
		argv = append(argv, "--entrypoint="+string(b))
	}
	argv = append(argv, ref.String())
	return append(argv, c.EntryPointArgs...)
}

// portsArgv prints a container's published ports, one
// "5432/tcp -> 0.0.0.0:40123" a line.
func portsArgv(container string) []string { return []string{podman, "port", container} }

var portLine = regexp.MustCompile(`^([0-9]{1,5})(/[a-z]+)? -> (.*):([0-9]{1,5})$`)

// parsePorts reads portsArgv's output as the runner's context wants it:
// the container's port -> the VM's port it is published at.
func parsePorts(out []byte) (map[string]string, error) {
	ports := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		m := portLine.FindStringSubmatch(l)
		if m == nil {
			return nil, fmt.Errorf("podman port: %q is not a port mapping", cut(l, 128))
		}
		ports[m[1]] = m[4]
	}
	return ports, nil
}

// ports reads the ports a container publishes on the VM.
func (h *hook) ports(ctx context.Context, g *guest, container string) (map[string]string, error) {
	out, err := g.must(ctx, "read the published ports of "+container, portsArgv(container), nil)
	if err != nil {
		return nil, err
	}
	return parsePorts(out)
}

// serviceName is the container name of the service called contextName.
func serviceName(st ghhooks.State, contextName string) string {
	return st.Container + "-svc-" + contextName
}

// startServices pulls and starts the job's service containers on its
// network, each reachable there by its contextName (a network alias, in
// the network's DNS), and answers each one's part of the response. The
// services' create options were checked and turned into arguments before
// anything was made (createArgs, by index).
func (h *hook) startServices(ctx context.Context, g *guest, svcs []ghhooks.Container, createArgs [][]string, st *ghhooks.State) ([]ghhooks.ServiceContext, error) {
	out := []ghhooks.ServiceContext{}
	for i := range svcs {
		s := &svcs[i]
		t := time.Now()
		ref, err := services.ParseRef(s.Image)
		if err != nil {
			return nil, fmt.Errorf("services[%d].image: %w", i, err)
		}
		if err := h.pull(ctx, g, ref, s.Registry); err != nil {
			return nil, fmt.Errorf("service %s: %w", s.ContextName, err)
		}
		name := serviceName(*st, s.ContextName)
		argv, env := h.runArgv([]string{podman, "run", "--detach", "--pull=never"}, s, name, st.Network, []string{s.ContextName}, createArgs[i])
		argv = append(argv, entryArgv(s, ref)...)
		b, err := g.must(ctx, "start the service "+s.ContextName, argv, env)
		if err != nil {
			return nil, err
		}
		if st.Services == nil {
			st.Services = map[string]string{}
		}
		st.Services[s.ContextName] = name
		sc := ghhooks.ServiceContext{ContextName: s.ContextName, Image: s.Image, ID: strings.TrimSpace(string(b)), Network: st.Network}
		if len(s.PortMappings) > 0 {
			if sc.Ports, err = h.ports(ctx, g, name); err != nil {
				return nil, err
			}
		}
		out = append(out, sc)
		h.say("Started the service %s (%s) in %s", s.ContextName, ref.String(), vm.Round(time.Since(t)))
	}
	// All started, each may now take its time to become healthy.
	for i := range svcs {
		if err := h.waitHealthy(ctx, g, svcs[i].ContextName, st.Services[svcs[i].ContextName]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// healthPoll is how often waitHealthy runs a service's health check,
// healthGrace how long past health_timeout one check may take to answer.
const healthPoll = time.Second

var healthGrace = 5 * time.Second

// waitHealthy waits until the service container name (the job's service
// contextName) answers its health check (podman healthcheck run: its
// createOptions' --health-cmd, else the image's HEALTHCHECK), as the
// runner's Docker hook waits before prepare_job answers; at most
// github_hooks.health_timeout. A service without a health check is not
// waited for; one still unhealthy then fails, with its check's answer.
func (h *hook) waitHealthy(ctx context.Context, g *guest, contextName, name string) error {
	t := time.Now()
	deadline := t.Add(h.g.HealthTimeout.D())
	for tries := 1; ; tries++ {
		// One check may hang (its own --health-timeout is the job's):
		// health_timeout bounds it too, with a little room to answer.
		cctx, cancel := context.WithDeadline(ctx, deadline.Add(healthGrace))
		code, out, errText, err := g.exec(cctx, []string{podman, "healthcheck", "run", name}, nil, nil)
		cancel()
		if err != nil {
			if ctx.Err() == nil && time.Now().After(deadline) {
				return fmt.Errorf("the service %s is not healthy after %s: its health check did not answer (github_hooks.health_timeout = %s, allowed 1s to 30m)", contextName, vm.Round(time.Since(t)), h.g.HealthTimeout.D())
			}
			return fmt.Errorf("the health check of the service %s: %w", contextName, err)
		}
		switch {
		case code == 0:
			if tries > 1 {
				h.say("The service %s is healthy after %s (%d checks)", contextName, vm.Round(time.Since(t)), tries)
			} else {
				h.say("The service %s is healthy", contextName)
			}
			return nil
		case code == 125 && strings.Contains(strings.ToLower(errText), "no defined healthcheck"):
			return nil
		case code != 1:
			return fmt.Errorf("the health check of the service %s failed (exit status %d): %s", contextName, code, strconv.Quote(errText))
		}
		if !time.Now().Add(healthPoll).Before(deadline) {
			return fmt.Errorf("the service %s is not healthy after %s (github_hooks.health_timeout = %s, allowed 1s to 30m; %d checks, podman's last answer %s)",
				contextName, vm.Round(time.Since(t)), h.g.HealthTimeout.D(), tries, strconv.Quote(strings.TrimSpace(string(out)+" "+errText)))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the service %s to be healthy: %w", contextName, context.Cause(ctx))
		case <-time.After(healthPoll):
		}
	}
}

// stepName is a fresh name for a container step's container (and its
// built image's tag): the job container's name and a random suffix.
func stepName(st *ghhooks.State) (string, error) {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return st.Container + "-step-" + hex.EncodeToString(b[:]), nil
}

// containerStep runs run_container_step: a one-off container on the job's
// network in the job's VM, of an allowed image or one built from a
// Dockerfile under the work directory (allow_build), with the step's
// entry point, arguments, variables (values never on a command line),
// working directory, mounts, ports and allowed create options; its output
// is the hook's, its exit status the hook's. The container (and a built
// image) is removed after the step, also when the hook is stopped.
func (h *hook) containerStep(ctx context.Context, in *ghhooks.Input) (err error) {
	st, err := in.DecodeState()
	if err != nil {
		return err
	}
	o := h.opts
	o.AllowBuild = h.g.AllowBuild
	c, err := in.ContainerStep(o)
	if err != nil {
		return err
	}
	build := c.Image == ""
	if build && !h.underWork(*c.Dockerfile) {
		return fmt.Errorf("args.dockerfile %q: not under the runner's work directory %s (the only directory the job's VM has)", cut(*c.Dockerfile, 256), h.g.WorkDir)
	}
	createArgs, err := h.opts.CreateArgs("args", c.CreateOptions)
	if err != nil {
		return err
	}
	jobs, j, err := h.jobOf(st)
	if err != nil {
		return err
	}
	defer jobs.Close()
	// The externals are in the VM when prepare_job shared them.
	if share, err := ghshare.Load(h.cfg.StateDir, st.Machine); err == nil && share != nil && share.ExtPID > 0 {
		h.extShared = true
	}
	g, closeGuest, err := jobGuest(ctx, j)
	if err != nil {
		return err
	}
	defer closeGuest()
	return h.runStep(ctx, g, st, c, createArgs)
}

// runStep runs a checked container step in the job's VM through g.
func (h *hook) runStep(ctx context.Context, g *guest, st *ghhooks.State, c *ghhooks.Container, createArgs []string) (err error) {
	build := c.Image == ""
	name, err := stepName(st)
	if err != nil {
		return err
	}
	// What the step leaves goes, also when it was cancelled or failed.
	var built string
	defer func() {
		rctx, cancel := detachctx.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if _, rerr := g.must(rctx, "remove the step's container "+name, rmArgv(name), nil); rerr != nil {
			err = errors.Join(err, rerr)
		}
		if built != "" {
			if _, rerr := g.must(rctx, "remove the step's image "+built, rmiArgv(built), nil); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}
	}()
	var ref services.Ref
	if build {
		tag := "localhost/" + name + ":latest"
		if ref, err = services.ParseRef(tag); err != nil {
			return err
		}
		h.say("Building the step's image from %s in the VM", *c.Dockerfile)
		code, err := g.c.Exec(ctx, g.wrap(buildArgv(*c.Dockerfile, ref.String()), nil), nil, nil, h.e.Stderr, h.e.Stderr)
		if err != nil {
			return fmt.Errorf("build the step's image: %w", err)
		}
		if code != 0 {
			return fmt.Errorf("build the step's image from %s failed (exit status %d)", *c.Dockerfile, code)
		}
		built = ref.String()
	} else {
		if ref, err = services.ParseRef(c.Image); err != nil {
			return fmt.Errorf("args.image: %w", err)
		}
		if err := h.pull(ctx, g, ref, c.Registry); err != nil {
			return err
		}
	}
	argv, env := h.runArgv([]string{podman, "run", "--rm", "--pull=never"}, c, name, st.Network, nil, createArgs)
	argv = append(argv, entryArgv(c, ref)...)
	code, err := g.c.Exec(ctx, g.wrap(argv, env), env, nil, h.e.Stdout, h.e.Stderr)
	if ctx.Err() != nil {
		return fmt.Errorf("the container step %s stopped: %w", name, context.Cause(ctx))
	}
	if err != nil {
		return fmt.Errorf("the container step %s: %w", name, err)
	}
	if code != 0 {
		return &ExitError{Code: code}
	}
	return nil
}

// buildArgv builds a container step's image from dockerfile, with its
// directory as the context (the VM has the work directory at the same
// path), labelled as the driver's.
func buildArgv(dockerfile, tag string) []string {
	return []string{podman, "build", "--label", services.Label, "--file", dockerfile, "--tag", tag, filepath.Dir(dockerfile)}
}

// rmArgv removes a container if it is there (stopping it first).
func rmArgv(name string) []string {
	return []string{podman, "rm", "--force", "--ignore", "--time", "5", name}
}

// rmiArgv removes an image the step built.
func rmiArgv(ref string) []string { return []string{podman, "rmi", "--force", ref} }

// cut shortens untrusted text for a message.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
