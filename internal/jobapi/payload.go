package jobapi

import (
	"cmp"
	"net/url"
	"strconv"
	"strings"
)

// The JSON shapes the runner exchanges with GitLab (gitlab-runner's
// common/network.go), reduced to the fields this server sends or reads.

type jobResponse struct {
	ID            int64          `json:"id"`
	Token         string         `json:"token"`
	AllowGitFetch bool           `json:"allow_git_fetch"`
	JobInfo       jobInfo        `json:"job_info"`
	GitInfo       gitInfo        `json:"git_info"`
	RunnerInfo    runnerInfo     `json:"runner_info"`
	Variables     []jobVariable  `json:"variables"`
	Steps         []step         `json:"steps"`
	Image         image          `json:"image"`
	Run           string         `json:"run,omitempty"`
	Services      []service      `json:"services"`
	Artifacts     []artifact     `json:"artifacts"`
	Cache         []cache        `json:"cache"`
	Credentials   []struct{}     `json:"credentials"`
	Dependencies  []dependency   `json:"dependencies"`
	Features      gitlabFeatures `json:"features"`
}

type jobInfo struct {
	Name        string `json:"name"`
	Stage       string `json:"stage"`
	ProjectID   int64  `json:"project_id"`
	ProjectName string `json:"project_name"`
}

type gitInfo struct {
	RepoURL   string   `json:"repo_url"`
	Ref       string   `json:"ref"`
	Sha       string   `json:"sha"`
	BeforeSha string   `json:"before_sha"`
	RefType   string   `json:"ref_type"`
	Refspecs  []string `json:"refspecs"`
	Depth     int      `json:"depth"`
}

type runnerInfo struct {
	Timeout int `json:"timeout"`
}

type jobVariable struct {
	Key    string `json:"key"`
	Value  string `json:"value"`
	Public bool   `json:"public"`
	File   bool   `json:"file"`
	Masked bool   `json:"masked"`
}

type step struct {
	Name         string   `json:"name"`
	Script       []string `json:"script"`
	Timeout      int      `json:"timeout"`
	When         string   `json:"when"`
	AllowFailure bool     `json:"allow_failure"`
}

type image struct {
	Name string `json:"name"`
}

