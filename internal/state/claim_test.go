package state

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func perm(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	require.NoError(t, err)
	return st.Mode().Perm()
}

func TestClaimIsExclusive(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	const name = "lve-a-sb-1"
	_, err := s.Create(name)
	require.NoError(t, err)

	cl, err := s.ClaimOf(name)
	require.NoError(t, err)
	require.Nil(t, cl, "an idle machine has no claim")

	at := time.Now().UTC().Truncate(time.Second)
	require.NoError(t, s.Claim(name, Claim{Job: "job-1", At: at}))
	err = s.Claim(name, Claim{Job: "job-2", At: at})
	require.ErrorIs(t, err, ErrClaimed)
	require.ErrorContains(t, err, name)
	err = s.Claim(name, Claim{Retire: true, Reason: "too old", At: at})
	require.ErrorIs(t, err, ErrClaimed, "nor can the service retire a claimed machine")

	cl, err = s.ClaimOf(name)
	require.NoError(t, err)
	require.Equal(t, &Claim{Job: "job-1", At: at}, cl, "the first claim stays")
	require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(s.MachineDir(name), claimFile)))
}

// Of many concurrent claims exactly one wins; the claim on file is the
// winner's.
func TestClaimConcurrentOneWins(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	const name = "lve-a-sb-2"
	_, err := s.Create(name)
	require.NoError(t, err)
	const n = 16
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = s.Claim(name, Claim{Job: fmt.Sprintf("job-%d", i), At: time.Now().UTC()})
		}()
	}
	close(start)
	wg.Wait()
	winner := -1
	for i, err := range errs {
		if err == nil {
			require.Equal(t, -1, winner, "two claims won: %d and %d", winner, i)
			winner = i
			continue
		}
		require.ErrorIs(t, err, ErrClaimed)
	}
	require.NotEqual(t, -1, winner, "no claim won")
	cl, err := s.ClaimOf(name)
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("job-%d", winner), cl.Job)
}

// A claim file that cannot be parsed counts as a claim to retire: such a
// machine is never handed out.
func TestClaimUnreadableCountsAsRetire(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	const name = "lve-a-sb-3"
	_, err := s.Create(name)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(s.MachineDir(name), claimFile), []byte("{trunc"), 0o600))
	cl, err := s.ClaimOf(name)
	require.NoError(t, err)
	require.NotNil(t, cl)
	require.True(t, cl.Retire)
	require.Empty(t, cl.Job)
	require.Contains(t, cl.Reason, "unreadable")
	require.ErrorIs(t, s.Claim(name, Claim{Job: "j"}), ErrClaimed)
}

// A machine without a state directory cannot be claimed (the claim is no
// error the caller could mistake for "claimed by someone").
func TestClaimWithoutMachineDir(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	err := s.Claim("lve-a-sb-gone", Claim{Job: "j"})
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrClaimed)
	cl, err := s.ClaimOf("lve-a-sb-gone")
	require.NoError(t, err)
	require.Nil(t, cl)
}

func TestRecordReadsOnlyTheMachineRecord(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	const name = "lve-a-sb-4"
	_, err := s.Record(name)
	require.ErrorIs(t, err, ErrNoMachine)
	_, err = s.Create(name)
	require.NoError(t, err)
	_, err = s.Record(name)
	require.ErrorIs(t, err, ErrNoMachine, "a machine still booting has no record")
	m := Machine{Name: name, Image: "tiny", Address: "127.0.0.1", Port: 22, Created: time.Now().UTC().Truncate(time.Second),
		Standby: &Standby{Image: "tiny", VCPUs: 1, MemoryMiB: 256, DiskGiB: 2, Base: FileVersion{Path: "/b", Size: 7, ModTime: 42}}}
	require.NoError(t, s.Save(m))
	got, err := s.Record(name)
	require.NoError(t, err, "no client key needed")
	require.Equal(t, &m, got)
}

func TestJobMappingRoundTrip(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	jm, err := s.MachineOfJob("lve-a-7")
	require.NoError(t, err)
	require.Nil(t, jm, "no mapping: a cold job")
	jobs, err := s.MappedJobs()
	require.NoError(t, err)
	require.Empty(t, jobs)

	at := time.Now().UTC().Truncate(time.Second)
	want := JobMachine{Machine: "lve-a-sb-1", Warm: true, At: at}
	require.NoError(t, s.MapJob("lve-a-7", want))
	require.NoError(t, s.MapJob("lve-a-8", JobMachine{Machine: "lve-a-sb-2", At: at}))
	jm, err = s.MachineOfJob("lve-a-7")
	require.NoError(t, err)
	require.Equal(t, &want, jm)

	// Mapping again replaces.
	want.Machine = "lve-a-sb-3"
	require.NoError(t, s.MapJob("lve-a-7", want))
	jm, err = s.MachineOfJob("lve-a-7")
	require.NoError(t, err)
	require.Equal(t, "lve-a-sb-3", jm.Machine)

	jobs, err = s.MappedJobs()
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"lve-a-7", "lve-a-8"}, jobs, "no temporary files listed")

	dir := filepath.Join(s.Dir, "jobs")
	require.Equal(t, os.FileMode(0o700), perm(t, dir))
	require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "lve-a-7.json")))

	require.NoError(t, s.UnmapJob("lve-a-7"))
	jm, err = s.MachineOfJob("lve-a-7")
	require.NoError(t, err)
	require.Nil(t, jm)
	require.NoError(t, s.UnmapJob("lve-a-7"), "idempotent")
	jobs, err = s.MappedJobs()
	require.NoError(t, err)
	require.Equal(t, []string{"lve-a-8"}, jobs)
}

