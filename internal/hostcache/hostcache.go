// Package hostcache is the host side of the per-project CI cache: a store
// of one file tree per project (of one GitLab instance), one for its
// protected refs and one for the others (ProjectID), that the run stage
// streams into a job's VM before restore_cache (Restore writes a tar
// stream for `tar -x` in the guest) and reads back after archive_cache
// (Save reads the tar stream of the guest's `tar -c`).
//
// # Trust
//
// The guest is hostile: the tar stream Save reads may contain anything.
// Save keeps only regular files with clean relative names (no absolute
// path, no "." / ".." / empty component, components of at most 255 bytes
// without control characters, at most MaxDepth components, at most
// MaxFiles files); directories are implied (directory entries are
// ignored); every other entry (symlink, hardlink, device, fifo, ...) is
// skipped and reported. Save also keeps only the files its filter names
// (the archives the runner's archive_cache script names): every other
// file the guest put in its cache directory is skipped and reported. Modes, owners and times in the stream are
// ignored: files are stored 0600, directories 0700, and a file's mtime is
// the time of the save that last wrote or confirmed it.
//
// The store directory itself is trusted to be written by this package
// only: Dir must be a real directory (not a symlink) owned by the current
// user. Every file operation goes through an os.Root opened on Dir, so a
// symlink planted in it cannot lead outside; on top of that Save replaces
// (never follows) a symlink or other non-directory it finds where it needs
// a directory or a file, so a link cannot make it write into another
// project either.
//
// # Limits
//
// A save whose regular-file entries (as declared by their headers) total
// more than ProjectLimit keeps nothing and fails with ErrProjectLimit; the
// decision is made from the header, before the entry's data is read. Save
// never reads more than ProjectLimit plus 1 MiB plus 10 KiB per tar entry
// from the stream (headers, skipped entries' data), and at most
// 2*MaxFiles entries, so an endless or lying stream ends in an error, not
// in unbounded reading; nothing is held in memory beyond one entry's
// header. Limits count what fills a disk: every file is charged its size
// in whole Blocks, at least one, and every directory one Block (Usage);
// a save whose kept files so charged exceed ProjectLimit, or that would
// make more than the entry limit's files and directories, keeps nothing.
// A save replaces the files it keeps, whole, and nothing else (the
// project's other files are other cache keys' archives). After a save
// the project is trimmed to ProjectLimit and the entry limit (least
// recently written files first, with the directories they leave empty;
// empty directories always) and the store to TotalLimit (least recently
// used projects first, never the project just saved unless it alone
// exceeds TotalLimit), counting what is staged and the scratch disks
// reserved (Reserve) as part of the store; a save also makes that room
// before it renames its staged files in.
//
// # Atomicity and locking
//
// Save writes every file to a staging directory under Dir (same file
// system); only when the whole stream was read and found valid does it
// make them durable (one syncfs) and rename them, one by one, into the
// project's tree, under an exclusive flock on the project. Restore reads
// under a shared flock, so it sees each file whole, old or new. A failure
// during the renames (a disk error) can leave some files of that save in
// place and others not; each file is whole either way. Restore never
// reads staging directories; each carries a lock file its Save holds,
// and Save, Prune and Evict remove those nobody holds (left by a killed
// process).
//
// # Layout
//
//	Dir/projects/<project>/lock      flock target; removed last on Remove
//	Dir/projects/<project>/last-use  empty; its mtime is the last use
//	Dir/projects/<project>/tree/...  the cached files
//	Dir/stage/<random>/lock          held by the Save that stages here
//	Dir/stage/<random>/<n>           staged files, numbered
//	Dir/stage/reserve-<machine>      a scratch disk's size, reserved (Reserve)
//
// Last use is the time of the last Restore or Save of the project.
package hostcache

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

const (
	// MaxFiles is the most regular files one Save keeps.
	MaxFiles = 10000
	// MaxDepth is the most path components a cached file's name has.
	MaxDepth = 16
	// MaxComponent is the longest path component, in bytes.
	MaxComponent = 255

	maxEntries     = 2 * MaxFiles // every kind of tar entry, per Save
	entryOverhead  = 10 << 10     // read budget per tar entry beyond file data
	streamOverhead = 1 << 20      // read budget per stream beyond the above
	staleStage     = time.Hour    // a staging dir without a lock file is left this long

	projectsDir = "projects"
	stageDir    = "stage"
	treeName    = "tree"
	lockName    = "lock"
	lastUseName = "last-use"
)

