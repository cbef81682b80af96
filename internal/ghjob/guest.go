package ghjob

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"iter"
	"maps"
	"strconv"
	"strings"
)

// Guest runs one program in the job's VM (sshexec.Client.Exec).
type Guest interface {
	Exec(ctx context.Context, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (int, error)
}

// guest runs the hook's fixed commands in the job's VM, through sudo -n
// where the login is not root.
type guest struct {
	c    Guest
	sudo bool
}

// Bounds of what the hook keeps of a guest command's output.
const (
	maxAnswer  = 64 << 10
	maxErrText = 2 << 10
)

// wrap puts argv under sudo -n (keeping env's names) for a non-root login.
func (g *guest) wrap(argv, env []string) []string {
	if !g.sudo {
		return argv
	}
	pre := []string{"sudo", "-n"}
	if len(env) > 0 {
		names := make([]string, 0, len(env))
		for _, kv := range env {
			n, _, _ := strings.Cut(kv, "=")
			names = append(names, n)
		}
		pre = append(pre, "--preserve-env="+strings.Join(names, ","))
	}
	return append(append(pre, "--"), argv...)
}

func (g *guest) exec(ctx context.Context, argv, env []string, stdin io.Reader) (int, []byte, string, error) {
	out := &capped{limit: maxAnswer}
	errb := &capped{limit: maxErrText}
	code, err := g.c.Exec(ctx, g.wrap(argv, env), env, stdin, out, errb)
	return code, out.b.Bytes(), strings.TrimSpace(errb.b.String()), err
}

// must runs argv; a non-zero status fails, saying what failed and what
// the command wrote to stderr.
func (g *guest) must(ctx context.Context, what string, argv, env []string) ([]byte, error) {
	return g.mustIn(ctx, what, argv, env, nil)
}

func (g *guest) mustIn(ctx context.Context, what string, argv, env []string, stdin io.Reader) ([]byte, error) {
	code, out, errText, err := g.exec(ctx, argv, env, stdin)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if code != 0 {
		return nil, fmt.Errorf("%s failed (exit status %d): %s", what, code, strconv.Quote(errText))
	}
	return out, nil
}

// capped keeps the first limit bytes written to it.
type capped struct {
	b     bytes.Buffer
	limit int
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.limit - c.b.Len(); room > 0 {
		c.b.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

func mapsKeys(m map[string]string) iter.Seq[string] { return maps.Keys(m) }

func base64Std(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