func TestJobMappingRefusesPathNames(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	for _, bad := range []string{"", ".", "..", "../x", "a/b", "/etc/passwd", "a\x00b"} {
		require.Error(t, s.MapJob(bad, JobMachine{Machine: "m"}), "%q", bad)
		_, err := s.MachineOfJob(bad)
		require.Error(t, err, "%q", bad)
		require.Error(t, s.UnmapJob(bad), "%q", bad)
	}
	_, err := os.Stat(filepath.Join(s.Dir, "x.json"))
	require.True(t, os.IsNotExist(err), "nothing written outside jobs/")
	jobs, err := s.MappedJobs()
	require.NoError(t, err)
	require.Empty(t, jobs)
}

func TestJobMappingCorrupt(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	require.NoError(t, os.MkdirAll(filepath.Join(s.Dir, "jobs"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, "jobs", "j.json"), []byte("nope"), 0o600))
	_, err := s.MachineOfJob("j")
	require.ErrorContains(t, err, "j.json")
}

func TestTouchAndAge(t *testing.T) {
	s := Store{Dir: filepath.Join(t.TempDir(), "new")}
	_, ok := s.Age("k")
	require.False(t, ok, "never touched")
	require.NoError(t, s.Touch("k"))
	age, ok := s.Age("k")
	require.True(t, ok)
	require.Less(t, age, time.Minute)
	require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(s.Dir, "k")))

	old := time.Now().Add(-time.Hour)
	require.NoError(t, os.Chtimes(filepath.Join(s.Dir, "k"), old, old))
	age, ok = s.Age("k")
	require.True(t, ok)
	require.InDelta(t, time.Hour.Seconds(), age.Seconds(), 60)
	require.NoError(t, s.Touch("k"))
	age, _ = s.Age("k")
	require.Less(t, age, time.Minute, "touch moves the time to now")
}

func TestVersionOf(t *testing.T) {
	path := filepath.Join(t.TempDir(), "base.qcow2")
	_, err := VersionOf(path)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NoError(t, os.WriteFile(path, []byte("QFI\xfb"), 0o644))
	v1, err := VersionOf(path)
	require.NoError(t, err)
	require.Equal(t, path, v1.Path)
	require.EqualValues(t, 4, v1.Size)

	later := time.Now().Add(time.Hour)
	require.NoError(t, os.Chtimes(path, later, later))
	v2, err := VersionOf(path)
	require.NoError(t, err)
	require.NotEqual(t, v1, v2, "a new mtime is a new version")
	require.Greater(t, v2.ModTime, v1.ModTime)
}

// Demand of an image whose name holds dots is the image's, not a prefix's.
func TestDemandOfDottedImageName(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	require.NoError(t, s.NoteDemand("ubuntu.24.04"))
	require.NoError(t, s.NoteDemand("tiny"))
	d, err := s.TakeDemand()
	require.NoError(t, err)
	var images []string
	for _, x := range d {
		images = append(images, x.Image)
	}
	require.ElementsMatch(t, []string{"ubuntu.24.04", "tiny"}, images)
	require.Error(t, s.NoteDemand("../x"))
	require.Error(t, s.NoteDemand(".hidden"))
}

// Held looks at a lock without creating anything (an administrator's look
// as another user must not leave files that user owns).
func TestHeldCreatesNothing(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	held, err := s.Held("_serve")
	require.NoError(t, err)
	require.False(t, held)
	_, err = os.Stat(filepath.Join(s.Dir, "locks"))
	require.ErrorIs(t, err, os.ErrNotExist, "no lock directory made")
	unlock, err := s.TryLock("_serve")
	require.NoError(t, err)
	held, err = s.Held("_serve")
	require.NoError(t, err)
	require.True(t, held)
	unlock()
	held, err = s.Held("_serve")
	require.NoError(t, err)
	require.False(t, held)
	unlock, err = s.TryLock("_serve")
	require.NoError(t, err, "Held's look left the lock free")
	unlock()
}
