package services

import (
	"bytes"
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
)

// call is one program the fake guest was asked to run.
type call struct {
	argv, env []string
	stdin     string
}

// fakeGuest answers each program by the first rule whose prefix matches its
// argv (joined with spaces) and records every call.
type fakeGuest struct {
	mu    sync.Mutex
	calls []call
	rules []rule
	hosts string // the guest's /etc/hosts, rewritten by the write
}

type rule struct {
	prefix string
	code   int
	out    string
	err    error
	delay  time.Duration // before the answer (a slow guest)
}

func (g *fakeGuest) Exec(ctx context.Context, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	var in []byte
	if stdin != nil {
		in, _ = io.ReadAll(stdin)
	}
	g.mu.Lock()
	g.calls = append(g.calls, call{argv: argv, env: env, stdin: string(in)})
	g.mu.Unlock()
	line := strings.Join(argv, " ")
	if _, rest, ok := strings.Cut(line, " -- podman "); ok && strings.HasPrefix(line, "sudo -n ") {
		line = "podman " + rest // the rules answer what runs under sudo
	}
	if line == "cat -- /etc/hosts" {
		_, _ = io.WriteString(stdout, g.hosts)
		return 0, nil
	}
	if strings.HasPrefix(line, "sh -c") && strings.Contains(line, HostsPath) {
		g.mu.Lock()
		g.hosts = string(in)
		g.mu.Unlock()
		return 0, nil
	}
	for _, r := range g.rules {
		if strings.HasPrefix(line, r.prefix) {
			if r.delay > 0 {
				select {
				case <-time.After(r.delay):
				case <-ctx.Done():
					return -1, ctx.Err() // a stream ended before it answered
				}
			}
			if r.code != 0 {
				_, _ = io.WriteString(stderr, r.out)
			} else {
				_, _ = io.WriteString(stdout, r.out)
			}
			return r.code, r.err
		}
	}
	return 0, nil
}

func (g *fakeGuest) lines() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var l []string
	for _, c := range g.calls {
		l = append(l, strings.Join(c.argv, " "))
	}
	return l
}

// answers of a guest where everything works: two services on the same
// port, each at its own address.
func happyRules() []rule {
	return []rule{
		{prefix: "podman image exists", code: 1},
		{prefix: "podman container inspect --format {{json .NetworkSettings.Networks}} lve-service-0", out: `{"lve-job-9":{"IPAddress":"10.89.0.2"}}`},
		{prefix: "podman container inspect --format {{json .NetworkSettings.Networks}} lve-service-1", out: `{"lve-job-9":{"IPAddress":"10.89.0.3"}}`},
		{prefix: "podman image inspect --format {{json .Config.ExposedPorts}} docker.io/library/postgres:15", out: `{"5432/tcp":{}}`},
		{prefix: "podman image inspect --format {{json .Config.ExposedPorts}} docker.io/library/redis:latest", out: `{"6379/tcp":{}}`},
	}
}

func twoServices(t *testing.T) *Plan {
	pl, err := NewPlan(&Payload{Variables: jobVars(), Services: []Image{
		{Name: "postgres:15", Alias: "db", Variables: []Variable{{Key: "PW", Value: "$DB_PASSWORD", Public: true}}},
		{Name: "redis", Variables: []Variable{{Key: "HEALTHCHECK_TCP_PORT", Value: "5432", Public: true}}},
	}}, Options{JobID: 9})
	require.NoError(t, err)
	return pl
}

