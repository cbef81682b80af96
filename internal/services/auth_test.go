package services

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

func authsOf(t *testing.T, b []byte) map[string]string {
	t.Helper()
	var f struct {
		Auths map[string]struct {
			Auth string `json:"auth"`
		} `json:"auths"`
	}
	require.NoError(t, json.Unmarshal(b, &f))
	out := map[string]string{}
	for h, e := range f.Auths {
		d, err := base64.StdEncoding.DecodeString(e.Auth)
		require.NoError(t, err)
		out[h] = string(d)
	}
	return out
}

// The job's registry credentials: DOCKER_AUTH_CONFIG first, then the
// payload's registry credentials for registries it did not name; hosts
// as podman keys them; nothing given, no file.
func TestAuthFile(t *testing.T) {
	none, notes, err := AuthFile(&Payload{Variables: jobVars()})
	require.NoError(t, err)
	require.Nil(t, none)
	require.Empty(t, notes)

	cfgJSON := `{"auths": {"https://index.docker.io/v1/": {"auth": "` + base64.StdEncoding.EncodeToString([]byte("hub:hubpw")) + `"},
		"registry.example.com:5050": {"username": "me", "password": "mine"},
		"registry.example.com/team": {"username": "team", "password": "teampw"},
		"helper.example.com": {"identitytoken": "s3cr3t"},
		"[::1]:5000": {"auth": "s3cr3t"}}, "credsStore": "desktop"}`
	b, notes, err := AuthFile(&Payload{
		Variables: []Variable{{Key: "DOCKER_AUTH_CONFIG", Value: cfgJSON, Masked: true}},
		Credentials: []Credential{
			{Type: "registry", URL: "registry.example.com:5050", Username: "gitlab-ci-token", Password: "job-token"},
			{Type: "registry", URL: "https://gitlab.example.com:5051/", Username: "gitlab-ci-token", Password: "job-token"},
			{Type: "other", URL: "x.example.com", Username: "u", Password: "p"},
			{Type: "registry", URL: "$(reboot)", Username: "u", Password: "s3cr3t"},
			{Type: "registry", URL: "r.example", Username: "a:b", Password: "s3cr3t"},
		},
	})
	require.NoError(t, err)
	require.Equal(t, map[string]string{
		"docker.io":                 "hub:hubpw",
		"registry.example.com:5050": "me:mine", // the variable's, not the job token's
		"registry.example.com/team": "team:teampw",
		"gitlab.example.com:5051":   "gitlab-ci-token:job-token",
	}, authsOf(t, b))
	// What cannot be used is skipped with a note, never with its value.
	require.Len(t, notes, 4, "%q", notes)
	joined := strings.Join(notes, "\n")
	require.Contains(t, joined, `DOCKER_AUTH_CONFIG: entry "[::1]:5000" skipped: not a registry`)
	require.Contains(t, joined, "DOCKER_AUTH_CONFIG: entry for helper.example.com skipped")
	require.Contains(t, joined, `credentials[3] skipped: "$(reboot)" is not a registry`)
	require.Contains(t, joined, "credentials[4] (r.example) skipped")
	require.NotContains(t, joined, "s3cr3t")

	for _, tc := range []struct {
		p    Payload
		want string
	}{
		{Payload{Variables: []Variable{{Key: "DOCKER_AUTH_CONFIG", Value: `{"auths": [s3cr3t]}`}}}, "DOCKER_AUTH_CONFIG: not a JSON object"},
		{Payload{Variables: []Variable{{Key: "DOCKER_AUTH_CONFIG", Value: strings.Repeat(" ", maxAuthConfig+1)}}}, "DOCKER_AUTH_CONFIG: longer than"},
	} {
		_, _, err := AuthFile(&tc.p)
		require.ErrorContains(t, err, tc.want)
		require.NotContains(t, err.Error(), "s3cr3t", "an error never shows a secret")
		require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
	}
}

// With credentials, Start writes them to AuthPath (0600) through stdin,
// pulls with --authfile and removes the file after the pulls, also when a
// pull failed; the password is in no argument and no log line.
func TestStartPullsWithTheJobsCredentialsAndRemovesThem(t *testing.T) {
	const pw = "job-t0ken-s3cr3t"
	plan := func(t *testing.T) *Plan {
		pl, err := NewPlan(&Payload{Variables: jobVars(), Services: []Image{{Name: "registry.example.com/team/db:1"}},
			Credentials: []Credential{{Type: "registry", URL: "registry.example.com", Username: "gitlab-ci-token", Password: pw}}},
			Options{JobID: 9})
		require.NoError(t, err)
		require.NotContains(t, pl.String(), pw)
		return pl
	}
	for _, pullFails := range []bool{false, true} {
		rules := happyRules()
		if pullFails {
			rules = append([]rule{{prefix: "podman pull", code: 125, out: "unauthorized"}}, rules...)
		}
		g := &fakeGuest{rules: rules, hosts: "127.0.0.1\tlocalhost\n"}
		var log bytes.Buffer
		_, err := Start(context.Background(), g, plan(t), Options{WaitTimeout: time.Second}, &log)
		if pullFails {
			require.ErrorContains(t, err, "registry.example.com/team/db:1")
		} else {
			require.NoError(t, err, log.String())
		}
		lines := g.lines()
		write := slicesIndex(lines, "sh -c "+writeFileScript+" lve-write "+AuthPath+" 0600")
		pull := slicesIndex(lines, "podman pull --quiet --authfile "+AuthPath+" registry.example.com/team/db:1")
		rm := slicesIndex(lines, "rm -f -- "+AuthPath+" "+AuthPath+".lve-tmp")
		require.True(t, write >= 0 && pull > write && rm > pull, "write, pull, remove in order: %v", lines)
		require.Equal(t, "gitlab-ci-token:"+pw, authsOf(t, []byte(g.calls[write].stdin))["registry.example.com"])
		for _, c := range g.calls {
			require.NotContains(t, strings.Join(c.argv, " "), pw, "the password on argv")
			require.NotContains(t, strings.Join(c.env, " "), pw, "the password in an environment")
		}
		require.NotContains(t, log.String(), pw)
		if !pullFails {
			require.Greater(t, slicesIndex(lines, "podman run --detach"), rm, "removed before any container runs")
		}
	}
	// A write that fails half-way: removed all the same (the file and its
	// temporary copy), before the error is returned.
	g := &fakeGuest{rules: append([]rule{{prefix: "sh -c " + writeFileScript + " lve-write " + AuthPath, code: 0, err: errors.New("connection lost")}}, happyRules()...), hosts: "127.0.0.1\tlocalhost\n"}
	_, err := Start(context.Background(), g, plan(t), Options{WaitTimeout: time.Second}, &bytes.Buffer{})
	require.ErrorContains(t, err, "write the job's registry credentials")
	require.Equal(t, "rm -f -- "+AuthPath+" "+AuthPath+".lve-tmp", g.lines()[len(g.lines())-1])

	// Credentials that cannot be removed: the job fails (system) rather than
	// leave them readable.
	g = &fakeGuest{rules: append([]rule{{prefix: "rm -f -- " + AuthPath, code: 1, out: "read-only"}}, happyRules()...), hosts: "127.0.0.1\tlocalhost\n"}
	_, err = Start(context.Background(), g, plan(t), Options{WaitTimeout: time.Second}, &bytes.Buffer{})
	require.ErrorContains(t, err, "remove the job's registry credentials")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.False(t, errors.Is(err, context.Canceled))
}

func slicesIndex(l []string, s string) int {
	for i, v := range l {
		if v == s || strings.HasPrefix(v, s) {
			return i
		}
	}
	return -1
}
