package harness

import (
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestMaskerSplitWrites(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	m := newMasker(&out, []string{"topsecret", "", "abc"})
	for _, chunk := range []string{"a to", "psec", "ret b", " ab", "c\n", "tops"} {
		_, _ = m.Write([]byte(chunk))
	}
	// "tops" could be the start of the secret: held back until Flush.
	assert.Equal(t, "a [MASKED] b [MASKED]\n", out.String())
	m.Flush()
	assert.Equal(t, "a [MASKED] b [MASKED]\ntops", out.String())
	assert.Equal(t, out.String(), m.String())
}

func TestMaskerPassesOrdinaryOutputAtOnce(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	m := newMasker(&out, []string{"zzzsecret"})
	_, _ = m.Write([]byte("progress: 10%"))
	assert.Equal(t, "progress: 10%", out.String(), "nothing held when no secret could start here")
}

func TestMaskerConcurrentWrites(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	m := newMasker(&out, []string{"s3cr3t"})
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 100; j++ {
				_, _ = m.Write([]byte("line s3cr3t\n"))
			}
		}()
	}
	wg.Wait()
	m.Flush()
	assert.NotContains(t, out.String(), "s3cr3t")
	assert.Equal(t, 800, strings.Count(out.String(), "[MASKED]"))
}