func TestStartOrderAliasesHostsAndNoSecretOnArgv(t *testing.T) {
	g := &fakeGuest{rules: happyRules(), hosts: "127.0.0.1\tlocalhost\n"}
	var log bytes.Buffer
	st, err := Start(context.Background(), g, twoServices(t), Options{WaitTimeout: 30 * time.Second,
		Registries: []byte("[[registry]]\n")}, &log)
	require.NoError(t, err, log.String())
	require.Len(t, st.Services, 2)

	lines := g.lines()
	// the sequential part, in order (the waits run side by side after it)
	want := []string{
		"podman --version",
		"sh -c " + writeFileScript + " lve-write " + RegistriesPath + " 0644",
		"podman network create --label " + Label + " lve-job-9",
		"podman image exists docker.io/library/postgres:15",
		"podman pull --quiet docker.io/library/postgres:15",
		"podman image exists docker.io/library/redis:latest",
		"podman pull --quiet docker.io/library/redis:latest",
	}
	require.Equal(t, want, lines[:len(want)])
	require.True(t, strings.HasPrefix(lines[7], "podman run --detach --pull never --name lve-service-0 --label "+Label+
		" --log-driver k8s-file --network lve-job-9 --network-alias postgres --network-alias db --env CI_JOB_ID"), lines[7])
	require.True(t, strings.HasSuffix(lines[7], "--env PW docker.io/library/postgres:15"), lines[7])
	require.Contains(t, lines, "timeout 30 bash -c "+waitScript+" lve-wait 10.89.0.2 5432")
	require.Contains(t, lines, "timeout 30 bash -c "+waitScript+" lve-wait 10.89.0.3 5432",
		"two services on one port: each waited for at its own address (redis by its HEALTHCHECK_TCP_PORT)")

	// the secret is the run's environment, nowhere else
	sawEnv := false
	for _, c := range g.calls {
		require.NotContains(t, strings.Join(c.argv, " "), secret, "a secret on argv")
		if c.argv[1] == "run" && strings.Contains(strings.Join(c.argv, " "), "lve-service-0") {
			require.Contains(t, c.env, "PW="+secret)
			sawEnv = true
		}
	}
	require.True(t, sawEnv)
	require.NotContains(t, log.String(), secret)

	require.Equal(t, "127.0.0.1\tlocalhost\n"+hostsBegin+"\n10.89.0.2\tpostgres\n10.89.0.2\tdb\n10.89.0.3\tredis\n"+hostsEnd+"\n", g.hosts)
	for _, l := range []string{
		"Created network lve-job-9 for the job's services in ",
		`Pulling image docker.io/library/postgres:15 for service "postgres:15" (services[0])...`,
		`Started service "postgres:15" (services[0]) as lve-service-0 at 10.89.0.2 (postgres, db) in `,
		`Service "redis" (services[1]) answers on port 5432 after `,
		"Services ready in ",
	} {
		require.Contains(t, log.String(), l)
	}
}

func TestStartWaitTimeoutIsAWarningWithLogs(t *testing.T) {
	rules := append([]rule{
		{prefix: "timeout 2 bash -c " + waitScript + " lve-wait 10.89.0.2 5432", code: 124},
		{prefix: "podman logs --tail 20 lve-service-0", out: "line one\nFATAL: \x1b[31mno config\n"},
	}, happyRules()...)
	// podman logs writes to stderr as well: the fake sends non-zero-code
	// text to stderr, so give it a zero code and stdout
	rules[1].code = 0
	g := &fakeGuest{rules: rules}
	var log bytes.Buffer
	st, err := Start(context.Background(), g, twoServices(t), Options{WaitTimeout: 2 * time.Second}, &log)
	require.NoError(t, err, "a service that does not answer is a warning, the job goes on")
	require.Len(t, st.Services, 2)
	out := log.String()
	require.Contains(t, out, `WARNING: service "postgres:15" (services[0]) did not answer on 10.89.0.2:5432 within 2s; the job goes on without waiting for it. Its last log lines:`)
	require.Contains(t, out, "  [lve-service-0] line one\n")
	require.Contains(t, out, `  [lve-service-0] FATAL: \x1b[31mno config`, "control characters escaped")
	require.Contains(t, out, `Service "redis" (services[1]) answers on port 5432`)
}

