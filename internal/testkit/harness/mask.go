package harness

import (
	"bytes"
	"io"
	"sort"
	"sync"
)

const maskedText = "[MASKED]"

// masker is a log sink that replaces secrets with [MASKED], as the runner
// does in job logs. It is safe for concurrent use. A secret split across
// writes is still caught: output that could be the start of a secret is held
// back until the next write or Flush, everything else passes through at once.
// It also keeps a copy of everything it emitted.
type masker struct {
	mu      sync.Mutex
	w       io.Writer
	secrets [][]byte // longest first
	pending []byte
	all     bytes.Buffer
}

func newMasker(w io.Writer, secrets []string) *masker {
	m := &masker{w: w}
	for _, s := range secrets {
		if s != "" {
			m.secrets = append(m.secrets, []byte(s))
		}
	}
	sort.Slice(m.secrets, func(i, j int) bool { return len(m.secrets[i]) > len(m.secrets[j]) })
	return m
}

func (m *masker) Write(p []byte) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pending = append(m.pending, p...)
	for _, s := range m.secrets {
		m.pending = bytes.ReplaceAll(m.pending, s, []byte(maskedText))
	}
	m.emit(len(m.pending) - m.partialSuffix())
	return len(p), nil
}

// Flush writes out anything held back.
func (m *masker) Flush() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.emit(len(m.pending))
}

// String returns everything emitted so far.
func (m *masker) String() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.all.String()
}

// emit writes the first n pending bytes. Errors of the destination are
// ignored: a broken log sink must not fail or block the job.
func (m *masker) emit(n int) {
	if n <= 0 {
		return
	}
	out := m.pending[:n]
	m.all.Write(out)
	_, _ = m.w.Write(out)
	m.pending = append(m.pending[:0:0], m.pending[n:]...)
}

// partialSuffix is the length of the longest suffix of pending that is a
// proper prefix of a secret.
func (m *masker) partialSuffix() int {
	best := 0
	for _, s := range m.secrets {
		max := min(len(s)-1, len(m.pending))
		for n := max; n > best; n-- {
			if bytes.HasSuffix(m.pending, s[:n]) {
				best = n
				break
			}
		}
	}
	return best
}

// gate forwards writes until closed, then drops them: the output of an
// abandoned process must not reach the log after RunJob returned.
type gate struct {
	mu     sync.Mutex
	w      io.Writer
	closed bool
}

func (g *gate) Write(p []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return len(p), nil
	}
	return g.w.Write(p)
}

func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}
