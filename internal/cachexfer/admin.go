package cachexfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// AdminCommand is the admin tool's hidden command that moves a project's
// host cache to and from a job's machine on hot-plugged disks; the run
// stage, built without libvirt, asks it (AdminDisk):
//
//	libvirt-executor --config=PATH cache-disk < REQUEST.json > ANSWER.json
//
// It reads one AdminRequest as JSON on its stdin and writes one
// AdminAnswer as JSON on its stdout (ServeAdmin); a failure is its exit
// status and its words on stderr. Nothing of the request is on its argv.
const AdminCommand = "cache-disk"

// The operations of an AdminRequest.
const (
	OpAttach  = "attach"  // the project's cache (the files named) on a restore disk; answers Attached
	OpScratch = "scratch" // an empty disk for the guest to write its cache on
	OpKeep    = "keep"    // keep the files named of the scratch disk, then delete both disks' volumes; answers Kept
	OpDrop    = "drop"    // delete both disks' volumes
)

// ops are the operations, in the order error messages list them.
var ops = []string{OpAttach, OpScratch, OpKeep, OpDrop}

// Bounds of what crosses the process boundary.
const (
	// MaxAdminRequest bounds a request: maxFiles names of maxFileName
	// bytes, escaped, and room for the rest.
	MaxAdminRequest = 1 << 20
	// MaxAdminAnswer bounds an answer (a save's result names at most ten
	// skipped entries, each cut to 80 characters).
	MaxAdminAnswer = 64 << 10
	maxFiles       = 64
	maxFileName    = 4096
	maxProject     = 256
)

// AdminRequest is what the run stage asks the admin tool's cache-disk
// command.
type AdminRequest struct {
	Op      string `json:"op"`
	Machine string `json:"machine"`
	// Project is the project's cache (attach, keep).
	Project string `json:"project,omitempty"`
	// Files are the archives wanted (attach) or kept (keep); none: nothing.
	Files []string `json:"files,omitempty"`
}

// Check says what is wrong with r, naming the allowed values.
func (r AdminRequest) Check() error {
	switch r.Op {
	case OpAttach, OpKeep:
		if r.Project == "" || len(r.Project) > maxProject || strings.ContainsAny(r.Project, "/\x00") {
			return fmt.Errorf("cache-disk %s: project %.300q: want a project's cache name (no slash, at most %d bytes)", r.Op, r.Project, maxProject)
		}
		if len(r.Files) > maxFiles {
			return fmt.Errorf("cache-disk %s: %d files named, at most %d", r.Op, len(r.Files), maxFiles)
		}
		for _, f := range r.Files {
			if f == "" || len(f) > maxFileName || strings.ContainsRune(f, 0) {
				return fmt.Errorf("cache-disk %s: file %.300q: want a path of 1 to %d bytes without NUL", r.Op, f, maxFileName)
			}
		}
	case OpScratch, OpDrop:
		if r.Project != "" || len(r.Files) > 0 {
			return fmt.Errorf("cache-disk %s takes a machine only, not a project or files", r.Op)
		}
	default:
		return fmt.Errorf("cache-disk: op %.100q: want one of %s", r.Op, strings.Join(ops, ", "))
	}
	if err := vm.CheckName(r.Machine); err != nil {
		return fmt.Errorf("cache-disk %s: %w", r.Op, err)
	}
	return nil
}

// Attached is the answer to attach: what is on the restore disk (0 files:
// nothing cached or named, no disk).
type Attached struct {
	Files int64 `json:"files"`
	Bytes int64 `json:"bytes"`
}

// AdminAnswer is the cache-disk command's answer: Attached for attach,
// Kept for keep, neither for scratch and drop.
type AdminAnswer struct {
	Attached *Attached         `json:"attached,omitempty"`
	Kept     *jobvm.KeepAnswer `json:"kept,omitempty"`
}

// check says what is wrong with a as the answer to op.
func (a AdminAnswer) check(op string) error {
	switch op {
	case OpAttach:
		if a.Attached == nil || a.Kept != nil {
			return errors.New("want attached only")
		}
		if a.Attached.Files < 0 || a.Attached.Bytes < 0 {
			return fmt.Errorf("attached %d files, %d bytes: want numbers of 0 or more", a.Attached.Files, a.Attached.Bytes)
		}
	case OpKeep:
		if a.Kept == nil || a.Attached != nil {
			return errors.New("want kept only")
		}
	default:
		if a.Attached != nil || a.Kept != nil {
			return errors.New("want an empty answer")
		}
	}
	return nil
}

