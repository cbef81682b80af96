package gitlab

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// payloadVar is one entry of a test payload's variables.
type payloadVar struct {
	Key    string `json:"key"`
	Value  string `json:"value"`
	Public bool   `json:"public"`
	Masked bool   `json:"masked"`
	Raw    bool   `json:"raw,omitempty"`
	File   bool   `json:"file,omitempty"`
}

// testPayload writes a JOB_RESPONSE_FILE with the given id, image and
// variables (plus a token and a repository URL that embeds it, as GitLab
// sends them) and returns its path.
func testPayload(t *testing.T, id int64, image string, vars ...payloadVar) string {
	t.Helper()
	return testPayloadToken(t, id, image, "glcbt-secret-token", vars...)
}

func testPayloadToken(t *testing.T, id int64, image, token string, vars ...payloadVar) string {
	t.Helper()
	p := map[string]any{
		"id": id, "token": token,
		"git_info":    map[string]any{"repo_url": "https://gitlab-ci-token:" + token + "@gitlab.example.com/g/p.git"},
		"runner_info": map[string]any{"timeout": 3600},
		"image":       map[string]any{"name": image},
		"variables":   vars,
	}
	b, err := json.Marshal(p)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(path, b, 0o600))
	return path
}

func pub(k, v string) payloadVar { return payloadVar{Key: k, Value: v, Public: true} }

// runConfig runs the config stage and returns its decoded output.
func runConfig(t *testing.T, cfg *config.Config, env map[string]string) (map[string]any, error) {
	t.Helper()
	var out bytes.Buffer
	r := &recorder{}
	if err := Config(context.Background(), r.env(env, &out), cfg); err != nil {
		return nil, err
	}
	var got map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &got))
	return got, nil
}

// `image: $VM_IMAGE` reaches the driver unexpanded in the payload: the
// driver expands it with the job's variables, like the runner does for
// CI_JOB_IMAGE, and only then matches it against the configured names.
func TestPayloadImageIsExpanded(t *testing.T) {
	cfg := testConfig(t)
	for _, written := range []string{"$VM_IMAGE", "${VM_IMAGE}"} {
		path := testPayload(t, 42, written, pub("CI_SERVER_URL", "https://gitlab.example.com"), pub("VM_IMAGE", "debian-12"))
		got, err := runConfig(t, cfg, map[string]string{"JOB_RESPONSE_FILE": path})
		require.NoError(t, err, written)
		require.Equal(t, "/srv/builds", got["builds_dir"], "%s selects debian-12", written)
	}

	// A refused expansion names both the result and what was written.
	path := testPayload(t, 42, "$VM_IMAGE", pub("VM_IMAGE", "../../etc/shadow"))
	_, err := runConfig(t, cfg, map[string]string{"JOB_RESPONSE_FILE": path})
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, `"../../etc/shadow"`)
	require.ErrorContains(t, err, `"$VM_IMAGE"`)
}

// Without JOB_RESPONSE_FILE the only job id is CUSTOM_ENV_CI_JOB_ID, which
// the job controls: a system failure unless the administrator opted in.
func TestNoPayloadFileIsSystemFailure(t *testing.T) {
	cfg := testConfig(t)
	_, err := runConfig(t, cfg, map[string]string{"CUSTOM_ENV_CI_JOB_ID": "77"})
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "JOB_RESPONSE_FILE")
	require.ErrorContains(t, err, "insecure_job_id_from_env")
}

// Two GitLab instances (or runners) sharing the driver configuration can
// hand out the same job id: their machines must still differ.
func TestMachineNameIsPerInstance(t *testing.T) {
	cfg := testConfig(t)
	hostname := func(vars ...payloadVar) string {
		t.Helper()
		got, err := runConfig(t, cfg, map[string]string{"JOB_RESPONSE_FILE": testPayload(t, 1000, "", vars...)})
		require.NoError(t, err)
		return got["hostname"].(string)
	}
	a := hostname(pub("CI_SERVER_URL", "https://gitlab-a.example.com"), pub("CI_RUNNER_ID", "7"))
	require.Equal(t, a, hostname(pub("CI_SERVER_URL", "https://gitlab-a.example.com"), pub("CI_RUNNER_ID", "7")), "stable")
	require.NotEqual(t, a, hostname(pub("CI_SERVER_URL", "https://gitlab-b.example.com"), pub("CI_RUNNER_ID", "7")), "another instance")
	require.NotEqual(t, a, hostname(pub("CI_SERVER_URL", "https://gitlab-a.example.com"), pub("CI_RUNNER_ID", "8")), "another runner")
	// A job's own variables come after GitLab's predefined ones: overriding
	// them does not move the job to another name.
	require.Equal(t, a, hostname(pub("CI_SERVER_URL", "https://gitlab-a.example.com"), pub("CI_RUNNER_ID", "7"),
		pub("CI_SERVER_URL", "https://gitlab-b.example.com"), pub("CI_RUNNER_ID", "8")), "job overrides are ignored")
	require.Regexp(t, `^lve-[0-9a-f]{8}-[0-9a-f]{8}-1000$`, a)

	// The job token (also in git_info.repo_url) changes with every job: it
	// is no part of the name.
	got, err := runConfig(t, cfg, map[string]string{"JOB_RESPONSE_FILE": testPayloadToken(t, 1000, "", "glcbt-another-token",
		pub("CI_SERVER_URL", "https://gitlab-a.example.com"), pub("CI_RUNNER_ID", "7"))})
	require.NoError(t, err)
	require.Equal(t, a, got["hostname"])
	// Every stage of the job finds the same machine.
	path := testPayload(t, 1000, "", pub("CI_SERVER_URL", "https://gitlab-a.example.com"), pub("CI_RUNNER_ID", "7"))
	e := (&recorder{}).env(map[string]string{"JOB_RESPONSE_FILE": path}, &bytes.Buffer{})
	j, err := e.load(cfg)
	require.NoError(t, err)
	require.Equal(t, a, j.name)
}

