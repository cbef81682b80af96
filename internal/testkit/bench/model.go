package bench

import (
	"fmt"
	"math"
	"time"
)

// Report is one benchmark run: what was measured, on what, and the verdicts.
// It is written as JSON as it is; the human table is rendered from it.
type Report struct {
	Started     time.Time `json:"started"`
	Host        string    `json:"host"`
	Config      string    `json:"config"`
	Runs        int       `json:"runs"`
	Concurrency int       `json:"concurrency"`
	// WarmRound says each image also got a warm round (ImageReport.Warm).
	WarmRound bool `json:"warm_round"`
	// ConnectionHolder is the configuration's [ssh] connection_holder: the
	// jobs (cold, concurrent, warm) run their stages through the job's
	// connection holder. DirectRuns is how many jobs per image ran with a
	// copy of the configuration that turns it off (ImageReport.Direct), 0
	// for none.
	ConnectionHolder bool `json:"connection_holder"`
	DirectRuns       int  `json:"direct_runs"`
	// WrapperRuns is how many jobs per image ran with a copy of the
	// configuration that turns the guest agent off (ImageReport.Wrapper):
	// through the holder, each stage a session and the stage wrapper; 0
	// for none.
	WrapperRuns int     `json:"wrapper_runs"`
	PollMs      float64 `json:"floor_poll_ms"`
	// Startup is each executable's start on the host (`--version`, run
	// repeatedly): the fixed cost every stage pays before doing anything.
	Startup   map[string]Summary `json:"startup_ms"`
	Images    []ImageReport      `json:"images"`
	Leftovers []string           `json:"leftovers,omitempty"`
}

// ImageReport holds every sample of one image and their summary.
type ImageReport struct {
	Image      string            `json:"image"`
	DomainType string            `json:"domain_type"`
	VCPUs      int               `json:"vcpus"`
	MemoryMiB  int               `json:"memory_mib"`
	Jobs       []JobSample       `json:"jobs"`
	Floors     []FloorSample     `json:"floors"`
	Concurrent *ConcurrentSample `json:"concurrent,omitempty"`
	// Warm is the warm round (after the cold jobs above): jobs that claim a
	// standby VM from a pool that libvirt-executor serve keeps.
	Warm *WarmRound `json:"warm,omitempty"`
	// Direct is the direct round: the same cold jobs with a copy of the
	// configuration with [ssh] connection_holder = false, every stage on
	// an SSH connection of its own (the path before the connection holder),
	// interleaved with the jobs above.
	Direct *DirectRound `json:"direct,omitempty"`
	// Wrapper is the wrapper round: the same cold jobs with a copy of the
	// configuration that sets [guest_tools] agent = "none" (the path
	// before the guest agent); nil when there was none.
	Wrapper *DirectRound `json:"wrapper,omitempty"`
	// FloorSpec says whether the floor's domain definition matched
	// prepare's once per-machine values are blanked: "same", "differs" (see
	// FloorSpecDiff) or why it could not be checked.
	FloorSpec     string       `json:"floor_spec"`
	FloorSpecDiff []string     `json:"floor_spec_diff,omitempty"`
	Summary       ImageSummary `json:"summary"`
	Targets       []Target     `json:"targets"`
}

