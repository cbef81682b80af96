package harness

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/url"
	"path"
	"sort"
	"strconv"
	"strings"
)

func randUint32() uint32 { return rand.Uint32() }

const (
	// ServerURL and RunnerID are the CI_SERVER_URL and CI_RUNNER_ID of every
	// job the harness runs (GitLab's predefined variables, first in the
	// payload): with them a test or the benchmark knows the driver's machine
	// names (gitlab.InstanceOf).
	ServerURL        = "http://gitlab.harness.invalid"
	RunnerID         = "1"
	runnerShortToken = "harness1"
	runnerArch       = "linux/amd64"
)

// featureFlags are the FF_* variables runner 16.11 exports, in its order.
var featureFlags = [][2]string{
	{"FF_TEST_FEATURE", "false"},
	{"FF_CMD_DISABLE_DELAYED_ERROR_LEVEL_EXPANSION", "false"},
	{"FF_NETWORK_PER_BUILD", "false"},
	{"FF_USE_LEGACY_KUBERNETES_EXECUTION_STRATEGY", "false"},
	{"FF_USE_DIRECT_DOWNLOAD", "true"},
	{"FF_SKIP_NOOP_BUILD_STAGES", "true"},
	{"FF_USE_FASTZIP", "false"},
	{"FF_DISABLE_UMASK_FOR_DOCKER_EXECUTOR", "false"},
	{"FF_ENABLE_BASH_EXIT_CODE_CHECK", "false"},
	{"FF_USE_WINDOWS_LEGACY_PROCESS_STRATEGY", "false"},
	{"FF_USE_NEW_BASH_EVAL_STRATEGY", "false"},
	{"FF_USE_POWERSHELL_PATH_RESOLVER", "false"},
	{"FF_USE_DYNAMIC_TRACE_FORCE_SEND_INTERVAL", "false"},
	{"FF_SCRIPT_SECTIONS", "false"},
	{"FF_USE_NEW_SHELL_ESCAPE", "false"},
	{"FF_ENABLE_JOB_CLEANUP", "false"},
	{"FF_KUBERNETES_HONOR_ENTRYPOINT", "false"},
	{"FF_POSIXLY_CORRECT_ESCAPES", "false"},
	{"FF_RESOLVE_FULL_TLS_CHAIN", "false"},
	{"FF_DISABLE_POWERSHELL_STDIN", "false"},
	{"FF_USE_POD_ACTIVE_DEADLINE_SECONDS", "true"},
	{"FF_USE_ADVANCED_POD_SPEC_CONFIGURATION", "false"},
	{"FF_SET_PERMISSIONS_BEFORE_CLEANUP", "true"},
	{"FF_SECRET_RESOLVING_FAILS_IF_MISSING", "true"},
	{"FF_RETRIEVE_POD_WARNING_EVENTS", "false"},
	{"FF_PRINT_POD_EVENTS", "false"},
	{"FF_USE_GIT_BUNDLE_URIS", "true"},
	{"FF_USE_DUMB_INIT_WITH_KUBERNETES_EXECUTOR", "false"},
	{"FF_USE_INIT_WITH_DOCKER_EXECUTOR", "false"},
	{"FF_LOG_IMAGES_CONFIGURED_FOR_JOB", "false"},
	{"FF_USE_DOCKER_AUTOSCALER_DIAL_STDIO", "true"},
	{"FF_CLEAN_UP_FAILED_CACHE_EXTRACT", "false"},
	{"FF_USE_WINDOWS_JOB_OBJECT", "false"},
	{"FF_TIMESTAMPS", "false"},
}

// jobVariable is one entry of the payload's variables list.
type jobVariable struct {
	Key    string `json:"key"`
	Value  string `json:"value"`
	Public bool   `json:"public"`
	File   bool   `json:"file"`
	Masked bool   `json:"masked"`
	Raw    bool   `json:"raw"`
}

// kv is a variable as it reaches a stage. envOnly ones are not exported in
// scripts (the runner passes CI_JOB_SERVICES only in the environment).
type kv struct {
	key, value string
	envOnly    bool
}

