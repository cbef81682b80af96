package sshexec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/crypto/ssh"
)

// Output runs a fixed command (never built from job input) and returns its
// stdout. A non-zero exit is returned as an error mentioning stderr.
func (c *Client) Output(ctx context.Context, cmd string) ([]byte, error) {
	s, err := c.c.NewSession()
	if err != nil {
		return nil, c.lost(err)
	}
	defer s.Close()
	var out, errb bytes.Buffer
	s.Stdout, s.Stderr = &out, &errb
	stop := context.AfterFunc(ctx, func() { _ = s.Close() })
	defer stop()
	if err := s.Run(cmd); err != nil {
		var ee *ssh.ExitError
		if errors.As(err, &ee) {
			return out.Bytes(), fmt.Errorf("exit status %d: %s", ee.ExitStatus(), strings.TrimSpace(errb.String()))
		}
		return nil, c.lost(err)
	}
	return out.Bytes(), nil
}
