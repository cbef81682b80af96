// Package gitlab is the GitLab Runner Custom executor front end: it knows
// the runner's protocol only. It reads the job's identity and requests
// (JOB_RESPONSE_FILE, CUSTOM_ENV_*), and implements the four stages, one
// file each: config (the runner's JSON), prepare (one jobvm.Job.Acquire
// call, with the guest tool check), run (each stage script through the
// job's jobvm.Session: its connection holder, else a direct connection;
// the host cache's transport, cache.go, for now too) and cleanup (one
// jobvm.Job.Release call, or Job.Keep for debugging). The job's machine is
// reached only through its jobvm.Job handle: gitlab writes no record of
// its own about it and opens no connection itself.
package gitlab

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// Job is the trusted identity of the job and what it asked for.
type Job struct {
	// ID is the job id from the runner's payload.
	ID int64
	// Timeout is the job's timeout (runner_info.timeout).
	Timeout time.Duration
	// Image is the job's `image:`, with the job's variables expanded.
	Image ImageRequest
	// Instance tags the GitLab instance and runner the job came from
	// (jobvm.InstanceTag of CI_SERVER_URL and CI_RUNNER_ID): part of the
	// machine name, so equal job ids of two instances never share a VM.
	Instance string
	// FromPayload says whether the identity came from JOB_RESPONSE_FILE.
	FromPayload bool
	// Server is the GitLab instance (CI_SERVER_URL's scheme and host only,
	// as instanceOf chooses it) for the host's logs.
	Server string
	// ServerURL is CI_SERVER_URL's scheme, host and path (no user info,
	// query or fragment, no trailing slash): the instance whose project
	// the host cache keeps, so that two instances under one host
	// (https://example.com/gitlab-a, .../gitlab-b) never share a cache.
	ServerURL string
	// Protected says the job runs for a protected ref, as GitLab tells
	// it: its CI_COMMIT_REF_PROTECTED (GitLab's own, the first entry) is
	// "true" and no cache key ends in "-non_protected" (GitLab's separate
	// caches); only a payload without the variable falls back to a key
	// ending in "-protected". A key the job chose never grants protection.
	// The host cache keeps the caches of protected and unprotected refs
	// apart.
	Protected bool
	// Services are the job's `services:`, which the driver does not
	// provide (services.go).
	Services Services
	// ProjectID is the job's project on its GitLab instance (the payload's
	// job_info.project_id, which GitLab sets and the job cannot): with
	// Server, whose cache the host cache gives the job. 0: not known.
	ProjectID int64
	// Steps says the job is a GitLab Steps job: its payload has `run`
	// (without the payload: CUSTOM_ENV_STEPS, which the runner's shim
	// sets, is not empty). The runner runs it as one build_script stage
	// calling `step-runner ci` in the guest (docs/steps.md).
	Steps bool
}

// StepRunnerImage is the image GitLab Runner 17.x-18.5 give a run: job
// that names none (for the Docker executor's sake): for this driver it
// asks for the default VM image, unless an image of that name is
// configured.
const StepRunnerImage = "registry.gitlab.com/gitlab-org/step-runner:v0"

// ImageRequest is the job's `image:` name: as written, and after expansion.
type ImageRequest struct {
	// Name is the name after variable expansion: the only part compared
	// with the configured image names. Empty asks for the default image.
	Name string
	// Written is the name as the payload has it; it differs from Name when
	// variables were expanded.
	Written string
	// Hidden says the expansion used a masked or non-public variable (a
	// secret, or one defined in the CI/CD settings): Name is never shown.
	Hidden bool
	// TooLong says the expansion outgrew maxExpanded (then Name is cut and
	// the request is refused).
	TooLong bool
	// StepsDefault says Name is StepRunnerImage, given by the runner to a
	// run: job without image:.
	StepsDefault bool
}