func TestExpandImage(t *testing.T) {
	v := func(k, val string) jobVariable { return jobVariable{Key: k, Value: val, Public: true} }
	tests := []struct {
		name, written, want string
		vars                []jobVariable
	}{
		{"plain", "debian-12", "debian-12", nil},
		{"dollar", "$IMG", "debian-12", []jobVariable{v("IMG", "debian-12")}},
		{"braces", "${IMG}", "debian-12", []jobVariable{v("IMG", "debian-12")}},
		{"inside text", "debian-${VER}", "debian-12", []jobVariable{v("VER", "12")}},
		{"unknown is empty", "$NOPE", "", nil},
		{"unknown inside", "debian-$NOPE", "debian-", nil},
		{"last entry wins", "$IMG", "debian-12", []jobVariable{v("IMG", "tiny"), v("IMG", "debian-12")}},
		{"value references another", "$IMG", "debian-12", []jobVariable{v("IMG", "debian-$VER"), v("VER", "12")}},
		{"one level only, as the runner", "$A", "$C", []jobVariable{v("A", "$B"), v("B", "$C"), v("C", "tiny")}},
		{"self reference stops", "$A", "xx$A", []jobVariable{v("A", "x$A")}},
		{"raw is not expanded", "$IMG", "debian-$VER", []jobVariable{{Key: "IMG", Value: "debian-$VER", Public: true, Raw: true}, v("VER", "12")}},
		{"double dollar", "$$IMG", "$IMG", []jobVariable{v("IMG", "tiny")}},
		{"shell parameters", "$1$?$*x", "x", []jobVariable{v("1", "no"), v("?", "no")}},
		{"file variable is a path, never the content", "$F", "<file variable F>", []jobVariable{{Key: "F", Value: "tiny", Public: true, File: true}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := expandImage(tc.written, tc.vars)
			require.Equal(t, tc.want, got.Name)
			require.Equal(t, tc.written, got.Written)
			require.False(t, got.Hidden)
			require.False(t, got.TooLong)
		})
	}

	// What a masked or non-public variable contributes is never shown.
	for _, secret := range []jobVariable{
		{Key: "S", Value: "s3cr3t-value", Public: false, Masked: true},
		{Key: "S", Value: "s3cr3t-value", Public: false},
		{Key: "S", Value: "s3cr3t-value", Public: true, Masked: true},
	} {
		for _, vars := range [][]jobVariable{{secret}, {secret, v("IMG", "x-$S")}} {
			req := expandImage("$IMG$S", vars)
			require.True(t, req.Hidden)
			_, err := ChooseImage(testConfig(t), req)
			require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
			require.NotContains(t, err.Error(), "s3cr3t")
			require.ErrorContains(t, err, `"$IMG$S"`)
		}
	}

	// Nested references cannot build a huge name.
	big := strings.Repeat("$B", 5000)
	req := expandImage(strings.Repeat("$A", 5000), []jobVariable{v("A", big), v("B", strings.Repeat("x", 5000))})
	require.True(t, req.TooLong)
	require.LessOrEqual(t, len(req.Name), maxExpanded)
	_, err := ChooseImage(testConfig(t), req)
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "expands to more than")
	require.Less(t, len(err.Error()), 400)

	// A name that expands to a configured one is that image; one that
	// expands to nothing is the default, as in the runner.
	cfg := testConfig(t)
	img, err := ChooseImage(cfg, expandImage("$IMG", []jobVariable{v("IMG", "debian-12")}))
	require.NoError(t, err)
	require.Equal(t, "debian-12", img.Name)
	img, err = ChooseImage(cfg, expandImage("$UNSET", nil))
	require.NoError(t, err)
	require.Equal(t, cfg.DefaultImage, img.Name)
	// A refused expansion shows both, each cut short.
	_, err = ChooseImage(cfg, expandImage("${IMG}", []jobVariable{v("IMG", strings.Repeat("y", 500))}))
	require.ErrorContains(t, err, `(expanded from "${IMG}")`)
	require.Less(t, len(err.Error()), 400)
}
