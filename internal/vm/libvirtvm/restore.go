package libvirtvm

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"
)

// AttachInterface implements vm.Hypervisor.
func (l *Conn) AttachInterface(ctx context.Context, name string, iface *libvirtxml.DomainInterface) error {
	return l.attachLive(ctx, name, iface)
}

// Save implements vm.Hypervisor.
func (l *Conn) Save(ctx context.Context, name, path string) error {
	return call0(ctx, l, func() error {
		d, err := l.domain(name)
		if err != nil {
			return err
		}
		defer d.Free()
		return notFound(d.SaveFlags(path, "", 0), libvirt.ERR_NO_DOMAIN)
	})
}

// RestoreStream implements vm.Hypervisor. The pipe is made in a private
// directory in pipeDir (libvirtd, root, opens it by path; QEMU reads it
// through the descriptor libvirt hands it) and removed when the call
// returns. It is opened for reading and writing here, so the open never
// waits for libvirt; it is closed once the stream is written (libvirt
// reads the rest, then the end), or failed, and when libvirt's call
// returns (a write libvirt never read ends).
func (l *Conn) RestoreStream(ctx context.Context, r io.Reader, pipeDir string) error {
	dir, err := os.MkdirTemp(pipeDir, ".restore-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	fifo := filepath.Join(dir, "clone.save")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		return fmt.Errorf("restore pipe: %w", err)
	}
	w, err := os.OpenFile(fifo, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("restore pipe: %w", err)
	}
	wrote := make(chan error, 1)
	go func() {
		// The head is longer than a pipe holds (libvirt pads the XML block
		// by 64 KiB): once it is written, libvirt has the pipe open, and
		// closing it is an end libvirt sees.
		_, err := io.Copy(w, r)
		_ = w.Close()
		wrote <- err
	}()
	restoreErr := call0(ctx, l, func() error { return l.conn.DomainRestoreFlags(fifo, "", libvirt.DOMAIN_SAVE_RUNNING) })
	// The path goes before our end closes: a libvirt that had not opened
	// the pipe yet (the call abandoned at ctx's end) finds no path, rather
	// than a pipe without a writer that it would wait on for ever.
	_ = os.Remove(fifo)
	_ = w.Close()
	if werr := <-wrote; restoreErr != nil && werr != nil {
		return fmt.Errorf("%w (restore pipe: %v)", restoreErr, werr)
	}
	return restoreErr // a write cut after libvirt restored the clone is no failure
}
