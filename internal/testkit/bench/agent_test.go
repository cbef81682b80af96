package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

func TestAgentProblem(t *testing.T) {
	const started = "Connection holder started in 20ms\n"
	const agent = "libvirt-executor: the stages run through the guest agent (started in 190ms): one process in the guest per stage\n"
	for _, tc := range []struct {
		name             string
		log              string
		wrapper, agentOn bool
		want             string
	}{
		{"agent round, as it should", started + agent, false, true, ""},
		{"agent round on the wrapper", started + "the guest has no agent\n", false, true, "ran through the wrapper although the configuration gives the guests the agent"},
		{"agent off in the configuration", started, false, false, ""},
		{"wrapper round, as it should", started, true, true, ""},
		{"wrapper round with the agent", started + agent, true, true, `agent = "none" did not take`},
		{"no holder: not the agent's to judge", "", false, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var j JobSample
			j.readHolder(tc.log)
			p := j.agentProblem(tc.wrapper, tc.agentOn)
			if tc.want == "" {
				require.Empty(t, p)
			} else {
				require.Contains(t, p, tc.want)
			}
		})
	}
}

func TestWithoutAgent(t *testing.T) {
	require.Equal(t, "[guest_tools]\nagent = \"none\"\ngitlab_runner = \"auto\"\n", WithoutAgent("[guest_tools]\ngitlab_runner = \"auto\"\n"))
	require.Equal(t, "[guest_tools]\nagent = \"none\"\n[ssh]\nagent = 1\n", WithoutAgent("[guest_tools]\nagent = \"/x/lve-agent\"\n[ssh]\nagent = 1\n"))
	require.Equal(t, "x = 1\n\n[guest_tools]\nagent = \"none\"\n", WithoutAgent("x = 1\n"))
	text, err := os.ReadFile(filepath.Join("..", "..", "..", "deploy", "config.example.toml"))
	require.NoError(t, err)
	c, err := config.Parse([]byte(WithoutAgent(string(text))))
	require.NoError(t, err)
	require.Equal(t, config.GuestToolsNone, c.GuestTools.Agent)
	require.Equal(t, 1, strings.Count(WithoutAgent(string(text)), "[guest_tools]"))

	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("[ssh]\nkeepalive_count = 3\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	b := &bench{opts: Options{ConfigPath: cfgPath}}
	w := b.setupWrapper(t.TempDir())
	require.NoError(t, w.err)
	require.True(t, w.mode.wrapper)
	require.False(t, w.mode.direct)
	c, err = config.Load(w.config)
	require.NoError(t, err)
	require.True(t, c.SSH.HolderEnabled(), "the wrapper round keeps the holder")
	require.Equal(t, config.GuestToolsNone, c.GuestTools.Agent)
}

func TestWriteTableAgentPaths(t *testing.T) {
	agent := pathJob(8000, 9000, []float64{10, 20, 30, 40, 50, 60}, []float64{5, 6, 7, 8}, 1500)
	agent.Run, agent.Agent = 1, true
	wrapper := pathJob(8000, 10000, []float64{300, 310, 320, 330, 340, 350}, []float64{300, 301, 302, 303}, 1400)
	wrapper.Run = 1
	img := ImageReport{Image: "tiny", DomainType: "qemu", FloorSpec: "same", Jobs: []JobSample{agent},
		Wrapper: &DirectRound{Jobs: []JobSample{wrapper, {Run: 2, Error: "job failed: boom"}}}}
	img.Summary = img.Summarize()
	img.Targets = append(Evaluate(img.Summary), EvaluateTCG(img)...)
	rep := &Report{Started: time.Unix(0, 0).UTC(), Runs: 1, ConnectionHolder: true, WrapperRuns: 2, Images: []ImageReport{img}}
	var out bytes.Buffer
	require.NoError(t, rep.WriteTable(&out))
	text := out.String()
	line := func(re string) {
		t.Helper()
		require.Regexp(t, regexp.MustCompile(`(?m)^`+re+`$`), text)
	}
	line(`plus 2 wrapper job\(s\) per image .*interleaved`)
	line(`wrapper vs guest agent \(same run\)\s+wrapper \(old\)\s+agent \(new\)\s+agent - wrapper`)
	line(`  jobs whose stages ran through the guest agent\s+0\s+1\s*`)
	line(`  overhead per stage \(all 4 no-op stages\)\s+302 ms \[300 ms - 303 ms\]\s+6\.5 ms \[5\.0 ms - 8\.0 ms\]\s+-295 ms`)
	line(`run overhead per stage, all no-op stages \(TCG goal\)\s+<= 100 ms\s+6\.5 ms \(median\)\s+PASS`)
	line(`wrapper run 2 FAILED: job failed: boom`)

	// Debian's goal; none on KVM.
	img.Image = "debian"
	require.Equal(t, TargetTCGStageOtherMs, EvaluateTCG(img)[0].Limit)
	img.DomainType = "kvm"
	require.Empty(t, EvaluateTCG(img))
}