var (
	// ErrProjectLimit: a Save's stream carried more than the project limit.
	ErrProjectLimit = errors.New("cache over the project limit")
	// ErrTooManyFiles: a Save's stream carried more than MaxFiles regular
	// files or more than 2*MaxFiles entries.
	ErrTooManyFiles = errors.New("too many entries in the cache stream")
)

// Store is a cache of file trees, one per project, under Dir.
type Store struct {
	Dir          string           // created 0700 if missing; must be owned by the current user
	ProjectLimit int64            // most bytes of files per project, > 0
	TotalLimit   int64            // most bytes of files in the store, > 0
	EntryLimit   int64            // most files and directories per project; 0: DefaultEntryLimit
	Now          func() time.Time // nil: time.Now

	blockSize int64 // what a directory and an empty file are charged; 0: Block (tests of byte counts use 1)
}

// ForConfig is the store of the configuration's [cache] table.
func ForConfig(c config.Cache) *Store {
	return &Store{Dir: c.Dir, ProjectLimit: c.ProjectLimit(), TotalLimit: c.TotalLimit()}
}

func (s *Store) now() time.Time {
	if s.Now != nil {
		return s.Now()
	}
	return time.Now()
}

// projectRE matches the store's project names: ProjectID's, and those of
// releases before protected and unprotected refs were kept apart (no
// suffix), which List, Prune, Evict and Remove still see and remove.
var projectRE = regexp.MustCompile(`^[0-9a-f]{16}-[1-9][0-9]{0,18}(?:-[pu])?$`)

// Suffixes of a project's name: the cache of its protected refs, and of
// the others (GitLab's protected and unprotected caches kept apart).
const (
	protectedSuffix   = "-p"
	unprotectedSuffix = "-u"
)

// ProjectID is the name of the cache of project projectID on the GitLab
// instance tagged instance (any non-empty text; only its hash is used),
// for the jobs of its protected refs (protected) or of the others: the
// first 16 hex digits of the tag's sha256, "-", the project ID, then "-p"
// or "-u". The two never share a file: a job of an unprotected branch
// can neither read nor replace what a protected one extracts.
func ProjectID(instance string, projectID int64, protected bool) (string, error) {
	if instance == "" {
		return "", errors.New("hostcache: empty instance tag")
	}
	if projectID <= 0 {
		return "", fmt.Errorf("hostcache: project ID %d: must be > 0", projectID)
	}
	sum := sha256.Sum256([]byte(instance))
	suffix := unprotectedSuffix
	if protected {
		suffix = protectedSuffix
	}
	return fmt.Sprintf("%s-%d%s", hex.EncodeToString(sum[:8]), projectID, suffix), nil
}

// checkProject accepts any project name of the store (Remove).
func checkProject(project string) error {
	if !projectRE.MatchString(project) {
		return fmt.Errorf("hostcache: %q is not a project name (from ProjectID)", project)
	}
	return nil
}

// checkJobProject accepts a name ProjectID makes (Save, Open): never one
// of an older release, which kept protected and unprotected refs' caches
// together; those are only listed and removed.
func checkJobProject(project string) error {
	if err := checkProject(project); err != nil {
		return err
	}
	if !strings.HasSuffix(project, protectedSuffix) && !strings.HasSuffix(project, unprotectedSuffix) {
		return fmt.Errorf("hostcache: %q is a cache of an older release that kept protected and unprotected refs together: it is not used for jobs (gc or `cache rm` removes it)", project)
	}
	return nil
}

func projectPath(project string, rest ...string) string {
	p := projectsDir + "/" + project
	for _, r := range rest {
		p += "/" + r
	}
	return p
}

