//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// hookShareUser is the user the hook test's virtiofsd runs as: made once
// (a system user without a home, with 65536 subordinate ids) and kept.
const hookShareUser = "lve-e2e-hooks"

// ensureHookShareUser makes hookShareUser with its subordinate ids, if
// this host has not got it yet, and returns its uid and gid.
func ensureHookShareUser(t *testing.T) (uid, gid int) {
	t.Helper()
	if _, err := user.Lookup(hookShareUser); err != nil {
		out, err := exec.Command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", hookShareUser).CombinedOutput()
		require.NoError(t, err, "useradd: %s", out)
	}
	sub, err := os.ReadFile("/etc/subuid")
	if err != nil || !strings.Contains(string(sub), hookShareUser+":") {
		out, err := exec.Command("usermod", "--add-subuids", "1200000000-1200065535", "--add-subgids", "1200000000-1200065535", hookShareUser).CombinedOutput()
		require.NoError(t, err, "usermod: %s", out)
	}
	u, err := user.Lookup(hookShareUser)
	require.NoError(t, err)
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	return uid, gid
}

// hookResult is one call of the hook.
type hookResult struct {
	code           int
	stdout, stderr string
}

// callHook runs the real libvirt-executor-hooks as the runner does: one
// JSON object on stdin, the configuration from the environment.
func callHook(t *testing.T, exe, cfgPath string, input any) hookResult {
	t.Helper()
	b, err := json.Marshal(input)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LIBVIRT_EXECUTOR_CONFIG=" + cfgPath}
	cmd.Stdin = bytes.NewReader(b)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	began := time.Now()
	err = cmd.Run()
	took := time.Since(began)
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	t.Logf("hook %v: exit %d in %s\nstdout:\n%s\nstderr:\n%s", input.(map[string]any)["command"], code, took.Round(time.Millisecond), out.String(), errb.String())
	return hookResult{code: code, stdout: out.String(), stderr: errb.String()}
}

// TestGitHubHooks drives the real libvirt-executor-hooks with the runner's
// JSON shapes (those of actions/runner-container-hooks' examples) and a
// temporary _work, on one cold VM of the podman image:
//   - prepare_job starts the job's virtiofsd (as the share user, in a user
//     namespace), boots the VM with _work shared at the same path, starts
//     the job container (an image from a registry reached as docker.io's
//     mirror) and writes the response: the state names the VM;
//   - three run_script_step calls run in the job container with the
//     step's variables, working directory and prependPath: the first reads
//     the checkout the runner made on the host and writes a file the host
//     then sees (owned by the share user, not root), the second exits 3
//     and so does the hook, the third sees the first's file;
//   - a service container (the test image's HTTP server, contextName db,
//     a port published where podman picks) and a job container port at
//     VM port 8080: the response names both with their ports; a script
//     step reaches the service as db; the service answers at the VM's
//     address and the port the response names;
//   - three run_container_step calls (the checkout mounted as the runner
//     mounts it): the first (an allowed image) reaches the service, sees
//     its variables (the step's and one of its options) and writes a file
//     the host then sees; the second exits 5 and so does the hook; the
//     third runs an image built in the VM from a Dockerfile in the
//     checkout (allow_build); no step's container or built image is left;
//   - cleanup_job twice: both succeed, and no domain, volume, machine
//     state, share record, socket directory or virtiofsd is left.
//
// hookSetup is the rig of a hook test: the share user, a registry reached
// as docker.io's mirror with the shell image as alpine:3.19, the runner's
// layout in a temporary directory (RUNNER/_work, the share user's, with a
// checkout; RUNNER/externals) and a configuration with [github_hooks].
type hookSetup struct {
	r         *rig
	work, ext string
	uid, gid  int
	hook      string
	checkout  string
}

