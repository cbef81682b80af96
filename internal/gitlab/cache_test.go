package gitlab

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

// Only the runner's cache sub-stages whose scripts call its cache helper
// copy anything: jobs without cache: (and saves with policy pull) pay
// nothing.
func TestCacheOpOf(t *testing.T) {
	for _, tc := range []struct {
		stage, script string
		want          cacheOp
	}{
		{"restore_cache", "gitlab-runner cache-extractor --file ../cache.zip", cacheRestore},
		{"restore_cache", "echo nothing to restore", cacheNone},
		{"archive_cache", "gitlab-runner cache-archiver --file ../cache.zip", cacheSave},
		{"archive_cache_on_failure", "gitlab-runner cache-archiver --file x", cacheSave},
		{"archive_cache", "", cacheNone},
		{"build_script", "gitlab-runner cache-archiver", cacheNone},
		{"step_script", "gitlab-runner cache-extractor", cacheNone},
	} {
		require.Equal(t, tc.want, cacheOpOf(tc.stage, []byte(tc.script)), "%s: %q", tc.stage, tc.script)
	}
}

// The project comes from the payload (GitLab's job_info.project_id and its
// own CI_SERVER_URL, the first entry), never from a variable the job sets;
// without a payload, or with the host cache off for the image, there is
// no store.
func TestHostCacheIdentity(t *testing.T) {
	dir := t.TempDir()
	payload := `{"id":5,"job_info":{"project_id":42},"variables":[` +
		`{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"},` +
		`{"key":"CI_PROJECT_ID","value":"42"},` +
		// the job's own definitions come after GitLab's and lose
		`{"key":"CI_SERVER_URL","value":"https://evil.example.com"},{"key":"CI_PROJECT_ID","value":"7"}]}`
	path := filepath.Join(dir, "response.json")
	require.NoError(t, os.WriteFile(path, []byte(payload), 0o600))
	j, err := ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": path}), false, func(string) {})
	require.NoError(t, err)
	require.Equal(t, int64(42), j.ProjectID)
	require.Equal(t, "https://gitlab.example.com", j.Server)
	require.Equal(t, "https://gitlab.example.com", j.ServerURL)
	require.False(t, j.Protected)

	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(dir, "c") + "\"\nimages = [\"a\"]\n[images.a]\nbase = \"/a\"\n[images.b]\nbase = \"/b\"\n"))
	require.NoError(t, err)
	jb := &job{cfg: cfg, job: j}
	store, project, why := hostCache(jb, cfg.Images["a"])
	require.NotNil(t, store, why)
	require.Equal(t, cfg.Cache.ProjectLimit(), store.ProjectLimit)

	// the same project of another instance, and another project: other directories
	other := *j
	other.ServerURL = "https://evil.example.com"
	_, p2, _ := hostCache(&job{cfg: cfg, job: &other}, cfg.Images["a"])
	other = *j
	other.ProjectID = 7
	_, p3, _ := hostCache(&job{cfg: cfg, job: &other}, cfg.Images["a"])
	require.NotEqual(t, project, p2)
	require.NotEqual(t, project, p3)
	// the same project's protected refs: another directory
	other = *j
	other.Protected = true
	_, p4, _ := hostCache(&job{cfg: cfg, job: &other}, cfg.Images["a"])
	require.NotEqual(t, project, p4)

	// image b is not in cache.images: nothing, and nothing said
	store, _, why = hostCache(jb, cfg.Images["b"])
	require.Nil(t, store)
	require.Empty(t, why)

	// no payload: the project is not known, the job log says so
	env := *j
	env.FromPayload = false
	store, _, why = hostCache(&job{cfg: cfg, job: &env}, cfg.Images["a"])
	require.Nil(t, store)
	require.Contains(t, why, "not known from the runner's payload")
}

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

// recordedScript is the script GitLab Runner 17.9.3 hands the run stage for
// stage (restore_cache or archive_cache: testdata/README.md), of a job
// whose cache key is key (the recording's deps-protected replaced).
func recordedScript(t *testing.T, stage, key string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "gitlab-runner-17.9.3-"+stage+".script"))
	require.NoError(t, err)
	require.Contains(t, string(b), "deps-protected/cache.zip")
	return bytes.ReplaceAll(b, []byte("deps-protected"), []byte(key))
}

