package admin

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// servicesChecks are doctor's lines for [services]: what is on, and for
// each registry mirror whether it answers the registry API from this host
// (GET /v2/: 200, or 401 from one that asks for a login). A mirror that
// does not answer is a warning: podman tries the registry itself after
// its mirrors, so jobs still pull, from farther away. Nothing when
// services are off.
func servicesChecks(ctx context.Context, s config.Services, client *http.Client) []Check {
	if !s.Enabled {
		return nil
	}
	var out []Check
	info := "enabled (podman in the job's VM, docs/services.md)"
	if cj := s.ContainerJobs; len(cj.AllowedImages) > 0 {
		info += fmt.Sprintf("; container jobs on VM image %s for %s", cj.VMImage, strings.Join(cj.AllowedImages, ", "))
	}
	out = append(out, Check{Name: "services", OK: true, Info: info})
	regs := make([]string, 0, len(s.Mirrors))
	for r := range s.Mirrors {
		regs = append(regs, r)
	}
	slices.Sort(regs)
	for _, r := range regs {
		for _, m := range s.Mirrors[r] {
			out = append(out, mirrorCheck(ctx, client, r, m, slices.Contains(s.PlainHTTP, m)))
		}
	}
	return out
}

// mirrorCheck asks mirror (HOST[:PORT][/PATH], as configured) for the
// registry API's base.
func mirrorCheck(ctx context.Context, client *http.Client, registry, mirror string, plain bool) Check {
	name := "services mirror " + mirror + " for " + registry
	scheme := "https"
	if plain {
		scheme = "http"
	}
	host, _, _ := strings.Cut(mirror, "/")
	url := scheme + "://" + host + "/v2/"
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	fix := "start the pull-through cache there (Debian's docker-registry with proxy: remoteurl, docs/services.md), or correct [services.mirrors]; the guests must reach it too"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Check{Name: name, OK: true, Warn: true, Info: err.Error(), Fix: fix}
	}
	resp, err := client.Do(req)
	if err != nil {
		return Check{Name: name, OK: true, Warn: true, Info: fmt.Sprintf("GET %s: %v; jobs pull from %s itself", url, err, registry), Fix: fix}
	}
	_ = resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK, http.StatusUnauthorized:
		return Check{Name: name, OK: true, Info: fmt.Sprintf("GET %s: %s (a registry)", url, resp.Status)}
	}
	return Check{Name: name, OK: true, Warn: true, Info: fmt.Sprintf("GET %s: %s, not a registry's answer; jobs pull from %s itself", url, resp.Status, registry), Fix: fix}
}
