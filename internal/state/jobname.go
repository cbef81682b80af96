package state

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// JobNameFormat is the format of the job name records this version writes.
// Readers accept every format up to theirs and read the fields they know
// (encoding/json ignores the others), so an older version reads a newer
// record as long as Job keeps its meaning.
const JobNameFormat = 1

// JobName records the name under which a job's machine was prepared,
// keyed by a key that no version changes (lifecycle.JobKey). A job in
// flight across an upgrade keeps the name its prepare gave it: the later
// stages of a newer version that names machines differently read it here
// instead of naming the machine again.
type JobName struct {
	Format int `json:"format"`
	// Job is the job's name under the version that prepared it: the
	// machine's name for a cold start, the job mapping's key for a warm
	// one (MapJob).
	Job string `json:"job"`
	// Version is the driver version that prepared the job (for the logs).
	Version string    `json:"version"`
	At      time.Time `json:"at"`
}

const jobNameDir = "job-names"

// ErrNewerFormat is JobNameOf's error for a record of a newer format than
// this version reads.
var ErrNewerFormat = errors.New("newer than this version's")

// IsBadRecord says err is about a record that was read but does not
// decode (cut short by a host crash), not about reading it.
func IsBadRecord(err error) bool { return errors.Is(err, errBadRecord) }

// JobNamePath is key's record file relative to the store (for Age).
func JobNamePath(key string) string { return filepath.Join(jobNameDir, key+".json") }

// A front end's name is lower-case words joined by '-' ("gitlab", "github-hooks").
var jobKeyRE = regexp.MustCompile(`^[a-z]+(-[a-z]+)*-[0-9a-f]{8,64}-[0-9]{1,19}$`)

func (s Store) jobNamePath(key string) (string, error) {
	if !jobKeyRE.MatchString(key) {
		return "", fmt.Errorf("refusing job name record for key %q", key)
	}
	return filepath.Join(s.Dir, JobNamePath(key)), nil
}

// NameJob records the job's name under its stable key (0600, atomically).
func (s Store) NameJob(key string, jn JobName) error {
	if _, err := s.jobNamePath(key); err != nil {
		return err
	}
	if jn.Format == 0 {
		jn.Format = JobNameFormat
	}
	return s.writeJSON(jobNameDir, key, jn)
}

// JobNameOf returns the job name record of key, or nil when there is none
// (a job prepared by a version that wrote none: its name is the one the
// current version gives it). A record of a newer format than this
// version's is an error that says so.
func (s Store) JobNameOf(key string) (*JobName, error) {
	path, err := s.jobNamePath(key)
	if err != nil {
		return nil, err
	}
	var jn JobName
	err = readRecord(path, &jn)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if jn.Format > JobNameFormat {
		return nil, fmt.Errorf("job name record %s has format %d, %w %d (downgraded in the middle of a job?)", key, jn.Format, ErrNewerFormat, JobNameFormat)
	}
	return &jn, nil
}

// ForgetJobName removes key's record; a missing one is success.
func (s Store) ForgetJobName(key string) error {
	path, err := s.jobNamePath(key)
	if err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// JobNameKeys lists the keys that have job name records.
func (s Store) JobNameKeys() ([]string, error) { return s.namesIn(jobNameDir, ".json") }
