package cachexfer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/agenttest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/cachetest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The guest's commands for the host cache are POSIX sh (dash, busybox
// ash): they parse, and shellcheck finds nothing in them.
func TestCacheCommandsArePOSIX(t *testing.T) {
	for _, cmd := range []string{restoreCommand, saveCommand, diskRestoreCommand, diskSaveCommand, diskSaveShell, diskSaveArmed, diskWriter} {
		out, err := exec.Command("/bin/sh", "-n", "-c", cmd).CombinedOutput()
		require.NoError(t, err, "%s\n%s", cmd, out)
		sc, err := exec.LookPath("shellcheck")
		if err != nil {
			t.Log("shellcheck not installed: syntax checked by /bin/sh only")
			continue
		}
		c := exec.Command(sc, "-s", "sh", "-")
		c.Stdin = strings.NewReader(cmd)
		out, err = c.CombinedOutput()
		require.NoError(t, err, "shellcheck:\n%s\n%s", out, cmd)
	}
	// The disk is found by the engine's serial, and every outcome says so on
	// its own line.
	require.Contains(t, diskRestoreCommand, `= lve-data ]`)
	require.Contains(t, diskSaveCommand, `= lve-scratch ]`)
	require.NotContains(t, diskWriter, "'", "diskSaveBody single-quotes it")
	for _, word := range []string{diskOK, diskMissing, diskUnreadable} {
		require.Contains(t, diskRestoreCommand, "echo "+word)
	}
	for _, word := range []string{diskWritten + " $st", diskMissing, diskUnwritable} {
		require.Contains(t, diskSaveCommand, "echo "+word)
	}
}

// Only the cached files the runner's restore_cache script names reach the
// guest (the job's key and its fallback keys); a script that names none
// of them gets none.
func TestWantedFiles(t *testing.T) {
	store := &hostcache.Store{Dir: filepath.Join(t.TempDir(), "c"), ProjectLimit: 1 << 20, TotalLimit: 1 << 20}
	project, err := hostcache.ProjectID("https://gitlab.example.com", 3, true)
	require.NoError(t, err)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range []string{"lve/demo/deps-v1-protected/cache.zip", "lve/demo/old-key-protected/cache.zip", "lve/demo/fallback-protected/cache.zip"} {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: n, Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}))
		_, err := tw.Write([]byte("z"))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	_, err = store.Save(context.Background(), project, &buf, hostcache.All)
	require.NoError(t, err)

	named := []string{"lve/demo/deps-v1-protected/cache.zip", "lve/demo/fallback-protected/cache.zip"}
	want, n, all, err := wantedFiles(context.Background(), store, project, named)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"lve/demo/deps-v1-protected/cache.zip", "lve/demo/fallback-protected/cache.zip"}, want)
	require.EqualValues(t, 2, n, "the wanted files' bytes")
	require.EqualValues(t, 3, all, "all files' bytes")

	want, n, all, err = wantedFiles(context.Background(), store, project, nil)
	require.NoError(t, err)
	require.Empty(t, want, "none named: none")
	require.Zero(t, n)
	require.EqualValues(t, 3, all)
	require.False(t, hostcache.Only(nil)("lve/demo/deps-v1-protected/cache.zip"), "none named keeps none")
	require.False(t, hostcache.Only([]string{"a"})("b"))
}

// recordingDisk is a Disk that records the scratch disks asked for
// and dropped; with block set, an attach waits for its context's end.
type recordingDisk struct {
	Disk
	attached, dropped chan string
	fail              error
	block             bool
}

func (d *recordingDisk) AttachScratch(ctx context.Context, name string) error {
	d.attached <- name
	if d.block {
		<-ctx.Done()
		return ctx.Err()
	}
	return d.fail
}

func (d *recordingDisk) Drop(_ context.Context, name string) error {
	d.dropped <- name
	return nil
}