// JobSample is one job driven through the runner-faithful harness. Times are
// in milliseconds, sizes in bytes; a nil pointer is a figure not obtained.
type JobSample struct {
	Run    int      `json:"run"`
	JobID  int64    `json:"job_id"`
	Host   HostLoad `json:"host_load"`
	OK     bool     `json:"ok"`
	Error  string   `json:"error,omitempty"`
	WallMs float64  `json:"wall_ms"` // config .. cleanup, as RunJob took
	// PrepareWallMs is the prepare process's wall time, as the runner waits for it.
	PrepareWallMs float64       `json:"prepare_wall_ms"`
	Prepare       *PrepareMs    `json:"prepare,omitempty"` // from the driver's timings record
	Timeline      *TimelineMs   `json:"prepare_timeline,omitempty"`
	Stages        []StageSample `json:"stages"`
	// BuildGuestMs is the no-op's own time inside the guest; BuildOverheadMs
	// is build_script's run_exec wall time minus it.
	BuildGuestMs    *float64 `json:"build_guest_ms,omitempty"`
	BuildOverheadMs *float64 `json:"build_overhead_ms,omitempty"`
	// StageGuestMs is each no-op stage's (NoopStages) own time in the guest,
	// StageOverheadMs its run_exec wall time minus that: build_script's are
	// BuildGuestMs and BuildOverheadMs again.
	StageGuestMs    map[string]float64 `json:"stage_guest_ms,omitempty"`
	StageOverheadMs map[string]float64 `json:"stage_overhead_ms,omitempty"`
	// HolderStarted says prepare started the job's connection holder (its
	// job-log line); DirectStages counts the run stages that connected
	// directly although the holder was on (run's "this stage connects
	// directly" line).
	HolderStarted bool `json:"holder_started,omitempty"`
	DirectStages  int  `json:"direct_stages,omitempty"`
	// Agent: the job log says its stages ran through the guest agent.
	Agent     bool    `json:"agent,omitempty"`
	CleanupMs float64 `json:"cleanup_ms"`
	// Gone is how long after cleanup returned the job's VM was really gone:
	// cleanup leaves the destroy, undefine and volumes to a detached reaper.
	Gone *GoneMs `json:"vm_gone,omitempty"`
	// OverlayBytes and SeedBytes are the volumes' allocation (bytes used on
	// the host) read from libvirt when the first run stage started, i.e.
	// right after prepare; OverlayCapacity is the overlay's virtual size.
	OverlayBytes    *uint64 `json:"overlay_bytes,omitempty"`
	OverlayCapacity *uint64 `json:"overlay_capacity,omitempty"`
	SeedBytes       *uint64 `json:"seed_bytes,omitempty"`
	// PeakRSS is each executable's peak resident set size (the maximum over
	// its invocations in this job), from wait4's rusage.
	PeakRSS map[string]int64 `json:"peak_rss_bytes"`
	// RusageMaxRSS is ru_maxrss per executable: an upper bound that includes
	// the benchmark's own peak RSS (see harness.StageResult.MaxRSSKiB).
	RusageMaxRSS map[string]int64 `json:"rusage_maxrss_bytes"`
	// Warm is set on a job of the warm round whose prepare claimed a
	// standby VM (Claim holds its figures); ColdStart is why one of that
	// round booted its own VM instead (the driver's "Cold start:" line).
	// Only warm jobs have Warm set; cold jobs never have any of the three.
	Warm      bool     `json:"warm,omitempty"`
	Claim     *ClaimMs `json:"claim,omitempty"`
	ColdStart string   `json:"cold_start,omitempty"`

	domainXML string // prepare's domain definition, to compare with the floor's
}

// ClaimMs is a warm start's own figures: from its timings record
// (lifecycle.TimingRecord with warm set) and the pool's state directory.
type ClaimMs struct {
	// VM is the standby VM the job claimed (the record's machine).
	VM string `json:"vm"`
	// Claim is the claim itself; Ready the front end's whole prepare (first
	// job-log line .. machine ready: claim and guest tool check); Launch the
	// prepare process's start until that first line.
	Claim  float64 `json:"claim"`
	Ready  float64 `json:"ready"`
	Launch float64 `json:"launch"`
	// Claimed is the record's claim moment.
	Claimed time.Time `json:"claimed"`
	// Refill is Claimed .. the service began booting the VM that replaces
	// it: the earliest reservation.json of the standby VMs that appeared
	// since the job started (Replacement). Nil when none appeared.
	Refill      *float64 `json:"refill,omitempty"`
	Replacement string   `json:"replacement,omitempty"`
}