func TestStartFailures(t *testing.T) {
	for name, tc := range map[string]struct {
		rules []rule
		want  string
		class exitcodes.Class
	}{
		"no podman": {[]rule{{prefix: "podman --version", code: 127, out: "podman: not found"}},
			`VM image "plain" has no container runtime (podman not found in the guest, exit status 127): run the job on an image with podman (deploy/images/build.sh podman`, exitcodes.SystemClass},
		"pull": {[]rule{{prefix: "podman pull --quiet docker.io/library/redis", code: 125, out: "manifest unknown"}},
			`services: cannot get image docker.io/library/redis:latest of service "redis" (services[1]) (pull policies if-not-present): if-not-present: podman pull: exit status 125: "manifest unknown"`, exitcodes.SystemClass},
		"network": {[]rule{{prefix: "podman network create", code: 125, out: "netavark: iptables missing"}},
			`create the job's network lve-job-9 failed (exit status 125): "netavark: iptables missing"`, exitcodes.SystemClass},
		"connection": {[]rule{{prefix: "podman pull", err: errors.New("connection lost")}},
			"connection lost", exitcodes.SystemClass},
	} {
		t.Run(name, func(t *testing.T) {
			g := &fakeGuest{rules: append(tc.rules, happyRules()...)}
			_, err := Start(context.Background(), g, twoServices(t), Options{WaitTimeout: time.Second, VMImage: "plain"}, io.Discard)
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, tc.class, exitcodes.Classify(err))
		})
	}
}

func TestStartPullPolicies(t *testing.T) {
	pl, err := NewPlan(&Payload{Services: []Image{{Name: "redis", PullPolicy: []string{"never"}}}}, Options{JobID: 9})
	require.NoError(t, err)
	// never: present in the VM, nothing pulled
	g := &fakeGuest{rules: []rule{{prefix: "podman container inspect", out: `{"lve-job-9":{"IPAddress":"10.89.0.2"}}`}}}
	_, err = Start(context.Background(), g, pl, Options{}, io.Discard)
	require.NoError(t, err)
	for _, l := range g.lines() {
		require.NotContains(t, l, "podman pull")
	}
	// never: absent, a system failure naming it
	g = &fakeGuest{rules: []rule{{prefix: "podman image exists", code: 1}}}
	_, err = Start(context.Background(), g, pl, Options{}, io.Discard)
	require.ErrorContains(t, err, `cannot get image docker.io/library/redis:latest of service "redis" (services[0]) (pull policies never): never: not in the VM`)

	// always, then if-not-present: a failed pull falls back to the copy in the VM
	pl.Services[0].PullPolicies = []string{PullAlways, PullIfNotPresent}
	g = &fakeGuest{rules: []rule{{prefix: "podman pull", code: 125, out: "registry down"},
		{prefix: "podman container inspect", out: `{"lve-job-9":{"IPAddress":"10.89.0.2"}}`}}}
	var log bytes.Buffer
	_, err = Start(context.Background(), g, pl, Options{}, &log)
	require.NoError(t, err)
	require.Contains(t, log.String(), "pull policy if-not-present: already in the VM")
}

func TestStartSudoKeepsEnvNamesOnly(t *testing.T) {
	g := &fakeGuest{rules: happyRules()}
	_, err := Start(context.Background(), g, twoServices(t), Options{Sudo: true}, io.Discard)
	require.NoError(t, err)
	for _, c := range g.calls {
		line := strings.Join(c.argv, " ")
		if strings.Contains(line, " run --detach") && strings.Contains(line, "lve-service-0") {
			require.True(t, strings.HasPrefix(line, "sudo -n --preserve-env=CI_JOB_ID,PUBLIC_FLAG,PG_TAG,PW -- podman run"), line)
		}
		require.NotContains(t, line, secret)
	}
}

func TestStartNothingToDo(t *testing.T) {
	pl, err := NewPlan(&Payload{}, Options{})
	require.NoError(t, err)
	g := &fakeGuest{}
	_, err = Start(context.Background(), g, pl, Options{}, io.Discard)
	require.NoError(t, err)
	require.Empty(t, g.calls, "a job without services touches nothing in the guest")
}

func TestFollowLogs(t *testing.T) {
	g := &fakeGuest{rules: []rule{{prefix: "podman logs --follow lve-service-0", out: "ready to accept connections\n"}}}
	var log bytes.Buffer
	st := &Started{Services: []Running{{Service: Service{Container: "lve-service-0", Aliases: []string{"postgres"}}}}}
	FollowLogs(context.Background(), g, st, false, "", &log)
	require.Equal(t, "[service postgres] ready to accept connections\n", log.String())
}