// payload is the part of JOB_RESPONSE_FILE the driver reads. The file also
// holds the job token: it is never decoded.
type payload struct {
	ID         *int64 `json:"id"`
	RunnerInfo struct {
		Timeout int64 `json:"timeout"`
	} `json:"runner_info"`
	Image struct {
		Name string `json:"name"`
	} `json:"image"`
	// Services are the job's `services:`, their variables expanded by the
	// runner: only name and alias are read.
	Services []payloadService `json:"services"`
	JobInfo  struct {
		ProjectID int64 `json:"project_id"`
	} `json:"job_info"`
	// Cache is the job's cache: list; only the keys are read (GitLab
	// appends -protected or -non_protected to them where the project keeps
	// the caches of protected refs apart, its default).
	Cache []struct {
		Key string `json:"key"`
	} `json:"cache"`
	// Run is the job's `run:` (GitLab Steps), a JSON string; only whether
	// there is one is read.
	Run json.RawMessage `json:"run"`
	// Variables are the job's CI/CD variables, GitLab's predefined ones
	// first, then the job's own. They include secrets (CI_JOB_TOKEN, masked
	// and file variables): they stay in memory, are used only to expand the
	// image name and to read the instance identity, and are never logged,
	// stored or shown.
	Variables []jobVariable `json:"variables"`
}

// jobVariable is one entry of the payload's variables.
type jobVariable struct {
	Key    string `json:"key"`
	Value  string `json:"value"`
	Public bool   `json:"public"`
	Masked bool   `json:"masked"`
	Raw    bool   `json:"raw"`
	File   bool   `json:"file"`
}

// maxJobTimeout bounds a timeout read from the payload (GitLab's maximum is
// one month).
const maxJobTimeout = 31 * 24 * time.Hour

// ReadJob determines the job. The job id comes from JOB_RESPONSE_FILE, the
// runner's own copy of the job payload. CUSTOM_ENV_* values can be set by the
// job's author, so without the file the stage fails as a system failure,
// unless the administrator accepts CUSTOM_ENV_CI_JOB_ID with
// insecure_job_id_from_env (allowEnvID; warn says so).
func ReadJob(getenv func(string) string, allowEnvID bool, warn func(string)) (*Job, error) {
	path := getenv("JOB_RESPONSE_FILE")
	if path == "" {
		if !allowEnvID {
			return nil, exitcodes.System(errors.New("JOB_RESPONSE_FILE is not set, so this job's identity cannot be trusted: " +
				"CUSTOM_ENV_CI_JOB_ID can be set by the job itself and would let it take over another job's VM. " +
				"GitLab Runner sets JOB_RESPONSE_FILE for every Custom executor stage: run the driver only as the runner's " +
				"config_exec, prepare_exec, run_exec and cleanup_exec. To accept the job-controlled id anyway (trusted jobs only), " +
				"set insecure_job_id_from_env = true in the driver configuration"))
		}
		idText := getenv("CUSTOM_ENV_CI_JOB_ID")
		id, err := strconv.ParseInt(idText, 10, 64)
		if err != nil || id <= 0 {
			return nil, fmt.Errorf("no JOB_RESPONSE_FILE and CUSTOM_ENV_CI_JOB_ID %s is not a positive job id", shown(idText))
		}
		warn("JOB_RESPONSE_FILE is not set; using CUSTOM_ENV_CI_JOB_ID, which the job itself can override (insecure_job_id_from_env = true)")
		timeout, _ := strconv.ParseInt(getenv("CUSTOM_ENV_CI_JOB_TIMEOUT"), 10, 64)
		// The runner has expanded CI_JOB_IMAGE already.
		image := getenv("CUSTOM_ENV_CI_JOB_IMAGE")
		steps := getenv("CUSTOM_ENV_STEPS") != ""
		return &Job{ID: id, Timeout: boundTimeout(timeout), Image: stepsImage(ImageRequest{Name: image, Written: image}, steps),
			Instance: InstanceOf(getenv("CUSTOM_ENV_CI_SERVER_URL"), getenv("CUSTOM_ENV_CI_RUNNER_ID")),
			Server:   serverOf(getenv("CUSTOM_ENV_CI_SERVER_URL")), ServerURL: serverURLOf(getenv("CUSTOM_ENV_CI_SERVER_URL")),
			Services: servicesFromEnv(getenv("CUSTOM_ENV_CI_JOB_SERVICES")),
			Steps:    steps}, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("JOB_RESPONSE_FILE: %w", err)
	}
	defer f.Close()
	var p payload
	if err := json.NewDecoder(f).Decode(&p); err != nil {
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			return nil, fmt.Errorf("JOB_RESPONSE_FILE %s is not valid JSON (offset %d)", path, syn.Offset)
		}
		return nil, fmt.Errorf("JOB_RESPONSE_FILE %s: cannot decode the job payload: %v", path, err)
	}
	if p.ID == nil || *p.ID <= 0 {
		return nil, fmt.Errorf("JOB_RESPONSE_FILE %s has no positive job id", path)
	}
	steps := hasRun(p.Run)
	return &Job{ID: *p.ID, Timeout: boundTimeout(p.RunnerInfo.Timeout), Image: stepsImage(expandImage(p.Image.Name, p.Variables), steps),
		Instance: instanceOf(p.Variables), FromPayload: true, Server: serverOf(firstVar(p.Variables, "CI_SERVER_URL")),
		ServerURL: serverURLOf(firstVar(p.Variables, "CI_SERVER_URL")), Protected: protectedOf(p),
		Services: servicesOf(p.Services, p.Variables), ProjectID: max(0, p.JobInfo.ProjectID), Steps: steps}, nil
}