// WarmRound is an image's warm round: libvirt-executor serve keeping a
// standby pool of one idle VM, and Runs sequential jobs, each started once
// the pool was idle again.
type WarmRound struct {
	// FirstIdleMs is the service's start until its first standby VM was
	// idle (booted and SSH-verified).
	FirstIdleMs float64     `json:"first_idle_ms"`
	Jobs        []JobSample `json:"jobs"`
	// Errors are the round's own problems (setup, waits for the pool, the
	// service's stop, the removal of its VMs); a job's are in the job.
	Errors []string `json:"errors,omitempty"`
	// Removed names the standby VMs removed after the service stopped.
	Removed []string `json:"removed,omitempty"`
}

// GoneMs is how long after the cleanup stage returned its VM was gone, in
// milliseconds, polled every GonePoll for at most GoneWithin: the domain
// unknown to libvirt, the machine's state directory (state_dir/machines/VM)
// removed, and both. A nil figure was not seen within GoneWithin (Error says
// what was left).
type GoneMs struct {
	VM       string   `json:"vm"`
	Domain   *float64 `json:"domain_ms,omitempty"`
	StateDir *float64 `json:"state_dir_ms,omitempty"`
	Gone     *float64 `json:"gone_ms,omitempty"`
	Polls    int      `json:"polls"`
	Error    string   `json:"error,omitempty"`
}

// DirectRound is an image's direct round: DirectRuns cold jobs whose stages
// each connect to the guest directly ([ssh] connection_holder = false), the
// path before the connection holder, for the before/after comparison.
type DirectRound struct {
	// Config is the configuration copy the round's jobs got.
	Config string      `json:"config"`
	Jobs   []JobSample `json:"jobs"`
	// Errors are the round's own problems (its configuration copy).
	Errors []string `json:"errors,omitempty"`
}

// HostLoad is how busy the host was when a sample started: the rig is shared
// and TCG guests compete for the same cores, so this explains outliers.
type HostLoad struct {
	Load1    float64 `json:"load1"`     // 1-minute load average
	OtherVMs int     `json:"other_vms"` // running domains that are not this sample's
}

// PrepareMs is the prepare stage's own figures, from its timings record
// (lifecycle.TimingRecord), in milliseconds.
type PrepareMs struct {
	Clone float64 `json:"clone"`
	Seed  float64 `json:"seed"` // create + upload
	// Entry is the static DHCP host entry's step ("reserve address"): a
	// spare taken over, or an entry added when every spare is held.
	Entry       float64 `json:"entry"`
	Define      float64 `json:"define"`
	Start       float64 `json:"start"`
	Created     float64 `json:"created"` // clone .. start, as one figure
	Address     float64 `json:"address"` // after start: until the DHCP lease (or agent) names an address
	SSH         float64 `json:"ssh"`     // after the address: until the pinned-key handshake and login succeed
	SSHAttempts int     `json:"ssh_attempts"`
	Check       float64 `json:"check"` // the guest tool check
	Ready       float64 `json:"ready"` // the whole provisioning, leftovers check included
}

func (h HostLoad) String() string {
	return fmt.Sprintf(" [load %.1f, %d other VM(s) running]", h.Load1, h.OtherVMs)
}

// TimelineMs is Timeline in milliseconds.
type TimelineMs struct {
	Launch     float64 `json:"launch"`
	ToStart    float64 `json:"to_start"`
	ToAddr     float64 `json:"to_address"`
	ToSSH      float64 `json:"to_ssh"`
	AfterSSH   float64 `json:"after_ssh"`
	StartToSSH float64 `json:"start_call_to_ssh"`
}

func toTimelineMs(t Timeline) *TimelineMs {
	return &TimelineMs{Launch: ms(t.Launch), ToStart: ms(t.ToStart), ToAddr: ms(t.ToAddr), ToSSH: ms(t.ToSSH),
		AfterSSH: ms(t.AfterSSH), StartToSSH: ms(t.StartToSSH)}
}

// StageSample is one executable invocation of a job.
type StageSample struct {
	Name         string  `json:"name"`
	Exec         string  `json:"exec"`
	WallMs       float64 `json:"wall_ms"`
	ExitCode     int     `json:"exit_code"`
	RSSBytes     int64   `json:"peak_rss_bytes"`      // the executable's own (VmHWM)
	RusageMaxRSS int64   `json:"rusage_maxrss_bytes"` // upper bound, see JobSample
}