func newHookSetup(t *testing.T) *hookSetup {
	t.Helper()
	base := setup(t)
	if base.user != nil {
		t.Skip("the hook runs as root here and starts virtiofsd as its share user; the confined mode's runner user has no subordinate ids")
	}
	podman := podmanImage(t, base)
	uid, gid := ensureHookShareUser(t)
	ln := base.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	reg := registrytest.StartAt(t, addr)
	pushShellImage(t, reg.Host, "library/alpine", "3.19")

	// The runner's layout: RUNNER/_work (the share user's, as a runner's
	// user owns it) and RUNNER/externals.
	root, err := os.MkdirTemp("", "lve-gh-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	require.NoError(t, os.Chmod(root, 0o755))
	work, ext := filepath.Join(root, "_work"), filepath.Join(root, "externals")
	for _, d := range []string{work, ext, work + "/_temp/_runner_hook_responses", work + "/_temp/_github_home", work + "/_temp/_github_workflow", work + "/repo/repo"} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	// A stand-in for the runner's node (JavaScript actions run it from
	// /__e): the externals stay root's, as the runner's user's are not the
	// share's namespace's.
	require.NoError(t, os.MkdirAll(filepath.Join(ext, "node20/bin"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(ext, "node20/bin/node"), []byte("#!/bin/sh\necho \"node stand-in: $*\"\n"), 0o755)) //nolint:gosec // G306: runs in the job container
	require.NoError(t, os.Symlink("node20/bin/node", filepath.Join(ext, "node")))
	const checkout = "checked out on the host\n"
	require.NoError(t, os.WriteFile(filepath.Join(work, "repo/repo/checkout.txt"), []byte(checkout), 0o644))
	require.NoError(t, filepath.Walk(work, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	}))

	r := base.withConfig(t, func(s string) string {
		// The podman image's machines boot with shared memory: a hook job
		// can take one of its standby VMs (TestGitHubHooksSweep).
		s = strings.Replace(s+"\n"+podman, "[images.podman]\n", "[images.podman]\nshared_memory = true\n", 1)
		return s + fmt.Sprintf(`
[services]
plain_http = [%q]
[services.mirrors]
"docker.io" = [%q]
[github_hooks]
vm_image = "podman"
allowed_images = ["alpine:*"]
work_dir = %q
share_user = %q
runtime_dir = "/run/lve-e2e-hooks"
job_timeout = "30m"
allow_build = true
`, reg.Host, reg.Host, work, hookShareUser)
	})
	return &hookSetup{r: r, work: work, ext: ext, uid: uid, gid: gid, hook: filepath.Join(r.bin, "libvirt-executor-hooks"), checkout: checkout}
}

// prepareInput is prepare_job's input as the runner writes it (the shape
// of the hook examples), answering into resp.
func (hs *hookSetup) prepareInput(resp string) map[string]any {
	work, ext := hs.work, hs.ext
	mounts := []map[string]any{
		{"sourceVolumePath": "/var/run/docker.sock", "targetVolumePath": "/var/run/docker.sock", "readOnly": false},
		{"sourceVolumePath": work, "targetVolumePath": "/__w", "readOnly": false},
		{"sourceVolumePath": ext, "targetVolumePath": "/__e", "readOnly": true},
		{"sourceVolumePath": work + "/_temp", "targetVolumePath": "/__w/_temp", "readOnly": false},
		{"sourceVolumePath": "/" + work + "/_temp/_github_home", "targetVolumePath": "/github/home", "readOnly": false},
		{"sourceVolumePath": work + "/_temp/_github_workflow", "targetVolumePath": "/github/workflow", "readOnly": false},
	}
	return map[string]any{
		"command": "prepare_job", "responseFile": resp, "state": map[string]any{},
		"args": map[string]any{
			"container": map[string]any{
				"image": "alpine:3.19", "workingDirectory": "/__w/repo/repo",
				"entryPoint": "tail", "entryPointArgs": []string{"-f", "/dev/null"},
				"createOptions":        "--label lve-e2e=hooks",
				"environmentVariables": map[string]string{"GITHUB_ACTIONS": "true", "CI": "true"},
				"userMountVolumes":     []any{}, "systemMountVolumes": mounts,
				"registry": nil, "portMappings": []string{},
			},
			"services": []any{},
		},
	}
}

// hookShare is the share record of a hook job's machine.
type hookShare struct {
	PID       int    `json:"pid"`
	VM        string `json:"vm"`
	ExtPID    int    `json:"ext_pid"`
	SocketDir string `json:"socket_dir"`
	RunnerPID int    `json:"runner_pid"`
}

func (hs *hookSetup) share(t *testing.T, machine string) hookShare {
	t.Helper()
	var share hookShare
	rb, err := os.ReadFile(filepath.Join(hs.r.cfg.StateDir, "github-hooks", machine+".json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(rb, &share))
	return share
}

// requireShareGone: no record, socket directory or virtiofsd of machine.
func (hs *hookSetup) requireShareGone(t *testing.T, machine string, share hookShare) {
	t.Helper()
	require.NoFileExists(t, filepath.Join(hs.r.cfg.StateDir, "github-hooks", machine+".json"), "the share record is gone")
	require.NoDirExists(t, share.SocketDir)
	require.True(t, processGone(share.PID), "virtiofsd has ended")
	require.True(t, share.ExtPID == 0 || processGone(share.ExtPID), "the externals' virtiofsd has ended")
}

func TestGitHubHooks(t *testing.T) {
	hs := newHookSetup(t)
	r, work, uid, hook, checkout := hs.r, hs.work, hs.uid, hs.hook, hs.checkout
	resp := filepath.Join(work, "_temp/_runner_hook_responses/prepare.json")
	in := hs.prepareInput(resp)
	// A service (the test image's HTTP server) reached by its contextName,
	// its port published on the VM where podman picks, and one of the job
	// container's at a port asked for.
	args := in["args"].(map[string]any)
	args["container"].(map[string]any)["portMappings"] = []string{"8080:80"}
	args["services"] = []any{map[string]any{
		"contextName": "db", "image": "alpine:3.19", "entryPoint": "/bin/svcserver", "entryPointArgs": []string{},
		"createOptions":        `--hostname db-host --health-cmd "/bin/svcserver get http://127.0.0.1:5432/"`,
		"environmentVariables": map[string]string{"MARKER": "svc-marker"},
		"userMountVolumes":     []any{}, "systemMountVolumes": []any{}, "registry": nil, "portMappings": []string{"5432"},
	}}
	began := time.Now()
	prep := callHook(t, hook, r.cfgPath, in)
	require.Equal(t, 0, prep.code, "prepare_job")
	t.Logf("prepare_job took %s (cold)", time.Since(began))
	b, err := os.ReadFile(resp)
	require.NoError(t, err)
	type ctxContainer struct {
		ContextName, Image, ID, Network string
		Ports                           map[string]string
	}
	var answer struct {
		State   map[string]any `json:"state"`
		Context struct {
			Container ctxContainer   `json:"container"`
			Services  []ctxContainer `json:"services"`
		} `json:"context"`
		IsAlpine *bool `json:"isAlpine"`
	}
	require.NoError(t, json.Unmarshal(b, &answer))
	require.Equal(t, map[string]string{"80": "8080"}, answer.Context.Container.Ports, "the job container's port at the VM's port asked for")
	require.Len(t, answer.Context.Services, 1)
	svc := answer.Context.Services[0]
	require.Equal(t, "db", svc.ContextName)
	require.NotEmpty(t, svc.ID)
	require.Equal(t, answer.Context.Container.Network, svc.Network)
	require.Contains(t, svc.Ports, "5432", "the service's port is reported: %v", svc.Ports)
	vmPort := svc.Ports["5432"]
	require.Regexp(t, `^[0-9]+$`, vmPort)
	machine, _ := answer.State["machine"].(string)
	require.True(t, strings.HasPrefix(machine, r.cfg.NamePrefix+"-"), "the state names the job's VM: %v", answer.State)
	cleaned := false
	t.Cleanup(func() {
		if !cleaned { // a failed test: its job goes, virtiofsd and all
			callHook(t, hook, r.cfgPath, map[string]any{"command": "cleanup_job", "responseFile": nil, "state": answer.State, "args": map[string]any{}})
		}
	})
	require.NotEmpty(t, answer.Context.Container.ID)
	require.NotEmpty(t, answer.Context.Container.Network)
	require.NotNil(t, answer.IsAlpine)
	require.False(t, *answer.IsAlpine, "the busybox image has no /etc/os-release of Alpine")
	require.Contains(t, prep.stderr, "Mounted "+work+" in the VM at the same path (virtiofs)")
	require.Regexp(t, `The service db is healthy`, prep.stderr, "prepare_job waited for the service's health check")

	// The job's virtiofsd: recorded, running as the share user.
	share := hs.share(t, machine)
	require.NotZero(t, share.PID)
	require.Zero(t, share.RunnerPID, "no runner's worker above a test")
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", share.PID))
	require.NoError(t, err)
	require.Contains(t, string(status), fmt.Sprintf("\nUid:\t%d\t%d\t%d\t%d\n", uid, uid, uid, uid), "virtiofsd runs as the share user, never root")
	fi, err := os.Stat(share.SocketDir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o710)|os.ModeDir, fi.Mode(), "only QEMU's group may enter the socket's directory")
	require.NotZero(t, share.ExtPID, "the externals have a virtiofsd of their own")
	status, err = os.ReadFile(fmt.Sprintf("/proc/%d/status", share.ExtPID))
	require.NoError(t, err)
	require.Contains(t, string(status), "\nUid:\t1200000000\t", "the externals' virtiofsd is a subordinate id of the share user on the host, not the user")

	step := func(script string, env map[string]string) hookResult {
		name := fmt.Sprintf("step-%d.sh", time.Now().UnixNano())
		require.NoError(t, os.WriteFile(filepath.Join(work, "_temp", name), []byte(script), 0o644))
		return callHook(t, hook, r.cfgPath, map[string]any{
			"command": "run_script_step", "responseFile": nil, "state": answer.State,
			"args": map[string]any{
				"entryPoint": "sh", "entryPointArgs": []string{"-e", "/__w/_temp/" + name},
				"environmentVariables": env, "prependPath": []string{"/opt/lve-tool/bin"},
				"workingDirectory": "/__w/repo/repo",
			},
		})
	}
	first := step(`echo "hello from $GREETING in $(pwd)"
echo "PATH=$PATH"
cat /__w/repo/repo/checkout.txt
echo "written in the VM" > /__w/repo/repo/out.txt
`, map[string]string{"GREETING": "the first step", "GITHUB_WORKSPACE": "/__w/repo/repo"})
	require.Equal(t, 0, first.code)
	require.Contains(t, first.stdout, "hello from the first step in /__w/repo/repo")
	require.Contains(t, first.stdout, "PATH=/opt/lve-tool/bin:/bin", "prependPath before the container's PATH")
	require.Contains(t, first.stdout, checkout, "the step sees the checkout the runner made on the host")
	out, err := os.ReadFile(filepath.Join(work, "repo/repo/out.txt"))
	require.NoError(t, err, "the file the step wrote is in the runner's _work")
	require.Equal(t, "written in the VM\n", string(out))
	fi, err = os.Stat(filepath.Join(work, "repo/repo/out.txt"))
	require.NoError(t, err)
	require.Equal(t, uint32(uid), fi.Sys().(*syscall.Stat_t).Uid, "what the container's root writes is the share user's on the host, not root's") //nolint:gosec // a uid

	second := step("echo before the failure\nexit 3\n", nil)
	require.Equal(t, 3, second.code, "the step's status is the hook's")
	require.Contains(t, second.stdout, "before the failure")

	third := step("test -f out.txt && echo third sees $(cat out.txt)\n", nil)
	require.Equal(t, 0, third.code)
	require.Contains(t, third.stdout, "third sees written in the VM")

	// The runner's externals: in the job container at /__e, read-only
	// there and in the VM; a root guest that mounts them writable still
	// cannot change them on the host.
	require.Contains(t, prep.stderr, "Mounted "+hs.ext+" in the VM at the same path, read-only")
	node := step("/__e/node20/bin/node --version\n/__e/node x\nif echo x > /__e/planted 2>/dev/null; then echo planted in the container; fi\n", nil)
	require.Equal(t, 0, node.code, "%s", node.stderr)
	require.Contains(t, node.stdout, "node stand-in: --version", "a JavaScript action's node runs from the externals")
	require.Contains(t, node.stdout, "node stand-in: x", "symbolic links inside the externals work")
	require.NotContains(t, node.stdout, "planted")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	mrec, mcl, err := r.manager(t).Manager().Machine(machine).Connect(ctx)
	require.NoError(t, err)
	defer mcl.Close()
	sudo := "sudo -n "
	if mrec.User == "root" {
		sudo = ""
	}
	attack := sudo + "sh -c 'mount -o remount,rw " + hs.ext + "; grep \" " + hs.ext + " \" /proc/mounts; echo planted > " + hs.ext + "/planted; echo x >> " + hs.ext + "/node20/bin/node; true' 2>&1"
	aout, err := mcl.Output(ctx, attack)
	require.NoError(t, err)
	t.Logf("a root guest writing to the externals: %s", aout)
	require.Regexp(t, `virtiofs rw[, ]`, string(aout), "the guest's root made its mount writable: only the host stops the writes")
	require.Contains(t, string(aout), "Permission denied", "the host refused the guest's writes")
	require.NoFileExists(t, filepath.Join(hs.ext, "planted"), "a root guest cannot add a file to the runner's externals")
	nb, err := os.ReadFile(filepath.Join(hs.ext, "node20/bin/node"))
	require.NoError(t, err)
	require.NotContains(t, string(nb), "\nx\n", "a root guest cannot change the runner's node")

	// The service by its contextName, from the job container (the
	// network's DNS); the server may take a moment after its start.
	svcStep := step("for i in 1 2 3 4 5 6 7 8 9 10; do svcserver get http://db:5432/ && exit 0; sleep 1; done; exit 1\n", nil)
	require.Equal(t, 0, svcStep.code)
	require.Contains(t, svcStep.stdout, "marker=svc-marker", "the job container reaches the service by its contextName")

	// The service's port as published on the VM answers there, from the
	// VM's network (the test's side of it).
	var rec struct {
		Address string `json:"address"`
	}
	rb, err := os.ReadFile(filepath.Join(r.cfg.StateDir, "machines", machine, "machine.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(rb, &rec))
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Proxy: nil}}
	hr, err := hc.Get("http://" + net.JoinHostPort(rec.Address, vmPort) + "/")
	require.NoError(t, err, "the service's published port on the VM")
	hb, err := io.ReadAll(hr.Body)
	_ = hr.Body.Close()
	require.NoError(t, err)
	require.Contains(t, string(hb), "marker=svc-marker", "the service answers at the VM's port the response names")
	c := dialMachine(t, r, machine)
	vctx, vcancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer vcancel()
	// (stdout and stderr in buffers of their own: two copies into one
	// bytes.Buffer race)
	var got, gotErr bytes.Buffer

	// Container steps: a one-off container of an allowed image on the
	// job's network, the checkout mounted as the runner mounts it.
	cstep := func(script string, env map[string]string, dockerfile ...string) hookResult {
		image, df := any("alpine:3.19"), any(nil)
		if len(dockerfile) > 0 {
			image, df = "", dockerfile[0]
		}
		return callHook(t, hook, r.cfgPath, map[string]any{
			"command": "run_container_step", "responseFile": nil, "state": answer.State,
			"args": map[string]any{
				"image": image, "dockerfile": df, "entryPoint": "sh", "entryPointArgs": []string{"-c", script},
				"workingDirectory": "/github/workspace", "createOptions": "--env OPT_VAR=from-options",
				"environmentVariables": env, "prependPath": []string{}, "portMappings": []string{},
				"systemMountVolumes": []map[string]any{
					{"sourceVolumePath": "/var/run/docker.sock", "targetVolumePath": "/var/run/docker.sock", "readOnly": false},
					{"sourceVolumePath": work + "/repo/repo", "targetVolumePath": "/github/workspace", "readOnly": false},
					{"sourceVolumePath": hs.ext, "targetVolumePath": "/__e", "readOnly": true},
				},
				"userMountVolumes": []any{}, "registry": nil,
			},
		})
	}
	cs := cstep(`echo "container step in $(pwd) with $STEP_VAR and $OPT_VAR"; svcserver get http://db:5432/; echo "$STEP_VAR" > step.txt`,
		map[string]string{"STEP_VAR": "step-value"})
	require.Equal(t, 0, cs.code)
	require.Contains(t, cs.stdout, "container step in /github/workspace with step-value and from-options", "the step's output streams through the hook")
	require.Contains(t, cs.stdout, "marker=svc-marker", "a container step is on the job's network")
	out, err = os.ReadFile(filepath.Join(work, "repo/repo/step.txt"))
	require.NoError(t, err, "the container step's file is in the runner's _work")
	require.Equal(t, "step-value\n", string(out))
	failed := cstep("echo failing; exit 5", nil)
	require.Equal(t, 5, failed.code, "the container's status is the hook's")
	require.Contains(t, failed.stdout, "failing")
	// A step built from a Dockerfile in the checkout (allow_build), in the
	// VM, FROM an allowed image through the same mirror.
	df := filepath.Join(work, "repo/repo/action/Dockerfile")
	require.NoError(t, os.MkdirAll(filepath.Dir(df), 0o755))
	require.NoError(t, os.WriteFile(df, []byte("FROM alpine:3.19\nRUN echo built in the VM > /built.txt\n"), 0o644))
	require.NoError(t, os.Chown(filepath.Dir(df), uid, hs.gid))
	require.NoError(t, os.Chown(df, uid, hs.gid))
	bs := cstep("cat /built.txt", nil, df)
	require.Equal(t, 0, bs.code)
	require.Contains(t, bs.stdout, "built in the VM")
	code, err := c.Exec(vctx, []string{"podman", "ps", "--all", "--format", "{{.Names}}"}, nil, nil, &got, &gotErr)
	require.NoError(t, err)
	require.Equal(t, 0, code, "%s", gotErr.String())
	require.ElementsMatch(t, []string{answer.State["container"].(string), answer.State["container"].(string) + "-svc-db"}, strings.Fields(got.String()),
		"the container steps' containers are gone; the job's and the service's remain")
	got.Reset()
	code, err = c.Exec(vctx, []string{"podman", "images", "--format", "{{.Repository}}"}, nil, nil, &got, &gotErr)
	require.NoError(t, err)
	require.Equal(t, 0, code, "%s", gotErr.String())
	require.NotContains(t, got.String(), "-step-", "the built image is gone")

	for i, want := range []string{"Removed the job's VM " + machine, "The job's VM " + machine + " was released before"} {
		c := callHook(t, hook, r.cfgPath, map[string]any{"command": "cleanup_job", "responseFile": nil, "state": answer.State, "args": map[string]any{}})
		require.Equal(t, 0, c.code, "cleanup_job #%d", i+1)
		require.Contains(t, c.stderr, want)
	}
	cleaned = true
	r.requireNoLeftovers(t, "after cleanup_job")
	hs.requireShareGone(t, machine, share)
}

// processGone says whether process pid has ended (gone, or a zombie).
func processGone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) > 0 && (f[0] == "Z" || f[0] == "X")
}

