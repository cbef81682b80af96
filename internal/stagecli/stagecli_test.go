package stagecli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/failure"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

func TestExitCodes(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.toml")
	require.NoError(t, os.WriteFile(good, []byte("state_dir = \""+dir+"\"\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	broken := filepath.Join(dir, "broken.toml")
	require.NoError(t, os.WriteFile(broken, []byte("[images.a]\nbase = \"/a.qcow2\"\nbogus = 1\n"), 0o600))
	env := map[string]string{"BUILD_FAILURE_EXIT_CODE": "11", "SYSTEM_FAILURE_EXIT_CODE": "12"}
	getenv := func(k string) string { return env[k] }

	tests := []struct {
		name  string
		argv  []string
		nargs int
		err   error
		want  int
		msg   string
	}{
		{"ok", []string{"x", "--config", good}, 0, nil, 0, ""},
		{"script failure", []string{"x", "--config", good}, 0, &exitcodes.ScriptError{Code: 3}, 11, "status 3"},
		{"user mistake", []string{"x", "--config", good}, 0, exitcodes.Userf("image nope"), 11, "image nope"},
		{"infrastructure", []string{"x", "--config", good}, 0, errors.New("libvirt down"), 12, "libvirt down"},
		{"broken config", []string{"x", "--config", broken}, 0, nil, 12, `broken.toml: line 3 column 1: unknown key "images.a.bogus"`},
		{"missing config", []string{"x", "--config", filepath.Join(dir, "none.toml")}, 0, nil, 12, "none.toml"},
		{"wrong arg count", []string{"x", "--config", good, "extra"}, 0, nil, 12, "takes 0 argument(s)"},
		{"unknown flag", []string{"x", "--nope"}, 0, nil, 12, "flag provided but not defined"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			called := false
			code := Run(Process{Args: tc.argv, Getenv: getenv, Stdout: &stdout, Stderr: &stderr}, Exe{Name: "x", NArgs: tc.nargs,
				Stage: func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
					called = true
					return tc.err
				}})
			require.Equal(t, tc.want, code, stderr.String())
			if tc.msg != "" {
				require.Contains(t, stderr.String(), tc.msg)
			}
			require.Empty(t, stdout.String(), "stdout is reserved for protocol output")
			require.Equal(t, tc.err != nil || tc.name == "ok", called, "the stage runs only with a valid config and arguments")
		})
	}
}

func TestConfigFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.toml")
	require.NoError(t, os.WriteFile(good, []byte("name_prefix = \"envcfg\"\nstate_dir = \""+dir+"\"\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	env := map[string]string{config.EnvPath: good}
	t.Setenv(config.EnvPath, good) // urfave/cli reads EnvVars from the process
	var got string
	code := Run(Process{Args: []string{"x"}, Getenv: func(k string) string { return env[k] }, Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}}, Exe{Name: "x",
		Stage: func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
			got = cfg.NamePrefix
			return nil
		}})
	require.Equal(t, 0, code)
	require.Equal(t, "envcfg", got)
}

// A stage that finishes its work although SIGTERM arrived still reports
// SYSTEM_FAILURE, so the exit code does not depend on which came first;
// cleanup, which runs to completion on purpose, reports its own result.
func TestSignalledStageIsSystemFailure(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "c.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("state_dir = \""+dir+"\"\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	env := map[string]string{"BUILD_FAILURE_EXIT_CODE": "1", "SYSTEM_FAILURE_EXIT_CODE": "2"}
	endsAnyway := func(result error) Stage {
		return func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
			early <- syscall.SIGTERM
			<-ctx.Done()  // the signal arrived ...
			return result // ... but the work had ended
		}
	}
	for _, tc := range []struct {
		name   string
		result error
		toEnd  bool
		want   int
	}{
		{"ordinary stage, work done", nil, false, 2},
		{"ordinary stage, script failed", &exitcodes.ScriptError{Code: 3}, false, 2},
		{"runs to completion", nil, true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			code := Run(Process{Args: []string{"x", "--config", cfgPath}, Getenv: func(k string) string { return env[k] }, Stdout: &bytes.Buffer{}, Stderr: &stderr},
				Exe{Name: "x", Stage: endsAnyway(tc.result), RunsToCompletion: tc.toEnd})
			require.Equal(t, tc.want, code, stderr.String())
			if tc.want == 2 {
				require.Contains(t, stderr.String(), "stopped: terminated signal received")
			}
		})
	}

	// A stage with an undo (prepare) that finished its work gets it
	// undone when it is reported as stopped, on a context of its own;
	// one whose work failed, or that runs to completion, does not.
	for _, tc := range []struct {
		name      string
		result    error
		undoErr   error
		wantUndo  bool
		wantInErr string
	}{
		{"work done", nil, nil, true, "(what the stage had done is undone)"},
		{"work done, undo failed", nil, errors.New("libvirt gone"), true, "undoing what the stage had done failed: libvirt gone"},
		{"work failed", &exitcodes.ScriptError{Code: 3}, nil, false, "the stage had ended"},
	} {
		t.Run("undo: "+tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			undone := false
			undo := func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
				require.NoError(t, ctx.Err(), "the undo runs on a context the signal did not end")
				undone = true
				return tc.undoErr
			}
			code := Run(Process{Args: []string{"x", "--config", cfgPath}, Getenv: func(k string) string { return env[k] }, Stdout: &bytes.Buffer{}, Stderr: &stderr},
				Exe{Name: "x", Stage: endsAnyway(tc.result), Undo: undo})
			require.Equal(t, 2, code, stderr.String())
			require.Equal(t, tc.wantUndo, undone)
			require.Contains(t, stderr.String(), tc.wantInErr)
		})
	}
}