// FloorSample is one boot of the same image made by the benchmark itself:
// the fastest a driver could possibly be with this guest on this host.
type FloorSample struct {
	Run   int      `json:"run"`
	OK    bool     `json:"ok"`
	Error string   `json:"error,omitempty"`
	Host  HostLoad `json:"host_load"`
	// SSHMs is the floor: from the call that starts the domain to the first
	// successful SSH handshake with the pinned host key and public-key login,
	// polled every Report.PollMs.
	SSHMs    float64 `json:"ssh_ms"`
	Attempts int     `json:"attempts"`
	// AttemptLog is each SSH attempt: when it began (ms after the address
	// was known), how long it took, and how it failed.
	AttemptLog  []string `json:"attempt_log,omitempty"`
	StartCallMs float64  `json:"start_call_ms"` // the start call itself (QEMU launch)
	// EntryMs is the floor's static DHCP host entry, the path before spare
	// entries: one added for the machine (outside the floor's span).
	EntryMs   float64 `json:"entry_ms"`
	AddressMs float64 `json:"address_ms"` // start call .. address known
	// HandshakeMs is one more TCP connect + SSH handshake + login on the
	// booted guest; ExecMs one session running `true` on an open connection
	// (medians of a few): what every run_exec pays.
	HandshakeMs float64 `json:"handshake_ms"`
	ExecMs      float64 `json:"exec_ms"`
	// WrapperShMs and WrapperBashMs: the stage wrapper (sshexec.Client.Run)
	// around the script `exit 0` run by sh and by bash, on an open
	// connection (medians of five; 0 if not measured).
	WrapperShMs   float64 `json:"wrapper_sh_ms,omitempty"`
	WrapperBashMs float64 `json:"wrapper_bash_ms,omitempty"`
	// AgentShMs and AgentBashMs: the same script through the guest agent
	// (started once on the floor VM's connection from its tools disk);
	// 0 when the floor VM has no agent.
	AgentShMs   float64 `json:"agent_sh_ms,omitempty"`
	AgentBashMs float64 `json:"agent_bash_ms,omitempty"`
	// DestroyMs is the destroy call alone, RemoveMs the whole removal
	// (destroy, undefine, volumes).
	DestroyMs float64 `json:"destroy_ms"`
	RemoveMs  float64 `json:"remove_ms"`
	// OverlayAtCreate is the overlay's allocation right after the start
	// call: what creating the linked clone costs, before guest writes.
	OverlayAtCreate *uint64 `json:"overlay_at_create_bytes,omitempty"`

	domainXML string
}

// ConcurrentSample is N jobs started at once.
type ConcurrentSample struct {
	N        int         `json:"n"`
	WallMs   float64     `json:"wall_ms"` // first start .. last job done
	Failures int         `json:"failures"`
	Jobs     []JobSample `json:"jobs"`
}

