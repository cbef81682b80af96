// Package sshexec is the guest shell: everything the host says to a guest
// over SSH goes through it. It owns
//
//   - the connection (conn.go): a TCP connect and an SSH login with the
//     per-job client key, trusting only the pinned host key;
//   - its keepalive (keepalive.go): a guest that stops answering for
//     KeepaliveInterval*KeepaliveCount is declared dead (ErrDeadGuest) and
//     the connection is closed, which fails every session on it;
//   - the readiness wait (waitready.go): WaitReady polls at a fixed rate
//     until a login succeeds; Probe and ProbeTCP (probe.go) check cheaply
//     that a guest's sshd still answers, without logging in;
//   - stages (run.go, wrapper.go, session.go): Run sends a script over the
//     SSH channel, never on a command line, and runs it in the guest under
//     a wrapper that records its process group, so that a cancel, a job
//     timeout, or StopStage from another connection stops the whole group
//     (SIGTERM, then SIGKILL), and that nothing the script leaves behind
//     holds the stage open;
//   - fixed commands (output.go): Output runs a command the driver wrote,
//     never job input (the group kill, StopStage, the guest tools check).
//     It keeps at most OutputLimit bytes of what the guest answers and
//     drops the rest, and it returns when its context ends, however much
//     the guest still sends: a hostile guest cannot make the host hold its
//     output or wait on it.
//
// It classifies outcomes: the script's own non-zero exit is an
// exitcodes.ScriptError; every other failure is a system failure.
package sshexec