// The archives a script names are its cache helper's --file paths under
// cache_dir, however the runner quotes them; nothing else in it (the
// job's variables, other paths under /cache, a name that does not end in
// the runner's archive file) is one.
func TestNamedArchives(t *testing.T) {
	for _, stage := range []string{"restore_cache", "archive_cache"} {
		require.Equal(t, []string{"lve/selftest/deps-protected/cache.zip"}, namedArchives(recordedScript(t, stage, "deps-protected")), stage)
		require.Equal(t, []string{"lve/selftest/deps-non_protected/cache.zip"}, namedArchives(recordedScript(t, stage, "deps-non_protected")), stage)
	}
	for _, tc := range []struct {
		script string
		want   []string
	}{
		// older runners' quoting, fallback keys, an absolute path
		{`'/opt/lve-tools/bin/gitlab-runner' 'cache-extractor' '--file' '../../../../cache/lve/demo/deps-v1-protected/cache.zip' '--timeout' '10'
'/opt/lve-tools/bin/gitlab-runner' 'cache-extractor' '--file' '../../../../cache/lve/demo/fallback-protected/cache.zip' '--timeout' '10'`,
			[]string{"lve/demo/deps-v1-protected/cache.zip", "lve/demo/fallback-protected/cache.zip"}},
		{`: | eval $'$\'gitlab-runner\' cache-archiver --file $\'../../cache/ns/p/k 1/cache.zip\' --timeout 10\n'`, nil},
		{`: | eval $'gitlab-runner cache-archiver --file $\'/cache/ns/p/k-protected/cache.zip\'\n'`, []string{"ns/p/k-protected/cache.zip"}},
		{"mkdir -p /cache/lve/p/k && head -c 9 /dev/urandom > /cache/lve/p/k/cache.zip\n", []string{"lve/p/k/cache.zip"}},
		{"gitlab-runner cache-extractor --file elsewhere.zip", nil},
		{"export X=/cache/ns/p/evil.txt\ncp a /cache/cache.zip\n", nil},
		{"--file ../cache/cache/ns/k/cache.zip", []string{"cache/ns/k/cache.zip"}},
	} {
		require.Equal(t, tc.want, namedArchives([]byte(tc.script)), "%q", tc.script)
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

	script := []byte(`'/opt/lve-tools/bin/gitlab-runner' 'cache-extractor' '--file' '../../../../cache/lve/demo/deps-v1-protected/cache.zip' '--timeout' '10'
'/opt/lve-tools/bin/gitlab-runner' 'cache-extractor' '--file' '../../../../cache/lve/demo/fallback-protected/cache.zip' '--timeout' '10'`)
	want, n, all, err := wantedFiles(context.Background(), store, project, namedArchives(script))
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"lve/demo/deps-v1-protected/cache.zip", "lve/demo/fallback-protected/cache.zip"}, want)
	require.EqualValues(t, 2, n, "the wanted files' bytes")
	require.EqualValues(t, 3, all, "all files' bytes")

	want, n, all, err = wantedFiles(context.Background(), store, project, namedArchives([]byte("gitlab-runner cache-extractor --file elsewhere.zip")))
	require.NoError(t, err)
	require.Empty(t, want, "none named: none")
	require.Zero(t, n)
	require.EqualValues(t, 3, all)
	require.False(t, hostcache.Only(nil)("lve/demo/deps-v1-protected/cache.zip"), "none named keeps none")
	require.False(t, hostcache.Only([]string{"a"})("b"))
}

