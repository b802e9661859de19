#!/usr/bin/env bash
# Builds (or finds cached) the kstatus tool of tests/tools/build.sh; prints its path last.
exec bash "$(dirname "$0")/build.sh" kstatus