// The scratch disk is attached during the archive_cache script when the
// save will go through a disk: cache_via = "disk" and disk_min_mib = 0,
// or what the host keeps of the key the script names (or of the project)
// is at least disk_min_mib. Unused, it is dropped; a failed attach drops
// nothing.
func TestEarly(t *testing.T) {
	dir := t.TempDir()
	disk := &recordingDisk{attached: make(chan string, 4), dropped: make(chan string, 4)}
	load := func(extra, image, name string) *Transfer {
		cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(dir, "c") + "\"\n" + extra +
			"[images.a]\nbase = \"/a\"\n[images.s]\nbase = \"/s\"\ncache_via = \"ssh\"\n"))
		require.NoError(t, err)
		tr, err := New(Setup{Cache: cfg.Cache, Image: cfg.Images[image], Machine: name,
			ServerURL: "https://gitlab.example.com", ProjectID: 42, Protected: true, Disk: disk})
		require.NoError(t, err)
		return tr
	}
	named := []string{"lve/demo/k-protected/cache.zip"}
	ctx := context.Background()

	es := load("disk_min_mib = 0\n", "a", "vm-1").Early(ctx, named)
	require.NotNil(t, es, "disk_min_mib = 0: always during the script")
	require.Equal(t, "vm-1", <-disk.attached)
	es.Drop(ctx)
	require.Equal(t, "vm-1", <-disk.dropped, "unused: its volume is deleted")

	require.Nil(t, load("disk_min_mib = 0\n", "s", "vm-1").Early(ctx, named), "cache_via = \"ssh\": no disk")
	require.Nil(t, load("disk_min_mib = 0\n", "a", "vm-1").Early(ctx, nil), "no archive named: no disk")
	var noTransfer *Transfer
	require.Nil(t, noTransfer.Early(ctx, named), "no host cache: no disk")

	tr := load("disk_min_mib = 1\n", "a", "vm-1")
	require.Nil(t, tr.Early(ctx, named), "nothing kept yet: the guest's du decides after the script")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "lve/demo/k-protected/cache.zip", Typeflag: tar.TypeReg, Mode: 0o644, Size: 2 << 20}))
	_, err := tw.Write(make([]byte, 2<<20))
	require.NoError(t, err)
	require.NoError(t, tw.Close())
	_, err = tr.Store().Save(ctx, tr.Project(), &buf, hostcache.All)
	require.NoError(t, err)
	es = load("disk_min_mib = 1\n", "a", "vm-2").Early(ctx, named)
	require.NotNil(t, es, "the key's kept archive (2 MiB) is at least disk_min_mib")
	require.Equal(t, "vm-2", <-disk.attached)
	<-es.done

	disk.fail = errors.New("no hot plug")
	es = load("disk_min_mib = 1\n", "a", "vm-3").Early(ctx, named)
	require.Equal(t, "vm-3", <-disk.attached)
	es.Drop(ctx)
	require.Equal(t, "vm-3", <-disk.dropped, "a failed attach may have left its volume: dropped too")
	var none *Early
	none.Drop(ctx) // nothing to do

	// The script failed while the attach still ran (libvirt slow): the
	// drop stops it instead of waiting for it, and deletes what it left.
	disk.fail, disk.block = nil, true
	es = load("disk_min_mib = 1\n", "a", "vm-5").Early(ctx, named)
	require.Equal(t, "vm-5", <-disk.attached)
	es.Drop(ctx)
	require.Equal(t, "vm-5", <-disk.dropped)
	require.ErrorIs(t, es.err, context.Canceled)
}

