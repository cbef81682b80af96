package state

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"time"
)

// keptFile marks a machine kept after its job failed (debug.allow_keep_on_failure).
const keptFile = "kept.json"

// Kept is the mark of a machine kept for debugging: whose it is and until
// when. It lives in the machine's directory, so it goes with the machine.
type Kept struct {
	// Name is the machine (filled in by KeptMachines, not stored).
	Name string `json:"-"`
	// Project is the job's project (its GitLab instance and project id).
	Project string    `json:"project"`
	At      time.Time `json:"at"`
	Until   time.Time `json:"until"`
}

// MarkKept records that the machine is kept.
func (s Store) MarkKept(name string, k Kept) error {
	b, err := json.Marshal(k)
	if err != nil {
		return err
	}
	return WriteFileAtomic(filepath.Join(s.MachineDir(name), keptFile), b)
}

// KeptMachines lists the machines marked kept, oldest first. A mark that
// does not decode still counts (a project of its own, kept now): a cap
// errs on the side of holding less.
func (s Store) KeptMachines() ([]Kept, error) {
	names, err := s.Names()
	if err != nil {
		return nil, err
	}
	var out []Kept
	for _, n := range names {
		var k Kept
		err := readRecord(filepath.Join(s.MachineDir(n), keptFile), &k)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			now := time.Now()
			k = Kept{Project: "?" + n, At: now, Until: now.Add(time.Hour)}
		}
		k.Name = n
		out = append(out, k)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At.Before(out[j].At) })
	return out, nil
}

// LockKept takes the host's lock on keeping machines, so that two
// cleanups deciding at once cannot both take the last place. Its file is
// hidden: LockNames does not list it as a machine.
func (s Store) LockKept(ctx context.Context) (unlock func(), err error) {
	return s.Lock(ctx, ".kept")
}