// recordingDisk is a CacheDisk that records the scratch disks asked for
// and dropped; with block set, an attach waits for its context's end.
type recordingDisk struct {
	CacheDisk
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
func TestStartScratch(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "response.json")
	require.NoError(t, os.WriteFile(path, []byte(`{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"}]}`), 0o600))
	jb, err := ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": path}), false, func(string) {})
	require.NoError(t, err)
	load := func(extra string) *job {
		cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(dir, "c") + "\"\n" + extra +
			"[images.a]\nbase = \"/a\"\n[images.s]\nbase = \"/s\"\ncache_via = \"ssh\"\n"))
		require.NoError(t, err)
		return &job{cfg: cfg, job: jb}
	}
	disk := &recordingDisk{attached: make(chan string, 4), dropped: make(chan string, 4)}
	e := Env{CacheDisk: disk}
	script := []byte("'gitlab-runner' 'cache-archiver' '--file' '../../../../cache/lve/demo/k-protected/cache.zip'")
	ctx := context.Background()

	j := load("disk_min_mib = 0\n")
	es := startScratch(ctx, e, j, "vm-1", j.cfg.Images["a"], script)
	require.NotNil(t, es, "disk_min_mib = 0: always during the script")
	require.Equal(t, "vm-1", <-disk.attached)
	es.drop(ctx, e, j, "vm-1")
	require.Equal(t, "vm-1", <-disk.dropped, "unused: its volume is deleted")

	require.Nil(t, startScratch(ctx, e, j, "vm-1", j.cfg.Images["s"], script), "cache_via = \"ssh\": no disk")

	j = load("disk_min_mib = 1\n")
	require.Nil(t, startScratch(ctx, e, j, "vm-1", j.cfg.Images["a"], script), "nothing kept yet: the guest's du decides after the script")
	store, project, _ := hostCache(j, j.cfg.Images["a"])
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "lve/demo/k-protected/cache.zip", Typeflag: tar.TypeReg, Mode: 0o644, Size: 2 << 20}))
	_, err = tw.Write(make([]byte, 2<<20))
	require.NoError(t, err)
	require.NoError(t, tw.Close())
	_, err = store.Save(ctx, project, &buf, hostcache.All)
	require.NoError(t, err)
	es = startScratch(ctx, e, j, "vm-2", j.cfg.Images["a"], script)
	require.NotNil(t, es, "the key's kept archive (2 MiB) is at least disk_min_mib")
	require.Equal(t, "vm-2", <-disk.attached)
	<-es.done

	disk.fail = errors.New("no hot plug")
	es = startScratch(ctx, e, j, "vm-3", j.cfg.Images["a"], script)
	require.Equal(t, "vm-3", <-disk.attached)
	es.drop(ctx, e, j, "vm-3")
	require.Equal(t, "vm-3", <-disk.dropped, "a failed attach may have left its volume: dropped too")
	var none *earlyScratch
	none.drop(ctx, e, j, "vm-4") // nothing to do

	// The script failed while the attach still ran (libvirt slow): the
	// drop stops it instead of waiting for it, and deletes what it left.
	disk.fail, disk.block = nil, true
	es = startScratch(ctx, e, j, "vm-5", j.cfg.Images["a"], script)
	require.Equal(t, "vm-5", <-disk.attached)
	es.drop(ctx, e, j, "vm-5")
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
					"cd " + guestCacheDir + " 2>/dev/null || { mkdir -p " + guestCacheDir + " && cd " + guestCacheDir + "; }": "cd " + cacheDir,
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
					"cd " + guestCacheDir + " 2>/dev/null || { mkdir -p " + guestCacheDir + " && cd " + guestCacheDir + "; }": "cd " + cacheDir,
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
		"cd " + guestCacheDir + " 2>/dev/null || { mkdir -p " + guestCacheDir + " && cd " + guestCacheDir + "; }": "cd " + cacheDir,
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
			`"$d" ` + guestCacheDir:                      `"$d" ` + cacheDir,
			`c=; read -r c < "/sys/block/${d##*/}/size"`: "c=" + strconv.Itoa(size/512),
			"cd " + guestCacheDir + " 2>/dev/null || { mkdir -p " + guestCacheDir + " && cd " + guestCacheDir + "; }": "cd " + cacheDir,
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

// readPayload is the job of a payload (JSON) as the stages read it.
func readPayload(t *testing.T, payload string) *Job {
	t.Helper()
	path := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(path, []byte(payload), 0o600))
	j, err := ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": path}), false, func(string) {})
	require.NoError(t, err)
	return j
}

