package sshtest

import "gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"

// Buffer is what a stage or session writes while a test reads it (the
// session's stdout and stderr are copied by goroutines): syncbuf.Buffer.
type Buffer = syncbuf.Buffer
