//go:build e2e && bench

package e2e

// The snapshot round (#48 item 5), run by `make bench`: a job's prepare
// and whole job when its VM is restored from its image's memory snapshot,
// against the same image's cold boot and a warm claim from a standby pool,
// tiny and Debian, interleaved round by round with the pool's idle VMs up
// throughout (so every start shares the same host load); four tiny jobs at
// once with no idle VM, from the snapshot and cold; where a snapshot
// prepare's time goes (its job log's step lines); and what a snapshot
// holds of the host's disk and memory against an idle standby VM. Every
// job is a real job through a real gitlab-runner run-single. The tables go
// to the test log and to LVE_BENCH_SNAPSHOT_OUT (JSON to
// LVE_BENCH_SNAPSHOT_JSON); LVE_BENCH_SNAPSHOT_RUNS (3) runs per start and
// image, 0 skips the round.

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

const benchDur = `([0-9.]+(?:ms|s|m[0-9.]*s?))`

// benchPrepareRE is the job log's last "Machine ready in": prepare's own
// whole time (a restored or claimed machine's line says which start).
var benchPrepareRE = regexp.MustCompile(`(?s).*Machine ready in ` + benchDur)

// benchStep is a row of the breakdown: its job log line (nil: derived).
type benchStep struct {
	Name string
	re   *regexp.Regexp
}

// benchSnapSteps are a snapshot prepare's step lines (vm.Engine.Restore's
// progress, provision's restore, address and SSH lines), in their order.
var benchSnapSteps = []benchStep{
	{"clone disk (overlay over the frozen one)", regexp.MustCompile(`clone disk done in ` + benchDur)},
	{"reserve address (DHCP host entry)", regexp.MustCompile(`reserve address done in ` + benchDur)},
	{"seed volume: create", regexp.MustCompile(`create seed volume done in ` + benchDur)},
	{"seed volume: upload", regexp.MustCompile(`upload seed done in ` + benchDur)},
	{"restore (virDomainRestore)", regexp.MustCompile(`(?m)^\s*restore done in ` + benchDur)},
	{"hot plug, all", regexp.MustCompile(`hot plug done in ` + benchDur)},
	{"  shared disk (tools)", regexp.MustCompile(`shared disk \S+ plugged in ` + benchDur)},
	{"  network interface", regexp.MustCompile(`network interface \([^)]*\) plugged in ` + benchDur)},
	{"  credentials disk", regexp.MustCompile(`credentials disk plugged in ` + benchDur)},
	{benchFilterSetup, nil}, // hot plug less its three plugs
	{"Restored (all of the above)", regexp.MustCompile(`from the memory snapshot of image .* in ` + benchDur + `, its lease`)},
	{"lease after the restore", regexp.MustCompile(`its lease after ` + benchDur)},
	{"address", regexp.MustCompile(`Booted, address \S+ \(.*\) in ` + benchDur)},
	{"SSH wait (SSH ready)", regexp.MustCompile(`SSH ready as .* in ` + benchDur + ` \(`)},
}

// benchFilterSetup is the part of the hot plug that no line times: the
// interface's network filter made sure of (vm's completeFilter: the
// network's gateway, EnsureNWFilters) before the interface is plugged.
const benchFilterSetup = "  network filter setup (hot plug's rest)"

// benchRest is the breakdown's last row: prepare less the restore, lease,
// address and SSH (the tools disk, the guest tools check, the connection
// holder).
const benchRest = "rest: tools disk, guest check, holder"

// benchStarts are the starts measured per image, in their first round's order.
var benchStarts = []string{"snapshot", "cold", "warm"}

// benchSnapImage is one image's figures.
type benchSnapImage struct {
	Image string
	// Prepare ("Machine ready in") and Job (runner taking it to its final
	// update), seconds, per start (benchStarts).
	Prepare, Job map[string][]float64
	// Steps: the snapshot prepares' breakdown (benchSnapSteps, benchRest).
	Steps map[string][]float64
	// What a snapshot holds (its frozen overlay and save volume, allocated
	// bytes; no RAM: its template is not running) against an idle
	// standby VM (its disk overlay's allocation and its QEMU's RSS).
	SnapshotOverlayBytes, SnapshotSaveBytes, SnapshotRAMBytes uint64
	StandbyDiskBytes, StandbyRSSBytes                         uint64
	MemoryMiB                                                 int
}

