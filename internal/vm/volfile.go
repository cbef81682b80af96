package vm

import (
	"context"
	"io"
	"os"
	"regexp"
	"strconv"

	"golang.org/x/sys/unix"
	"libvirt.org/go/libvirtxml"
)

// dacLabelRE is a DAC label as libvirt writes it for a running domain:
// "+UID:+GID".
var dacLabelRE = regexp.MustCompile(`^\+([0-9]{1,10}):\+([0-9]{1,10})$`)

// DACImageLabelOf is the DAC image label of a running domain's live XML
// dx ("+UID:+GID"), or "" where it has none of that form.
func DACImageLabelOf(dx *libvirtxml.Domain) string {
	for _, l := range dx.SecLabel {
		if l.Model == "dac" && dacLabelRE.MatchString(l.ImageLabel) {
			return l.ImageLabel
		}
	}
	return ""
}

// ParseDACLabel returns the uid and gid of a DAC label "+UID:+GID".
func ParseDACLabel(label string) (uid, gid int, ok bool) {
	m := dacLabelRE.FindStringSubmatch(label)
	if m == nil {
		return 0, 0, false
	}
	u, err1 := strconv.ParseUint(m[1], 10, 31)
	g, err2 := strconv.ParseUint(m[2], 10, 31)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return int(u), int(g), true
}

// OpenVolumeFile opens the volume file at path (a path libvirt gave for a
// volume of this host) for reading, or returns nil where this process may
// not read it, it is not a regular file, or the last component is a
// link: the caller reads it through libvirt then.
func OpenVolumeFile(path string) *os.File {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil
	}
	return f
}

// ContextReader is r that fails with ctx's cause once ctx is done.
func ContextReader(ctx context.Context, r io.Reader) io.Reader { return ctxReader{ctx, r} }

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if c.ctx.Err() != nil {
		return 0, context.Cause(c.ctx)
	}
	return c.r.Read(p)
}