// ImageSummary holds medians and ranges over the successful samples. Times
// in ms, sizes in bytes.
type ImageSummary struct {
	Clone       Summary `json:"clone_ms"`
	Seed        Summary `json:"seed_ms"`
	Entry       Summary `json:"entry_ms"`
	DefineStart Summary `json:"define_start_ms"`
	Created     Summary `json:"created_ms"`
	Address     Summary `json:"address_ms"`
	SSH         Summary `json:"ssh_ms"`
	Ready       Summary `json:"ready_ms"`
	PrepareWall Summary `json:"prepare_wall_ms"`

	TLLaunch     Summary `json:"timeline_launch_ms"`
	TLToStart    Summary `json:"timeline_to_start_ms"`
	TLToAddr     Summary `json:"timeline_to_address_ms"`
	TLToSSH      Summary `json:"timeline_to_ssh_ms"`
	TLAfterSSH   Summary `json:"timeline_after_ssh_ms"`
	TLStartToSSH Summary `json:"timeline_start_call_to_ssh_ms"`

	Floor          Summary `json:"floor_ms"`
	FloorAddress   Summary `json:"floor_address_ms"`
	FloorStartCall Summary `json:"floor_start_call_ms"`
	FloorEntry     Summary `json:"floor_entry_ms"`
	Handshake      Summary `json:"handshake_ms"`
	Exec           Summary `json:"exec_ms"`
	WrapperSh      Summary `json:"wrapper_sh_ms"`
	WrapperBash    Summary `json:"wrapper_bash_ms"`
	AgentSh        Summary `json:"agent_sh_ms"`
	AgentBash      Summary `json:"agent_bash_ms"`
	FloorDestroy   Summary `json:"floor_destroy_ms"`
	FloorRemove    Summary `json:"floor_remove_ms"`
	// Ratio is prepare wall / floor, paired run by run.
	Ratio Summary `json:"prepare_floor_ratio"`
	// OwnBootRatio is prepare wall / its own VM's start call -> SSH login
	// (timeline), per job: free of the boot-to-boot variance that the paired
	// ratio carries, blind to how late the driver notices each boot phase.
	OwnBootRatio Summary `json:"prepare_own_boot_ratio"`
	// Overhead outside the boot: prepare wall - start call -> SSH login.
	OutsideBoot Summary `json:"prepare_outside_boot_ms"`
	// FloorOverlayAtCreate is the floor's overlay allocation right after the
	// start call, before the guest has written anything worth mentioning.
	FloorOverlayAtCreate Summary `json:"floor_overlay_at_create_bytes"`

	StageWall  map[string]Summary `json:"stage_wall_ms"`
	BuildGuest Summary            `json:"build_guest_ms"`
	Overhead   Summary            `json:"run_overhead_ms"`
	// OverheadAll is the run overhead of every no-op stage (NoopStages) of
	// every job, pooled: len(NoopStages) samples per job.
	OverheadAll Summary `json:"run_overhead_all_stages_ms"`
	Cleanup     Summary `json:"cleanup_ms"`
	// VMGone is cleanup's return until its VM is gone (GoneMs.Gone).
	VMGone  Summary `json:"cleanup_to_vm_gone_ms"`
	JobWall Summary `json:"job_wall_ms"`

	Overlay Summary            `json:"overlay_bytes"`
	SeedVol Summary            `json:"seed_bytes"`
	PeakRSS map[string]Summary `json:"peak_rss_bytes"`

	JobFailures   int `json:"job_failures"`
	FloorFailures int `json:"floor_failures"`

	// Warm summarizes the warm round; nil when there was none.
	Warm *WarmSummary `json:"warm,omitempty"`

	// HolderPath summarizes the cold jobs (above) stage by stage, the
	// configuration's path (the connection holder unless it turns that
	// off), DirectPath the direct round's jobs the same way; nil when there
	// was no direct round. Side by side: before and after the holder.
	HolderPath PathSummary  `json:"holder_path"`
	DirectPath *PathSummary `json:"direct_path,omitempty"`
	// WrapperPath summarizes the wrapper round's jobs the same way: before
	// and after the guest agent.
	WrapperPath *PathSummary `json:"wrapper_path,omitempty"`
}

// PathSummary is one way of running the stages (connection holder or a
// connection per stage) over a set of jobs, stage by stage: medians and
// ranges over the jobs that succeeded, in ms.
type PathSummary struct {
	// Jobs is the count; Failures those that failed (left out).
	Jobs     int `json:"jobs"`
	Failures int `json:"failures"`
	// HolderStarted counts the succeeded jobs whose prepare started a
	// connection holder; DirectStages the run stages of those jobs that
	// connected directly all the same.
	HolderStarted int `json:"holder_started"`
	DirectStages  int `json:"direct_stages"`
	// Agent counts the succeeded jobs whose stages ran through the guest
	// agent.
	Agent int `json:"agent"`

	ConfigWall  Summary `json:"config_wall_ms"`
	PrepareWall Summary `json:"prepare_wall_ms"`
	// StageWall is each run stage's run_exec wall (RunStages).
	StageWall map[string]Summary `json:"stage_wall_ms"`
	// RunStageWall is, per job, the median wall of its run stages;
	// RunStagesTotal their sum.
	RunStageWall   Summary `json:"run_stage_wall_ms"`
	RunStagesTotal Summary `json:"run_stages_total_ms"`
	// Overhead is build_script's run overhead, OverheadAll every no-op
	// stage's, pooled.
	Overhead    Summary `json:"run_overhead_ms"`
	OverheadAll Summary `json:"run_overhead_all_stages_ms"`
	Cleanup     Summary `json:"cleanup_ms"`
	VMGone      Summary `json:"cleanup_to_vm_gone_ms"`
	JobWall     Summary `json:"job_wall_ms"`
	// AfterPrepare is the job wall without config and prepare: the run
	// stages, cleanup and the harness between them, free of the boot's
	// variance.
	AfterPrepare Summary `json:"job_wall_after_prepare_ms"`
}