// TestGitHubHooksSweep: a runner that never calls cleanup_job. prepare_job
// runs under a stand-in for the runner's worker (a script named
// Runner.Worker): the share record names it; a step's hook is killed
// (SIGKILL) in the middle of a long step; a sweep while the worker runs
// leaves the job alone; once the worker is killed, the next sweep
// (libvirt-executor gc) removes the VM and stops virtiofsd, and nothing of
// the job is left.
//
// It is also the warm start: the pool service keeps one idle VM of the
// hook's image (booted with shared memory), and prepare_job claims it and
// hot-plugs the job's shares into it.
func TestGitHubHooksSweep(t *testing.T) {
	hs := newHookSetup(t)
	hs.r = hs.r.withConfig(t, func(s string) string { return poolsvc.WithPool(s, "podman", 1) })
	r := hs.r
	svc := r.serve(t)
	r.waitIdle(t, 1, 5*time.Minute)
	dir := t.TempDir()
	worker := filepath.Join(dir, "Runner.Worker")
	require.NoError(t, os.WriteFile(worker, []byte("#!/bin/sh\n\"$1\" <\"$2\" 2>\"$2.err\"; echo $? >\"$2.rc\"\nsleep 900\n"), 0o755))
	resp := filepath.Join(hs.work, "_temp/_runner_hook_responses/sweep.json")
	b, err := json.Marshal(hs.prepareInput(resp))
	require.NoError(t, err)
	input := filepath.Join(dir, "prepare.json")
	require.NoError(t, os.WriteFile(input, b, 0o600))
	cmd := exec.Command(worker, hs.hook, input)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LIBVIRT_EXECUTOR_CONFIG=" + r.cfgPath}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	killed := false
	kill := func() {
		if !killed {
			killed = true
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			_ = cmd.Wait()
		}
	}
	t.Cleanup(kill)
	deadline := time.Now().Add(10 * time.Minute)
	var rc []byte
	for time.Now().Before(deadline) {
		if rc, err = os.ReadFile(input + ".rc"); err == nil && len(rc) > 0 {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	stderr, _ := os.ReadFile(input + ".err")
	t.Logf("prepare_job under the stand-in worker: exit %s%s", rc, stderr)
	require.Equal(t, "0\n", string(rc), "prepare_job")
	require.Regexp(t, `Warm start: VM \S+ \(idle for`, string(stderr), "an idle VM of the pool took the job")
	require.Contains(t, string(stderr), "The job's shared directories hot-plugged into")
	require.Contains(t, string(stderr), "(warm start)")
	// No more boots: the job's VM is what the sweep is about.
	_, err = svc.Stop(poolsvc.StopWait)
	require.NoError(t, err)
	b, err = os.ReadFile(resp)
	require.NoError(t, err)
	var answer struct {
		State map[string]any `json:"state"`
	}
	require.NoError(t, json.Unmarshal(b, &answer))
	machine, _ := answer.State["machine"].(string)
	share := hs.share(t, machine)
	require.Equal(t, cmd.Process.Pid, share.RunnerPID, "the record names the runner's worker")
	require.NotEqual(t, machine, share.VM, "the record names the claimed standby VM that serves the job")

	// SIGKILL of the hook in the middle of a long step: the step's hook
	// is gone, the job's VM is not, until the sweep.
	require.NoError(t, os.WriteFile(filepath.Join(hs.work, "_temp", "long.sh"), []byte("echo long step started\nsleep 600\n"), 0o644))
	sb, err := json.Marshal(map[string]any{
		"command": "run_script_step", "responseFile": nil, "state": answer.State,
		"args": map[string]any{"entryPoint": "sh", "entryPointArgs": []string{"-e", "/__w/_temp/long.sh"},
			"environmentVariables": map[string]string{}, "prependPath": []string{}, "workingDirectory": "/__w/repo/repo"},
	})
	require.NoError(t, err)
	stepCmd := exec.Command(hs.hook)
	stepCmd.Env = cmd.Env
	stepCmd.Stdin = bytes.NewReader(sb)
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	stepCmd.Stdout, stepCmd.Stderr = pw, pw
	require.NoError(t, stepCmd.Start())
	require.NoError(t, pw.Close())
	started := make(chan string, 1)
	go func() {
		var seen bytes.Buffer
		buf := make([]byte, 4096)
		for {
			n, rerr := pr.Read(buf)
			seen.Write(buf[:n])
			if strings.Contains(seen.String(), "long step started") || rerr != nil {
				started <- seen.String()
				return
			}
		}
	}()
	select {
	case got := <-started:
		require.Contains(t, got, "long step started", "the long step runs")
	case <-time.After(3 * time.Minute):
		_ = stepCmd.Process.Kill()
		t.Fatal("the long step did not start within 3 minutes")
	}
	require.NoError(t, stepCmd.Process.Signal(syscall.SIGKILL))
	werr := stepCmd.Wait()
	_ = pr.Close()
	require.Error(t, werr, "the hook was killed mid-step")
	t.Logf("the step's hook killed mid-step: %v", werr)

	out, err := r.admin("gc").CombinedOutput()
	require.NoError(t, err, "gc: %s", out)
	require.Contains(t, r.leftovers(t), "domain "+share.VM, "a sweep while the worker runs leaves its job alone")
	require.False(t, processGone(share.PID))

	kill()
	out, err = r.admin("gc").CombinedOutput()
	require.NoError(t, err, "gc: %s", out)
	t.Logf("gc after the worker ended:\n%s", out)
	require.NotContains(t, r.leftovers(t), "domain "+share.VM, "the sweep removed the claimed VM")
	r.removeStandbys(t) // the pool's refill, if it booted before the service stopped
	r.requireNoLeftovers(t, "after the sweep")
	hs.requireShareGone(t, machine, share)
}

// TestGitHubHooksFailedPrepareLeavesNothing: a prepare_job that fails
// after its VM booted (a VM image without virtiofs) exits non-zero naming
// the failure, writes no response, and leaves no domain, volume, machine
// state, share record, socket directory or virtiofsd.
func TestGitHubHooksFailedPrepareLeavesNothing(t *testing.T) {
	hs := newHookSetup(t)
	// The tiny image as the hook's VM (it boots in seconds): it has no
	// virtiofs, so prepare_job fails once the VM is up, both virtiofsd run
	// and the shares are plugged in, at the mount.
	hs.r = hs.r.withConfig(t, func(s string) string {
		return strings.Replace(s, "vm_image = \"podman\"", "vm_image = \"tiny\"", 1)
	})
	r := hs.r
	resp := filepath.Join(hs.work, "_temp/_runner_hook_responses/failed.json")
	res := callHook(t, hs.hook, r.cfgPath, hs.prepareInput(resp))
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "Started a read-only virtiofsd for "+hs.ext, "both shares were up")
	require.Contains(t, res.stderr, "mount the runner's work directory in the VM (virtiofs) failed", "it failed after the VM was up")
	require.NoFileExists(t, resp)
	r.requireNoLeftovers(t, "after the failed prepare_job")
	recs, err := filepath.Glob(filepath.Join(r.cfg.StateDir, "github-hooks", "*"))
	require.NoError(t, err)
	require.Empty(t, recs, "no share record or log")
	socks, err := filepath.Glob("/run/lve-e2e-hooks/*")
	require.NoError(t, err)
	require.Empty(t, socks, "no socket directory")
	out, err := exec.Command("pgrep", "-u", hookShareUser, "virtiofsd").CombinedOutput()
	require.Error(t, err, "no virtiofsd of the share user runs: %s", out)
	out, err = exec.Command("pgrep", "-u", "1200000000", "virtiofsd").CombinedOutput()
	require.Error(t, err, "no virtiofsd of the externals (a subordinate id of the share user) runs: %s", out)
}
