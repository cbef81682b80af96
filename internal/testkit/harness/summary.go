package harness

import (
	"fmt"
	"io"
	"text/tabwriter"
)

// WriteSummary prints the job's outcome and one line per invocation.
func (r *Result) WriteSummary(w io.Writer) error {
	reason := r.FailureReason
	if reason == "" {
		reason = "-"
	} else if r.Message != "" && r.Message != r.FailureReason {
		reason += " (" + r.Message + ")"
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "state:\t%s\n", r.State)
	fmt.Fprintf(tw, "failure reason:\t%s\n", reason)
	if r.FailureReason == ReasonScriptFailure {
		fmt.Fprintf(tw, "script exit code:\t%d\n", r.ScriptExitCode)
	}
	fmt.Fprintf(tw, "prepare attempts:\t%d\n", r.PrepareAttempts)
	if r.ProjectDir != "" {
		fmt.Fprintf(tw, "project dir:\t%s\n", r.ProjectDir)
	}
	fmt.Fprintf(tw, "\nstage\texec\tattempt\tresult\n")
	for _, s := range r.Stages {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", s.Name, s.Exec, s.Attempt, describe(s))
	}
	return tw.Flush()
}