// benchAtOnce is four jobs at once with no idle VM, from one start.
type benchAtOnce struct {
	Start   string
	Wall    float64   // queueing the four to the last one's end, seconds
	Prepare []float64 // each job's
}

func TestBenchSnapshot(t *testing.T) {
	runs := 3
	if v, err := strconv.Atoi(os.Getenv("LVE_BENCH_SNAPSHOT_RUNS")); err == nil && v >= 0 {
		runs = v
	}
	if runs == 0 {
		t.Skip("LVE_BENCH_SNAPSHOT_RUNS=0: the snapshot round is skipped")
	}
	rr := newRealRunner(t)
	cold := rr.r
	snap := cold.withSnapshot(t, "tiny", "debian")
	images := []*benchSnapImage{{Image: "tiny"}, {Image: "debian"}}
	recs := map[string]string{} // image: its snapshot's template
	for _, im := range images {
		rec := snap.makeSnapshot(t, im.Image)
		recs[im.Image] = rec.Template
		im.MemoryMiB = rec.MemoryMiB
		im.Prepare, im.Job, im.Steps = map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	}
	job := func(name, image string) jobapi.Job {
		return jobapi.Job{Name: name, GitURL: rr.repo, SHA: rr.sha, Image: image, Script: []string{"test -f README.md"}}
	}

	// Four tiny jobs at once, no pool: from the snapshot, then cold.
	var atOnce []*benchAtOnce
	four := &benchSnapImage{Image: "tiny, four at once", Steps: map[string][]float64{}}
	for _, r := range []*rig{snap, cold} {
		a := &benchAtOnce{Start: map[*rig]string{snap: "snapshot", cold: "cold"}[r]}
		rr.cfgPath = r.cfgPath
		t0 := time.Now()
		res := rr.runJobsAtOnce(t, job("four-a", "tiny"), job("four-b", "tiny"), job("four-c", "tiny"), job("four-d", "tiny"))
		a.Wall = time.Since(t0).Seconds()
		for _, j := range res {
			require.Equal(t, jobapi.StateSuccess, j.State, j.Trace)
			require.Equal(t, a.Start == "snapshot", strings.Contains(j.Trace, "(snapshot)"), "a %s start: %s", a.Start, j.Trace)
			a.Prepare = append(a.Prepare, benchDuration(benchPrepareRE, j.Trace))
			if a.Start == "snapshot" {
				benchSnapBreakdown(t, four, j.Trace)
			}
		}
		t.Logf("[bench] four tiny jobs at once, %s: all done in %.2fs, prepares %v", a.Start, a.Wall, a.Prepare)
		atOnce = append(atOnce, a)
	}

	// One standby VM per image up from here on: every start below shares
	// its load; none is measured while the pool boots one.
	warm := cold.withConfig(t, func(s string) string { return poolsvc.WithPool(poolsvc.WithPool(s, "tiny", 1), "debian", 1) })
	warm.serve(t)
	rigs := map[string]*rig{"snapshot": snap, "cold": cold, "warm": warm}
	for i := range runs {
		for _, im := range images {
			order := slices.Concat(benchStarts[i%3:], benchStarts[:i%3])
			for _, start := range order {
				warm.waitIdle(t, 2, 10*time.Minute)
				rr.cfgPath = rigs[start].cfgPath
				res := rr.runJobs(t, job(fmt.Sprintf("bench-%s-%s-%d", im.Image, start, i), im.Image))[0]
				require.Equal(t, jobapi.StateSuccess, res.State, res.Trace)
				restored := strings.Contains(res.Trace, "from the memory snapshot of image "+im.Image)
				require.Equal(t, start == "snapshot", restored, "a %s start restores only from the snapshot: %s", start, res.Trace)
				require.Equal(t, start == "warm", warmVM(res.Trace) != "", "a %s start claims only from the pool: %s", start, res.Trace)
				im.Prepare[start] = append(im.Prepare[start], benchDuration(benchPrepareRE, res.Trace))
				im.Job[start] = append(im.Job[start], res.Duration.Seconds())
				if start == "snapshot" {
					benchSnapBreakdown(t, im, res.Trace)
				}
				t.Logf("[bench] %s %s run %d: prepare %.2fs, job %.2fs", im.Image, start, i+1, im.Prepare[start][i], im.Job[start][i])
			}
		}
	}

	// What each holds with no job running.
	warm.waitIdle(t, 2, 10*time.Minute)
	for _, im := range images {
		benchSnapHolds(t, warm, im, recs[im.Image])
	}

	var b strings.Builder
	fmt.Fprintf(&b, "Memory snapshot (#48) against cold boot and warm claim, %d run(s) each, interleaved, one idle standby per image up throughout, through gitlab-runner run-single (median, min-max, seconds):\n", runs)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "IMAGE\tSTART\tMACHINE READY\tWHOLE JOB")
	for _, im := range images {
		for _, s := range benchStarts {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", im.Image, s, benchCell(im.Prepare[s]), benchCell(im.Job[s]))
		}
	}
	require.NoError(t, tw.Flush())
	for _, im := range images {
		ratio := func(v map[string][]float64, over string) float64 {
			return benchMedian(v["snapshot"]) / benchMedian(v[over])
		}
		fmt.Fprintf(&b, "%s (medians): snapshot/cold prepare %.2fx, job %.2fx; snapshot/warm prepare %.2fx, job %.2fx\n", im.Image,
			ratio(im.Prepare, "cold"), ratio(im.Job, "cold"), ratio(im.Prepare, "warm"), ratio(im.Job, "warm"))
	}
	fmt.Fprintf(&b, "\nFour tiny jobs at once, no idle VM (seconds):\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "START\tALL FOUR DONE\tEACH PREPARE")
	for _, a := range atOnce {
		fmt.Fprintf(tw, "%s\t%.2f\t%s\n", a.Start, a.Wall, benchCell(a.Prepare))
	}
	require.NoError(t, tw.Flush())
	fmt.Fprintf(&b, "snapshot/cold (four at once): all done %.2fx, prepare %.2fx\n", atOnce[0].Wall/atOnce[1].Wall, benchMedian(atOnce[0].Prepare)/benchMedian(atOnce[1].Prepare))
	fmt.Fprintf(&b, "\nWhere a snapshot prepare's time goes (job log lines; median, min-max, seconds):\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\ttiny\tdebian\ttiny, four at once")
	for _, s := range slices.Concat(benchSnapSteps, []benchStep{{Name: benchRest}}) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", s.Name, benchCell(images[0].Steps[s.Name]), benchCell(images[1].Steps[s.Name]), benchCell(four.Steps[s.Name]))
	}
	fmt.Fprintf(tw, "prepare (Machine ready)\t%s\t%s\t%s\n", benchCell(images[0].Prepare["snapshot"]), benchCell(images[1].Prepare["snapshot"]), benchCell(atOnce[0].Prepare))
	require.NoError(t, tw.Flush())
	fmt.Fprintf(&b, "\nHeld per image with no job running (MiB; the base image is shared by both and not counted):\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "IMAGE\tSNAPSHOT DISK (overlay + save)\tSNAPSHOT RAM\tSTANDBY DISK (overlay)\tSTANDBY RAM (QEMU RSS)\tVM MEMORY")
	mib := func(n uint64) float64 { return float64(n) / (1 << 20) }
	for _, im := range images {
		fmt.Fprintf(tw, "%s\t%.1f (%.1f + %.1f)\t%.0f\t%.1f\t%.0f\t%d\n", im.Image, mib(im.SnapshotOverlayBytes+im.SnapshotSaveBytes),
			mib(im.SnapshotOverlayBytes), mib(im.SnapshotSaveBytes), mib(im.SnapshotRAMBytes), mib(im.StandbyDiskBytes), mib(im.StandbyRSSBytes), im.MemoryMiB)
	}
	require.NoError(t, tw.Flush())
	t.Log("\n" + b.String())
	if p := os.Getenv("LVE_BENCH_SNAPSHOT_OUT"); p != "" {
		require.NoError(t, os.WriteFile(p, []byte(b.String()), 0o644))
	}
	if p := os.Getenv("LVE_BENCH_SNAPSHOT_JSON"); p != "" {
		js, err := json.MarshalIndent(map[string]any{"runs": runs, "images": images, "four_at_once": atOnce, "four_at_once_steps": four.Steps}, "", "  ")
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, js, 0o644))
	}
}

