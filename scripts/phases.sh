# Sourced by setup.sh and test.sh: times the phases of a run (set-up steps, builds, suites).
#
#   phase NAME     ends the phase that is running (if any) and starts NAME
#   phase_end      ends the phase that is running
#
# With RINGLM_PHASE_LOG set (.ci/run sets it), each finished phase appends a line
# "NAME<TAB>SECONDS" to that file; a phase cut short by a failure appends "NAME<TAB>SECONDS<TAB>failed",
# so the report still says where the time went. scripts/ci_report.py reads the file.

_phase_name=""
_phase_start=""

_phase_record() {
  [ -n "$_phase_name" ] || return 0
  if [ -n "${RINGLM_PHASE_LOG:-}" ]; then
    local now="${EPOCHREALTIME/,/.}"
    printf '%s\t%s%s\n' "$_phase_name" "$(awk -v a="$_phase_start" -v b="$now" 'BEGIN { printf "%.1f", b - a }')" \
      "${1:+	$1}" >>"$RINGLM_PHASE_LOG"
  fi
  _phase_name=""
}

phase_end() { _phase_record; }

phase() {
  _phase_record
  _phase_name="$1"
  _phase_start="${EPOCHREALTIME/,/.}"
}

# A script that stops on an error records the phase it stopped in.
trap '_phase_record failed' EXIT
