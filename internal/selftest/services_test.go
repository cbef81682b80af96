package selftest

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

// The services job's script, run by a real shell: its markers are printed
// only when what they say happened, and the script's own text (which the
// runner echoes into the job log) never reads as one.
func TestServicesJobScript(t *testing.T) {
	o := Options{Services: "postgres:15", ServicesImage: "podman", Image: "tiny", ServicePort: 5432}
	job := servicesJob(o)
	require.Equal(t, "podman", job.Image, "the services job runs on --services-image")
	require.Equal(t, []jobapi.Service{{Name: "postgres:15", Alias: ServiceAlias}}, job.Services)
	require.Len(t, job.Script, 2)
	text := strings.Join(job.Script, "\n")
	for _, marker := range []string{svcResolved, svcAnswered, ServiceAlias + " does not resolve in the guest"} {
		require.NotContains(t, text, marker, "the echoed script would read as its own marker")
	}
	// Here the alias resolves nowhere: the script says so and fails, also
	// with errexit and pipefail on, as in the runner's script.
	out, err := exec.Command("bash", "-c", "set -eo pipefail\n"+job.Script[0]).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), ServiceAlias+" does not resolve in the guest")
	require.NotContains(t, string(out), svcResolved)

	require.Equal(t, "tiny", servicesJob(Options{Services: "redis", Image: "tiny"}).Image, "without --services-image: --image")
	require.Len(t, servicesJob(Options{Services: "redis"}).Script, 1, "no port, no connect")
}

func TestDiagnoseServices(t *testing.T) {
	o := Options{Services: "postgres:15", ServicePort: 5432}
	ok := JobReport{Name: produceName, State: jobapi.StateSuccess}
	passed := "Services ready in 3.1s: 1 started\n" + svcResolved + "10.89.0.2 selftest-service\n" + svcAnswered + "5432\n"
	for _, tc := range []struct {
		name, state, trace, want string
	}{
		{"no podman", jobapi.StateFailed, "services: the job asks for services or a container image, but VM image \"tiny\" has no container runtime (podman not found", "pass --services-image"},
		{"disabled", jobapi.StateFailed, "this runner does not provide services, and fails jobs that ask for them", "set [services] enabled = true"},
		{"not allowed", jobapi.StateFailed, "service postgres:15 is not among the images this runner allows for services (services.allowed_images: redis:*)", "not in [services] allowed_images"},
		{"pull", jobapi.StateFailed, "services: cannot get image docker.io/library/postgres:15 of service postgres:15 (pull policies always): manifest unknown", "could not pull postgres:15"},
		{"alias", jobapi.StateFailed, "Services ready in 3.1s: 1 started\nselftest: selftest-service does not resolve in the guest", "did not find its service by its alias"},
		{"port", jobapi.StateFailed, "Services ready in 3.1s: 1 started\n" + svcResolved + "10.89.0.2 selftest-service\nbash: connect: Connection refused", "could not connect to its service on port 5432"},
		{"warned", jobapi.StateSuccess, "WARNING: service postgres:15 did not answer on 10.89.0.2:5432 within 30s; the job goes on\n" + passed, "did not start or did not answer"},
		{"no services started", jobapi.StateSuccess, svcResolved + "x\n" + svcAnswered + "5432\n", "did not start its service"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := JobReport{Name: svcName, State: tc.state, FailureReason: "runner_system_failure", Trace: tc.trace}
			j.Services = servicesVerdict(j, o)
			rep := &Report{Jobs: []JobReport{ok, {Name: consumeName, State: jobapi.StateSuccess}, j}}
			fixes := diagnose(rep, o, nil, "", nil)
			require.Len(t, fixes, 1, "%v", fixes)
			require.Contains(t, fixes[0], tc.want)
			rep.Fixes = fixes
			var out bytes.Buffer
			rep.Print(&out)
			require.Contains(t, out.String(), "--- last lines of selftest-services ---", "the job log of what went wrong is shown")
		})
	}

	j := JobReport{Name: svcName, State: jobapi.StateSuccess, Trace: passed}
	j.Services = servicesVerdict(j, o)
	require.Empty(t, j.Services)
	rep := &Report{Jobs: []JobReport{ok, {Name: consumeName, State: jobapi.StateSuccess}, j}}
	require.Empty(t, diagnose(rep, o, nil, "", nil))
	var out bytes.Buffer
	rep.Print(&out)
	require.Contains(t, out.String(), "a job's service container started in its VM and the job found it by its alias")
	require.Contains(t, out.String(), "uploaded and downloaded an artifact", "the sample jobs ran")

	// --sample-jobs=false: the verdict claims only what ran.
	rep = &Report{Jobs: []JobReport{j}}
	require.Empty(t, diagnose(rep, o, nil, "", nil))
	out.Reset()
	rep.Print(&out)
	require.Contains(t, out.String(), "OK: VMs start, run the stages and go; a job's service container started")
	require.NotContains(t, out.String(), "artifact")
}