// The guest's save onto the scratch disk, run here under each login shell
// (busybox ash uses busybox's dd, find and wc; dash and bash coreutils')
// with a file standing in for the disk: the direct layout where it
// applies, a tar stream where it does not, and either way the host keeps
// exactly the cache's files.
func TestDiskSaveBody(t *testing.T) {
	shells := map[string][]string{"bash": {"bash"}, "dash": {"dash"}, "busybox-ash": {"busybox", "sh"}}
	big := bytes.Repeat([]byte("0123456789abcdef"), (3<<20)/16)
	big = append(big, "tail of a file not a MiB multiple"...)
	for _, tc := range []struct {
		name  string
		files map[string][]byte
		how   string
		skip  int64 // entries the host leaves out
	}{
		{"few files", map[string][]byte{
			"lve/p/deps-protected/cache.zip": big,
			"lve/p/empty/cache.zip":          {},
			"lve/p/exact/cache.zip":          bytes.Repeat([]byte{7}, 1<<20),
			"lve/p/a key with spaces/x":      []byte("small\\n not a newline"),
		}, "direct", 0},
		{"over 100 files", func() map[string][]byte {
			m := map[string][]byte{}
			for i := range 101 {
				m[filepath.Join("k", strconv.Itoa(i))] = []byte(strconv.Itoa(i))
			}
			return m
		}(), "tar", 0},
		{"a name with a newline", map[string][]byte{"k/cache.zip": big, "k/two\nlines": []byte("x")}, "tar", 1},
	} {
		for _, how := range []string{"bash", "dash", "busybox-ash", "dash-sudo"} {
			shell, viaSudo := strings.CutSuffix(how, "-sudo")
			argv := shells[shell]
			t.Run(tc.name+"/"+how, func(t *testing.T) {
				_, err := exec.LookPath(argv[0])
				require.NoError(t, err, "%s is needed (make deps installs it)", argv[0])
				dir := t.TempDir()
				cacheDir := filepath.Join(dir, "cache")
				for name, b := range tc.files {
					require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(cacheDir, name)), 0o755))
					require.NoError(t, os.WriteFile(filepath.Join(cacheDir, name), b, 0o644))
				}
				disk := filepath.Join(dir, "disk")
				capacity := int64(64 << 20)
				require.NoError(t, os.WriteFile(disk, nil, 0o600))
				require.NoError(t, os.Truncate(disk, capacity))
				body := diskSaveBody
				for old, repl := range map[string]string{
					`c=; read -r c < "/sys/block/${d##*/}/size"`:                                                              "c=" + strconv.FormatInt(capacity/512, 10),
					"cd " + GuestCacheDir + " 2>/dev/null || { mkdir -p " + GuestCacheDir + " && cd " + GuestCacheDir + "; }": "cd " + cacheDir,
				} {
					require.Equal(t, 1, strings.Count(body, old), old)
					body = strings.Replace(body, old, repl, 1)
				}
				env := []string{"TMPDIR=" + dir}
				if viaSudo {
					// The job's user cannot write the disk; sudo -n can (a
					// stand-in that runs what it is given).
					bin := filepath.Join(dir, "bin")
					require.NoError(t, os.Mkdir(bin, 0o755))
					require.NoError(t, os.WriteFile(filepath.Join(bin, "sudo"), []byte("#!/bin/sh\n[ \"$1\" = -n ] && shift\necho \"$1\" >> "+filepath.Join(bin, "calls")+"\nexec \"$@\"\n"), 0o755))
					old := `if [ -w "$d" ]; then W=`
					require.Equal(t, 1, strings.Count(body, old))
					body = strings.Replace(body, old, `if false; then W=`, 1)
					env = append(env, "PATH="+bin+":"+os.Getenv("PATH"))
				}
				cmd := exec.Command(argv[0], append(argv[1:], "-c", "d="+disk+"\n"+body)...)
				cmd.Env = append(os.Environ(), env...)
				out, err := cmd.CombinedOutput()
				require.NoError(t, err, "%s", out)
				require.Equal(t, diskWritten+" 0 "+tc.how, lastLine(string(out)), "%s", out)
				left, err := os.ReadDir(dir)
				require.NoError(t, err)
				wantLeft := 2 // cache, disk
				if viaSudo {
					wantLeft++ // bin
					calls, err := os.ReadFile(filepath.Join(dir, "bin", "calls"))
					require.NoError(t, err)
					require.Equal(t, "true\nsh\n", string(calls), "sudo twice: may I, and the writes")
				}
				require.Len(t, left, wantLeft, "the lists in TMPDIR are removed")

				f, err := os.Open(disk)
				require.NoError(t, err)
				defer f.Close()
				store := &hostcache.Store{Dir: filepath.Join(dir, "store"), ProjectLimit: 32 << 20, TotalLimit: 64 << 20}
				project, err := hostcache.ProjectID("https://gitlab.example.com", 3, false)
				require.NoError(t, err)
				stream, err := hostcache.FromDisk(f, store.ProjectLimit)
				require.NoError(t, err)
				res, err := store.Save(context.Background(), project, stream, hostcache.All)
				require.NoError(t, stream.Close())
				require.NoError(t, err)
				require.Equal(t, tc.skip, res.SkipCount, "%v", res.Skipped)
				var buf bytes.Buffer
				_, err = store.Restore(context.Background(), project, &buf)
				require.NoError(t, err)
				got := map[string][]byte{}
				tr := tar.NewReader(&buf)
				for {
					h, err := tr.Next()
					if errors.Is(err, io.EOF) {
						break
					}
					require.NoError(t, err)
					if h.Typeflag != tar.TypeReg {
						continue
					}
					b, err := io.ReadAll(tr)
					require.NoError(t, err)
					got[h.Name] = b
				}
				want := map[string][]byte{}
				for name, b := range tc.files {
					if !strings.Contains(name, "\n") {
						want[name] = b
					}
				}
				require.Equal(t, len(want), len(got))
				for name, b := range want {
					require.True(t, bytes.Equal(b, got[name]), "%s: %d bytes kept, %d written", name, len(got[name]), len(b))
				}
			})
		}
	}
}