// Every stage leaves one event record for the metrics and its step
// records in the step log: the stage's own name, the outcome's class and
// reason; a signalled stage is "cancelled".
func TestStageRecordsItsOutcome(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "c.toml")
	steps := filepath.Join(dir, "steps.jsonl")
	require.NoError(t, os.WriteFile(cfgPath, []byte("state_dir = \""+dir+"\"\n[log]\nsteps = \"file\"\nsteps_file = \""+steps+"\"\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	env := map[string]string{"BUILD_FAILURE_EXIT_CODE": "1", "SYSTEM_FAILURE_EXIT_CODE": "2"}
	stage := func(result error, signal bool) Stage {
		return func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
			e.Report.Identify("42", "https://gitlab.example", "lve-x-y-42")
			e.Report.SetStage(args[1])
			e.Report.Machine("lve-x-y-42", "a")
			e.Report.Step("inner", time.Millisecond, nil)
			if signal {
				early <- syscall.SIGTERM
				<-ctx.Done()
			}
			return result
		}
	}
	run := func(result error, signal bool, stageName string, want int) {
		code := Run(Process{Args: []string{"libvirt-executor-run", "--config", cfgPath, "script", stageName}, Getenv: func(k string) string { return env[k] },
			Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}}, Exe{Name: "libvirt-executor-run", NArgs: 2, Stage: stage(result, signal)})
		require.Equal(t, want, code)
	}
	run(&exitcodes.ScriptError{Code: 3}, false, "step_script", 1)
	run(nil, true, "after_script", 2)
	run(nil, false, "get_sources", 0)
	var got []obs.Event
	_, err := (obs.Spool{Dir: filepath.Join(dir, lifecycle.EventsDir)}).Fold(obs.Cursor{}, obs.Reader{
		Apply: func(e obs.Event) { got = append(got, e) }, Invalid: func() { t.Error("invalid record") },
		Save: func(obs.Cursor) error { return nil },
	})
	require.NoError(t, err)
	require.Len(t, got, 3)
	require.Equal(t, []string{"step_script", "after_script", "get_sources"}, []string{got[0].Stage, got[1].Stage, got[2].Stage})
	require.Equal(t, []string{obs.ResultBuild, obs.ResultSystem, obs.ResultSuccess}, []string{got[0].Result, got[1].Result, got[2].Result})
	require.Equal(t, []string{failure.ReasonScript, failure.ReasonCancelled, failure.ReasonNone}, []string{got[0].Reason, got[1].Reason, got[2].Reason})
	require.Equal(t, "lve-x-y-42", got[0].Job)
	require.Equal(t, "a", got[0].Image)
	b, err := os.ReadFile(steps)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	require.Len(t, lines, 6, "two records per stage: its step and the whole stage")
	var last map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[1]), &last))
	require.Equal(t, "stage", last["step"])
	require.Equal(t, "step_script", last["stage"])
	require.Equal(t, "failed", last["outcome"])
	require.Equal(t, "build_failure", last["class"])
	require.Equal(t, "script", last["reason"])
	require.Equal(t, "42", last["job_id"])
	require.Equal(t, "https://gitlab.example", last["instance"])
}
