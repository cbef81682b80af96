package services

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

const secret = "s3cr3t-masked-value"

func jobVars() []Variable {
	return []Variable{
		{Key: "CI_JOB_ID", Value: "42", Public: true},
		{Key: "CI_JOB_TOKEN", Value: "token-" + secret, Public: false, Masked: true},
		{Key: "DB_PASSWORD", Value: secret, Public: false, Masked: true},
		{Key: "PUBLIC_FLAG", Value: "on", Public: true},
		{Key: "bad-name", Value: "x", Public: true},
		{Key: "PG_TAG", Value: "15", Public: true},
	}
}

func TestPlanAliasesAndDuplicates(t *testing.T) {
	p := &Payload{Variables: jobVars(), Services: []Image{
		{Name: "postgres:$PG_TAG", Alias: "db, pg"},
		{Name: "postgres:14"},               // every alias taken: not started
		{Name: "postgres:13", Alias: "old"}, // derived taken, its own is free
		{Name: "group/img", Alias: "-bad"},
	}}
	pl, err := NewPlan(p, Options{JobID: 7})
	require.NoError(t, err)
	require.Equal(t, "lve-job-7", pl.Network)
	require.Len(t, pl.Services, 3)
	require.Equal(t, []string{"postgres", "db", "pg"}, pl.Services[0].Aliases)
	require.Equal(t, "docker.io/library/postgres:15", pl.Services[0].Ref.String(), "the name's variables are expanded")
	require.Equal(t, []string{"old"}, pl.Services[1].Aliases)
	require.Equal(t, 2, pl.Services[1].Index)
	require.Equal(t, []string{"group__img", "group-img"}, pl.Services[2].Aliases)
	notes := strings.Join(pl.Notes, "\n")
	require.Contains(t, notes, `Skipping alias "postgres" for service "postgres:14" (services[1]): services[0] already has it`)
	require.Contains(t, notes, `Not starting service "postgres:14" (services[1])`)
	require.Contains(t, notes, `Skipping alias "postgres" for service "postgres:13" (services[2])`)
	require.Contains(t, notes, `"-bad" is not a host name`)
	require.Equal(t, "lve-service-2", pl.Services[1].Container)
}

func TestPlanEnvironment(t *testing.T) {
	p := &Payload{Variables: jobVars(), Services: []Image{{Name: "postgres:15", Variables: []Variable{
		{Key: "POSTGRES_PASSWORD", Value: "pw-$CI_JOB_ID", Public: true},
		{Key: "RAW", Value: "$CI_JOB_ID", Public: true, Raw: true},
		{Key: "PUBLIC_FLAG", Value: "off", Public: true},
		{Key: "HEALTHCHECK_TCP_PORT", Value: "5433", Public: true},
	}}}}
	pl, err := NewPlan(p, Options{})
	require.NoError(t, err)
	s := pl.Services[0]
	require.Equal(t, []string{"CI_JOB_ID=42", "PUBLIC_FLAG=off", "PG_TAG=15", "POSTGRES_PASSWORD=pw-42", "RAW=$CI_JOB_ID", "HEALTHCHECK_TCP_PORT=5433"}, s.Env)
	require.Equal(t, 5433, s.HealthPort)
	for _, kv := range s.Env {
		require.NotContains(t, kv, secret, "no masked or non-public job variable reaches a service")
	}
	require.Equal(t, []string{PullIfNotPresent}, s.PullPolicies)

	// a service variable may use a secret on purpose: it is the job's to give
	p.Services[0].Variables = []Variable{{Key: "PW", Value: "$DB_PASSWORD", Public: true}}
	pl, err = NewPlan(p, Options{})
	require.NoError(t, err)
	require.Contains(t, pl.Services[0].Env, "PW="+secret)
}

func TestPlanHidesSecretNames(t *testing.T) {
	p := &Payload{Variables: append(jobVars(), Variable{Key: "PRIVATE_REG", Value: "private.example", Public: false}),
		Services: []Image{{Name: "$PRIVATE_REG/db:1", Alias: "x" + secret}}}
	pl, err := NewPlan(p, Options{})
	require.NoError(t, err)
	s := pl.Services[0]
	require.True(t, s.Hidden)
	require.Equal(t, "services[0]", s.Shown)
	require.NotContains(t, strings.Join(pl.Notes, "\n"), secret)
	require.NotContains(t, s.image(), "private.example")
}

