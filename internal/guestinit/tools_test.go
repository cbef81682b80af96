package guestinit

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	diskfs "github.com/diskfs/go-diskfs"
	"github.com/stretchr/testify/require"
)

func TestToolsISORoundTrip(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "gitlab-runner")
	content := []byte("#!/bin/sh\necho fake runner\n")
	require.NoError(t, os.WriteFile(src, content, 0o600)) // the disk gives it 0755 anyway
	out := filepath.Join(dir, "tools.iso")
	sum := sha256.Sum256(content)
	man := ToolsManifest{Programs: map[string]ToolOrigin{"gitlab-runner": {Source: src, SHA256: hex.EncodeToString(sum[:]), Size: int64(len(content))}}}
	require.NoError(t, ToolsISO(out, map[string]string{"gitlab-runner": src}, man, dir))

	st, err := os.Stat(out)
	require.NoError(t, err)
	require.Zero(t, st.Size()%2048, "whole 2 KiB blocks")

	d, err := diskfs.Open(out, diskfs.WithOpenMode(diskfs.ReadOnly))
	require.NoError(t, err)
	defer func() { _ = d.Close() }()
	fs, err := d.GetFilesystem(0)
	require.NoError(t, err)
	require.Equal(t, ToolsLabel, strings.TrimRight(fs.Label(), "\x00 "))
	// (go-diskfs's reader cannot read file data back here; the data is
	// contiguous in ISO 9660, so the image holds it verbatim.)
	img, err := os.ReadFile(out)
	require.NoError(t, err)
	require.True(t, bytes.Contains(img, content), "the program's bytes are on the disk")
	// Rock Ridge: the name as is (an NM entry) and POSIX attributes (PX);
	// that the guest can run it is the e2e tests' part.
	require.True(t, bytes.Contains(img, []byte("NM")) && bytes.Contains(img, []byte("gitlab-runner")))
	require.True(t, bytes.Contains(img, []byte("PX")))
	mb, err := json.MarshalIndent(man, "", "  ")
	require.NoError(t, err)
	require.True(t, bytes.Contains(img, mb), "tools.json says where the program came from")

	left, err := filepath.Glob(filepath.Join(dir, "tools-stage-*"))
	require.NoError(t, err)
	require.Empty(t, left, "the staging copy is removed")
}

func TestToolsISORefusesAProgramThatIsNotWhatItIsNamedAfter(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "gitlab-runner")
	require.NoError(t, os.WriteFile(src, []byte("new content"), 0o755))
	man := ToolsManifest{Programs: map[string]ToolOrigin{"gitlab-runner": {Source: src, SHA256: strings.Repeat("ab", 32)}}}
	err := ToolsISO(filepath.Join(dir, "t.iso"), map[string]string{"gitlab-runner": src}, man, dir)
	require.ErrorContains(t, err, "changed while it was being copied")
}

func TestToolsISORefusesBadNames(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"", "../x", "a/b", ".hidden"} {
		err := ToolsISO(filepath.Join(dir, "t.iso"), map[string]string{name: "/bin/true"}, ToolsManifest{}, dir)
		require.ErrorContains(t, err, "refused", name)
	}
}