// The save's command armed during the script (diskSaveArmed) does nothing
// to the disk until it reads go: at the end of its stdin without it, it
// says so and leaves the disk as it was; with it, it writes the direct
// layout as diskSaveCommand does.
func TestDiskSaveArmed(t *testing.T) {
	shells := map[string][]string{"bash": {"bash"}, "dash": {"dash"}, "busybox-ash": {"busybox", "sh"}}
	for _, shell := range []string{"bash", "dash", "busybox-ash"} {
		for _, stdin := range []string{"", diskGo + "\n", "stop\n"} {
			t.Run(fmt.Sprintf("%s/%q", shell, stdin), func(t *testing.T) {
				dir := t.TempDir()
				cacheDir := filepath.Join(dir, "cache")
				require.NoError(t, os.MkdirAll(filepath.Join(cacheDir, "k"), 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(cacheDir, "k", "cache.zip"), []byte("zip bytes"), 0o644))
				disk := filepath.Join(dir, "disk")
				require.NoError(t, os.WriteFile(disk, nil, 0o600))
				require.NoError(t, os.Truncate(disk, 8<<20))
				script := diskSaveArmed
				script = script[strings.Index(script, diskSavePrep):] // the disk is $d
				for old, repl := range map[string]string{
					`c=; read -r c < "/sys/block/${d##*/}/size"`:                                                              "c=" + strconv.Itoa((8<<20)/512),
					"cd " + GuestCacheDir + " 2>/dev/null || { mkdir -p " + GuestCacheDir + " && cd " + GuestCacheDir + "; }": "cd " + cacheDir,
				} {
					require.Equal(t, 1, strings.Count(script, old), old)
					script = strings.Replace(script, old, repl, 1)
				}
				argv := shells[shell]
				cmd := exec.Command(argv[0], append(argv[1:], "-c", "d="+disk+"\n"+script)...)
				cmd.Stdin = strings.NewReader(stdin)
				out, err := cmd.CombinedOutput()
				require.NoError(t, err, "%s", out)
				b, err := os.ReadFile(disk)
				require.NoError(t, err)
				if stdin != diskGo+"\n" {
					require.Equal(t, diskNotAsked, lastLine(string(out)))
					require.Equal(t, make([]byte, 8<<20), b, "the disk is not written")
					return
				}
				require.Equal(t, diskWritten+" 0 direct", lastLine(string(out)), "%s", out)
				require.True(t, bytes.HasPrefix(b, []byte(hostcache.DirectMagic+"\n")), "the manifest is written")
				require.Equal(t, "zip bytes", string(b[hostcache.DirectManifestMax:hostcache.DirectManifestMax+9]))
			})
		}
	}
}