// CI_DEBUG_SERVICES in a stage: the labelled service containers found in
// the guest (not the job's container, nothing else named by the guest)
// are followed from the guest's previous second on, each line prefixed
// with its container; stop ends the streams.
func TestStartServiceLogs(t *testing.T) {
	g := &fakeGuest{rules: []rule{
		{prefix: "date +%s", out: "1700000000\n"},
		{prefix: "podman ps --filter label=" + Label + " --format {{.Names}}", out: "lve-service-0\nlve-job-9-build\nlve-service-1\n$(reboot)\n"},
		{prefix: "podman logs --follow --since 1699999999 lve-service-0", out: "GET / from 10.89.0.9\n"},
		{prefix: "podman logs --follow --since 1699999999 lve-service-1", out: "\x1b[31mready\n"},
	}}
	var log syncbuf.Buffer
	stop, err := StartServiceLogs(context.Background(), g, false, &log)
	require.NoError(t, err)
	stop(10 * time.Millisecond)
	lines := strings.Split(strings.TrimSpace(log.String()), "\n")
	slices.Sort(lines)
	require.Equal(t, []string{"[service lve-service-0] GET / from 10.89.0.9", `[service lve-service-1] \x1b[31mready`}, lines)
	for _, l := range g.lines() {
		require.NotContains(t, l, "lve-job-9-build")
		require.NotContains(t, l, "reboot")
	}

	// A follower that starts slowly (under software emulation podman takes
	// seconds) still shows what the service wrote during the stage: stop
	// waits until it has as many lines as podman has, at most its grace.
	g = &fakeGuest{rules: []rule{
		{prefix: "date +%s", out: "1700000000\n"},
		{prefix: "podman ps", out: "lve-service-0\n"},
		{prefix: "podman logs --follow --since 1699999999 lve-service-0", out: "GET / answered\n", delay: 400 * time.Millisecond},
		{prefix: "podman logs --since 1699999999 lve-service-0", out: "GET / answered\n"},
	}}
	var slow syncbuf.Buffer
	stop, err = StartServiceLogs(context.Background(), g, false, &slow)
	require.NoError(t, err)
	t0 := time.Now()
	stop(10 * time.Second)
	require.Equal(t, "[service lve-service-0] GET / answered\n", slow.String())
	require.Less(t, time.Since(t0), 5*time.Second, "stop waits for the follower, not for its grace")

	g = &fakeGuest{rules: []rule{{prefix: "date", out: "1700000000\n"}, {prefix: "podman ps", code: 125, out: "no podman"}}}
	_, err = StartServiceLogs(context.Background(), g, false, &log)
	require.ErrorContains(t, err, "podman ps: exit status 125: no podman")
}

// Prepull: the mirrors written first, an image already in the VM left
// alone, another pulled (anonymously); a bad name is refused naming it.
func TestPrepull(t *testing.T) {
	g := &fakeGuest{rules: []rule{
		{prefix: "podman image exists docker.io/library/postgres:15", code: 0},
		{prefix: "podman image exists docker.io/library/redis:7", code: 1},
	}}
	var log bytes.Buffer
	require.NoError(t, Prepull(context.Background(), g, []string{"postgres:15", "redis:7"}, Options{Registries: []byte("[[registry]]\n")}, &log))
	require.Equal(t, []string{
		"podman --version",
		"sh -c " + writeFileScript + " lve-write " + RegistriesPath + " 0644",
		"podman image exists docker.io/library/postgres:15",
		"podman image exists docker.io/library/redis:7",
		"podman pull --quiet docker.io/library/redis:7",
	}, g.lines())
	require.Contains(t, log.String(), "Using image docker.io/library/postgres:15 for the pool's pre-pull (pull policy if-not-present: already in the VM)")
	require.Contains(t, log.String(), "Pre-pulled 2 image(s) in ")

	require.NoError(t, Prepull(context.Background(), &fakeGuest{}, nil, Options{}, &log), "nothing to pull: nothing done")
	err := Prepull(context.Background(), &fakeGuest{}, []string{"UPPER/Case::bad"}, Options{}, &log)
	require.ErrorContains(t, err, `pre-pull "UPPER/Case::bad"`)
}