// protectedOf says whether a payload's job runs for a protected ref: a
// cache key ends in "-protected" (GitLab's suffix where the project keeps
// the caches of protected refs apart), or CI_COMMIT_REF_PROTECTED's first
// entry (GitLab's own: the job's variables come after it) is "true".
func protectedOf(p payload) bool {
	suffixed, unprotectedKey := false, false
	for _, c := range p.Cache {
		suffixed = suffixed || strings.HasSuffix(c.Key, "-protected")
		unprotectedKey = unprotectedKey || strings.HasSuffix(c.Key, "-non_protected")
	}
	if unprotectedKey {
		return false // GitLab's separate caches say so
	}
	for _, v := range p.Variables {
		if v.Key == "CI_COMMIT_REF_PROTECTED" {
			// GitLab's own word (its first entry) decides: a key is the
			// job's to choose, and with separate caches off a job of an
			// unprotected ref could end its key in -protected.
			return v.Value == "true"
		}
	}
	return suffixed // a payload without the variable (not seen from GitLab)
}

// hasRun says a payload's run is there: not missing, null or "".
func hasRun(run json.RawMessage) bool {
	var s *string
	if err := json.Unmarshal(run, &s); err == nil {
		return s != nil && *s != ""
	}
	return len(run) > 0 // not a string: the runner says what is wrong with it
}

// stepsImage marks the runner's image for a run: job without image:.
func stepsImage(req ImageRequest, steps bool) ImageRequest {
	req.StepsDefault = steps && req.Name == StepRunnerImage && !req.TooLong
	return req
}

// serverOf is a GitLab URL's scheme and host, nothing else (no user info,
// no path), or "" if it is not an http(s) URL.
func serverOf(u string) string {
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "https" && p.Scheme != "http") || p.Host == "" {
		return ""
	}
	return p.Scheme + "://" + p.Host
}

// serverURLOf is a GitLab URL's scheme, host and path (no user info,
// query or fragment; the path without its trailing slashes), or "" if it
// is not an http(s) URL.
func serverURLOf(u string) string {
	s := serverOf(u)
	if s == "" {
		return ""
	}
	p, _ := url.Parse(u) // serverOf parsed it
	return s + strings.TrimRight(p.EscapedPath(), "/")
}

