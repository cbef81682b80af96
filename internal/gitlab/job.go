// Package gitlab is the GitLab Runner Custom executor front end: it reads the
// job's identity and requests, and implements the config, prepare, run and
// cleanup stages on top of the front-end-neutral lifecycle package.
package gitlab

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// Job is the trusted identity of the job and what it asked for.
type Job struct {
	// ID is the job id from the runner's payload.
	ID int64
	// Timeout is the job's timeout (runner_info.timeout).
	Timeout time.Duration
	// Image is the job's `image:` name; empty for none.
	Image string
	// FromPayload says whether the identity came from JOB_RESPONSE_FILE.
	FromPayload bool
}

// payload is the part of JOB_RESPONSE_FILE the driver reads. The file also
// holds the job token and variables: they are never decoded here, let alone
// logged.
type payload struct {
	ID         *int64 `json:"id"`
	RunnerInfo struct {
		Timeout int64 `json:"timeout"`
	} `json:"runner_info"`
	Image struct {
		Name string `json:"name"`
	} `json:"image"`
}

// maxJobTimeout bounds a timeout read from the payload (GitLab's maximum is
// one month).
const maxJobTimeout = 31 * 24 * time.Hour

// ReadJob determines the job. The job id comes from JOB_RESPONSE_FILE, the
// runner's own copy of the job payload. CUSTOM_ENV_* values can be set by the
// job's author, so CUSTOM_ENV_CI_JOB_ID is used only when the runner provides
// no payload file at all (warn says so).
func ReadJob(getenv func(string) string, warn func(string)) (*Job, error) {
	path := getenv("JOB_RESPONSE_FILE")
	if path == "" {
		idText := getenv("CUSTOM_ENV_CI_JOB_ID")
		id, err := strconv.ParseInt(idText, 10, 64)
		if err != nil || id <= 0 {
			return nil, fmt.Errorf("no JOB_RESPONSE_FILE and CUSTOM_ENV_CI_JOB_ID %q is not a positive job id", idText)
		}
		warn("JOB_RESPONSE_FILE is not set (runner older than the Custom executor's payload file?); using CUSTOM_ENV_CI_JOB_ID, which the job itself can override")
		timeout, _ := strconv.ParseInt(getenv("CUSTOM_ENV_CI_JOB_TIMEOUT"), 10, 64)
		return &Job{ID: id, Timeout: boundTimeout(timeout), Image: getenv("CUSTOM_ENV_CI_JOB_IMAGE")}, nil
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
	return &Job{ID: *p.ID, Timeout: boundTimeout(p.RunnerInfo.Timeout), Image: p.Image.Name, FromPayload: true}, nil
}

func boundTimeout(seconds int64) time.Duration {
	if seconds <= 0 {
		return time.Hour
	}
	d := time.Duration(seconds) * time.Second
	return min(d, maxJobTimeout)
}

// MachineName is the deterministic name of the job's machine: the prefix, the
// first block of the controller id (one installation) and the job id.
func MachineName(prefix, controller string, jobID int64) string {
	short := controller
	if len(short) > 8 {
		short = short[:8]
	}
	return fmt.Sprintf("%s-%s-%d", prefix, short, jobID)
}

// ChooseImage picks the configured image the job asked for, or the default.
// The name is only compared with configured names. An unknown name is the
// user's mistake (BUILD_FAILURE: retrying cannot fix it); the message lists
// what is allowed.
func ChooseImage(cfg *config.Config, asked string) (*config.Image, error) {
	if asked == "" {
		img, _ := cfg.Image(cfg.DefaultImage)
		return img, nil
	}
	if img, ok := cfg.Image(asked); ok {
		return img, nil
	}
	shown := asked
	if len(shown) > 64 {
		shown = shown[:64] + "..."
	}
	return nil, exitcodes.Userf("image %q is not offered by this runner; allowed images: %s (or leave image: empty for %q)",
		shown, quoteList(cfg.ImageNames()), cfg.DefaultImage)
}

func quoteList(items []string) string {
	b, _ := json.Marshal(items)
	return string(b)
}
