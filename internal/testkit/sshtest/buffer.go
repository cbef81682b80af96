package sshtest

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer that a stage or session writes while a test
// reads it (the session's stdout and stderr are copied by goroutines).
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns what was written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