// The armed save over a real SSH session (sshtest runs its commands on
// this host): fired, it writes the disk; its stdin closed without go
// (the script failed, the stage ends), it ends without writing; ended
// before it was fired (connection lost), fire says so and the caller
// starts the save itself.
func TestArmedSave(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cacheDir := filepath.Join(dir, "cache")
	require.NoError(t, os.MkdirAll(filepath.Join(cacheDir, "k"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(cacheDir, "k", "cache.zip"), []byte("zip bytes"), 0o644))
	disk := filepath.Join(dir, "disk")
	newDisk := func() {
		require.NoError(t, os.WriteFile(disk, nil, 0o600))
		require.NoError(t, os.Truncate(disk, 8<<20))
	}
	script := diskSaveArmed[strings.Index(diskSaveArmed, diskSavePrep):]
	for old, repl := range map[string]string{
		`c=; read -r c < "/sys/block/${d##*/}/size"`:                                                              "c=" + strconv.Itoa((8<<20)/512),
		"cd " + GuestCacheDir + " 2>/dev/null || { mkdir -p " + GuestCacheDir + " && cd " + GuestCacheDir + "; }": "cd " + cacheDir,
	} {
		script = strings.Replace(script, old, repl, 1)
	}
	was := diskSaveArmed
	diskSaveArmed = "d=" + disk + "\n" + script
	t.Cleanup(func() { diskSaveArmed = was })

	srv := sshtest.Start(t)
	dial := func() *sshexec.Client {
		c, err := sshexec.Dial(ctx, sshexec.Target{Addr: srv.Addr(), User: "root", Signer: srv.ClientSigner(), HostKey: srv.HostKey()})
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	c := dial()

	newDisk()
	a := arm(ctx, c)
	require.True(t, a.fire(ctx))
	<-a.done
	require.NoError(t, a.err)
	require.Equal(t, diskWritten+" 0 direct", lastLine(a.out.String()), a.out.String())
	b, err := os.ReadFile(disk)
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(b, []byte(hostcache.DirectMagic+"\n")))

	newDisk()
	a = arm(ctx, c)
	require.NoError(t, a.stdin.Close())
	<-a.done
	require.NoError(t, a.err)
	require.Equal(t, diskNotAsked, lastLine(a.out.String()))
	b, err = os.ReadFile(disk)
	require.NoError(t, err)
	require.Equal(t, make([]byte, 8<<20), b, "not asked: the disk is not written")

	lost := dial()
	a = arm(ctx, lost)
	require.NoError(t, lost.Close())
	<-a.done
	require.Error(t, a.err)
	require.False(t, a.fire(ctx), "ended before go: the caller starts the save itself")

	// An armed command that did not see the disk in time (its 10 s ran
	// while the runner zipped) is not taken at its word: the caller starts
	// the save again, with 10 s of its own. Other answers are used.
	ended := func(out string) *armedSave {
		pr, pw := io.Pipe()
		_ = pr.Close()
		a := &armedSave{stdin: pw, out: &headBuffer{limit: 4096}, done: make(chan struct{})}
		_, _ = a.out.Write([]byte(out))
		close(a.done)
		return a
	}
	require.False(t, ended(diskMissing+"\n").fire(ctx))
	require.True(t, ended(diskUnwritable+"\n").fire(ctx))

	// A guest that never started the command never reads go: fire gives
	// up with its context (the save's own bound), and the caller's own
	// try is bounded by the same context.
	_, pw := io.Pipe()
	stuck := &armedSave{stdin: pw, out: &headBuffer{limit: 4096}, done: make(chan struct{})}
	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	require.False(t, stuck.fire(sctx))
}

// The writer refuses a manifest whose file no longer has the size listed
// (it changed after the guest measured it), and a manifest without its
// end: it fails, and writes no manifest on the disk, so that the host
// never takes bytes that were not written for a file.
func TestDiskWriterRefuses(t *testing.T) {
	for name, man := range map[string]string{
		"size changed": hostcache.DirectMagic + "\n1048576 5 ./f\n" + hostcache.DirectEnd + "\n",
		"no end":       hostcache.DirectMagic + "\n1048576 3 ./f\n",
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("abc"), 0o644))
			disk := filepath.Join(dir, "disk")
			require.NoError(t, os.WriteFile(disk, nil, 0o600))
			require.NoError(t, os.Truncate(disk, 4<<20))
			cmd := exec.Command("dash", "-c", diskWriter, "sh", disk, "direct")
			cmd.Dir = dir
			cmd.Stdin = strings.NewReader(man)
			out, err := cmd.CombinedOutput()
			require.Error(t, err, "%s", out)
			b, err := os.ReadFile(disk)
			require.NoError(t, err)
			require.False(t, bytes.HasPrefix(b, []byte(hostcache.DirectMagic)), "no manifest on the disk")
		})
	}
}