// benchSnapBreakdown adds a snapshot prepare's step times to im.Steps;
// every step's line must be there (bar the tools disk's, where a job has
// none).
func benchSnapBreakdown(t *testing.T, im *benchSnapImage, trace string) {
	t.Helper()
	rest := benchDuration(benchPrepareRE, trace)
	for _, s := range benchSnapSteps {
		if s.re == nil {
			n := len(im.Steps[s.Name])
			plugs := im.Steps["hot plug, all"][n] - im.Steps["  shared disk (tools)"][n] - im.Steps["  network interface"][n] - im.Steps["  credentials disk"][n]
			im.Steps[s.Name] = append(im.Steps[s.Name], plugs)
			continue
		}
		if s.re.FindStringSubmatch(trace) == nil {
			require.Contains(t, s.Name, "shared disk", "%q in the job log:\n%s", s.re, trace)
		}
		d := benchDuration(s.re, trace)
		im.Steps[s.Name] = append(im.Steps[s.Name], d)
		switch s.Name {
		case "Restored (all of the above)", "lease after the restore", "address", "SSH wait (SSH ready)":
			rest -= d
		}
	}
	im.Steps[benchRest] = append(im.Steps[benchRest], rest)
}

// benchSnapHolds measures what im's snapshot (template) and its idle
// standby VM hold of the host: allocated volume bytes, and
// RAM (none for the snapshot: its template domain must not be running).
func benchSnapHolds(t *testing.T, r *rig, im *benchSnapImage, template string) {
	t.Helper()
	if d, err := r.conn.LookupDomainByName(template); err == nil {
		active, err := d.IsActive()
		require.NoError(t, err)
		require.False(t, active, "the snapshot's template %s runs with no job", template)
		_ = d.Free()
	}
	im.SnapshotRAMBytes = 0
	pool, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
	require.NoError(t, err)
	defer pool.Free()
	alloc := func(vol string) uint64 {
		v, err := pool.LookupStorageVolByName(vol)
		require.NoError(t, err, "volume %s", vol)
		defer v.Free()
		info, err := v.GetInfo()
		require.NoError(t, err)
		return info.Allocation
	}
	im.SnapshotOverlayBytes, im.SnapshotSaveBytes = alloc(vm.DiskVolume(template)), alloc(vm.SaveVolume(template))
	all, err := r.manager(t).Standbys()
	require.NoError(t, err)
	for _, sb := range all {
		if !sb.Idle() || sb.Record.Standby.Image != im.Image {
			continue
		}
		d, err := r.conn.LookupDomainByName(sb.Name)
		require.NoError(t, err)
		stats, err := d.MemoryStats(uint32(libvirt.DOMAIN_MEMORY_STAT_NR), 0)
		require.NoError(t, err)
		_ = d.Free()
		for _, s := range stats {
			if s.Tag == int32(libvirt.DOMAIN_MEMORY_STAT_RSS) {
				im.StandbyRSSBytes = s.Val << 10 // KiB
			}
		}
		im.StandbyDiskBytes = alloc(vm.DiskVolume(sb.Name))
	}
	require.NotZero(t, im.StandbyRSSBytes, "an idle %s standby VM's RSS", im.Image)
}
