package jobvm

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
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
	require.Equal(t, 1, strings.Count(serr.String(), "its commands connect directly"), "said once per session: %s", serr.String())

	_, err = j.Release(ctx, Observer{})
	require.NoError(t, err)
	requireNothingLeft(t, hv, m)
}