// WarmSummary holds medians and ranges over the warm round's jobs that
// succeeded and started warm: a job that started cold is counted
// (ColdStarts), never mixed into the figures. Times in ms, sizes in bytes.
type WarmSummary struct {
	PrepareWall Summary            `json:"prepare_wall_ms"`
	Claim       Summary            `json:"claim_ms"`
	Ready       Summary            `json:"ready_ms"`
	Overhead    Summary            `json:"run_overhead_ms"`
	Cleanup     Summary            `json:"cleanup_ms"`
	VMGone      Summary            `json:"cleanup_to_vm_gone_ms"`
	JobWall     Summary            `json:"job_wall_ms"`
	PeakRSS     map[string]Summary `json:"peak_rss_bytes"`
	Refill      Summary            `json:"refill_ms"`
	// ColdWarm is the cold prepare wall's median over the warm one's; nil
	// unless both are known.
	ColdWarm *float64 `json:"cold_warm_prepare_ratio,omitempty"`
	// Jobs is the round's job count: WarmStarts succeeded warm, ColdStarts
	// succeeded but booted their own VM, Failures failed.
	Jobs       int `json:"jobs"`
	WarmStarts int `json:"warm_starts"`
	ColdStarts int `json:"cold_starts"`
	Failures   int `json:"failures"`
}

// RunStages are the run_exec stages of the benchmark job, in order: the
// runner's prepare_script and get_sources (GIT_STRATEGY none), then the
// no-op stages (NoopStages).
var RunStages = []string{"prepare_script", "get_sources", "build_script", "after_script", "archive_cache", "upload_artifacts_on_success"}

// NoopStages are the benchmark job's stages that run the no-op
// (NoopCommandIn), so that each job gives several samples of the run
// overhead: its script (build_script), its after_script, and two extra
// stages named like those the runner runs after a successful script.
var NoopStages = []string{"build_script", "after_script", "archive_cache", "upload_artifacts_on_success"}

// Executables are the driver's programs, in the order they run.
var Executables = []string{"config", "prepare", "run", "cleanup"}