func TestPlanRefusals(t *testing.T) {
	allow, err := NewAllowlist([]string{"postgres:*"})
	require.NoError(t, err)
	many := make([]Image, MaxServices+1)
	for i := range many {
		many[i] = Image{Name: "redis"}
	}
	for name, tc := range map[string]struct {
		p    Payload
		o    Options
		want string
	}{
		"not allowed":   {Payload{Services: []Image{{Name: "mysql:8"}}}, Options{Allowed: allow}, `service "mysql:8" (services[0]) is not among the images this runner allows for services (services.allowed_images: "postgres:*")`},
		"bad name":      {Payload{Services: []Image{{Name: "$(id)"}}}, Options{}, "not an image reference"},
		"too many":      {Payload{Services: many}, Options{}, "at most 16"},
		"pull policy":   {Payload{Services: []Image{{Name: "redis", PullPolicy: []string{"sometimes"}}}}, Options{}, `pull_policy "sometimes" is not one of "always", "if-not-present", "never"`},
		"policy denied": {Payload{Services: []Image{{Name: "redis", PullPolicy: []string{"always"}}}}, Options{AllowedPullPolicies: []string{"if-not-present"}}, "not allowed by this runner"},
		"health port":   {Payload{Services: []Image{{Name: "redis", Variables: []Variable{{Key: "HEALTHCHECK_TCP_PORT", Value: "99999"}}}}}, Options{}, "is not a port"},
		"var name":      {Payload{Services: []Image{{Name: "redis", Variables: []Variable{{Key: "A-B", Value: "1"}}}}}, Options{}, "is not a name"},
		"nul arg":       {Payload{Services: []Image{{Name: "redis", Command: []string{"a\x00"}}}}, Options{}, "NUL"},
		"huge args":     {Payload{Services: []Image{{Name: "redis", Command: []string{strings.Repeat("x", MaxArgBytes)}}}}, Options{}, "at most 65536"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewPlan(&tc.p, tc.o)
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "a job's mistake is a build failure")
		})
	}
}

func TestRunArgvCarriesNoValue(t *testing.T) {
	pl, err := NewPlan(&Payload{Variables: jobVars(), Services: []Image{{Name: "postgres:15", Alias: "db",
		Entrypoint: []string{"/bin/sh", "-c"}, Command: []string{"exec postgres -c 'a b'"},
		Variables: []Variable{{Key: "PW", Value: "$DB_PASSWORD", Public: true}}}}}, Options{JobID: 1})
	require.NoError(t, err)
	argv := RunArgv(pl.Network, pl.Services[0])
	require.Equal(t, []string{"podman", "run", "--detach", "--pull", "never", "--name", "lve-service-0", "--label", Label, "--log-driver", "k8s-file",
		"--network", "lve-job-1", "--network-alias", "postgres", "--network-alias", "db",
		"--env", "CI_JOB_ID", "--env", "PUBLIC_FLAG", "--env", "PG_TAG", "--env", "PW",
		`--entrypoint=["/bin/sh","-c"]`, "docker.io/library/postgres:15", "exec postgres -c 'a b'"}, argv)
	require.NotContains(t, strings.Join(argv, " "), secret)

	s := pl.Services[0]
	s.Entrypoint, s.EntrypointSet, s.Command = nil, true, nil
	argv = RunArgv(pl.Network, s)
	require.Equal(t, "--entrypoint=", argv[len(argv)-2], `entrypoint: [""] clears the image's`)
}

func TestParseAnswers(t *testing.T) {
	ports, err := ParseExposedPorts([]byte(`{"6379/tcp":{},"53/udp":{},"5432/tcp":{}}` + "\n"))
	require.NoError(t, err)
	require.Equal(t, []int{5432, 6379}, ports)
	ports, err = ParseExposedPorts([]byte("null\n"))
	require.NoError(t, err)
	require.Empty(t, ports)
	_, err = ParseExposedPorts([]byte("garbage"))
	require.Error(t, err)

	a, err := ParseAddress([]byte(`{"lve-job-1":{"IPAddress":"10.89.0.2"}}`), "lve-job-1")
	require.NoError(t, err)
	require.Equal(t, netip.MustParseAddr("10.89.0.2"), a)
	_, err = ParseAddress([]byte(`{"podman":{"IPAddress":"10.88.0.2"}}`), "lve-job-1")
	require.ErrorContains(t, err, "not on network lve-job-1")
	_, err = ParseAddress([]byte(`{"lve-job-1":{"IPAddress":"10.89.0.2\n1.2.3.4 evil"}}`), "lve-job-1")
	require.Error(t, err)
}

