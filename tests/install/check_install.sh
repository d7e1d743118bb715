#!/usr/bin/env bash
# `cmake --install` into a fresh prefix, then the installed ringlm, run from another directory,
# must find its plugin in <prefix>/lib/ringlm and run the model.
#   check_install.sh BUILD_DIR PREFIX MODEL
set -euo pipefail
build="$1" prefix="$2" model="$3"
rm -rf "$prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
test -x "$prefix/bin/ringlm" || { echo "FAIL: no $prefix/bin/ringlm"; exit 1; }
test -f "$prefix/lib/ringlm/libringlm-opencl.so" || { echo "FAIL: no plugin in $prefix/lib/ringlm"; exit 1; }
cd /
# Only the installed copy of the plugin may be found: no plugin path from the environment.
devices="$(env -u RINGLM_PLUGIN_PATH "$prefix/bin/ringlm" devices 2>&1)"
echo "$devices"
grep -q "opencl:0 .*\[$prefix/bin/../lib/ringlm/libringlm-opencl.so\]" <<<"$devices" ||
  { echo "FAIL: the installed ringlm does not list the installed plugin"; exit 1; }
text="$("$prefix/bin/ringlm" run -m "$model" -p "The capital of France is" -n 8 --temp 0 -t 1 2>/dev/null)"
echo "run: $text"
grep -q "Paris" <<<"$text" || { echo "FAIL: the installed ringlm did not answer"; exit 1; }
echo PASS