// repoURL is git_info.repo_url: for http(s) URLs with the job token embedded,
// as GitLab sends it.
func (j *Job) repoURL() string {
	u, err := url.Parse(j.RepoURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.User != nil {
		return j.RepoURL
	}
	u.User = url.UserPassword("gitlab-ci-token", j.Token)
	return u.String()
}

// projectSlug is the runner's ProjectSlug: the URL path without .git, or
// "project-<id>" for repositories that are not URLs (like the recorded trace's
// /srv/git/demo-repo, which gave /builds/project-1).
func (j *Job) projectSlug() string {
	u, err := url.Parse(j.RepoURL)
	if err == nil && u.Host != "" {
		slug := path.Clean(strings.TrimSuffix(u.Path, ".git"))
		slug = strings.TrimPrefix(slug, "/")
		if slug != "." && slug != "" && !strings.Contains(slug, "..") {
			return slug
		}
	}
	return fmt.Sprintf("project-%d", j.ProjectID)
}

// projectDir is CI_PROJECT_DIR for builds_dir (runner's StartBuild).
func (j *Job) projectDir(buildsDir string, shared bool) string {
	dir := j.projectSlug()
	if shared {
		dir = path.Join(runnerShortToken, strconv.Itoa(j.ConcurrentID), dir)
	}
	return path.Join(buildsDir, dir)
}

func (j *Job) namespaceAndName() (string, string) {
	p := strings.Trim(j.ProjectPath, "/")
	if i := strings.LastIndex(p, "/"); i >= 0 {
		return p[:i], p[i+1:]
	}
	return "", p
}

// payloadVariables are the variables GitLab sends, then the user's.
func (j *Job) payloadVariables() []jobVariable {
	ns, name := j.namespaceAndName()
	id := strconv.FormatInt(j.ID, 10)
	projectURL := j.ServerURL + "/" + strings.Trim(j.ProjectPath, "/")
	pub := func(k, v string) jobVariable { return jobVariable{Key: k, Value: v, Public: true} }
	short := j.SHA
	if len(short) > 8 {
		short = short[:8]
	}
	vars := []jobVariable{
		pub("CI_JOB_ID", id),
		pub("CI_JOB_NAME", j.Name),
		pub("CI_JOB_STAGE", j.Stage),
		{Key: "CI_JOB_TOKEN", Value: j.Token, Masked: true},
		pub("CI_BUILD_ID", id),
		pub("CI_PIPELINE_ID", "1"),
		pub("CI_PIPELINE_IID", "1"),
		pub("CI_PROJECT_ID", strconv.FormatInt(j.ProjectID, 10)),
		pub("CI_PROJECT_NAME", name),
		pub("CI_PROJECT_PATH", strings.Trim(j.ProjectPath, "/")),
		pub("CI_PROJECT_NAMESPACE", ns),
		pub("CI_PROJECT_URL", projectURL),
		pub("CI_COMMIT_SHA", j.SHA),
		pub("CI_COMMIT_SHORT_SHA", short),
		pub("CI_COMMIT_REF_NAME", j.Ref),
		pub("CI_COMMIT_BRANCH", j.Ref),
		pub("CI_COMMIT_BEFORE_SHA", strings.Repeat("0", 40)),
		pub("CI_DEFAULT_BRANCH", j.Ref),
		pub("CI_SERVER_URL", j.ServerURL),
		pub("CI_SERVER_HOST", strings.TrimPrefix(strings.TrimPrefix(j.ServerURL, "http://"), "https://")),
		pub("CI_JOB_URL", projectURL+"/-/jobs/"+id),
		pub("CI_RUNNER_ID", RunnerID),
		pub("CI_REPOSITORY_URL", j.repoURL()),
	}
	if j.Image != "" {
		vars = append(vars, pub("CI_JOB_IMAGE", j.Image))
	}
	for _, k := range sortedKeys(j.Variables) {
		vars = append(vars, jobVariable{Key: k, Value: j.Variables[k]})
	}
	for _, k := range sortedKeys(j.Masked) {
		vars = append(vars, jobVariable{Key: k, Value: j.Masked[k], Masked: true})
	}
	return vars
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// stageVars are all variables for one invocation, in the order runner 16.11
// exports them, later duplicates overriding earlier ones in place. buildsDir
// and projectDir are empty for config_exec.
func (j *Job) stageVars(buildsDir, projectDir, status string) []kv {
	var vars []kv
	for _, ff := range featureFlags {
		vars = append(vars, kv{key: ff[0], value: ff[1]})
	}
	vars = append(vars,
		kv{key: "CI_RUNNER_SHORT_TOKEN", value: runnerShortToken},
		kv{key: "CI_BUILDS_DIR", value: buildsDir},
		kv{key: "CI_PROJECT_DIR", value: projectDir},
		kv{key: "CI_CONCURRENT_ID", value: strconv.Itoa(j.ConcurrentID)},
		kv{key: "CI_CONCURRENT_PROJECT_ID", value: strconv.Itoa(j.ConcurrentID)},
		kv{key: "CI_SERVER", value: "yes"},
		kv{key: "CI_JOB_STATUS", value: status},
		kv{key: "CI_JOB_TIMEOUT", value: strconv.Itoa(int(j.Timeout.Seconds()))},
	)
	for _, v := range j.payloadVariables() {
		vars = append(vars, kv{key: v.Key, value: v.Value})
	}
	vars = append(vars,
		kv{key: "CI_JOB_SERVICES", envOnly: true},
		kv{key: "CI_SHARED_ENVIRONMENT", value: "true"},
		kv{key: "CI_RUNNER_VERSION", value: RunnerVersion},
		kv{key: "CI_RUNNER_REVISION", value: RunnerRevision},
		kv{key: "CI_RUNNER_EXECUTABLE_ARCH", value: runnerArch},
		kv{key: "RUNNER_TEMP_PROJECT_DIR", value: projectDir + ".tmp"},
	)
	if j.ScriptTimeout > 0 {
		vars = append(vars, kv{key: "RUNNER_SCRIPT_TIMEOUT", value: j.ScriptTimeout.String()})
	}
	return dedupe(vars)
}

func dedupe(vars []kv) []kv {
	idx := make(map[string]int, len(vars))
	out := vars[:0:0]
	for _, v := range vars {
		if i, ok := idx[v.key]; ok {
			out[i] = v
			continue
		}
		idx[v.key] = len(out)
		out = append(out, v)
	}
	return out
}

// payload is the JOB_RESPONSE_FILE content, shaped like the recorded
// response.json.
type payload struct {
	ID            int64         `json:"id"`
	Token         string        `json:"token"`
	AllowGitFetch bool          `json:"allow_git_fetch"`
	JobInfo       payloadJob    `json:"job_info"`
	GitInfo       payloadGit    `json:"git_info"`
	RunnerInfo    payloadRunner `json:"runner_info"`
	Variables     []jobVariable `json:"variables"`
	Steps         []payloadStep `json:"steps"`
	Image         payloadImage  `json:"image"`
	Services      []any         `json:"services"`
	Artifacts     []any         `json:"artifacts"`
	Cache         []any         `json:"cache"`
	Credentials   []any         `json:"credentials"`
	Dependencies  []any         `json:"dependencies"`
	Features      payloadFeat   `json:"features"`
}

type payloadJob struct {
	Name        string `json:"name"`
	Stage       string `json:"stage"`
	ProjectID   int64  `json:"project_id"`
	ProjectName string `json:"project_name"`
}

type payloadGit struct {
	RepoURL   string   `json:"repo_url"`
	Ref       string   `json:"ref"`
	SHA       string   `json:"sha"`
	BeforeSHA string   `json:"before_sha"`
	RefType   string   `json:"ref_type"`
	Refspecs  []string `json:"refspecs"`
	Depth     int      `json:"depth"`
}

type payloadRunner struct {
	Timeout int `json:"timeout"`
}

type payloadStep struct {
	Name         string   `json:"name"`
	Script       []string `json:"script"`
	Timeout      int      `json:"timeout"`
	When         string   `json:"when"`
	AllowFailure bool     `json:"allow_failure"`
}

type payloadImage struct {
	Name string `json:"name"`
}

type payloadFeat struct {
	TraceSections  bool     `json:"trace_sections"`
	FailureReasons []string `json:"failure_reasons"`
}

var gitRefspecs = []string{"+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*"}

func (j *Job) payloadJSON() ([]byte, error) {
	_, name := j.namespaceAndName()
	timeout := int(j.Timeout.Seconds())
	p := payload{
		ID:            j.ID,
		Token:         j.Token,
		AllowGitFetch: true,
		JobInfo:       payloadJob{Name: j.Name, Stage: j.Stage, ProjectID: j.ProjectID, ProjectName: name},
		GitInfo: payloadGit{
			RepoURL: j.repoURL(), Ref: j.Ref, SHA: j.SHA, BeforeSHA: strings.Repeat("0", 40),
			RefType: "branch", Refspecs: gitRefspecs, Depth: j.GitDepth,
		},
		RunnerInfo: payloadRunner{Timeout: timeout},
		Variables:  j.payloadVariables(),
		Steps: []payloadStep{
			{Name: "script", Script: nonNil(j.Script), Timeout: timeout, When: "on_success"},
		},
		Image:        payloadImage{Name: j.Image},
		Services:     []any{},
		Artifacts:    []any{},
		Cache:        []any{},
		Credentials:  []any{},
		Dependencies: []any{},
		Features: payloadFeat{TraceSections: true, FailureReasons: []string{
			ReasonScriptFailure, ReasonSystemFailure, ReasonJobTimeout, "unknown_failure",
		}},
	}
	if len(j.AfterScript) > 0 {
		p.Steps = append(p.Steps, payloadStep{Name: "after_script", Script: j.AfterScript, Timeout: timeout, When: "always"})
	}
	return json.Marshal(p)
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// secrets are the values masked in logs.
func (j *Job) secrets() []string {
	out := []string{j.Token}
	for _, k := range sortedKeys(j.Masked) {
		out = append(out, j.Masked[k])
	}
	return out
}
