package main

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestExitCode(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int
	}{
		{nil, 0},
		{errJobFailed, 1},
		{fmt.Errorf("wrapped: %w", errJobFailed), 1},
		{errors.New("harness broke"), 2},
	} {
		assert.Equal(t, tc.want, exitCode(tc.err), "%v", tc.err)
	}
}

func TestKeyValues(t *testing.T) {
	m, err := keyValues([]string{"A=1", "B=x=y", "C="})
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"A": "1", "B": "x=y", "C": ""}, m)
	_, err = keyValues([]string{"nokey"})
	assert.Error(t, err)
	_, err = keyValues([]string{"=v"})
	assert.Error(t, err)
}

func TestPrefixWriter(t *testing.T) {
	var b strings.Builder
	w := &prefixWriter{w: &b, prefix: "> "}
	for _, s := range []string{"one\ntw", "o\n", "three\nfour"} {
		_, _ = w.Write([]byte(s))
	}
	assert.Equal(t, "> one\n> two\n> three\n> four", b.String())
}

func TestRunRequiresRunExec(t *testing.T) {
	err := app().Run([]string{"lve-harness", "run", "--script", "true"})
	assert.Error(t, err)
	assert.Equal(t, 2, exitCode(err))
}