// A job is protected when GitLab says so: a cache key with its
// "-protected" suffix, or its own CI_COMMIT_REF_PROTECTED (the first
// entry: a job's own definition after it does not count). The instance
// is CI_SERVER_URL with its path: two GitLabs under one host are two.
func TestJobProtectedAndInstance(t *testing.T) {
	for _, tc := range []struct {
		cache, vars string
		want        bool
	}{
		{`[{"key":"deps-protected"}]`, ``, true},
		{`[{"key":"deps-non_protected"}]`, ``, false},
		{`[{"key":"deps"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"true"}`, true},
		{`[]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"false"},{"key":"CI_COMMIT_REF_PROTECTED","value":"true"}`, false},
		{`[{"key":"deps-non_protected"},{"key":"other-non_protected"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"false"}`, false},
		{`null`, ``, false},
		// A key is the job's to choose: it never grants protection GitLab
		// does not (separate caches off, an unprotected ref).
		{`[{"key":"mine-protected"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"false"}`, false},
		{`[{"key":"deps-non_protected"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"true"}`, false},
	} {
		j := readPayload(t, `{"id":5,"job_info":{"project_id":42},"cache":`+tc.cache+`,"variables":[{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"}`+tc.vars+`]}`)
		require.Equal(t, tc.want, j.Protected, "cache %s, variables %s", tc.cache, tc.vars)
	}

	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(t.TempDir(), "c") + "\"\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	projects := map[string]bool{}
	for _, u := range []string{"https://example.com/gitlab-a", "https://example.com/gitlab-b/", "https://user@example.com"} {
		j := readPayload(t, `{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"`+u+`"}]}`)
		require.Equal(t, "https://example.com", j.Server, "the logs' server: scheme and host")
		_, p, why := hostCache(&job{cfg: cfg, job: j}, cfg.Images["a"])
		require.NotEmpty(t, p, why)
		projects[p] = true
	}
	require.Len(t, projects, 3, "each instance's path is part of its identity (the third has none)")
	j := readPayload(t, `{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"https://example.com/gitlab-b/?x#y"}]}`)
	require.Equal(t, "https://example.com/gitlab-b", j.ServerURL, "no query, fragment or trailing slash")
}