// instanceOf tags the GitLab instance and runner of a payload: its
// CI_SERVER_URL and CI_RUNNER_ID, each the FIRST entry of that key. GitLab
// sends its predefined variables first and the job's own variables (which
// may redefine any key, and which the runner lets win) after them, so the
// first entry is GitLab's own value, not the job's. A missing key counts as
// "" (a job can then choose the value, but not its job id, which comes from
// the payload's id). Never the payload's token, nor git_info.repo_url: it
// embeds the job token.
func instanceOf(vars []jobVariable) string {
	return InstanceOf(firstVar(vars, "CI_SERVER_URL"), firstVar(vars, "CI_RUNNER_ID"))
}

// firstVar is the value of key's first entry in vars, or "".
func firstVar(vars []jobVariable, key string) string {
	for _, v := range vars {
		if v.Key == key {
			return v.Value
		}
	}
	return ""
}

// InstanceOf is the instance tag of a GitLab server URL and runner id, as
// machine names carry it.
func InstanceOf(serverURL, runnerID string) string { return jobvm.InstanceTag(serverURL, runnerID) }

func boundTimeout(seconds int64) time.Duration {
	if seconds <= 0 {
		return time.Hour
	}
	d := time.Duration(seconds) * time.Second
	return min(d, maxJobTimeout)
}

// ChooseImage picks the configured image the job asked for, or the default.
// The (expanded) name is only compared with configured names. An unknown
// name is the user's mistake (BUILD_FAILURE: retrying cannot fix it); the
// message lists what is allowed, and shows the name cut short: as expanded,
// plus as written when they differ, unless the expansion used a masked or
// non-public variable (then only as written).
func ChooseImage(cfg *config.Config, req ImageRequest) (*config.Image, error) {
	if req.Name == "" && !req.TooLong {
		img, _ := cfg.Image(cfg.DefaultImage)
		return img, nil
	}
	if req.StepsDefault {
		if img, ok := cfg.OfferedImage(req.Name, cfg.ImageNames()); ok {
			return img, nil
		}
		img, _ := cfg.Image(cfg.DefaultImage)
		return img, nil
	}
	if !req.TooLong {
		if img, ok := cfg.OfferedImage(req.Name, cfg.ImageNames()); ok {
			return img, nil
		}
		if host, ok := containerHost(cfg, req); ok {
			return host, nil
		}
	}
	var what string
	switch {
	case req.TooLong:
		what = fmt.Sprintf("image %q expands to more than %d characters and", cut(req.Written), maxExpanded)
	case !req.expanded():
		what = fmt.Sprintf("image %q", cut(req.Name))
	case req.Hidden:
		what = fmt.Sprintf("image %q (its expansion uses a masked or non-public variable and is not shown)", cut(req.Written))
	default:
		what = fmt.Sprintf("image %q (expanded from %q)", cut(req.Name), cut(req.Written))
	}
	containers := ""
	if pats := cfg.Services.ContainerJobs.AllowedImages; len(pats) > 0 {
		containers = "; or a container image this runner allows (services.container_jobs.allowed_images: " + quoteList(pats) + ")"
	}
	return nil, exitcodes.Userf("%s is not offered by this runner; allowed images: %s (or leave image: empty for %q)%s",
		what, quoteList(cfg.ImageNames()), cfg.DefaultImage, containers)
}

// containerHost is the VM image that hosts the job when its image: names
// no configured VM image but a container image the administrator allows
// ([services.container_jobs]: a container job, #46 item 2).
func containerHost(cfg *config.Config, req ImageRequest) (*config.Image, bool) {
	if req.TooLong || req.StepsDefault || req.Name == "" {
		return nil, false
	}
	if _, ok := cfg.OfferedImage(req.Name, cfg.ImageNames()); ok {
		return nil, false
	}
	name, ok := services.ContainerHost(cfg.Services.ContainerJobs, req.Name)
	if !ok {
		return nil, false
	}
	return cfg.Image(name)
}

// cut shortens a job-controlled name for a message.
func cut(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

func quoteList(items []string) string {
	b, _ := json.Marshal(items)
	return string(b)
}