// Summarize computes the summary of an image's sequential samples.
func (r *ImageReport) Summarize() ImageSummary {
	var s ImageSummary
	col := func(f func(j *JobSample) float64) Summary {
		var v []float64
		for i := range r.Jobs {
			if r.Jobs[i].OK {
				v = append(v, f(&r.Jobs[i]))
			}
		}
		return Summarize(v)
	}
	prep := func(f func(p *PrepareMs) float64) Summary {
		return col(func(j *JobSample) float64 {
			if j.Prepare == nil {
				return math.NaN()
			}
			return f(j.Prepare)
		})
	}
	optU := func(p *uint64) float64 {
		if p == nil {
			return math.NaN()
		}
		return float64(*p)
	}
	s.Clone = prep(func(p *PrepareMs) float64 { return p.Clone })
	s.Seed = prep(func(p *PrepareMs) float64 { return p.Seed })
	s.Entry = prep(func(p *PrepareMs) float64 { return p.Entry })
	s.DefineStart = prep(func(p *PrepareMs) float64 { return p.Define + p.Start })
	s.Created = prep(func(p *PrepareMs) float64 { return p.Created })
	s.Address = prep(func(p *PrepareMs) float64 { return p.Address })
	s.SSH = prep(func(p *PrepareMs) float64 { return p.SSH })
	s.Ready = prep(func(p *PrepareMs) float64 { return p.Ready })
	s.PrepareWall = col(func(j *JobSample) float64 { return j.PrepareWallMs })
	tl := func(f func(t *TimelineMs) float64) Summary {
		return col(func(j *JobSample) float64 {
			if j.Timeline == nil {
				return math.NaN()
			}
			return f(j.Timeline)
		})
	}
	s.TLLaunch = tl(func(t *TimelineMs) float64 { return t.Launch })
	s.TLToStart = tl(func(t *TimelineMs) float64 { return t.ToStart })
	s.TLToAddr = tl(func(t *TimelineMs) float64 { return t.ToAddr })
	s.TLToSSH = tl(func(t *TimelineMs) float64 { return t.ToSSH })
	s.TLAfterSSH = tl(func(t *TimelineMs) float64 { return t.AfterSSH })
	s.TLStartToSSH = tl(func(t *TimelineMs) float64 { return t.StartToSSH })
	s.OwnBootRatio = col(func(j *JobSample) float64 {
		if j.Timeline == nil || j.Timeline.StartToSSH <= 0 {
			return math.NaN()
		}
		return j.PrepareWallMs / j.Timeline.StartToSSH
	})
	s.OutsideBoot = col(func(j *JobSample) float64 {
		if j.Timeline == nil {
			return math.NaN()
		}
		return j.PrepareWallMs - j.Timeline.StartToSSH
	})
	s.BuildGuest = col(func(j *JobSample) float64 { return orNaN(j.BuildGuestMs) })
	s.Overhead = col(func(j *JobSample) float64 { return orNaN(j.BuildOverheadMs) })
	s.Cleanup = col(func(j *JobSample) float64 { return j.CleanupMs })
	s.JobWall = col(func(j *JobSample) float64 { return j.WallMs })
	s.HolderPath = SummarizePath(r.Jobs)
	s.OverheadAll, s.VMGone = s.HolderPath.OverheadAll, s.HolderPath.VMGone
	if r.Direct != nil {
		d := SummarizePath(r.Direct.Jobs)
		s.DirectPath = &d
	}
	if r.Wrapper != nil {
		w := SummarizePath(r.Wrapper.Jobs)
		s.WrapperPath = &w
	}
	s.Overlay = col(func(j *JobSample) float64 { return optU(j.OverlayBytes) })
	s.SeedVol = col(func(j *JobSample) float64 { return optU(j.SeedBytes) })
	s.StageWall = map[string]Summary{}
	for _, name := range RunStages {
		s.StageWall[name] = col(func(j *JobSample) float64 {
			for _, st := range j.Stages {
				if st.Name == name {
					return st.WallMs
				}
			}
			return math.NaN()
		})
	}
	s.PeakRSS = map[string]Summary{}
	for _, exe := range Executables {
		s.PeakRSS[exe] = col(peakRSSOf(exe))
	}

	fcol := func(f func(f *FloorSample) float64) Summary {
		var v []float64
		for i := range r.Floors {
			if r.Floors[i].OK {
				v = append(v, f(&r.Floors[i]))
			}
		}
		return Summarize(v)
	}
	s.Floor = fcol(func(f *FloorSample) float64 { return f.SSHMs })
	s.FloorAddress = fcol(func(f *FloorSample) float64 { return f.AddressMs })
	s.FloorStartCall = fcol(func(f *FloorSample) float64 { return f.StartCallMs })
	s.FloorEntry = fcol(func(f *FloorSample) float64 { return zeroNaN(f.EntryMs) })
	s.Handshake = fcol(func(f *FloorSample) float64 { return f.HandshakeMs })
	s.Exec = fcol(func(f *FloorSample) float64 { return f.ExecMs })
	s.WrapperSh = fcol(func(f *FloorSample) float64 { return zeroNaN(f.WrapperShMs) })
	s.WrapperBash = fcol(func(f *FloorSample) float64 { return zeroNaN(f.WrapperBashMs) })
	s.AgentSh = fcol(func(f *FloorSample) float64 { return zeroNaN(f.AgentShMs) })
	s.AgentBash = fcol(func(f *FloorSample) float64 { return zeroNaN(f.AgentBashMs) })
	s.FloorDestroy = fcol(func(f *FloorSample) float64 { return f.DestroyMs })
	s.FloorRemove = fcol(func(f *FloorSample) float64 { return f.RemoveMs })
	s.FloorOverlayAtCreate = fcol(func(f *FloorSample) float64 {
		if f.OverlayAtCreate == nil {
			return math.NaN()
		}
		return float64(*f.OverlayAtCreate)
	})

	var ratios []float64
	for _, j := range r.Jobs {
		if !j.OK {
			s.JobFailures++
			continue
		}
		for _, f := range r.Floors {
			if f.Run == j.Run && f.OK && f.SSHMs > 0 {
				ratios = append(ratios, j.PrepareWallMs/f.SSHMs)
			}
		}
	}
	for _, f := range r.Floors {
		if !f.OK {
			s.FloorFailures++
		}
	}
	s.Ratio = Summarize(ratios)
	if r.Warm != nil {
		w := r.Warm.Summarize(s.PrepareWall)
		s.Warm = &w
	}
	return s
}