// cacheGuest is an SSH server whose "guest" runs the host cache's fixed
// commands with cache_dir at a directory of the test's (the login shell
// puts dir where the commands say /cache); files are what cache_dir holds
// at first.
func cacheGuest(t *testing.T, files map[string]string) (*sshexec.Client, string) {
	t.Helper()
	dir := t.TempDir()
	for name, body := range files {
		p := filepath.Join(dir, "cache", name)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
	}
	login := filepath.Join(dir, "login")
	// The test's own commands (restoreCommand, saveCommand): fixed text
	// with /cache in it.
	require.NoError(t, os.WriteFile(login, []byte("#!/bin/sh\n[ \"$1\" = -c ] || exit 2\nc=$(printf '%s' \"$2\" | sed \"s#"+guestCacheDir+"#"+dir+"/cache#g\")\nexec sh -c \"$c\"\n"), 0o755))
	srv := sshtest.Start(t)
	srv.SetLogin(login)
	c, err := sshexec.Dial(context.Background(), sshexec.Target{Addr: srv.Addr(), User: "root", Signer: srv.ClientSigner(), HostKey: srv.HostKey()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c, filepath.Join(dir, "cache")
}

// The host cache keeps a project's protected and unprotected caches
// apart, over the real save and restore paths (SSH here; the scratch
// disk's keep takes the same filter), with the scripts GitLab Runner
// 17.9.3 writes: a protected job's archive is kept; a job of an
// unprotected branch of the same project finds nothing of it, and what it
// leaves in cache_dir (the protected key's archive with its own bytes
// among it) never replaces it: only its own key's archive is kept, in its
// own cache; the protected job's next run restores its archive as it was.
func TestHostCacheKeepsProtectedApart(t *testing.T) {
	ctx := context.Background()
	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(t.TempDir(), "c") + "\"\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	jobOf := func(key, protected string) *job {
		return &job{cfg: cfg, job: readPayload(t, `{"id":5,"job_info":{"project_id":42},"cache":[{"key":"`+key+`"}],"variables":[`+
			`{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"},{"key":"CI_COMMIT_REF_PROTECTED","value":"`+protected+`"}]}`)}
	}
	const protArchive = "lve/selftest/deps-protected/cache.zip"
	const unprotArchive = "lve/selftest/deps-non_protected/cache.zip"
	protBytes := "PK protected archive " + strings.Repeat("p", 1000)

	// The protected job saves; a file the guest put beside its archive is
	// left out.
	store, prot, _ := hostCache(jobOf("deps-protected", "true"), cfg.Images["a"])
	c, _ := cacheGuest(t, map[string]string{protArchive: protBytes, "planted.txt": "x"})
	res, gerr, serr := saveBySSH(ctx, store, prot, namedArchives(recordedScript(t, "archive_cache", "deps-protected")), c)
	require.NoError(t, gerr)
	require.NoError(t, serr)
	require.EqualValues(t, 1, res.Files)
	require.EqualValues(t, 1, res.SkipCount, "%v", res.Skipped)
	require.Contains(t, res.Skipped[0], "planted.txt")

	// The unprotected job: another cache; its restore finds nothing, even
	// where its script names the protected key's archive.
	_, unprot, _ := hostCache(jobOf("deps-non_protected", "false"), cfg.Images["a"])
	require.NotEqual(t, prot, unprot)
	restoreScript := append(recordedScript(t, "restore_cache", "deps-non_protected"), recordedScript(t, "restore_cache", "deps-protected")...)
	want, _, all, err := wantedFiles(ctx, store, unprot, namedArchives(restoreScript))
	require.NoError(t, err)
	require.Empty(t, want)
	require.Zero(t, all)
	// It leaves the protected key's archive, poisoned, in its cache_dir,
	// beside its own.
	c, _ = cacheGuest(t, map[string]string{protArchive: "poison", unprotArchive: "its own", "lve/selftest/x/cache.zip": "other"})
	res, gerr, serr = saveBySSH(ctx, store, unprot, namedArchives(recordedScript(t, "archive_cache", "deps-non_protected")), c)
	require.NoError(t, gerr)
	require.NoError(t, serr)
	require.EqualValues(t, 1, res.Files, "its own archive only")
	require.EqualValues(t, 2, res.SkipCount, "%v", res.Skipped)

	// The protected job's next run restores its own archive, untouched.
	named := namedArchives(recordedScript(t, "restore_cache", "deps-protected"))
	want, size, _, err := wantedFiles(ctx, store, prot, named)
	require.NoError(t, err)
	require.Equal(t, []string{protArchive}, want)
	require.EqualValues(t, len(protBytes), size)
	c, guestDir := cacheGuest(t, nil)
	rr, err := restoreBySSH(ctx, store, prot, want, c)
	require.NoError(t, err)
	require.EqualValues(t, 1, rr.Files)
	got, err := os.ReadFile(filepath.Join(guestDir, protArchive))
	require.NoError(t, err)
	require.Equal(t, protBytes, string(got))
	entries, err := os.ReadDir(filepath.Join(guestDir, "lve", "selftest"))
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing else of the project's caches reaches the guest")
}

// A restore_cache or archive_cache script that names no archive copies
// nothing (never the project's whole cache), and says so in the job log,
// before any connection to the guest is made.
func TestRunCacheNamesNothing(t *testing.T) {
	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(t.TempDir(), "c") + "\"\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	j := &job{cfg: cfg, job: readPayload(t, `{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"}]}`)}
	store, project, _ := hostCache(j, cfg.Images["a"])
	_, err = store.Save(context.Background(), project, bytes.NewReader(tarOf(t, map[string]string{"lve/selftest/k/cache.zip": "z"})), hostcache.All)
	require.NoError(t, err)
	var out bytes.Buffer
	e := Env{Stdout: &out}
	// j.m is nil: a connection attempt would panic.
	runCache(context.Background(), e, j, "vm-1", cfg.Images["a"], cacheRestore, []byte("gitlab-runner cache-extractor --file elsewhere.zip"), nil)
	require.Contains(t, out.String(), "Host cache: nothing restored: the runner's restore_cache script names no cache archive")
	out.Reset()
	runCache(context.Background(), e, j, "vm-1", cfg.Images["a"], cacheSave, []byte("gitlab-runner cache-archiver --file elsewhere.zip"), nil)
	require.Contains(t, out.String(), "Host cache: nothing kept: the runner's archive_cache script names no cache archive")
}

// tarOf is a tar stream of files.
func tarOf(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range files {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}))
		_, err := tw.Write([]byte(body))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}
