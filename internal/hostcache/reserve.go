package hostcache

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// A reservation stands for a scratch disk of a save in flight: a volume
// in the storage pool, outside the store, that the guest fills with up
// to its capacity before the host stages what it keeps. It is a file
// Dir/stage/reserve-<machine> holding the capacity in decimal; it counts
// against TotalLimit (stageUsage) until Unreserve removes it (with the
// disk's volume) or it is older than staleReservation (a machine torn
// down with its disk before its save came).
const (
	reservePrefix    = "reserve-"
	staleReservation = 6 * time.Hour
)

var reserveNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$`)

func reservation(name string) (string, error) {
	if !reserveNameRE.MatchString(name) {
		return "", fmt.Errorf("hostcache: %q cannot name a reservation", name)
	}
	return stageDir + "/" + reservePrefix + name, nil
}

// Reserve counts bytes (a scratch disk's capacity) for machine name
// against TotalLimit until Unreserve, and first makes room for them:
// projects go, least recently used first, until the store, its staging
// and its reservations fit (evictTotal). A reservation larger than
// TotalLimit on its own is refused. Reserving again for the same name
// replaces the reservation.
func (s *Store) Reserve(ctx context.Context, name string, bytes int64) (EvictResult, error) {
	var res EvictResult
	file, err := reservation(name)
	if err != nil {
		return res, err
	}
	if bytes < 0 || bytes > s.TotalLimit {
		return res, fmt.Errorf("hostcache: a scratch disk of %d bytes does not fit in the total limit of %d bytes", bytes, s.TotalLimit)
	}
	root, err := s.open()
	if err != nil {
		return res, err
	}
	defer func() { _ = root.Close() }()
	tmp := file + "." + randomName() + ".new"
	err = root.WriteFile(tmp, []byte(strconv.FormatInt(bytes, 10)), 0o600)
	if err == nil {
		err = root.Rename(tmp, file)
	}
	if err != nil {
		_ = root.Remove(tmp)
		return res, fmt.Errorf("hostcache: reserving: %w", err)
	}
	if err := s.cleanStaging(root); err != nil {
		return res, err
	}
	return s.evictTotal(ctx, root, "")
}

// Unreserve removes machine name's reservation; none is no error.
func (s *Store) Unreserve(name string) error {
	file, err := reservation(name)
	if err != nil {
		return err
	}
	root, err := s.open()
	if err != nil {
		return err
	}
	defer func() { _ = root.Close() }()
	if err := root.Remove(file); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("hostcache: %w", err)
	}
	return nil
}

// Staged is what the store's staging holds now, charged as the projects'
// trees are: the files of saves in flight, and the scratch disks reserved
// for them (Reserve). It counts against TotalLimit.
func (s *Store) Staged() (int64, error) {
	root, err := s.open()
	if err != nil {
		return 0, err
	}
	defer func() { _ = root.Close() }()
	return s.stageUsage(root)
}

// stageUsage is Staged.
func (s *Store) stageUsage(root *os.Root) (int64, error) {
	var total int64
	err := fs.WalkDir(root.FS(), stageDir, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // a save done meanwhile
		}
		if err != nil {
			return err
		}
		switch {
		case p == stageDir:
		case d.IsDir():
			total += s.block()
		case strings.HasPrefix(p, stageDir+"/"+reservePrefix):
			if strings.HasSuffix(p, ".new") {
				return nil
			}
			b, err := root.ReadFile(p)
			if err == nil {
				n, perr := strconv.ParseInt(string(b), 10, 64)
				if perr == nil && n > 0 {
					total += s.charge(n)
				}
			}
		default:
			fi, err := d.Info()
			if err == nil {
				total += s.charge(fi.Size())
			}
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("hostcache: staging: %w", err)
	}
	return total, nil
}
