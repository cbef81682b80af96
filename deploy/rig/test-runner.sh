#!/usr/bin/env bash
# Prints the path of the gitlab-runner binary the tests use, or nothing when there is none
# (see test-tool.sh).
exec "$(dirname "$0")/test-tool.sh" gitlab-runner "${1:?usage: test-runner.sh BIN_DIR}"
