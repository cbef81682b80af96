package sshexec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Bounds of an Exec request (its argument vector and environment travel
// on the command's stdin, see execWrapper).
const (
	// MaxExecArgs bounds the number of arguments plus environment entries.
	MaxExecArgs = 4096
	// MaxExecBytes bounds their total size.
	MaxExecBytes = 1 << 20
)

// execWrapper is the one fixed command Exec sends. It reads the request
// from its stdin, NUL-delimited: the number of environment entries, the
// entries (NAME=VALUE, exported), the number of arguments, the arguments;
// then it replaces itself with the program (whose stdin is the rest of the
// channel's input). bash's read takes a pipe one byte at a time, so none
// of the program's input is consumed. No part of the request is ever
// parsed by a shell: the values reach export and exec as words. Exit 120
// is a malformed request (never a program's own status here).
const execWrapper = `bash -c 'rd() { IFS= read -r -d "" "$1"; }
rd n || exit 120; case $n in ""|*[!0-9]*) exit 120;; esac
while [ "$n" -gt 0 ]; do rd kv || exit 120; export "$kv" || exit 120; n=$((n-1)); done
rd n || exit 120; case $n in ""|*[!0-9]*|0) exit 120;; esac
a=(); while [ "$n" -gt 0 ]; do rd x || exit 120; a+=("$x"); n=$((n-1)); done
exec "${a[@]}"' lve-exec`

// ExecMalformed is the status execWrapper ends with for a request it
// cannot read.
const ExecMalformed = 120

// Exec runs the program argv[0] (looked up on the guest's PATH) with the
// arguments argv[1:] and the environment entries env (NAME=VALUE) added to
// the login's, without a shell ever parsing them: they travel on the
// command's stdin ahead of stdin's own bytes, never on a command line, so
// neither the guest's process list nor an SSH log shows them (only
// "bash -c <fixed script>"). The guest needs bash.
//
// stdout and stderr are written from goroutines of their own: one writer
// given for both must be safe for concurrent use (a bytes.Buffer is not:
// its ReadFrom drops what another goroutine wrote meanwhile).
//
// The result is the program's exit status (128+N when signal N ended it)
// with a nil error, or an error when the program's end is unknown (the
// connection lost, ctx ended: then the command's channel is closed, which
// ends the program unless it ignores SIGHUP) or the request is refused
// here (empty argv, a NUL byte, an environment entry that is not
// NAME=VALUE, over MaxExecArgs or MaxExecBytes).
func (c *Client) Exec(ctx context.Context, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	req, err := ExecRequest(argv, env)
	if err != nil {
		return -1, err
	}
	if ctx.Err() != nil {
		return -1, fmt.Errorf("command not started: %w", context.Cause(ctx))
	}
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	type started struct {
		s   *session
		err error
	}
	ready := make(chan started, 1)
	go func() {
		s, err := c.start(execWrapper, io.MultiReader(bytes.NewReader(req), stdin), orDiscard(stdout), orDiscard(stderr))
		ready <- started{s, err}
	}()
	var s *session
	select {
	case r := <-ready:
		if r.err != nil {
			return -1, r.err
		}
		s = r.s
	case <-ctx.Done():
		go func() {
			if r := <-ready; r.s != nil {
				r.s.close()
			}
		}()
		return -1, fmt.Errorf("the guest did not start the command: %w", context.Cause(ctx))
	}
	defer s.close()
	var res exitResult
	select {
	case res = <-s.exited:
	case <-ctx.Done():
		return -1, fmt.Errorf("the guest's command did not end: %w", context.Cause(ctx))
	}
	select {
	case <-s.drained:
	case <-ctx.Done():
		return -1, fmt.Errorf("the guest's command ended but its output did not: %w", context.Cause(ctx))
	}
	switch {
	case !res.ok:
		return -1, c.lost(errors.New("the command ended without an exit status"))
	case res.signal != "":
		return 128 + signalNumber(res.signal), nil
	}
	return res.status, nil
}

// ExecRequest is the stdin prefix that execWrapper reads for argv and env,
// or why they cannot be sent. Exported for other transports of the same
// fixed command (a job's connection holder).
func ExecRequest(argv, env []string) ([]byte, error) {
	if len(argv) == 0 || argv[0] == "" {
		return nil, errors.New("exec: no program")
	}
	if len(argv)+len(env) > MaxExecArgs {
		return nil, fmt.Errorf("exec: %d arguments and environment entries, at most %d", len(argv)+len(env), MaxExecArgs)
	}
	var b bytes.Buffer
	field := func(s string) error {
		if strings.IndexByte(s, 0) >= 0 {
			return errors.New("exec: an argument or environment entry holds a NUL byte")
		}
		b.WriteString(s)
		b.WriteByte(0)
		if b.Len() > MaxExecBytes {
			return fmt.Errorf("exec: the request exceeds %d bytes", MaxExecBytes)
		}
		return nil
	}
	_ = field(strconv.Itoa(len(env)))
	for _, kv := range env {
		name, _, ok := strings.Cut(kv, "=")
		if !ok || !ValidEnvName(name) {
			return nil, fmt.Errorf("exec: environment entry %q is not NAME=VALUE with NAME of letters, digits and _", cut(name, 64))
		}
		if err := field(kv); err != nil {
			return nil, err
		}
	}
	_ = field(strconv.Itoa(len(argv)))
	for _, a := range argv {
		if err := field(a); err != nil {
			return nil, err
		}
	}
	return b.Bytes(), nil
}

// ValidEnvName reports whether name can be an environment variable's name
// for a shell's export: a letter or _, then letters, digits and _.
func ValidEnvName(name string) bool {
	if name == "" {
		return false
	}
	for i, r := range name {
		switch {
		case r == '_', r >= 'A' && r <= 'Z', r >= 'a' && r <= 'z':
		case r >= '0' && r <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}