// open checks the limits and Dir (creating it 0700 if missing), and opens
// the root every file operation goes through.
func (s *Store) open() (*os.Root, error) {
	if s.ProjectLimit <= 0 || s.TotalLimit <= 0 {
		return nil, fmt.Errorf("hostcache: limits must be > 0 (project %d, total %d)", s.ProjectLimit, s.TotalLimit)
	}
	if s.Dir == "" {
		return nil, errors.New("hostcache: no store directory")
	}
	fi, err := os.Lstat(s.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err = os.MkdirAll(s.Dir, 0o700); err != nil {
			return nil, fmt.Errorf("hostcache: %w", err)
		}
		fi, err = os.Lstat(s.Dir)
	}
	if err != nil {
		return nil, fmt.Errorf("hostcache: %w", err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		return nil, fmt.Errorf("hostcache: store directory %s is a symlink: name the directory itself", s.Dir)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("hostcache: store directory %s is not a directory", s.Dir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Getuid() {
		return nil, fmt.Errorf("hostcache: store directory %s is not owned by the current user (uid %d)", s.Dir, os.Getuid())
	}
	root, err := os.OpenRoot(s.Dir)
	if err != nil {
		return nil, fmt.Errorf("hostcache: %w", err)
	}
	for _, d := range []string{projectsDir, stageDir} {
		if err := realDir(root, d); err != nil {
			_ = root.Close()
			return nil, err
		}
	}
	return root, nil
}

// realDir makes name a directory (0700) if it is missing, and fails if it
// is anything else (a symlink included).
func realDir(root *os.Root, name string) error {
	err := root.Mkdir(name, 0o700)
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("hostcache: %w", err)
	}
	fi, err := root.Lstat(name)
	if err != nil {
		return fmt.Errorf("hostcache: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("hostcache: %s/%s is not a directory", root.Name(), name)
	}
	return nil
}

var errNoProject = errors.New("no such project")

// lockProject takes a flock (how: syscall.LOCK_SH or LOCK_EX) on the
// project's lock file, creating the project's directory and lock file if
// create; without create, a missing project is errNoProject. With try, a
// lock held by another is errBusy instead of a wait. Close the file to
// unlock. Remove deletes a lock file while holding it; a waiter that then
// gets the lock of the deleted file sees so and tries again.
func lockProject(ctx context.Context, root *os.Root, project string, how int, create, try bool) (*os.File, error) {
	dir, lock := projectPath(project), projectPath(project, lockName)
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		flag := os.O_RDWR
		if create {
			flag |= os.O_CREATE
			if err := realDir(root, dir); err != nil {
				return nil, err
			}
		} else if fi, err := root.Lstat(dir); err == nil && !fi.IsDir() {
			return nil, fmt.Errorf("hostcache: %s/%s is not a directory", root.Name(), dir)
		}
		f, err := root.OpenFile(lock, flag, 0o600)
		if errors.Is(err, fs.ErrNotExist) {
			if !create {
				return nil, errNoProject
			}
			if attempt < 100 {
				continue // removed between the mkdir and the open
			}
		}
		if err != nil {
			return nil, fmt.Errorf("hostcache: %w", err)
		}
		if err := flockCtx(ctx, f, how, try); err != nil {
			f.Close()
			return nil, err
		}
		held, err1 := f.Stat()
		named, err2 := root.Lstat(lock)
		if err1 == nil && err2 == nil && os.SameFile(held, named) {
			return f, nil
		}
		f.Close() // removed while we waited: take the new one
	}
}

var errBusy = errors.New("locked by another")

// flockCtx takes the flock, polling so that ctx can end the wait.
func flockCtx(ctx context.Context, f *os.File, how int, try bool) error {
	for {
		err := syscall.Flock(int(f.Fd()), how|syscall.LOCK_NB)
		if err == nil {
			return nil
		}
		if err != syscall.EWOULDBLOCK && err != syscall.EINTR {
			return &os.PathError{Op: "flock", Path: f.Name(), Err: err}
		}
		if try && err == syscall.EWOULDBLOCK {
			return errBusy
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("hostcache: waiting for the lock on %s: %w", f.Name(), ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// touch sets the project's last use to now.
func (s *Store) touch(root *os.Root, project string) error {
	name := projectPath(project, lastUseName)
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("hostcache: %w", err)
	}
	f.Close()
	now := s.now()
	if err := root.Chtimes(name, now, now); err != nil {
		return fmt.Errorf("hostcache: %w", err)
	}
	return nil
}

func randomName() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// cleanStaging removes staging directories whose Save is gone: those
// whose lock file nobody holds, and those without one older than
// staleStage (a Save killed between the mkdir and the lock); and scratch
// disks' reservations older than staleReservation.
func (s *Store) cleanStaging(root *os.Root) error {
	d, err := root.Open(stageDir)
	if err != nil {
		return fmt.Errorf("hostcache: %w", err)
	}
	entries, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return fmt.Errorf("hostcache: %w", err)
	}
	var errs []error
	for _, e := range entries {
		name := stageDir + "/" + e.Name()
		if strings.HasPrefix(e.Name(), reservePrefix) && e.Type().IsRegular() {
			if fi, err := e.Info(); err != nil || time.Since(fi.ModTime()) < staleReservation {
				continue
			}
		}
		if e.IsDir() {
			f, err := root.OpenFile(name+"/"+lockName, os.O_RDWR, 0)
			if err == nil {
				err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
				if err == nil {
					err = root.RemoveAll(name)
					errs = append(errs, err)
				}
				f.Close()
				continue
			}
			if fi, err := e.Info(); err != nil || time.Since(fi.ModTime()) < staleStage {
				continue
			}
		}
		errs = append(errs, root.RemoveAll(name))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("hostcache: cleaning staging: %w", err)
	}
	return nil
}
