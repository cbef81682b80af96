package state

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
)

func TestControllerIDStableAndRaceFree(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	ids := make([]string, 8)
	errs := make([]error, len(ids))
	var wg sync.WaitGroup
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// require only on the test's goroutine: FailNow from another
			// one would not stop the test.
			ids[i], errs[i] = s.ControllerID()
		}()
	}
	wg.Wait()
	for i, id := range ids {
		require.NoError(t, errs[i], "goroutine %d", i)
		require.Equal(t, ids[0], id)
	}
	require.Regexp(t, uuidRE, ids[0])
	again, err := s.ControllerID()
	require.NoError(t, err)
	require.Equal(t, ids[0], again)

	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, ctrlFile), []byte("garbage"), 0o600))
	_, err = s.ControllerID()
	require.ErrorContains(t, err, "not a controller id")
}

func TestMachineRoundTripAndPermissions(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	k, err := guestinit.NewKeys("x")
	require.NoError(t, err)
	dir, err := s.Create("lve-a-1")
	require.NoError(t, err)
	_, err = s.Create("lve-a-1")
	require.Error(t, err, "no silent reuse")
	require.NoError(t, s.SaveKey("lve-a-1", k.ClientPEM))
	m := Machine{Name: "lve-a-1", Address: "10.0.0.2", Port: 22, User: "root", Shell: "bash", HostKey: k.HostPublicLine(), Created: time.Now().UTC()}
	require.NoError(t, s.Save(m))

	for _, p := range []string{dir, filepath.Join(dir, keyFile), filepath.Join(dir, machineFile)} {
		st, err := os.Stat(p)
		require.NoError(t, err)
		if st.IsDir() {
			require.Equal(t, os.FileMode(0o700), st.Mode().Perm(), p)
		} else {
			require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), p)
		}
	}
	got, signer, hostKey, err := s.Load("lve-a-1")
	require.NoError(t, err)
	require.Equal(t, m.Address, got.Address)
	require.Equal(t, k.Client.PublicKey().Marshal(), signer.PublicKey().Marshal())
	require.Equal(t, k.Host.Marshal(), hostKey.Marshal())

	names, err := s.Names()
	require.NoError(t, err)
	require.Equal(t, []string{"lve-a-1"}, names)

	require.NoError(t, s.Remove("lve-a-1"))
	require.NoDirExists(t, dir)
	require.NoError(t, s.Remove("lve-a-1"), "idempotent")
	_, _, _, err = s.Load("lve-a-1")
	require.ErrorIs(t, err, ErrNoMachine)
	require.Error(t, s.Remove("../x"))
}

func TestLock(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	unlock, err := s.TryLock("lve-a-1")
	require.NoError(t, err)
	_, err = s.TryLock("lve-a-1")
	require.ErrorIs(t, err, ErrBusy, "flock is per open file: a second holder is refused")
	other, err := s.TryLock("lve-a-2")
	require.NoError(t, err, "locks are per machine")
	other()

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = s.Lock(ctx, "lve-a-1")
	require.ErrorIs(t, err, context.DeadlineExceeded)

	go func() { time.Sleep(50 * time.Millisecond); unlock() }()
	unlock2, err := s.Lock(context.Background(), "lve-a-1")
	require.NoError(t, err, "acquired once released")
	names, err := s.LockNames()
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"lve-a-1", "lve-a-2"}, names)
	s.RemoveLock("lve-a-1")
	unlock2()
	names, _ = s.LockNames()
	require.Equal(t, []string{"lve-a-2"}, names)
}

func TestRememberRecall(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	type fact struct{ A []string }
	var got fact
	require.False(t, s.Recall("img", &got))
	require.NoError(t, s.Remember("img", fact{A: []string{"git-lfs"}}))
	require.True(t, s.Recall("img", &got))
	require.Equal(t, []string{"git-lfs"}, got.A)
	st, err := os.Stat(filepath.Join(s.Dir, "cache", "img.json"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
}

// Every record reader goes through readRecord: a missing file and a
// corrupt one are told apart, and the error names the file.
func TestReadRecordErrors(t *testing.T) {
	dir := t.TempDir()
	var v struct{ A int }

	missing := filepath.Join(dir, "missing.json")
	err := readRecord(missing, &v)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NotErrorIs(t, err, errBadRecord)
	require.ErrorContains(t, err, missing)

	bad := filepath.Join(dir, "bad.json")
	require.NoError(t, os.WriteFile(bad, []byte(`{"A":`), 0o600))
	err = readRecord(bad, &v)
	require.ErrorIs(t, err, errBadRecord)
	require.NotErrorIs(t, err, os.ErrNotExist)
	require.ErrorContains(t, err, bad)

	good := filepath.Join(dir, "good.json")
	require.NoError(t, os.WriteFile(good, []byte(`{"A":3}`), 0o600))
	require.NoError(t, readRecord(good, &v))
	require.Equal(t, 3, v.A)
}

// What each reader makes of a missing and of a corrupt record.
func TestRecordReadersMissingAndCorrupt(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	const name = "m"
	_, err := s.Create(name)
	require.NoError(t, err)
	def := Reservation{VCPUs: 1, MemoryMiB: 512}

	// Missing.
	cl, err := s.ClaimOf(name)
	require.NoError(t, err)
	require.Nil(t, cl)
	_, err = s.Record(name)
	require.ErrorIs(t, err, ErrNoMachine)
	e, err := s.EndedOf(name)
	require.NoError(t, err)
	require.Nil(t, e)
	jm, err := s.MachineOfJob("j")
	require.NoError(t, err)
	require.Nil(t, jm)
	res, err := s.Reservations(def)
	require.NoError(t, err)
	require.Equal(t, def, res[name])
	var v map[string]int
	require.False(t, s.Recall("x", &v))

	// Corrupt.
	dir := s.MachineDir(name)
	for _, f := range []string{claimFile, machineFile, reapFile} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, f), []byte("{"), 0o600))
	}
	// A field of the wrong type: the fields before it are taken, the
	// others keep def (json.Unmarshal's way, as before).
	require.NoError(t, os.WriteFile(filepath.Join(dir, reservationFile), []byte(`{"vcpus":4,"memory_mib":"x"}`), 0o600))
	require.NoError(t, os.MkdirAll(filepath.Join(s.Dir, "jobs"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, "jobs", "j.json"), []byte("{"), 0o600))
	require.NoError(t, os.MkdirAll(filepath.Join(s.Dir, "cache"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, "cache", "x.json"), []byte("{"), 0o600))

	cl, err = s.ClaimOf(name)
	require.NoError(t, err)
	require.Equal(t, &Claim{Retire: true, Reason: "unreadable claim record"}, cl)
	_, err = s.Record(name)
	require.ErrorIs(t, err, errBadRecord)
	require.ErrorContains(t, err, filepath.Join(dir, machineFile))
	e, err = s.EndedOf(name)
	require.NoError(t, err)
	require.Equal(t, &Ended{Reason: "ended (unreadable mark)"}, e)
	_, err = s.MachineOfJob("j")
	require.ErrorIs(t, err, errBadRecord)
	require.ErrorContains(t, err, "j.json")
	res, err = s.Reservations(def)
	require.NoError(t, err)
	require.Equal(t, Reservation{VCPUs: 4, MemoryMiB: 512}, res[name])
	require.False(t, s.Recall("x", &v))
}
