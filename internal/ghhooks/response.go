package ghhooks

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// State is what the hook keeps between its calls: the runner hands back,
// with every later command, the state prepare_job answered. It names the
// job's VM and what runs in it; the hook proves the VM is its own before
// it acts on it.
type State struct {
	// Machine is the job's VM; Job the key its record is kept under.
	Machine string `json:"machine"`
	Job     string `json:"job"`
	// Network is the job's container network in the VM, Container the
	// job container's name, Services each service's container by its
	// contextName.
	Network   string            `json:"network"`
	Container string            `json:"container"`
	Services  map[string]string `json:"services,omitempty"`
	// Path is the job container's own PATH, which a step's prependPath
	// goes before.
	Path string `json:"path,omitempty"`
}

// ContainerContext is what the runner learns of one container.
type ContainerContext struct {
	ID      string            `json:"id,omitempty"`
	Network string            `json:"network,omitempty"`
	Ports   map[string]string `json:"ports,omitempty"`
}

// Response is prepare_job's answer.
type Response struct {
	State   State `json:"state"`
	Context struct {
		Container ContainerContext `json:"container"`
		Services  []ServiceContext `json:"services"`
	} `json:"context"`
	IsAlpine bool `json:"isAlpine"`
}

// ServiceContext is one service's part of the answer.
type ServiceContext struct {
	ContextName string            `json:"contextName"`
	Image       string            `json:"image"`
	ID          string            `json:"id"`
	Network     string            `json:"network,omitempty"`
	Ports       map[string]string `json:"ports,omitempty"`
}

// DecodeState reads the state the runner handed back: a state this hook
// wrote (a machine and a job), else an error saying so.
func (in *Input) DecodeState() (*State, error) {
	if len(in.State) == 0 || string(in.State) == "null" || string(in.State) == "{}" {
		return nil, errors.New("state: empty (prepare_job did not run, or the runner lost its answer)")
	}
	var st State
	if err := json.Unmarshal(in.State, &st); err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	if st.Machine == "" || st.Job == "" {
		return nil, errors.New("state: names no machine or job (not a state this hook wrote)")
	}
	return &st, nil
}

// WriteResponse writes r to path, which must lie in the runner's work
// directory workDir, as the runner reads it: the whole answer or nothing (a
// file beside it, renamed into place), mode 0600, a file already there
// replaced. The way from workDir to the file's directory is walked without
// following a symbolic link (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS):
// a job's VM can write into the work directory, and a link it left there
// must not lead this write anywhere else.
func WriteResponse(workDir, path string, r *Response) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	rel, err := filepath.Rel(workDir, path)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") || !filepath.IsAbs(workDir) {
		return fmt.Errorf("responseFile %s: not in the runner's work directory %s", path, workDir)
	}
	root, err := unix.Open(workDir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("responseFile %s: the work directory %s: %w", path, workDir, err)
	}
	defer func() { _ = unix.Close(root) }()
	dir := root
	if d := filepath.Dir(rel); d != "." {
		dir, err = unix.Openat2(root, d, &unix.OpenHow{
			Flags:   unix.O_DIRECTORY | unix.O_RDONLY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS,
		})
		switch {
		case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR):
			return fmt.Errorf("responseFile %s: its directory %s does not exist", path, filepath.Dir(path))
		case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV):
			return fmt.Errorf("responseFile %s: a symbolic link on the way from %s to it (not followed)", path, workDir)
		case err != nil:
			return fmt.Errorf("responseFile %s: %w", path, err)
		}
		defer func() { _ = unix.Close(dir) }()
	}
	var nonce [8]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return err
	}
	tmp := ".lve-hook-response-" + hex.EncodeToString(nonce[:])
	fd, err := unix.Openat(dir, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("responseFile %s: cannot write in %s: %w", path, filepath.Dir(path), err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	_, werr := f.Write(b)
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		_ = unix.Unlinkat(dir, tmp, 0)
		return fmt.Errorf("responseFile %s: %w", path, err)
	}
	// A link already at the name is replaced, never followed.
	if err := unix.Renameat(dir, tmp, dir, filepath.Base(rel)); err != nil {
		_ = unix.Unlinkat(dir, tmp, 0)
		return fmt.Errorf("responseFile %s: %w", path, err)
	}
	return nil
}
