#!/bin/sh
# libvirt-executor's GitHub Actions container hook, as the runner wants it.
# The runner runs ACTIONS_RUNNER_CONTAINER_HOOKS only when its name ends in
# .js, .sh or .ps1; this file hands the hook's input (standard input) to
# libvirt-executor-hooks, whose exit status is the runner's answer.
exec /usr/bin/libvirt-executor-hooks "$@"