// Summarize computes the warm round's summary; cold is the cold jobs'
// prepare wall, for the ratio of the medians.
func (w *WarmRound) Summarize(cold Summary) WarmSummary {
	s := WarmSummary{Jobs: len(w.Jobs), PeakRSS: map[string]Summary{}}
	var warm []*JobSample
	for i := range w.Jobs {
		j := &w.Jobs[i]
		switch {
		case !j.OK:
			s.Failures++
		case !j.Warm:
			s.ColdStarts++
		default:
			s.WarmStarts++
			warm = append(warm, j)
		}
	}
	col := func(f func(j *JobSample) float64) Summary {
		v := make([]float64, 0, len(warm))
		for _, j := range warm {
			v = append(v, f(j))
		}
		return Summarize(v)
	}
	s.PrepareWall = col(func(j *JobSample) float64 { return j.PrepareWallMs })
	claim := func(f func(c *ClaimMs) float64) Summary {
		return col(func(j *JobSample) float64 {
			if j.Claim == nil { // warm by its job log, without a record
				return math.NaN()
			}
			return f(j.Claim)
		})
	}
	s.Claim = claim(func(c *ClaimMs) float64 { return c.Claim })
	s.Ready = claim(func(c *ClaimMs) float64 { return c.Ready })
	s.Refill = claim(func(c *ClaimMs) float64 { return orNaN(c.Refill) })
	s.Overhead = col(func(j *JobSample) float64 { return orNaN(j.BuildOverheadMs) })
	s.Cleanup = col(func(j *JobSample) float64 { return j.CleanupMs })
	s.VMGone = col(goneOf)
	s.JobWall = col(func(j *JobSample) float64 { return j.WallMs })
	for _, exe := range Executables {
		s.PeakRSS[exe] = col(peakRSSOf(exe))
	}
	if cold.Known() && s.PrepareWall.Known() && s.PrepareWall.Median > 0 {
		r := cold.Median / s.PrepareWall.Median
		s.ColdWarm = &r
	}
	return s
}

// orNaN is *p, or NaN (a figure not obtained) for nil.
// zeroNaN is x, or NaN for 0 (not measured).
func zeroNaN(x float64) float64 {
	if x == 0 {
		return math.NaN()
	}
	return x
}

func orNaN(p *float64) float64 {
	if p == nil {
		return math.NaN()
	}
	return *p
}

// peakRSSOf reads a job's peak RSS of executable exe, NaN if not sampled.
func peakRSSOf(exe string) func(j *JobSample) float64 {
	return func(j *JobSample) float64 {
		if v, ok := j.PeakRSS[exe]; ok && v > 0 {
			return float64(v)
		}
		return math.NaN()
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
