package garm

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// garm lists every pool's instances again and again (its pool manager
// reconciles what the provider has with what it knows). A pool garm has
// not named for a long time was deleted, or its garm is gone: its
// instances are orphans. The provider notes, per controller and pool, when
// garm last named the pool (any command with GARM_POOL_ID); list and
// doctor report the instances of a pool not named for garm.orphan_after.

// poolsDir holds one file per (controller, pool): its modification time
// is when garm last named the pool.
func poolsDir(stateDir string) string { return filepath.Join(stateDir, "garm", "pools") }

// seenFile is the file of a controller's pool; both are UUIDs (ReadEnv and
// the ownership tags are checked), anything else has none.
func seenFile(stateDir, controller, pool string) (string, bool) {
	if !uuidRE.MatchString(controller) || !uuidRE.MatchString(pool) {
		return "", false
	}
	return filepath.Join(poolsDir(stateDir), strings.ToLower(controller)+"_"+strings.ToLower(pool)), true
}

// MarkPoolSeen notes that garm named the pool now.
func MarkPoolSeen(stateDir, controller, pool string, now time.Time) error {
	p, ok := seenFile(stateDir, controller, pool)
	if !ok {
		return fmt.Errorf("controller %q / pool %q: not UUIDs", cut(controller), cut(pool))
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	if err := os.Chtimes(p, now, now); err == nil {
		return nil
	}
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		return err
	}
	return os.Chtimes(p, now, now)
}

// PoolSeen is when garm last named the pool (false: never, here).
func PoolSeen(stateDir, controller, pool string) (time.Time, bool) {
	p, ok := seenFile(stateDir, controller, pool)
	if !ok {
		return time.Time{}, false
	}
	fi, err := os.Stat(p)
	if err != nil {
		return time.Time{}, false
	}
	return fi.ModTime(), true
}

// Orphan says why a garm instance is an orphan, or "" when it is not one
// (or not garm's): garm has not named its pool for orphanAfter (counted
// from the instance's creation when the pool was never noted).
func Orphan(stateDir string, o *vm.Owner, now time.Time, orphanAfter time.Duration) string {
	if o == nil || o.Frontend != Frontend {
		return ""
	}
	ctrl, pool := o.Tag(TagController), o.Tag(TagPool)
	seen, ok := PoolSeen(stateDir, ctrl, pool)
	if !ok || seen.Before(o.Created) {
		seen = o.Created
	}
	if silent := now.Sub(seen); silent > orphanAfter {
		return fmt.Sprintf("garm (controller %s) has not named pool %s for %s", ctrl, pool, silent.Round(time.Second))
	}
	return ""
}