func TestRewriteHosts(t *testing.T) {
	old := "127.0.0.1\tlocalhost\n127.0.1.1\tlve-podman\n"
	a, b := netip.MustParseAddr("10.89.0.2"), netip.MustParseAddr("10.89.0.3")
	got := RewriteHosts([]byte(old), []HostEntry{{a, "postgres"}, {a, "db"}, {b, "redis"}})
	want := old + hostsBegin + "\n10.89.0.2\tpostgres\n10.89.0.2\tdb\n10.89.0.3\tredis\n" + hostsEnd + "\n"
	require.Equal(t, want, string(got))
	again := RewriteHosts(got, []HostEntry{{b, "cache"}})
	require.Equal(t, old+hostsBegin+"\n10.89.0.3\tcache\n"+hostsEnd+"\n", string(again), "an earlier block is replaced")
	require.Equal(t, old, string(RewriteHosts(got, nil)))
	require.Equal(t, "x\n"+hostsBegin+"\n10.89.0.3\tc\n"+hostsEnd+"\n", string(RewriteHosts([]byte("x"), []HostEntry{{b, "c"}})))
}

func TestRegistriesConf(t *testing.T) {
	b, err := RegistriesConf([]Mirror{{Registry: "docker.io", Locations: []MirrorLocation{{"10.0.0.1:5000", true}}}})
	require.NoError(t, err)
	s := string(b)
	require.Contains(t, s, "[[registry]]")
	require.Contains(t, s, "prefix = 'docker.io'")
	require.Contains(t, s, "[[registry.mirror]]")
	require.Contains(t, s, "location = '10.0.0.1:5000'")
	require.Contains(t, s, "insecure = true")
	none, err := RegistriesConf(nil)
	require.NoError(t, err)
	require.Nil(t, none)
}

func TestDecodePayload(t *testing.T) {
	p, err := DecodePayload(strings.NewReader(`{"token":"x","image":{"name":"podman","entrypoint":["/bin/sh"]},
	 "services":[{"name":"postgres:15","alias":"db","command":["postgres"],"pull_policy":["always"],
	 "variables":[{"key":"A","value":"1","public":true}]}],"variables":[{"key":"CI","value":"true","public":true}]}`))
	require.NoError(t, err)
	require.Equal(t, "podman", p.Image.Name)
	require.Equal(t, []string{"/bin/sh"}, p.Image.Entrypoint)
	require.Equal(t, Image{Name: "postgres:15", Alias: "db", Command: []string{"postgres"}, PullPolicy: []string{"always"},
		Variables: []Variable{{Key: "A", Value: "1", Public: true}}}, p.Services[0])
	_, err = DecodePayload(strings.NewReader(`{"services":`))
	require.Error(t, err)
	_, err = DecodePayload(strings.NewReader(`{"x":"` + strings.Repeat("a", MaxPayload) + `"}`))
	require.ErrorContains(t, err, "exceeds")
}

func TestOptionsFrom(t *testing.T) {
	c, err := config.Parse([]byte(`[services]
wait_timeout = "45s"
allowed_images = ["postgres:*"]
plain_http = ["10.213.7.1:5000"]
[services.mirrors]
"docker.io" = ["mirror.example", "10.213.7.1:5000"]
[images.a]
base = "/a.qcow2"
`))
	require.NoError(t, err)
	o, err := OptionsFrom(c.Services, 5, "podman", "debian")
	require.NoError(t, err)
	require.Equal(t, 45*time.Second, o.WaitTimeout)
	require.True(t, o.Sudo, "a login user other than root runs podman through sudo")
	require.Equal(t, PullIfNotPresent, o.DefaultPullPolicy)
	require.Equal(t, []string{"postgres:*"}, o.Allowed.Patterns())
	conf := string(o.Registries)
	require.Equal(t, 1, strings.Count(conf, "[[registry]]"), conf)
	require.Regexp(t, `(?s)location = 'mirror.example'\n\n.*location = '10.213.7.1:5000'\ninsecure = true`, conf)
	o, err = OptionsFrom(config.Services{}, 5, "podman", "root")
	require.NoError(t, err)
	require.False(t, o.Sudo)
	require.Nil(t, o.Registries)
}