// readOne decodes the one JSON value of what r holds, at most max bytes,
// into v; strict refuses fields v does not have.
func readOne(r io.Reader, max int64, v any, strict bool) error {
	b, err := io.ReadAll(io.LimitReader(r, max+1))
	if err != nil {
		return err
	}
	if int64(len(b)) > max {
		return fmt.Errorf("over %d bytes", max)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("not the JSON wanted: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("more than one JSON value")
	}
	return nil
}

// ReadAdminRequest reads and checks one request (at most MaxAdminRequest
// bytes, no field it does not know).
func ReadAdminRequest(r io.Reader) (AdminRequest, error) {
	var req AdminRequest
	if err := readOne(r, MaxAdminRequest, &req, true); err != nil {
		return AdminRequest{}, fmt.Errorf("cache-disk: the request on stdin: %w", err)
	}
	return req, req.Check()
}

// ReadAdminAnswer reads and checks the answer to op (at most
// MaxAdminAnswer bytes; fields it does not know are a newer tool's and
// left aside).
func ReadAdminAnswer(r io.Reader, op string) (AdminAnswer, error) {
	var a AdminAnswer
	err := readOne(r, MaxAdminAnswer, &a, false)
	if err == nil {
		err = a.check(op)
	}
	if err != nil {
		return AdminAnswer{}, fmt.Errorf("%s %s %s: answer: %w", jobvm.AdminExecutable, AdminCommand, op, err)
	}
	return a, nil
}

// ServeAdmin is the admin tool's side: it reads one request from in, does
// it on d and writes its answer on out. An error is the operation's
// failure (keep's is in its answer).
func ServeAdmin(ctx context.Context, in io.Reader, out io.Writer, d Disk) error {
	req, err := ReadAdminRequest(in)
	if err != nil {
		return err
	}
	var a AdminAnswer
	switch req.Op {
	case OpAttach:
		res, err := d.Attach(ctx, req.Machine, req.Project, req.Files)
		if err != nil {
			return err
		}
		a.Attached = &Attached{Files: res.Files, Bytes: res.Bytes}
	case OpScratch:
		if err := d.AttachScratch(ctx, req.Machine); err != nil {
			return err
		}
	case OpKeep:
		k := jobvm.NewKeepAnswer(d.Keep(ctx, req.Machine, req.Project, req.Files))
		a.Kept = &k
	case OpDrop:
		if err := d.Drop(ctx, req.Machine); err != nil {
			return err
		}
	}
	return json.NewEncoder(out).Encode(a)
}

// AdminRun runs the admin tool's cache-disk command with request on its
// stdin and returns the start of its stdout (at least MaxAdminAnswer+1
// bytes of it, when it wrote that much).
type AdminRun func(ctx context.Context, request []byte) ([]byte, error)

// AdminDisk is Disk through the admin tool, which run starts.
func AdminDisk(run AdminRun) Disk { return adminDisk{run: run} }

type adminDisk struct{ run AdminRun }

func (d adminDisk) ask(ctx context.Context, req AdminRequest) (AdminAnswer, error) {
	if err := req.Check(); err != nil {
		return AdminAnswer{}, err
	}
	body, err := json.Marshal(req)
	if err != nil {
		return AdminAnswer{}, err
	}
	out, err := d.run(ctx, body)
	if err != nil {
		return AdminAnswer{}, err
	}
	return ReadAdminAnswer(bytes.NewReader(out), req.Op)
}

func (d adminDisk) Attach(ctx context.Context, name, project string, want []string) (hostcache.RestoreResult, error) {
	a, err := d.ask(ctx, AdminRequest{Op: OpAttach, Machine: name, Project: project, Files: want})
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	return hostcache.RestoreResult{Files: a.Attached.Files, Bytes: a.Attached.Bytes}, nil
}

func (d adminDisk) AttachScratch(ctx context.Context, name string) error {
	_, err := d.ask(ctx, AdminRequest{Op: OpScratch, Machine: name})
	return err
}

func (d adminDisk) Keep(ctx context.Context, name, project string, keep []string) jobvm.Kept {
	a, err := d.ask(ctx, AdminRequest{Op: OpKeep, Machine: name, Project: project, Files: keep})
	if err != nil {
		return jobvm.Kept{DropErr: err, Err: err}
	}
	return a.Kept.Kept()
}

func (d adminDisk) Drop(ctx context.Context, name string) error {
	_, err := d.ask(ctx, AdminRequest{Op: OpDrop, Machine: name})
	return err
}
