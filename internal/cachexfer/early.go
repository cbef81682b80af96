package cachexfer

import (
	"context"
	"errors"
	"io"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Early is a scratch disk attached while the archive_cache stage's
// script (the runner making its archive) runs, so that the hot plug and
// the guest's finding the disk are done when the archive is: the copy
// after the script is then only the guest writing the disk and the host
// reading it.
//
// The save's SSH connection is made then too: its handshake costs a TCG
// guest 0.3 s (tiny) to 1.3 s (Debian), which the guest's other vCPU and
// the host's other core do while the runner zips.
type Early struct {
	t *Transfer

	done   chan struct{}
	cancel context.CancelFunc // stops an attach not needed any more
	err    error
	took   time.Duration

	connected   chan struct{}
	stopConnect context.CancelFunc
	client      *sshexec.Client // nil once taken; else closed by drop
	armed       *armedSave      // set before connected is closed; nil if none

	dropped bool // the save's Keep deleted the disk's volume
}

// armedSave is the save's guest command (diskSaveArmed), started on the
// early connection once the disk is attached, waiting for go: the SSH
// session, the guest's shell, its finding the disk and its sudo check
// (a third of a second for Debian) are paid while the runner zips.
type armedSave struct {
	stdin *io.PipeWriter
	out   *headBuffer
	done  chan struct{} // closed when the command has ended; err says how
	err   error
}

// arm starts diskSaveArmed on client; it ends with ctx at the latest.
func arm(ctx context.Context, client *sshexec.Client) *armedSave {
	pr, pw := io.Pipe()
	a := &armedSave{stdin: pw, out: &headBuffer{limit: 4096}, done: make(chan struct{})}
	go func() {
		defer close(a.done)
		a.err = client.Stream(ctx, diskSaveArmed, pr, a.out)
		_ = pr.CloseWithError(errors.New("the save's guest command ended"))
	}()
	return a
}

// fire tells the armed command to write the disk, and reports whether it
// will: false when it ended before (its connection lost, the guest's
// shell killed by the job, or it did not see the disk within its 10 s,
// which ran while the runner zipped), when the guest did not take the
// go before ctx ended (a guest that never answered the session's
// start): the caller starts diskSaveCommand itself. An armed command
// that ended on its own with another answer (not writable) is used as it
// is.
func (a *armedSave) fire(ctx context.Context) bool {
	select {
	case <-a.done:
		last := lastLine(a.out.String())
		return a.err == nil && last != "" && last != diskMissing
	default:
	}
	sent := make(chan error, 1)
	go func() { // the pipe's reader is the session's, once it started
		_, err := io.WriteString(a.stdin, diskGo+"\n")
		sent <- err
	}()
	var err error
	select {
	case err = <-sent:
	case <-ctx.Done():
		err = context.Cause(ctx)
	}
	_ = a.stdin.Close()
	return err == nil
}

// predictWait bounds Early's look at what the host keeps (a shared
// lock on the project, which a save being installed holds for a moment):
// the runner's script does not wait for it longer.
const predictWait = 2 * time.Second

// Early attaches the scratch disk for a save in the background, while the
// runner's script still makes the archive, when the save will go through a
// disk: the image's cache_via = "disk", the script names an archive
// (named), and the cache it names (or, for a key not cached yet, the
// project's whole cache) is at least cache.disk_min_mib, or that is 0.
// Else nil (also for a nil t). The caller drops it when the stage ends
// (Early.Drop), whatever became of the save.
func (t *Transfer) Early(ctx context.Context, named []string) *Early {
	if t == nil || !t.viaDisk || len(named) == 0 {
		return nil
	}
	if min := t.diskMin; min > 0 {
		pctx, cancel := context.WithTimeout(ctx, predictWait)
		want, size, all, err := wantedFiles(pctx, t.store, t.project, named)
		cancel()
		if len(want) == 0 {
			size = all
		}
		if err != nil || size < min {
			return nil
		}
	}
	actx, cancel := context.WithCancel(ctx)
	es := &Early{t: t, done: make(chan struct{}), cancel: cancel}
	go func() {
		defer close(es.done)
		t0 := time.Now()
		es.err = t.disk.AttachScratch(actx, t.name)
		es.took = time.Since(t0)
	}()
	cctx, stop := context.WithCancel(ctx)
	es.connected, es.stopConnect = make(chan struct{}), stop
	go func() {
		defer close(es.connected)
		if t.dial == nil { // the caller dials itself when there is none
			return
		}
		if _, es.client, _ = t.dial.Take(cctx); es.client == nil {
			return
		}
		select {
		case <-es.done:
			if es.err == nil {
				es.armed = arm(cctx, es.client)
			}
		case <-cctx.Done():
		}
	}()
	return es
}

// armedCommand is the save's guest command started during the script, or
// nil (none, or no early disk).
func (es *Early) armedCommand() *armedSave {
	if es == nil {
		return nil
	}
	<-es.connected
	return es.armed
}

// wait is the attach's result, once it has ended.
func (es *Early) wait() error {
	<-es.done
	es.cancel()
	return es.err
}

// connection hands over the connection made during the script, once its
// dial has ended; the caller closes it. nil when there is none (no early
// disk, the dial failed, or the connection's keepalive gave up while the
// script ran): the caller dials itself, and says why if that fails too.
func (es *Early) connection() *sshexec.Client {
	if es == nil {
		return nil
	}
	<-es.connected
	c := es.client
	es.client = nil
	if c != nil && c.Dead() != nil {
		es.armed = nil // its session went with the connection
		_ = c.Close()
		return nil
	}
	return c
}

// Drop stops the early disk's attach if it still runs and deletes its
// volume: at the end of the stage, whether the save used the disk, went
// over SSH or was not made (the script failed). Also after a failed or
// stopped attach: one stopped midway (the admin tool is killed) may have
// left its volume; deleting none is success. Not again after the save's
// Keep deleted it.
func (es *Early) Drop(ctx context.Context) {
	if es == nil {
		return
	}
	es.cancel()
	es.stopConnect()
	<-es.done
	<-es.connected
	if es.armed != nil {
		_ = es.armed.stdin.Close() // not asked: the guest's command ends
	}
	if es.client != nil {
		_ = es.client.Close()
	}
	if !es.dropped {
		es.t.dropDisks(ctx)
	}
}

// saveCache keeps the archives named in keep (those the runner's
// archive_cache script names) of the guest's cache_dir in the project's
// cache: written by the guest on a scratch disk (the image's cache_via =
// "disk"), else, or when the guest cannot use the disk, over the client's
// connection. Any other file in cache_dir is left out. The job log says