// The save through the guest agent (agentSave, over a real SSH session:
// sshtest runs its commands on this host, with the agent built as the
// tools disk carries it): armed and fired, and started after the script,
// the agent writes the direct layout the host reads back; a cache the
// layout cannot carry (a name with a newline) makes the agent say so, and
// the shell's way writes it as a tar stream.
func TestGuestWriteThroughTheAgent(t *testing.T) {
	ctx := context.Background()
	was := []string{guestAgent, diskSaveArmed, diskSaveCommand, diskSaveShell}
	t.Cleanup(func() { guestAgent, diskSaveArmed, diskSaveCommand, diskSaveShell = was[0], was[1], was[2], was[3] })
	built := agenttest.BuildT(t)
	guestAgent = built

	dir := t.TempDir()
	cacheDir := filepath.Join(dir, "cache")
	require.NoError(t, os.MkdirAll(filepath.Join(cacheDir, "k"), 0o755))
	zip := bytes.Repeat([]byte("zip bytes "), 300000)
	require.NoError(t, os.WriteFile(filepath.Join(cacheDir, "k", "cache.zip"), zip, 0o644))
	disk := filepath.Join(dir, "disk")
	const size = 16 << 20
	newDisk := func() {
		require.NoError(t, os.WriteFile(disk, nil, 0o600))
		require.NoError(t, os.Truncate(disk, size))
	}
	here := func(script string) string {
		for old, repl := range map[string]string{
			`"$d" ` + GuestCacheDir:                      `"$d" ` + cacheDir,
			`c=; read -r c < "/sys/block/${d##*/}/size"`: "c=" + strconv.Itoa(size/512),
			"cd " + GuestCacheDir + " 2>/dev/null || { mkdir -p " + GuestCacheDir + " && cd " + GuestCacheDir + "; }": "cd " + cacheDir,
		} {
			script = strings.ReplaceAll(script, old, repl)
		}
		return "d=" + disk + "\n" + script
	}
	// The commands as they are, but for the disk (no /sys here) and the
	// agent's path.
	find := findDisk(vm.ScratchDiskSerial)
	withAgent := func(script, agent string) string {
		require.True(t, strings.HasPrefix(script, find))
		require.Equal(t, 1, strings.Count(script, "A='"+guestinit.GuestAgentPath+"'"))
		return here(strings.Replace(strings.TrimPrefix(script, find), "A='"+guestinit.GuestAgentPath+"'", "A='"+agent+"'", 1))
	}
	useAgent := func(agent string) {
		diskSaveArmed, diskSaveCommand = withAgent(was[1], agent), withAgent(was[2], agent)
	}
	useAgent(built)
	diskSaveShell = here(strings.TrimPrefix(was[3], find))
	kept := func() map[string][]byte { return cachetest.Kept(t, disk, size) }

	srv := sshtest.Start(t)
	c, err := sshexec.Dial(ctx, sshexec.Target{Addr: srv.Addr(), User: "root", Signer: srv.ClientSigner(), HostKey: srv.HostKey()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })

	newDisk()
	last, err := guestWrite(ctx, c, arm(ctx, c))
	require.NoError(t, err)
	require.Equal(t, diskWritten+" 0 direct agent", last)
	require.Equal(t, map[string][]byte{"./k/cache.zip": zip}, kept())

	newDisk()
	last, err = guestWrite(ctx, c, nil)
	require.NoError(t, err)
	require.Equal(t, diskWritten+" 0 direct agent", last, "started after the script")
	require.Equal(t, map[string][]byte{"./k/cache.zip": zip}, kept())

	// An agent that does not know cache-save (an older one) leaves the
	// save to the shell's way; so does one that took the go and died (its
	// shell finds its stdin ended: the host runs the shell's save).
	for name, script := range map[string]string{
		"older agent":       "#!/bin/sh\necho 'lve-agent takes no arguments' >&2\nexit 2\n",
		"died after the go": "#!/bin/sh\nread -r g\nkill -9 $$\n",
	} {
		stand := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		require.NoError(t, os.WriteFile(stand, []byte(script), 0o755))
		useAgent(stand)
		newDisk()
		last, err = guestWrite(ctx, c, arm(ctx, c))
		require.NoError(t, err, name)
		require.Equal(t, diskWritten+" 0 direct", last, "%s: the shell's direct layout", name)
		require.Equal(t, map[string][]byte{"./k/cache.zip": zip}, kept(), name)
	}
	useAgent(built)

	newDisk()
	require.NoError(t, os.WriteFile(filepath.Join(cacheDir, "k", "odd\nname"), []byte("x"), 0o644))
	last, err = guestWrite(ctx, c, arm(ctx, c))
	require.NoError(t, err)
	require.Equal(t, diskWritten+" 0 tar", last, "the agent's layout cannot carry it: the shell's tar")
	b, err := os.ReadFile(disk)
	require.NoError(t, err)
	require.False(t, bytes.HasPrefix(b, []byte(hostcache.DirectMagic)), "a tar stream, not the layout")
	require.Equal(t, zip, kept()["./k/cache.zip"])
}
