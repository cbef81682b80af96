package selftest

import (
	"cmp"
	"fmt"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

// The services job (--services IMAGE): a job written for the Docker
// executor's services, run in a fresh VM of the image that hosts them. The
// driver pulls the service's image (through the configured mirrors), starts
// it on the job's network and waits for its exposed ports; the job's
// script, on the VM's own OS, finds it by its alias and, given a port,
// connects to it. What the host reads back from the job log says which of
// runtime, allow-list, pull, start or answer is wrong.

// Lines of the services job's script that the host looks for.
const (
	svcResolved = "selftest: service resolves as "
	svcAnswered = "selftest: service answered on port "
)

// servicesJob is the services job for o.
func servicesJob(o Options) jobapi.Job {
	script := []string{
		// /etc/hosts is where the driver puts every alias (getent is
		// not on every image).
		// Each marker is echoed in two words: the runner's echo of the
		// command then never reads as the marker itself.
		// The runner's script runs with errexit and pipefail: an alias
		// found nowhere must not end it before it says so (`|| true`),
		// and no pipe into head, whose early exit would fail the writer.
		fmt.Sprintf(`line=$(getent hosts %[1]s 2>/dev/null || grep -m 1 -w %[1]s /etc/hosts || true); `+
			`if [ -z "$line" ]; then echo "selftest: %[1]s does not" "resolve in the guest"; exit 1; fi; echo "selftest: service" "resolves as $line"`, ServiceAlias),
	}
	if o.ServicePort > 0 {
		script = append(script, fmt.Sprintf(`timeout 20 bash -c 'exec 3<>/dev/tcp/%s/%d' && echo "selftest: service" "answered on port %d"`, ServiceAlias, o.ServicePort, o.ServicePort))
	}
	return jobapi.Job{
		Name: svcName, Stage: "test", Image: cmp.Or(o.ServicesImage, o.Image),
		Services: []jobapi.Service{{Name: o.Services, Alias: ServiceAlias}},
		Script:   script,
	}
}

// servicesVerdict is what a passed services job still shows wrong: a
// service the driver warned about (it did not start, or did not answer on
// its ports in time; the job goes on in both cases), or a script that
// did not see it. "" when all is well; failed jobs are diagnose's.
func servicesVerdict(j JobReport, o Options) string {
	if j.State != jobapi.StateSuccess {
		return ""
	}
	switch t := j.Trace; {
	case strings.Contains(t, "WARNING: service "):
		return "the service did not start or did not answer on its ports within [services] wait_timeout (the driver's warning and the service's last log lines are in the job log below)"
	case !strings.Contains(t, "Services ready in "):
		return "the job passed, but the driver did not start its service (is [services] enabled = true in this configuration?)"
	case !strings.Contains(t, svcResolved):
		return "the job passed without finding its service by its alias"
	case o.ServicePort > 0 && !strings.Contains(t, fmt.Sprintf("%s%d", svcAnswered, o.ServicePort)):
		return "the job passed without reaching its service's port"
	}
	return ""
}

// servicesFix is the fix for a failed services job, from its log ("" when
// nothing there is specific to services).
func servicesFix(j JobReport, o Options) string {
	t := j.Trace
	switch {
	case strings.Contains(t, "has no container runtime"):
		return "the services job's VM image has no podman: pass --services-image with an image that has it (deploy/images/build.sh podman; docs/services.md)"
	case strings.Contains(t, "does not provide services"):
		return "this configuration does not provide services: set [services] enabled = true (docs/services.md)"
	case strings.Contains(t, "is not among the images this runner allows for services"):
		return fmt.Sprintf("the service image %s is not in [services] allowed_images: add a pattern that matches it, or pass an allowed image to --services", o.Services)
	case strings.Contains(t, "services: cannot get image") || strings.Contains(t, "services: pull image"):
		return fmt.Sprintf("the guest could not pull %s: check [services.mirrors] and plain_http, and that the guests reach the registry (the job log below has podman's message; docs/services.md)", o.Services)
	case strings.Contains(t, ServiceAlias+" does not resolve in the guest"):
		return "the job's script did not find its service by its alias in the guest (/etc/hosts): the job log below shows what the driver did"
	case o.ServicePort > 0 && strings.Contains(t, svcResolved) && !strings.Contains(t, fmt.Sprintf("%s%d", svcAnswered, o.ServicePort)):
		return fmt.Sprintf("the job's script could not connect to its service on port %d (--service-port): the job log below shows the service's start and its ports", o.ServicePort)
	}
	return ""
}
