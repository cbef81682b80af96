package jobvm

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// Session.Run and Session.Stream with the connection holder on ([ssh]
// connection_holder's default) and none running: nothing starts through
// it, the stage and the streams connect directly and say so (a stream
// once per session), and what they run arrives.
func TestSessionFallsBackToDirect(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	require.True(t, m.Manager().Cfg.SSH.HolderEnabled())
	ctx := context.Background()
	j, err := m.Jobs().Job(JobRef{Frontend: "gitlab", Instance: lifecycle.InstanceTag("https://gitlab.example", "runner"), ID: 7}, nil)
	require.NoError(t, err)
	_, err = j.Acquire(ctx, AcquireRequest{
		Request: lifecycle.Request{Image: img, Frontend: "test", Job: "7", Lifetime: time.Hour},
		Size:    m.Manager().Cfg.ImageSize(img),
	})
	require.NoError(t, err)
	g.RejectSessions(false)

	sess := j.Session()
	defer sess.Close()
	var out, errs bytes.Buffer
	require.NoError(t, sess.Run(ctx, Stage{Script: []byte("echo hello from the stage\n"), Stdout: &out, Stderr: &errs}))
	require.Contains(t, out.String(), "hello from the stage")
	require.Contains(t, errs.String(), "this stage connects directly")

	var sout, serr bytes.Buffer
	require.NoError(t, sess.Stream(ctx, "cat", strings.NewReader("piped;"), &sout, &serr))
	require.NoError(t, sess.Stream(ctx, "cat", strings.NewReader("again"), &sout, &serr))
	require.Equal(t, "piped;again", sout.String())
	require.Equal(t, 1, strings.Count(serr.String(), "this session's commands connect directly"), "said once per session: %s", serr.String())

	// Two streams at once on a fresh session (native steps' proxy beside
	// its log tail): both fall back, the note comes once.
	two := j.Session()
	two.Who = "the steps"
	defer two.Close()
	var wg sync.WaitGroup
	var notes syncbuf.Buffer
	outs := make([]bytes.Buffer, 2)
	errsAt := make([]error, 2)
	for i := range 2 {
		wg.Go(func() {
			errsAt[i] = two.Stream(ctx, "cat", strings.NewReader(fmt.Sprintf("stream %d", i)), &outs[i], &notes)
		})
	}
	wg.Wait()
	for i := range 2 {
		require.NoError(t, errsAt[i])
		require.Equal(t, fmt.Sprintf("stream %d", i), outs[i].String())
	}
	require.Equal(t, 1, strings.Count(notes.String(), "the steps connect directly"), notes.String())

	_, err = j.Release(ctx, Observer{})
	require.NoError(t, err)
	requireNothingLeft(t, hv, m)
}

// Job.Acquire: a container job's container is named in its mapping and,
// for a run stage of the previous version, in its machine's record; an
// image that is not on the host and that this executable cannot pull
// fails before anything of the job is made (no name record, no mapping,
// no machine).
func TestJobAcquireContainerAndImage(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	ctx := context.Background()
	ref := JobRef{Frontend: "gitlab", Instance: lifecycle.InstanceTag("https://gitlab.example", "runner"), ID: 8}
	j, err := m.Jobs().Job(ref, nil)
	require.NoError(t, err)

	missing := *img
	missing.Name, missing.Source, missing.Base = "gone", "oci://registry.example/gone:1", ""
	_, err = j.Acquire(ctx, AcquireRequest{
		Request: lifecycle.Request{Image: &missing, Frontend: "gitlab", Job: "8", Lifetime: time.Hour},
		Size:    m.Manager().Cfg.ImageSize(img),
	})
	require.ErrorContains(t, err, "this executable does not pull: run libvirt-executor image pull gone")
	store := m.Manager().Store
	named, err := store.JobNameOf(lifecycle.JobKey(ref.Frontend, ref.Instance, ref.ID))
	require.NoError(t, err)
	require.Nil(t, named, "no name record")
	requireNothingLeft(t, hv, m)

	_, err = j.Acquire(ctx, AcquireRequest{
		Request:   lifecycle.Request{Image: img, Frontend: "gitlab", Job: "8", Lifetime: time.Hour},
		Size:      m.Manager().Cfg.ImageSize(img),
		Container: "lve-job-8-build",
	})
	require.NoError(t, err)
	c, err := j.Container()
	require.NoError(t, err)
	require.Equal(t, "lve-job-8-build", c)
	mapped, err := store.MachineOfJob(j.Name())
	require.NoError(t, err)
	require.Equal(t, "lve-job-8-build", mapped.Container, "the mapping names it")
	rec, err := store.Record(j.Name())
	require.NoError(t, err)
	require.Equal(t, "lve-job-8-build", rec.Container, "the machine's record names it for the previous version's run stage")
	_, err = j.Release(ctx, Observer{})
	require.NoError(t, err)
	requireNothingLeft(t, hv, m)
}