// service is one of the job's services (the runner's common.Image).
type service struct {
	Name       string   `json:"name"`
	Alias      string   `json:"alias,omitempty"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Command    []string `json:"command,omitempty"`
}

type artifact struct {
	Name      string   `json:"name"`
	Untracked bool     `json:"untracked"`
	Paths     []string `json:"paths"`
	Exclude   []string `json:"exclude"`
	When      string   `json:"when"`
	Type      string   `json:"artifact_type"`
	Format    string   `json:"artifact_format"`
	ExpireIn  string   `json:"expire_in"`
}

type cache struct {
	Key       string   `json:"key"`
	Untracked bool     `json:"untracked"`
	Policy    string   `json:"policy"`
	Paths     []string `json:"paths"`
	When      string   `json:"when"`
}

type dependency struct {
	ID    int64  `json:"id"`
	Name  string `json:"name"`
	Token string `json:"token"`
	// ArtifactsFile is left out when the job has no artifacts, as GitLab
	// does; the runner then skips the download.
	ArtifactsFile *artifactsFile `json:"artifacts_file,omitempty"`
}

type artifactsFile struct {
	Filename string `json:"filename"`
	Size     int64  `json:"size"`
}

type gitlabFeatures struct {
	TraceSections     bool     `json:"trace_sections"`
	TokenMaskPrefixes []string `json:"token_mask_prefixes"`
	FailureReasons    []string `json:"failure_reasons"`
}

// jobRequest is the body of POST /jobs/request.
type jobRequest struct {
	Token string `json:"token"`
}

// updateJobRequest is the body of PUT /jobs/:id.
type updateJobRequest struct {
	Token         string `json:"token"`
	State         string `json:"state"`
	FailureReason string `json:"failure_reason"`
	ExitCode      int    `json:"exit_code"`
	Output        struct {
		Checksum string `json:"checksum"`
		Bytesize int    `json:"bytesize"`
	} `json:"output"`
}

// The fake project every job belongs to.
const (
	projectID        = 1
	projectNamespace = "lve"
	projectName      = "selftest"
	defaultTimeout   = 3600
	nullSHA          = "0000000000000000000000000000000000000000"
)

// failureReasons are the reasons this "GitLab" understands; the runner sends
// unknown_failure in place of one that is not listed.
var failureReasons = []string{
	"script_failure", "runner_system_failure", "job_execution_timeout", "unknown_failure",
	"image_pull_failure", "stuck_or_timeout_failure", "api_failure", "runner_unsupported",
	"archived_failure", "unmet_prerequisites", "scheduler_failure", "data_integrity_failure",
}

// payload builds the job as GitLab would send it. Called with s.mu held, when
// the runner takes the job, so that dependencies see artifacts uploaded since.
func (s *Server) payload(j *job) jobResponse {
	spec := j.spec
	serverURL := cmp.Or(s.public, s.url)
	base, _ := url.Parse(serverURL) // a listener's address, or checked by SetPublicURL: it parses
	project := Project{ID: projectID, Namespace: projectNamespace, Name: projectName}
	if spec.Project != nil {
		project = *spec.Project
	}
	projectPath := project.Namespace + "/" + project.Name
	projectURL := serverURL + projectPath
	timeout := spec.TimeoutSeconds
	if timeout <= 0 {
		timeout = defaultTimeout
	}
	ref := spec.Ref
	if ref == "" {
		ref = "main"
	}
	repoURL, sha := spec.GitURL, spec.SHA
	if repoURL == "" {
		// The runner derives the project's build and cache directories from
		// the repository URL even when it clones nothing.
		repoURL, sha = projectURL+".git", nullSHA
	}
	id := strconv.FormatInt(j.id, 10)
	pub := func(k, v string) jobVariable { return jobVariable{Key: k, Value: v, Public: true} }
	vars := []jobVariable{
		pub("CI_JOB_ID", id),
		pub("CI_JOB_NAME", spec.Name),
		pub("CI_JOB_STAGE", spec.Stage),
		{Key: "CI_JOB_TOKEN", Value: j.token, Masked: true},
		pub("CI_JOB_URL", projectURL+"/-/jobs/"+id),
		pub("CI_PIPELINE_ID", id),
		pub("CI_PIPELINE_IID", "1"),
		pub("CI_PROJECT_ID", strconv.FormatInt(project.ID, 10)),
		pub("CI_PROJECT_NAME", project.Name),
		pub("CI_PROJECT_NAMESPACE", project.Namespace),
		pub("CI_PROJECT_PATH", projectPath),
		pub("CI_PROJECT_URL", projectURL),
		pub("CI_REPOSITORY_URL", repoURL),
		pub("CI_COMMIT_SHA", sha),
		pub("CI_COMMIT_BEFORE_SHA", nullSHA),
		pub("CI_COMMIT_REF_NAME", ref),
		pub("CI_COMMIT_BRANCH", ref),
		pub("CI_DEFAULT_BRANCH", ref),
		pub("CI_SERVER_URL", strings.TrimSuffix(serverURL, "/")),
		pub("CI_SERVER_HOST", base.Hostname()),
		pub("CI_SERVER_PORT", base.Port()),
		pub("CI_SERVER_PROTOCOL", "http"),
		pub("GITLAB_CI", "true"),
	}
	if spec.GitURL == "" {
		vars = append(vars, pub("GIT_STRATEGY", "none"))
	}
	for _, v := range spec.Variables {
		vars = append(vars, jobVariable{Key: v.Key, Value: v.Value, Public: v.Public, File: v.File, Masked: v.Masked})
	}

	steps := []step{}
	if spec.Run == "" || len(spec.Script) > 0 {
		steps = append(steps, step{Name: "script", Script: spec.Script, Timeout: timeout, When: "on_success"})
	}
	if len(spec.AfterScript) > 0 {
		steps = append(steps, step{Name: "after_script", Script: spec.AfterScript, Timeout: timeout, When: "always"})
	}

	resp := jobResponse{
		ID:            j.id,
		Token:         j.token,
		AllowGitFetch: true,
		JobInfo:       jobInfo{Name: spec.Name, Stage: spec.Stage, ProjectID: project.ID, ProjectName: project.Name},
		GitInfo: gitInfo{
			RepoURL: repoURL, Ref: ref, Sha: sha, BeforeSha: nullSHA, RefType: "branch",
			Refspecs: []string{"+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*"},
		},
		RunnerInfo:   runnerInfo{Timeout: timeout},
		Variables:    vars,
		Steps:        steps,
		Image:        image{Name: spec.Image},
		Run:          spec.Run,
		Services:     []service{},
		Artifacts:    []artifact{},
		Cache:        []cache{},
		Credentials:  []struct{}{},
		Dependencies: []dependency{},
		Features: gitlabFeatures{
			TraceSections: true, TokenMaskPrefixes: []string{"lve-job-"}, FailureReasons: failureReasons,
		},
	}
	for _, sv := range spec.Services {
		resp.Services = append(resp.Services, service(sv))
	}
	if a := spec.Artifacts; a != nil {
		resp.Artifacts = append(resp.Artifacts, artifact{
			Name: a.Name, Untracked: a.Untracked, Paths: a.Paths, Exclude: []string{},
			When: orDefault(a.When, "on_success"), Type: "archive", Format: "zip", ExpireIn: a.ExpireIn,
		})
	}
	if c := spec.Cache; c != nil {
		resp.Cache = append(resp.Cache, cache{
			Key: c.Key, Untracked: c.Untracked, Paths: c.Paths,
			Policy: orDefault(c.Policy, "pull-push"), When: orDefault(c.When, "on_success"),
		})
	}
	for _, depID := range spec.Dependencies {
		dep := s.jobs[depID]
		if dep == nil {
			s.log.Warn("job depends on an unknown job", "job", j.id, "dependency", depID)
			continue
		}
		// Like GitLab, the token is the downloading job's own: a job token
		// is only good while its job runs, and the server checks that the
		// running job depends on the one whose artifacts it asks for.
		d := dependency{ID: depID, Name: dep.spec.Name, Token: j.token}
		if dep.artifacts != nil {
			d.ArtifactsFile = &artifactsFile{Filename: "artifacts.zip", Size: int64(len(dep.artifacts))}
		}
		resp.Dependencies = append(resp.Dependencies, d)
	}
	return resp
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}
